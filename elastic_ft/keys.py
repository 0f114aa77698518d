"""Every key elastic-ft keeps in etcd or in a store, spelled in this module only.

All of a run's etcd keys live under its *run prefix*, ``<etcd_prefix>/<run_id>/``
(:class:`RunKeys`)::

    config                          the job config (JSON)
    rdzv/closed                     the job is over
    rdzv/monitor                    on the monitor's lease: which node it is (created once per term)
    rdzv/board                      on the monitor's lease: its digest of the rendezvous, the
                                    one key every node watches (see docs/rendezvous.md)
    rdzv/alive/<node>               on the node's lease: its agent is alive
    rdzv/round/<n>/join/<node>      on the node's lease: it asks to be in round n
    rdzv/round/<n>/result           round n's members in rank order (written once)
    rdzv/round/<n>/ranks/<c>        the same, split by node into chunks: the one each node reads
    rdzv/round/<n>/left/<node>      a member left round n cleanly
    rdzv/round/<n>/slot/<k>         on the node's lease: a hot spare that joined round n
                                    while it ran holds its k-th late place
    rdzv/round/<n>/late/<node>      that late member (lease, place), kept after it dies
    round/<n>/store/<key>           round n's torch.distributed.Store
    round/<n>/store.writes/<token>  on a short lease: a store write that committed
    ftrun/escalations/<n>           ftrun escalated from round n (job-wide count)
    ftrun/store/<key>               the agents' job-wide store (respawns so far)
    replicas/members/<replica>/<r>  on the rank's lease: rank r of replica group <replica> takes part
                                    (its committed step, the quorum it last had, a failure it saw)
    replicas/quorum/<id>            quorum <id> (zero-padded): the replica groups that train together
                                    from it on (written once, by compare-and-create)
    replica_pg/<id>/arrivals/<replica>/<r>   rank r of replica group <replica> reached quorum <id>
    replica_pg/<id>/<r>/<key>       quorum <id>'s cross-replica process group of group rank r: its store
    events/<stream>/next            the run's event log (streams main and progress): the number
                                    the stream's next event takes
    events/<stream>/ring/<slot>     the event numbered seq, at slot seq % capacity (bounded)

Inside a round's store (relative to the store, so the same names serve a
TCPStore) the node side and the worker side keep their records::

    ftrun/nodes/<node>              an agent's global ranks and worker pids
    ftrun/exits/<rank>              how a worker ended
    ftrun/exit_barrier/<node>       an agent finished
    ftrun/next_rank                 initial ranks handed to respawned workers
    ftrun/world                     the round's active world size and hot spares
    elastic_ft/inprocess/job/...    the Wrapper's job-wide keys (WRAPPER_JOB)
    elastic_ft/inprocess/iteration/<n>/...   one restart iteration's keys
    elastic_ft/inprocess/iteration/<n>/heal/...   its peer healing: progress records, transfer groups
    elastic_ft/rank_assignment/<policy>/<call>/...   grouping-key exchanges

The parsers are total: a key that does not have the expected shape gives
``None``, never an exception, since anything read from etcd is untrusted.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- the run's etcd keys ------------------------------------------------------

RDZV = "rdzv/"
#: The run's two event streams: what happened (rounds, faults, restarts), and the ranks' sampled
#: progress, kept apart so a long job's progress samples never push its faults out of the log.
EVENTS_MAIN = "main"
EVENTS_PROGRESS = "progress"


@dataclass(frozen=True)
class RunKeys:
    """The etcd keys of one run, ``<etcd_prefix>/<run_id>/...``."""

    etcd_prefix: str
    run_id: str

    @property
    def root(self) -> str:
        """``<etcd_prefix>/<run_id>/``: every key of the run starts with it."""
        return f"{self.etcd_prefix.rstrip('/')}/{self.run_id}/"

    @property
    def config(self) -> str:
        return self.root + "config"

    @property
    def rdzv(self) -> str:
        """The prefix every rendezvous key lives under; :func:`parse_rdzv_key` reads keys relative to it."""
        return self.root + RDZV

    @property
    def closed(self) -> str:
        return self.rdzv + "closed"

    def alive(self, node: str) -> str:
        return f"{self.rdzv}alive/{node}"

    @property
    def health_prefix(self) -> str:
        """Each node's last health-check verdict before a join (``elastic-ft status`` lists them)."""
        return self.root + "health/"

    def health(self, node: str) -> str:
        return self.health_prefix + node

    @property
    def monitor(self) -> str:
        """On the monitor's lease: the election of the node that follows every key and writes the board."""
        return self.rdzv + "monitor"

    @property
    def board(self) -> str:
        """The monitor's digest of the rendezvous: the one key every node watches."""
        return self.rdzv + "board"

    def join(self, number: int, node: str) -> str:
        return f"{self.rdzv}round/{number}/join/{node}"

    def rank_chunk(self, number: int, chunk: int) -> str:
        """Chunk ``chunk`` of round ``number``'s ranks: the members whose node id hashes to it."""
        return f"{self.rdzv}round/{number}/ranks/{chunk}"

    def result(self, number: int) -> str:
        return f"{self.rdzv}round/{number}/result"

    def left(self, number: int, node: str) -> str:
        return f"{self.rdzv}round/{number}/left/{node}"

    def slot(self, number: int, place: int) -> str:
        return f"{self.rdzv}round/{number}/slot/{place}"

    def late(self, number: int, node: str) -> str:
        return f"{self.rdzv}round/{number}/late/{node}"

    def rdzv_round(self, number: int) -> str:
        """Prefix of round ``number``'s rendezvous keys."""
        return f"{self.rdzv}round/{number}/"

    def round_data(self, number: int) -> str:
        """Prefix of round ``number``'s data (its store)."""
        return f"{self.root}round/{number}/"

    def round_store(self, number: int) -> str:
        """Prefix of round ``number``'s ``torch.distributed.Store``."""
        return f"{self.root}round/{number}/store/"

    @property
    def ftrun_store(self) -> str:
        """Prefix of the agents' job-wide store (counts that outlive rounds, such as respawns)."""
        return self.root + "ftrun/store/"

    @property
    def escalations(self) -> str:
        return self.root + "ftrun/escalations/"

    def escalation(self, number: int) -> str:
        return f"{self.escalations}{number}"

    @property
    def replicas(self) -> ReplicaKeys:
        """The keys of the job's replica groups (:mod:`elastic_ft.replicas`)."""
        return ReplicaKeys(self.root)

    def events_next(self, stream: str = EVENTS_MAIN) -> str:
        """An event stream's counter: the sequence number its next event takes."""
        return f"{self.root}events/{stream}/next"

    def events_ring(self, stream: str = EVENTS_MAIN) -> str:
        """Prefix of an event stream's slots (outside ``rdzv/``: the rendezvous's watches never see events)."""
        return f"{self.root}events/{stream}/ring/"

    def event_slot(self, slot: int, stream: str = EVENTS_MAIN) -> str:
        return f"{self.events_ring(stream)}{slot}"


@dataclass(frozen=True)
class ReplicaKeys:
    """The keys of a run's replica groups, under ``<run root>``."""

    root: str

    @property
    def prefix(self) -> str:
        """What every rank of a replicated job follows: the member records and the quorums."""
        return self.root + "replicas/"

    @property
    def members(self) -> str:
        return self.prefix + "members/"

    def member(self, replica: str, group_rank: int) -> str:
        return f"{self.members}{replica}/{group_rank}"

    @property
    def quorums(self) -> str:
        """One key per quorum id, in id order."""
        return self.prefix + "quorum/"

    def quorum(self, quorum_id: int) -> str:
        return f"{self.quorums}{quorum_id:012d}"

    @property
    def slots(self) -> str:
        """One key per replica group id ``ftrun --replica-groups`` handed a node, on that launcher's lease."""
        return self.prefix + "slots/"

    def slot(self, replica: int) -> str:
        return f"{self.slots}{replica}"

    def arrivals(self, quorum_id: int) -> str:
        """Prefix of the store where every rank of quorum ``quorum_id`` arrives before its groups are built (outside
        :attr:`prefix`)."""
        return f"{self.root}replica_pg/{quorum_id}/arrivals/"

    def group_store(self, quorum_id: int, group_rank: int) -> str:
        """Prefix of the store in which quorum ``quorum_id``'s cross-replica group of ``group_rank`` meets (outside
        :attr:`prefix`, so the ranks following that prefix do not see every group's set-up)."""
        return f"{self.root}replica_pg/{quorum_id}/{group_rank}/"


def store_write_token(store_prefix: str, token: str) -> str:
    """The key that records a committed write of the store at ``store_prefix`` (beside it, not inside it).

    Outside the store's own prefix, so ``num_keys`` and the store's watches
    never see it; inside the round's prefix, so it goes with the round.
    """
    return f"{store_prefix.rstrip('/')}.writes/{token}"


def store_queues_prefix(store_prefix: str) -> str:
    """The prefix of every queue of the store at ``store_prefix`` (see :func:`store_queue_prefix`)."""
    return f"{store_prefix.rstrip('/')}.queue/"


def store_queue_prefix(store_prefix: str, name: str) -> str:
    """The keys of the store's queue ``name`` (``queue_push``), beside the store as its write tokens are.

    The name is length-prefixed, so no queue's prefix is another's: ``a``
    and ``a/b`` are ``.queue/1:a/`` and ``.queue/3:a/b/``.
    """
    return f"{store_queues_prefix(store_prefix)}{len(name)}:{name}/"


def parse_store_queue_key(store_prefix: str, key: str) -> str | None:
    """The name of the queue an item key of the store at ``store_prefix`` belongs to; None for any other key."""
    queues = store_queues_prefix(store_prefix)
    if not key.startswith(queues):
        return None
    length, colon, rest = key[len(queues) :].partition(":")
    if not colon or not length.isdigit() or len(rest) <= int(length) or rest[int(length)] != "/":
        return None
    return rest[: int(length)]


@dataclass(frozen=True)
class RdzvKey:
    """What a key relative to ``rdzv/`` names; ``kind`` is closed, alive, join, result, left, late or slot."""

    kind: str
    round: int = -1
    node: str = ""
    place: int = -1  # of a slot


def parse_rdzv_key(relative: str) -> RdzvKey | None:
    """Read a key relative to :attr:`RunKeys.rdzv`; ``None`` for a key of no known shape."""
    parts = relative.split("/")
    if parts == ["closed"]:
        return RdzvKey("closed")
    if len(parts) == 2 and parts[0] == "alive" and parts[1]:
        return RdzvKey("alive", node=parts[1])
    if len(parts) < 3 or parts[0] != "round":
        return None
    number = parse_count(parts[1])
    if number is None:
        return None
    if parts[2] == "result" and len(parts) == 3:
        return RdzvKey("result", round=number)
    if parts[2] in ("join", "left", "late") and len(parts) == 4 and parts[3]:
        return RdzvKey(parts[2], round=number, node=parts[3])
    if parts[2] == "slot" and len(parts) == 4 and (place := parse_count(parts[3])) is not None:
        return RdzvKey("slot", round=number, place=place)
    return None


# ---- names inside a round's store ------------------------------------------------

FTRUN_NODES = "ftrun/nodes/"
FTRUN_EXITS = "ftrun/exits/"
FTRUN_EXIT_BARRIER = "ftrun/exit_barrier/"
#: The round's world as the agents set it up: {"active_world_size", "spare_nodes", "max_nodes"}.
FTRUN_WORLD = "ftrun/world"
#: Initial ranks handed to respawned workers: ``world_size + add(FTRUN_NEXT_RANK, 1) - 1``.
FTRUN_NEXT_RANK = "ftrun/next_rank"
#: Respawns so far (``add``, in the agents' job-wide store, RunKeys.ftrun_store): the job's budget's count.
FTRUN_RESPAWNS = "respawns"

WRAPPER_NAMESPACE = "elastic_ft/inprocess"
#: The Wrapper's job-wide view; inside it, the records below (by initial rank).
WRAPPER_JOB = f"{WRAPPER_NAMESPACE}/job"
WRAPPED = "wrapped/"
POSITION = "position/"
LEFT = "left/"
HEARTBEAT = "heartbeat/"
#: The hang judge's last look at every peer of an iteration (one record, rewritten each look): the stalled
#: ranks read it instead of every peer's records (``coordination.fault_records.PeerLook``).
PEER_LOOK = "peer_look"
#: Growing the world: a respawned process registers (append, one initial rank a line), a
#: restart admits it (``admitted/<r>``: the iteration it starts in, or ``withdrawn``).
JOINERS = "joiners"
ADMITTED = "admitted/"
#: A reserve rank (or joiner) that became active: one JSON line each, {"initial_rank", "iteration"}.
ACTIVATIONS = "activations"
#: "1" once the ranks accept joiners (their rank assignment can grow the world), "0" if they cannot.
ACCEPTS_JOINERS = "accepts_joiners"
#: Set once an iteration completed: the job is done, and joiners still waiting leave.
FINISHED = "finished"
#: The iteration the last restart began (absent: iteration 0): where a node with no rank in the world
#: asks for a restart that admits its joiners.
LATEST_ITERATION = "latest_iteration"

#: The Wrapper's barriers (names of key groups, see :func:`barrier_arrived`).
INITIAL_BARRIER = "initial_barrier"
ITERATION_BARRIER = "iteration_barrier"
COMPLETION_BARRIER = "completion_barrier"
TERMINATION_BARRIER = "termination_barrier"
EXIT_BARRIER = "exit_barrier"
#: Healing: the active ranks publish their progress, then meet here; the result lists every rank's.
HEAL_BARRIER = "heal_barrier"

#: Keys of one restart iteration's view.
OUTCOME = "outcome"
#: A planned restart's step boundary: the restart happens before the optimizer step of this number (counted
#: from the iteration's start) on every active rank, so that no collective is in flight when it lands.
RESTART_STEP = "restart_step"
INTERRUPTIONS = "interruptions"
TERMINATED = "terminated"
#: Processes expected in the iteration that died before they took their place there: joiners it admitted, and
#: ranks of the previous iteration that its restart counted on (their initial ranks, a line each).
LOST_RANKS = "lost_ranks"
ANY_COMPLETED = "any_completed"
#: Set once a rank made a step (optimizer step or ping) in the iteration.
PROGRESSED = "progressed"
RANK_OF_INITIAL = "rank_of_initial/"
ACTIVE_WORLD_SIZE = "active_world_size"

RANK_ASSIGNMENT = "elastic_ft/rank_assignment"
HEAL = "heal"


def heal_progress(active_rank: int) -> str:
    """An active rank's progress record at the start of an iteration: JSON {"step", "fresh"}."""
    return f"{HEAL}/progress/{active_rank}"


def heal_group(sender: int) -> str:
    """Store prefix under which sender ``sender`` and its receivers bootstrap their transfer group."""
    return f"{HEAL}/group/{sender}/"


def heal_group_ready(sender: int) -> str:
    """The barrier every member of ``sender``'s transfer group reaches once its side of the group is connected."""
    return f"{HEAL}/ready/{sender}"


def wrapper_iteration(number: int) -> str:
    """The store prefix of the Wrapper's restart iteration ``number``."""
    return f"{WRAPPER_NAMESPACE}/iteration/{number}"


def barrier_arrived(name: str, rank: int) -> str:
    return f"{name}/arrived/{rank}"


def barrier_count(name: str) -> str:
    return f"{name}/count"


def barrier_count_slots(name: str) -> str:
    """The prefix of an etcd store's arrival counters for barrier ``name``: an arrival of ``k`` ranks in one
    transaction rewrites slots ``0 .. k-1`` once each, and the arrivals are the sum of the slots' versions."""
    return f"{name}/counted/"


def barrier_count_slot(name: str, slot: int) -> str:
    return f"{barrier_count_slots(name)}{slot}"


def barrier_done(name: str) -> str:
    return f"{name}/done"


def barrier_last(name: str) -> str:
    """The rank whose arrival completed barrier ``name``: the one that publishes its result."""
    return f"{name}/last"


def rank_assignment_exchange(policy: str, call: int) -> str:
    """Prefix of one grouping-key exchange of a rank-assignment policy."""
    return f"{RANK_ASSIGNMENT}/{policy}/{call}"


def exchange_published(exchange: str, rank: int) -> str:
    return f"{exchange}/keys/{rank}"


def exchange_arrived(exchange: str) -> str:
    """The counter prefix of an exchange's arrivals (on etcd, slots as :func:`barrier_count_slots`'s)."""
    return f"{exchange}/arrived/"


def exchange_table(exchange: str) -> str:
    return f"{exchange}/table"


# ---- parsers ---------------------------------------------------------------------

_MAX_COUNT_DIGITS = 18  # beyond any round, rank or iteration a job reaches; keeps int() cheap


def parse_count(text: str) -> int | None:
    """A non-negative decimal integer (a round, rank or iteration), else ``None``."""
    if not text or len(text) > _MAX_COUNT_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def suffix(key: str, prefix: str) -> str | None:
    """The part of ``key`` after ``prefix``, or ``None`` if ``key`` is not under it (or is it)."""
    if not key.startswith(prefix) or len(key) == len(prefix):
        return None
    return key[len(prefix) :]


def count_suffix(key: str, prefix: str) -> int | None:
    """The number that ends ``key`` right after ``prefix`` (``.../exits/3`` -> 3), else ``None``."""
    rest = suffix(key, prefix)
    return None if rest is None else parse_count(rest)


def parse_replica_member_key(relative: str) -> tuple[str, int] | None:
    """``<replica>/<group rank>`` (relative to :attr:`ReplicaKeys.members`) as its parts; None if malformed."""
    replica, _, rank = relative.rpartition("/")
    group_rank = parse_count(rank)
    if not replica or "/" in replica or group_rank is None:
        return None
    return replica, group_rank


def parse_quorum_key(relative: str) -> int | None:
    """A quorum's id from its key relative to :attr:`ReplicaKeys.quorums`; None if malformed."""
    return parse_count(relative) if len(relative) == 12 else None


def run_root_of_round_store(prefix: str) -> str | None:
    """The run prefix (:attr:`RunKeys.root`) of a round's store prefix ``<root>round/<n>/store/``; None if
    ``prefix`` has another shape."""
    head, separator, tail = prefix.rpartition("round/")
    number, _, rest = tail.partition("/")
    if not separator or not head.endswith("/") or parse_count(number) is None or rest != "store/":
        return None
    return head
