"""Fencing through an etcd outage: when a node's ranks may commit steps, and when a lost lease is a death (pure).

A node's workers commit an optimizer step only while nobody can have
counted their node out (``local_board``'s fence): normally while its lease
is proven alive (the send time of the last refresh etcd answered, plus the
TTL). When etcd stops answering, two cases look the same from inside the
node, and must be told apart:

* **a partition**: this node cannot reach etcd, the others can. They will
  count it out once its lease ends, and train on without it: its ranks must
  stop before that, as they do when its proof runs out;
* **an outage**: nobody can reach etcd. Nobody can count anybody out, so
  every rank may go on training; and when etcd is back, the leases that
  ended with it (a freeze longer than the TTL ends every one of them at
  once) are no death: every node announces itself again, and nobody is
  counted out or fenced.

What tells them apart is the other members, over the data network that the
outage leaves up. A node whose proof goes stale (half a TTL left, where a
healthy lease, refreshed every third of its TTL, always has two thirds)
asks every other live member's agent (its probe port, ``probe.py``) whether
it reaches etcd (:class:`Vouch`). A member whose own proof is stale too
answers "no, and I promise to count nobody out for the next ``period``
seconds"; one whose proof is fresh answers "yes", with no promise. While
every other member's promise holds, the node's fence extends to the
earliest one's end (:func:`fence`): since nobody can count it out before
then, its ranks may step. One member without a promise (it reaches etcd,
or it does not answer) and the fence runs out with the node's own proof,
as before. The leases of one job are refreshed at different moments of
their TTL (up to a third apart), so a member may still say "yes" at the
first ask; the asks repeat every :data:`ASK_EVERY` of the period, and the
slowest member's proof turns stale a sixth of the TTL before the asker's
runs out.

A promise binds its giver (:func:`death_verdict`): until it ends, the
node holds back any death it learns from a lease that ended (its probes'
own confirmations excepted: a process that refuses connections is not
training). Once it ends, a death counts only if the node's own lease is
proven alive after the death was seen: if its own lease ended too, etcd
was away for everybody, and the death is dropped. So a node stepping on a
promise is never counted out before the promise's end, which its own fence
never passes: the same argument as the lease's, with the promise's giver
in place of etcd.

Whether the node was counted out while its lease was lost decides whether
its workers must restart (:func:`next_generation`): a new lease whose
fence never lapsed since the old one's last proof keeps the generation;
one that follows a lapse, or a lease revoked before its proof ran out (a
member's probes confirmed the node lost), starts a new one, and the
workers restart into the membership the job has now (``Fenced``).

The functions here decide; ``launcher/fence_keeper.py`` and the agent
carry out. Times are ``time.monotonic()`` seconds, given as arguments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

#: What a vouch answer may claim at most, in seconds (an answer is untrusted input).
MAX_PROMISE = 3600.0
#: A lease proof with less than this share of the period left is stale: its node no longer reaches etcd.
STALE = 0.5
#: How often a node whose proof is stale asks again (share of the period) while a member has no promise out,
#: and once every member's promise holds.
ASK_EVERY = 0.125
RENEW_EVERY = 0.25


@dataclasses.dataclass(frozen=True)
class Vouch:
    """One member's answer about its own contact with etcd.

    ``proven``: its lease is proven alive now (it reaches etcd); ``promise``:
    for how many seconds from its answer it counts nobody out (0 when proven).
    """

    node: str
    proven: bool
    promise: float

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "proven": self.proven, "promise": self.promise}

    @classmethod
    def from_json(cls, document: object) -> Vouch | None:
        """A vouch from an untrusted answer: None unless it is one."""
        if not isinstance(document, dict):
            return None
        node, proven, promise = document.get("node"), document.get("proven"), document.get("promise")
        if not isinstance(node, str) or not node or len(node) > 300 or not isinstance(proven, bool):
            return None
        if isinstance(promise, bool) or not isinstance(promise, int | float) or not math.isfinite(promise):
            return None
        if not 0 <= promise <= MAX_PROMISE or (proven and promise):
            return None
        return cls(node, proven, float(promise))


@dataclasses.dataclass(frozen=True)
class Fence:
    """Until when this node's ranks may commit steps, and why."""

    valid_until: float
    reason: str
    #: The fence rests on the other members' promises, not on the node's own lease.
    vouched: bool = False


def fence(
    own_valid_until: float,
    promised_until: Mapping[str, float],
    reaching: frozenset[str],
    members: frozenset[str],
    now: float,
) -> Fence:
    """The node's fence: its lease's proof, extended by the other members' promises while all of them hold.

    ``promised_until``: until when each member promised to count nobody out
    (the latest end it promised: a promise binds its giver whatever it
    answers later); ``reaching``: the members whose last answer said they
    reach etcd; ``members``: the other members whose promises are needed
    (every other live node of the run).
    """
    own = Fence(own_valid_until, "its lease is proven alive" if own_valid_until > now else "its lease is unproven")
    missing = [node for node in sorted(members) if promised_until.get(node, 0.0) <= now]
    if members and not missing:
        vouched_until = min(promised_until[node] for node in members)
        if vouched_until > own_valid_until:  # written before the proof runs out: the ranks never see a gap
            return Fence(
                vouched_until,
                f"its lease is stale, and all {len(members)} other member(s) promise to count nobody out: etcd is "
                "away for everybody",
                vouched=True,
            )
    if own_valid_until > now or not missing:
        return own
    node = missing[0]
    why = (
        f"member {node} reaches etcd: this node may be cut off from it"
        if node in reaching
        else f"member {node} has not promised (no answer)"
    )
    return dataclasses.replace(own, reason=f"{own.reason}, and {why}")


def stale(own_valid_until: float, period: float, now: float) -> bool:
    """Whether a lease proof has gone stale: less than :data:`STALE` of the period left (its node stopped
    reaching etcd a refresh or more ago)."""
    return own_valid_until - now < STALE * period


def should_ask(own_valid_until: float, last_asked: float | None, all_promised: bool, period: float, now: float) -> bool:
    """Whether to ask the other members for promises now: the node's proof is stale, and no round of asks ran in
    the last :data:`ASK_EVERY` of the period (:data:`RENEW_EVERY` once every member's promise holds)."""
    if not stale(own_valid_until, period, now):
        return False
    every = (RENEW_EVERY if all_promised else ASK_EVERY) * period
    return last_asked is None or now - last_asked >= every


def answer(node: str, own_valid_until: float, period: float, now: float) -> tuple[Vouch, float]:
    """What this node answers a member that asks (and until when it is bound by its promise: ``now`` when it
    promised nothing).

    A node whose own proof is fresh reaches etcd: it says so and promises
    nothing. Only its own lease counts: promises it holds from others prove
    nothing of etcd.
    """
    if not stale(own_valid_until, period, now):
        return Vouch(node, True, 0.0), now
    return Vouch(node, False, period), now + period


def death_verdict(*, confirmed_here: bool, own_lease: bool | None, hold_until: float, now: float) -> tuple[str, str]:
    """What to do with a member whose lease ended: ``absorb`` (report its ranks), ``wait`` (look again later) or
    ``drop`` (no death), with the reason.

    ``confirmed_here``: this node's own probes found the member's agent gone
    (refused, mute, or silent from the majority side): its process trains no
    more, whatever etcd says. ``own_lease``: whether this node's own lease
    was proven alive after the death was seen (None: not known yet).
    ``hold_until``: the end of this node's promises and of the quiet window
    after it announced itself again.
    """
    if confirmed_here:
        return "absorb", "this node's probes confirmed it lost"
    if now < hold_until:
        return (
            "wait",
            f"this node counts nobody out for {hold_until - now:.1f} s more (its promises, or its own new lease)",
        )
    if own_lease is None:
        return "wait", "this node's own lease is not yet proven alive since: etcd may be away for everybody"
    if not own_lease:
        return (
            "drop",
            "this node's own lease ended too: etcd was away for everybody, and every node announces itself again",
        )
    return "absorb", "its lease ended while this node's own was alive"


def next_generation(generation: int, lease_changed: bool, lapsed: bool, revoked: bool = False) -> tuple[int, str]:
    """The fence's generation once the node holds a new lease: the same when its fence never lapsed since the
    old lease's last proof (nobody can have counted it out), one more otherwise (its workers restart).

    ``revoked``: the old lease ended while its proof still ran. etcd ends a lease no earlier than its proof
    says, so a member revoked it, which it does only once its probes confirmed the node lost: the node was
    counted out, however briefly its fence had to lapse for the node to see it (on a loaded host the new
    lease can come before the fence keeper looks again)."""
    if not lease_changed:
        return generation, "the same lease"
    if generation == 0:
        return 1, "the node's first lease"
    if revoked:
        return generation + 1, "the old lease was revoked before its proof ran out: a member counted the node out"
    if not lapsed:
        return generation, "a new lease, and the fence never lapsed meanwhile: nobody can have counted the node out"
    return generation + 1, "a new lease after the fence lapsed: the others may have counted the node out"
