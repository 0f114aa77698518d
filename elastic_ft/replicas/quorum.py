"""Which replica groups train together: the members' records, the quorum, and the next quorum (pure).

A *replica group* holds a whole copy of the model (one rank, or the G ranks
of an FSDP/HSDP shard group). Rank ``r`` of every group in a quorum
all-reduces with rank ``r`` of the others; a fault inside one group ends
that group's part, never the others' processes. Every rank of every group
keeps a :class:`MemberRecord` in etcd, on its process's lease, written when
it joins and when it sees a collective fail: never per step. A
:class:`Quorum` is written once per change, by whichever rank first sees
the change (a compare-and-create on its id), and every rank follows the
quorums through a watch.

:func:`next_quorum` is the one rule, a function of the current quorum and
the records (and whether the grace for a failure is over), returning the
next quorum and its reason, as TorchFT's ``quorum_compute`` does:

- no quorum yet: the complete groups, once there are ``min_replicas``;
- a complete group not in the quorum (a newcomer, a group back from a
  fault): the complete groups;
- a group lost (a member's record gone) while no member saw a collective
  fail: the complete groups, once the grace ended (a record etcd dropped
  with an expired lease comes back on a new one; a group that died makes a
  collective fail);
- a member that saw a collective of the quorum fail: a new quorum of the
  groups whose members all saw it (the others are blocked on the broken
  group or gone), once every group of the quorum did, or the grace ended;
- otherwise the quorum stands.

A group is *complete* when records of ranks ``0..G-1`` exist and agree on
``G``; a group whose size differs from the quorum's never joins it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastic_ft.untrusted import MAX_TEXT, MalformedRecord, count_field, integer, json_document, text_list_field

#: The most replica groups a quorum lists (a forged record claiming more is refused).
MAX_REPLICAS = 65536
#: "None yet", in a record's quorum fields.
NO_QUORUM = -1


@dataclass(frozen=True)
class MemberRecord:
    """What rank ``group_rank`` of replica group ``replica`` says about itself in etcd.

    ``step`` is its committed step when it wrote the record; ``quorum`` the
    last quorum it trained in (``NO_QUORUM``: none, a newcomer); ``failed``
    the quorum in which it saw a collective fail (``NO_QUORUM``: none).
    """

    replica: str
    group_rank: int
    group_world_size: int
    step: int
    quorum: int = NO_QUORUM
    failed: int = NO_QUORUM

    def encode(self) -> bytes:
        return json.dumps(
            {"group_world_size": self.group_world_size, "step": self.step, "quorum": self.quorum, "failed": self.failed}
        ).encode()

    @classmethod
    def decode(cls, replica: str, group_rank: int, raw: bytes | str) -> MemberRecord:
        """Raises :class:`~elastic_ft.untrusted.MalformedRecord` for a record this module did not write."""
        what = "replica member record"
        document = json_document(raw, what)
        return cls(
            replica=replica,
            group_rank=group_rank,
            group_world_size=count_field(document, "group_world_size", what, low=1, high=MAX_REPLICAS),
            step=count_field(document, "step", what),
            quorum=integer(document.get("quorum"), "quorum", what, low=NO_QUORUM),
            failed=integer(document.get("failed"), "failed", what, low=NO_QUORUM),
        )


@dataclass(frozen=True)
class Quorum:
    """Quorum ``id``: the replica groups (sorted) that train together from it on, each of
    ``group_world_size`` ranks."""

    id: int
    replicas: tuple[str, ...]
    group_world_size: int

    def index(self, replica: str) -> int:
        """The place of ``replica`` in the quorum: its rank in the cross-replica groups."""
        return self.replicas.index(replica)

    def encode(self) -> bytes:
        return json.dumps(
            {"id": self.id, "replicas": list(self.replicas), "group_world_size": self.group_world_size}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Quorum:
        """Raises :class:`~elastic_ft.untrusted.MalformedRecord` for a record this module did not write."""
        what = "replica quorum"
        document = json_document(raw, what)
        replicas = text_list_field(document, "replicas", what, max_items=MAX_REPLICAS)
        if not replicas or list(replicas) != sorted(set(replicas)):
            raise MalformedRecord(f"{what} has replicas={list(replicas)!r}; expected a sorted list of distinct ids")
        return cls(
            id=count_field(document, "id", what),
            replicas=replicas,
            group_world_size=count_field(document, "group_world_size", what, low=1, high=MAX_REPLICAS),
        )


def check_replica_id(replica: str) -> str:
    """``replica`` if it can name a replica group in a key; else a ``ValueError`` saying what is expected."""
    if not isinstance(replica, str) or not replica or "/" in replica or len(replica) > MAX_TEXT:
        raise ValueError(
            f"replica_id {replica!r} cannot name a replica group; expected non-empty text without '/', at most "
            f"{MAX_TEXT} characters"
        )
    return replica


@dataclass(frozen=True)
class QuorumDecision:
    """The quorum to train in (None: none can be formed yet) and why."""

    quorum: Quorum | None
    reason: str
    #: True when the decision is a new quorum to write (its id is the next one).
    changed: bool = False
    #: True when the quorum stands only until the grace ends (a change is pending).
    holding: bool = False


def complete_groups(
    members: Iterable[MemberRecord], group_world_size: int | None = None
) -> dict[str, list[MemberRecord]]:
    """The groups with a record for every one of their ranks, all agreeing on the group's size (and equal to
    ``group_world_size`` when given)."""
    by_group: dict[str, list[MemberRecord]] = {}
    for member in members:
        by_group.setdefault(member.replica, []).append(member)
    complete = {}
    for replica, records in by_group.items():
        sizes = {record.group_world_size for record in records}
        if len(sizes) != 1:
            continue
        (size,) = sizes
        if group_world_size is not None and size != group_world_size:
            continue
        if sorted(record.group_rank for record in records) == list(range(size)):
            complete[replica] = records
    return complete


def next_quorum(
    current: Quorum | None,
    members: Iterable[MemberRecord],
    min_replicas: int,
    grace_over: bool = False,
) -> QuorumDecision:
    """The quorum that follows ``current`` given the members' records (see the module docstring)."""
    records = list(members)
    size = current.group_world_size if current is not None else _common_size(records)
    groups = complete_groups(records, size)
    if current is None:
        if size is None or len(groups) < min_replicas:
            return QuorumDecision(None, f"{len(groups)} complete replica group(s); waiting for {min_replicas}")
        return _formed(0, groups, size, f"first quorum of {len(groups)} replica group(s)")
    lost = sorted(set(current.replicas) - set(groups))
    joined = sorted(set(groups) - set(current.replicas))
    saw_failure = {replica for replica, group in groups.items() if all(record.failed >= current.id for record in group)}
    any_failure = any(record.failed >= current.id for group in groups.values() for record in group)
    if any_failure:
        waiting = sorted(set(current.replicas) & set(groups) - saw_failure)
        if waiting and not grace_over:
            return QuorumDecision(current, f"quorum {current.id} failed; waiting for {waiting} to see it", holding=True)
        kept = {replica: groups[replica] for replica in sorted(saw_failure | set(joined))}
        reason = f"quorum {current.id} failed" + (f"; left out {waiting} (grace over)" if waiting else "")
    elif lost and not grace_over:
        # No member saw a collective fail: the groups still train. Their records went with a lease etcd let expire
        # (etcd away longer than the TTL, say), and come back on a new one; a group that died fails a collective.
        return QuorumDecision(current, f"lost {lost} without a failure; waiting for their records", holding=True)
    elif lost or joined:
        kept = groups
        reason = "; ".join(
            part for part in (f"lost {lost}" if lost else "", f"joined {joined}" if joined else "") if part
        )
    else:
        return QuorumDecision(current, "unchanged")
    if len(kept) < min_replicas:
        return QuorumDecision(None, f"{reason}: {len(kept)} replica group(s) left, fewer than {min_replicas}")
    return _formed(current.id + 1, kept, current.group_world_size, reason)


def _common_size(records: list[MemberRecord]) -> int | None:
    """The group size most records give (ties: the smallest): the size of the first quorum."""
    counts: dict[int, int] = {}
    for record in records:
        counts[record.group_world_size] = counts.get(record.group_world_size, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda size: (-counts[size], size))


def _formed(quorum_id: int, groups: Mapping[str, list[MemberRecord]], size: int, reason: str) -> QuorumDecision:
    return QuorumDecision(Quorum(quorum_id, tuple(sorted(groups)), size), reason, changed=True)


@dataclass(frozen=True)
class Healing:
    """Who sends its state to whom when a quorum starts: the members behind the highest step receive it from one
    at that step, spread over them."""

    step: int
    #: receiver index -> sender index, both places in the quorum.
    senders: dict[int, int]


def plan_healing(steps: list[int], sync_all: bool = False) -> Healing:
    """Given each quorum member's committed step, in quorum order: who heals from whom. With ``sync_all`` (TorchFT's
    ``init_sync``), members that have not trained yet all take the first one's state, so every replica starts
    from the same weights however each initialized them."""
    top = max(steps)
    sources = [index for index, step in enumerate(steps) if step == top]
    if sync_all and top == 0:
        sources = sources[:1]
    behind = [index for index in range(len(steps)) if index not in sources]
    return Healing(top, {receiver: sources[k % len(sources)] for k, receiver in enumerate(behind)})
