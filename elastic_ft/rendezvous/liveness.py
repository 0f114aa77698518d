"""Node loss at network speed: when to suspect a member, what confirms its loss, who acts (pure).

A member's lease says it is alive until ``lease_ttl`` after its agent last
refreshed it: 10 s by default, the time a survivor would wait for a host
whose link was cut, or whose agent and workers died. The data path knows
much sooner: a rank blocked in a collective, or waiting at the Wrapper's
barriers, for longer than ``suspect_after``, waits for ranks that may be
gone. That is only a suspicion (a slow peer looks the same); what confirms
it is a direct probe of every other member's agent (TCP connections to the
probe port it published with its ``alive`` record; the agent greets each
with one byte):

* the connection is **refused**: the host answers, but no agent listens
  any more: its process died (the host's kernel says so at once);
* **no handshake at all** within ``probe_bound`` (silence: a dead host, a
  cut link, a partition between this host and that one);
* a handshake but **no greeting** within ``greeting_bound`` after it (the
  host is up, the agent does not run: stopped, or its process wedged; its
  lease could not be refreshed either, so it would expire anyway);
* **a greeting** clears the suspicion: the member is alive, only slow. A
  lossy link delays answers, it does not silence all of them: the probe
  opens a new connection every ``retry_every`` while none has answered,
  and a node whose earlier answers were slow gets bounds scaled to its
  round trips (:func:`bounds_for`), so a slow link is never taken for a
  dead one. A host starved of CPU still greets within milliseconds: the
  agent's probe thread only wakes to send one byte.

Silence is the one answer that may be the prober's own fault (a node cut
off hears silence from everyone): only a node that reaches a majority of
the live nodes counts silent members lost (:func:`in_majority`).

A confirmed loss revokes the member's lease, and every node sees it dead
through its watch at once; revoking is idempotent, so every node that
confirms it may do it. The functions here decide; ``rendezvous/probe.py``
and ``launcher/agent.py`` carry out.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class Detection:
    """The knobs of failure detection, in seconds.

    ``suspect_after``: how long a local rank may stay blocked (in a
    collective, or at a barrier) before the other members are probed;
    ``probe_bound``: how long a probe waits for a handshake before a member
    counts as silent; ``greeting_bound``: how long, after the first
    handshake, it waits for the agent's greeting; ``retry_every``: the pause
    between two connection attempts of one probe; ``probe_every``: the
    shortest time between two rounds of probes from one node;
    ``rtt_factor``: a node's bounds are at least this many times the slowest
    of its recent answers (:func:`bounds_for`).
    """

    suspect_after: float = 0.3
    probe_bound: float = 1.0
    greeting_bound: float = 2.0
    retry_every: float = 0.05
    probe_every: float = 1.0
    rtt_factor: float = 4.0

    def __post_init__(self) -> None:
        for name in ("suspect_after", "probe_bound", "greeting_bound", "retry_every", "probe_every", "rtt_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 3600:
                raise ValueError(f"Detection {name}={value!r} is invalid; expected seconds in (0, 3600)")
        if self.retry_every > self.probe_bound:
            raise ValueError(f"Detection retry_every={self.retry_every} exceeds probe_bound={self.probe_bound}")


class Answer(enum.Enum):
    """What one probe of a member's agent got."""

    ANSWERED = "answered"  # the agent greeted: its host and its process are there, and it runs
    REFUSED = "refused"  # its host answered, no agent listens: the process died
    SILENT = "silent"  # no handshake within the bound: the host or the link is gone
    MUTE = "mute"  # a handshake, no greeting within the bound: the host is up, its agent does not run
    UNKNOWN = "unknown"  # no probe address published (an older agent, a malformed record)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The verdict on one member: ``state`` is ``lost``, ``alive`` or ``unconfirmed`` (silent, but this node
    is not in the majority, or counts nobody out for now); ``reason`` says why. Changes of ``state`` are what
    gets logged."""

    node: str
    state: str
    reason: str

    @property
    def lost(self) -> bool:
        return self.state == "lost"


def should_probe(stalled_for: float | None, since_last_probe: float | None, detection: Detection) -> bool:
    """Whether to probe the other members now: a local rank has been blocked for ``suspect_after`` (``None``:
    none is), and no round of probes ran in the last ``probe_every`` (``None``: none ever did)."""
    if stalled_for is None or stalled_for < detection.suspect_after:
        return False
    return since_last_probe is None or since_last_probe >= detection.probe_every


def bounds_for(recent: Iterable[float], detection: Detection) -> Detection:
    """The detection to probe one node with, given how long its recent answers took (seconds).

    A link that delays every packet (a congested or long path) makes
    answers slow, not absent: the bounds grow to ``rtt_factor`` times the
    slowest recent answer, so the verdict stays "slow" on such a link.
    """
    slowest = max(recent, default=0.0)
    scaled = detection.rtt_factor * slowest
    if scaled <= min(detection.probe_bound, detection.greeting_bound):
        return detection
    return dataclasses.replace(
        detection,
        probe_bound=max(detection.probe_bound, scaled),
        greeting_bound=max(detection.greeting_bound, scaled),
    )


def in_majority(answers: Mapping[str, tuple[Answer, float]], me: str) -> bool:
    """Whether ``me`` reaches a majority of the live nodes (itself included) in ``answers``.

    Silence is the one answer that may be the prober's own fault: a node
    cut off from the others hears silence from all of them, as they do from
    it. Only the side that still reaches most nodes may count the silent
    ones lost; on an even split, the half holding the first node in node
    order (every node computes the same). Without this, a host that reaches
    etcd but not its peers would revoke them all.
    """
    reached = {node for node, (answer, _) in answers.items() if answer is not Answer.SILENT} | {me}
    total = len(answers) + 1
    if 2 * len(reached) != total:
        return 2 * len(reached) > total
    return min(set(answers) | {me}) in reached


def judge(answers: Mapping[str, tuple[Answer, float]], me: str, held_for: float = 0.0) -> list[Verdict]:
    """The verdict on each member ``me`` probed (``answers``: node -> (answer, seconds it took)), in node order.

    A refusal or a mute host proves the member's agent gone whoever asks; silence counts only when ``me`` is
    in the majority (:func:`in_majority`) and is not holding (``held_for``: the seconds left of its quiet
    window after it announced itself on a new lease, or of its promises). A node just counted out for being
    cut off is the likeliest to be cut off again, and while its links go down it may, for a moment, reach a
    majority it is about to lose: its silence is no proof then.
    """
    majority = in_majority(answers, me)
    verdicts = []
    for node in sorted(answers):
        answer, seconds = answers[node]
        if answer is Answer.REFUSED:
            verdicts.append(
                Verdict(node, "lost", f"its agent refuses connections ({seconds:.2f} s): the process is gone")
            )
        elif answer is Answer.SILENT and not majority:
            reason = "silent, but so are most nodes: this node may be the one cut off; left to its lease"
            verdicts.append(Verdict(node, "unconfirmed", reason))
        elif answer is Answer.SILENT and held_for > 0:
            reason = (
                f"silent, but this node counts nobody out for {held_for:.1f} s more (its own new lease, or its "
                "promises): its own links are suspect; left to its lease and the other members"
            )
            verdicts.append(Verdict(node, "unconfirmed", reason))
        elif answer is Answer.SILENT:
            verdicts.append(
                Verdict(node, "lost", f"no answer to {seconds:.1f} s of probes: its host or the link to it is down")
            )
        elif answer is Answer.MUTE:
            verdicts.append(
                Verdict(
                    node, "lost", f"its host answers but its agent has not run for {seconds:.1f} s: stopped or wedged"
                )
            )
        elif answer is Answer.ANSWERED:
            verdicts.append(Verdict(node, "alive", f"its agent answered in {seconds:.3f} s: alive, only slow"))
        else:
            verdicts.append(Verdict(node, "alive", "it published no probe address: left to its lease"))
    return verdicts


def probe_targets(members: Iterable[str], alive: Iterable[str], me: str) -> list[str]:
    """The members to probe: every other member still holding an ``alive`` record (the others are dead already)."""
    living = set(alive)
    return sorted(node for node in set(members) if node != me and node in living)


def peers_reachable(answers: Mapping[str, tuple[Answer, float]]) -> bool:
    """Whether a node reaches every other live member's agent: what a node cut off and counted out waits
    for before its new workers ask to join again (else they would stall the others once more)."""
    return all(answer in (Answer.ANSWERED, Answer.UNKNOWN) for answer, _ in answers.values())
