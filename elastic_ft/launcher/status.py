"""What ``elastic-ft status`` shows: the run's rounds, members, workers and restarts, read from etcd.

:func:`collect_status` reads a few key ranges and returns plain data (what
``--json`` prints); :func:`render_status` turns it into the table. Records
that do not decode are skipped, not fatal: the status of a job is exactly
when a reader must cope with whatever is in etcd. Each skipped key is
listed, with the reason, under ``malformed``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from elastic_ft.coordination.fault_records import parse_interruptions
from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.job_config import JobConfig, JobConfigError, parse_stored_job_config
from elastic_ft.keys import (
    ACTIVATIONS,
    ADMITTED,
    FTRUN_EXITS,
    FTRUN_NEXT_RANK,
    FTRUN_NODES,
    FTRUN_WORLD,
    INTERRUPTIONS,
    JOINERS,
    OUTCOME,
    POSITION,
    RANK_OF_INITIAL,
    TERMINATION_BARRIER,
    WRAPPER_JOB,
    RunKeys,
    barrier_arrived,
    barrier_done,
    count_suffix,
    parse_count,
    suffix,
    wrapper_iteration,
)
from elastic_ft.launcher.escalation import WorkerExit
from elastic_ft.launcher.node_health import HealthRecord
from elastic_ft.launcher.records import EscalationRecord, ExitRecord, NodeRecord, WorldRecord
from elastic_ft.observability.events import JobEvent, one_line
from elastic_ft.observability.outages import describe_outage, outages
from elastic_ft.rendezvous.model import RoundResult, parse_state
from elastic_ft.untrusted import MalformedRecord, SkipLog, decode, json_object

#: Exit kinds that are no failure: a worker that completed, or a respawned one the job completed without.
_NOT_FAILED = (WorkerExit.SUCCEEDED.value, WorkerExit.RETIRED.value)

log = logging.getLogger(__name__)
_SKIPPED = SkipLog(log)


def _alive_info(raw: bytes) -> dict[str, Any] | None:
    """An alive key's {"host": str, "pid": int}, or None."""
    document = json_object(raw)
    if document is None:
        return None
    host, pid = document.get("host"), document.get("pid")
    if not isinstance(host, str) or isinstance(pid, bool) or not isinstance(pid, int):
        return None
    return {"host": host[:255], "pid": pid}


def _stored_config(raw: bytes) -> tuple[JobConfig | None, str | None]:
    """The stored job config, or None and why it cannot be used."""
    try:
        return parse_stored_job_config(raw, "the run's config key"), None
    except JobConfigError as error:
        return None, str(error)[:300]


def _hosts(raw: dict[str, Any], malformed: list[dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Each live node's host and pid, from its ``alive/`` record (a malformed one is listed, not used)."""
    hosts = {}
    for key, kv in raw.items():
        node = suffix(key, "alive/")
        if node is not None:
            info = _alive_info(kv.value)
            if info is None:
                malformed.append({"key": kv.key, "reason": 'expected {"host": <text>, "pid": <integer>}'})
            else:
                hosts[node] = info
    return hosts


def collect_status(client: EtcdClient, keys: RunKeys, events: list[JobEvent] | None = None) -> dict[str, Any]:
    """Everything ``elastic-ft status`` shows (``events``: the run's, when the caller read them already)."""
    kvs, revision = client.get_prefix(keys.rdzv)
    config_kv, _ = client.get(keys.config)
    raw = {kv.key[len(keys.rdzv) :]: kv for kv in kvs}
    state = parse_state(raw)
    malformed = [{"key": keys.rdzv + key, "reason": reason} for key, reason in sorted(state.malformed.items())]
    hosts = _hosts(raw, malformed)
    config: JobConfig | None = None
    if config_kv is not None:
        config, problem = _stored_config(config_kv.value)
        if problem is not None:
            malformed.append({"key": config_kv.key, "reason": problem})
    current = state.last_closed
    members = _members(current, state, hosts)
    members += _late_members(current, state, hosts)
    open_round = state.round(state.open_round)
    member_nodes = {m["node"] for m in members}
    # Without a stored config, max_nodes is unknown: nodes waiting are not called spares.
    full = current is not None and config is not None and len(current.members) >= config.nodes.max_nodes
    joined = []
    for node in sorted(open_round.joins, key=lambda n: open_round.joins[n].create_revision):
        role = "rejoined" if node in member_nodes else ("spare" if full else "waiting")
        joined.append({"node": node, "role": role, "host": hosts.get(node, {}).get("host")})
    workers: list[dict[str, Any]] = []
    terminated: list[int] = []
    iteration = None
    restart = None
    world: dict[str, Any] = {
        "spare_nodes": 0,
        "active_world_size": None,
        "respawns": 0,
        "joined": [],
        "activations": [],
    }
    if current is not None:
        dead_nodes = {m["node"] for m in members if m["state"] == "dead"}
        store = keys.round_store(current.round)
        workers, terminated, iteration = _worker_status(client, store, dead_nodes, malformed)
        if iteration is not None:
            restart = _restart_in_progress(client, store, iteration)
        world = _world_status(client, store, len(members), malformed)
    escalations = _escalations(client, keys, malformed)
    return {
        "node_health": _node_health(client, keys, malformed),
        "etcd_outages": _etcd_outages(client, keys, events),
        "run": keys.run_id,
        "revision": revision,
        "closed": state.closed,
        "round": None if current is None else current.round,
        "rounds_completed": 0 if current is None else current.round + 1,
        "master": None if current is None else f"{current.master_addr}:{current.master_port}",
        "members": members,
        "next_round": state.open_round,
        "joined_next_round": joined,
        "config": None if config is None else config.to_document(),
        "workers": workers,
        "terminated_ranks": terminated,
        "in_process_restarts": iteration,
        "restart_in_progress": restart,
        **world,
        "process_restarts": len(escalations),
        "escalations": escalations,
        "malformed": malformed,
    }


#: The most recent etcd outages ``status`` lists.
RECENT_OUTAGES = 5


def _etcd_outages(client: EtcdClient, keys: RunKeys, events: list[JobEvent] | None) -> list[dict[str, Any]]:
    """The job's most recent etcd outages, from its event log: start, end, length and who waited on it."""
    now = time.time()
    if events is None:
        events = EventLog(client, keys).read().events
    return [
        {"start": o.start, "end": o.end, "seconds": round(o.seconds(now), 3), "seen_by": list(o.seen_by)}
        for o in outages(events)[-RECENT_OUTAGES:]
    ]


def _members(current: RoundResult | None, state: Any, hosts: dict[str, Any]) -> list[dict[str, Any]]:
    if current is None:
        return []
    members = []
    left = state.round(current.round).left
    for rank, member in enumerate(current.members):
        if member.node in left:
            health = "left"
        elif state.is_alive(member):
            health = "alive"
        else:
            health = "dead"
        info = hosts.get(member.node, {})
        members.append(
            {"rank": rank, "node": member.node, "host": info.get("host"), "pid": info.get("pid"), "state": health}
        )
    return members


def _late_members(current: RoundResult | None, state: Any, hosts: dict[str, Any]) -> list[dict[str, Any]]:
    """Hot spares that joined the running round, after its members (``rank`` is their group rank)."""
    if current is None:
        return []
    record = state.round(current.round)
    held = set(record.slots.values())
    late = []
    for node, member in sorted(record.late.items(), key=lambda item: item[1].place):
        health = "left" if node in record.left else ("alive" if node in held and node in state.alive else "dead")
        info = hosts.get(node, {})
        late.append(
            {
                "rank": member.place,
                "node": node,
                "host": info.get("host"),
                "pid": info.get("pid"),
                "state": health,
                "late": True,
            }
        )
    return late


def _node_health(client: EtcdClient, keys: RunKeys, malformed: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Each node's last health verdict before a join (``ftrun``'s node health checks)."""
    kvs, _ = client.get_prefix(keys.health_prefix)
    verdicts = []
    for kv in kvs:
        try:
            record = HealthRecord.from_json(kv.value)
        except MalformedRecord as error:
            malformed.append({"key": kv.key, "reason": error.reason})
            continue
        verdicts.append(
            {
                "node": kv.key[len(keys.health_prefix) :],
                "healthy": record.healthy,
                "problems": list(record.problems),
                "checked_at": record.checked_at,
            }
        )
    return verdicts


def _escalations(client: EtcdClient, keys: RunKeys, malformed: list[dict[str, str]]) -> list[dict[str, Any]]:
    records = _records(client, keys.escalations, parse_count, EscalationRecord.from_json, malformed)
    return [
        {"round": number, "node": record.node, "reason": record.reason, "time": record.time}
        for number, record in sorted(records.items())
    ]


KeyT = TypeVar("KeyT")
RecordT = TypeVar("RecordT")


def _records(
    client: EtcdClient,
    prefix: str,
    parse_key: Callable[[str], KeyT | None],
    decode: Callable[[bytes], RecordT],
    malformed: list[dict[str, str]],
) -> dict[KeyT, RecordT]:
    """The records under ``prefix`` by key suffix; malformed keys and records are skipped (and listed)."""
    found: dict[KeyT, RecordT] = {}
    for kv in client.get_prefix(prefix)[0]:
        rest = suffix(kv.key, prefix)
        key = None if rest is None else parse_key(rest)
        if key is None:
            continue
        try:
            found[key] = decode(kv.value)
        except MalformedRecord as error:
            malformed.append({"key": kv.key, "reason": str(error)[:300]})
    return found


def _worker_status(
    client: EtcdClient, store_prefix: str, dead_nodes: set[str], malformed: list[dict[str, str]]
) -> tuple[list[dict[str, Any]], list[int], int | None]:
    """The workers of the round from ftrun's and the Wrappers' records in the round's store.

    Returns the workers by global rank, the ranks that left the job (failed
    or on a dead node), and the highest in-process restart iteration reached.
    """
    nodes = _records(client, store_prefix + FTRUN_NODES, lambda rest: rest, NodeRecord.from_json, malformed)
    exits = _records(client, store_prefix + FTRUN_EXITS, parse_count, ExitRecord.from_json, malformed)
    positions_prefix = f"{store_prefix}{WRAPPER_JOB}/{POSITION}"
    positions = {}
    for kv in client.get_prefix(positions_prefix)[0]:
        rank = count_suffix(kv.key, positions_prefix)
        if rank is None:
            continue
        position = _position(kv.value)
        if position is None:
            malformed.append({"key": kv.key, "reason": 'expected {"iteration": <integer>, "rank": <integer>}'})
        else:
            positions[rank] = position
    workers: list[dict[str, Any]] = []
    for node, record in nodes.items():
        for rank, pid in zip(record.global_ranks, record.pids, strict=True):
            exit_record = exits.get(rank)
            if exit_record is not None:
                state = f"{exit_record.kind} ({exit_record.exitcode})"
            elif node in dead_nodes:
                state = "node dead"
            else:
                state = "running"
            position = positions.get(rank, {})
            active = position.get("active")
            workers.append(
                {
                    "rank": rank,
                    "node": node,
                    "pid": pid,
                    "state": state,
                    "iteration": position.get("iteration"),
                    "rank_in_iteration": position.get("rank"),
                    "mode": None if active is None else ("active" if active else "reserve"),
                }
            )
    listed = {worker["rank"] for worker in workers}
    for rank, exit_record in exits.items():
        if rank not in listed:  # a process its node replaced (respawned) since
            workers.append(
                {
                    "rank": rank,
                    "node": exit_record.node,
                    "pid": exit_record.pid,
                    "state": f"{exit_record.kind} ({exit_record.exitcode})",
                    "iteration": positions.get(rank, {}).get("iteration"),
                    "rank_in_iteration": positions.get(rank, {}).get("rank"),
                    "mode": None,
                }
            )
    workers.sort(key=lambda worker: worker["rank"])
    terminated = sorted(
        w["rank"]
        for w in workers
        if w["state"] == "node dead" or (w["rank"] in exits and exits[w["rank"]].kind not in _NOT_FAILED)
    )
    iterations = [position["iteration"] for position in positions.values()]
    return workers, terminated, max(iterations) if iterations else None


def _position(raw: bytes) -> dict[str, Any] | None:
    """A Wrapper's position record, {"iteration": int >= 0, "rank": int >= 0, "active": bool}, or None."""
    document = json_object(raw)
    if document is None:
        return None
    values = [document.get("iteration"), document.get("rank")]
    active = document.get("active", True)
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in values):
        return None
    if not isinstance(active, bool):
        return None
    return {"iteration": values[0], "rank": values[1], "active": active}


def _world_status(
    client: EtcdClient, store_prefix: str, members: int, malformed: list[dict[str, str]]
) -> dict[str, Any]:
    """Hot spares, respawned workers and activations of the round (from the agents' and Wrappers' records).

    ``members``: the round's nodes, late members included, so that a spare
    that joined the running round counts as one that joined the round.
    """
    job = f"{store_prefix}{WRAPPER_JOB}/"
    world_kv, _ = client.get(store_prefix + FTRUN_WORLD)
    spares, size = 0, None
    if world_kv is not None:
        try:
            world = decode(world_kv.key, world_kv.value, WorldRecord.from_json)
        except MalformedRecord as error:
            malformed.append({"key": world_kv.key, "reason": error.reason[:300]})
        else:
            spares, size = world.spares_with(members), world.active_world_size
    respawns_kv, _ = client.get(store_prefix + FTRUN_NEXT_RANK)
    respawns = parse_count(respawns_kv.value.decode(errors="replace")) if respawns_kv is not None else 0
    joiners_kv, _ = client.get(job + JOINERS)
    registered = joiners_kv.value.decode(errors="replace").split() if joiners_kv is not None else []
    admitted = {
        rank: kv.value.decode(errors="replace")[:32]
        for kv in client.get_prefix(job + ADMITTED)[0]
        if (rank := count_suffix(kv.key, job + ADMITTED)) is not None
    }
    ranks = dict.fromkeys(rank for rank in map(parse_count, registered) if rank is not None)
    joined = [{"initial_rank": rank, "admitted": admitted.get(rank)} for rank in ranks]
    activations_kv, _ = client.get(job + ACTIVATIONS)
    activations = []
    for line in activations_kv.value.decode(errors="replace").splitlines() if activations_kv is not None else []:
        record = json_object(line.encode())
        values = [record.get("initial_rank"), record.get("iteration")] if record else []
        if len(values) == 2 and all(parse_count(str(v)) is not None and not isinstance(v, bool) for v in values):
            activations.append({"initial_rank": values[0], "iteration": values[1]})
        else:
            malformed.append({"key": job + ACTIVATIONS, "reason": f"skipped a malformed line {line[:80]!r}"})
    return {
        "spare_nodes": spares,
        "active_world_size": size,
        "respawns": respawns or 0,
        "joined": joined,
        "activations": sorted(activations, key=lambda a: (a["iteration"], a["initial_rank"])),
    }


def _restart_in_progress(client: EtcdClient, store_prefix: str, iteration: int) -> dict[str, Any] | None:
    """The restart of ``iteration`` if one is under way: when and why it was interrupted, whom it waits for.

    An iteration is being restarted from the moment its outcome is
    ``interrupted`` until its termination barrier completes; meanwhile the
    ranks that have not arrived at that barrier are the ones it waits for.
    """
    prefix = f"{store_prefix}{wrapper_iteration(iteration)}/"
    kvs, _ = client.get_prefix(prefix)
    found = {kv.key[len(prefix) :]: kv.value for kv in kvs}
    if found.get(OUTCOME) != b"interrupted" or barrier_done(TERMINATION_BARRIER) in found:
        return None
    initial_of: dict[int, int] = {}
    for key, value in found.items():
        initial = count_suffix(key, RANK_OF_INITIAL)
        rank = parse_count(value.decode(errors="replace"))
        if initial is not None and rank is not None:
            initial_of[rank] = initial
    records, malformed = parse_interruptions(found.get(INTERRUPTIONS, b"").decode(errors="replace"))
    for line in malformed:
        _SKIPPED.skip(
            MalformedRecord(f"{line:.200}", f"iteration {iteration}: {INTERRUPTIONS}"), "an interruption record"
        )
    interruptions = [
        {"rank": r.rank, "initial_rank": initial_of.get(r.rank), "kind": r.kind, "message": r.message, "time": r.time}
        for r in records
    ]
    arrived = {rank for rank in initial_of if barrier_arrived(TERMINATION_BARRIER, rank) in found}
    times = [record["time"] for record in interruptions if record["time"] is not None]
    return {
        "iteration": iteration,
        "interrupted_at": min(times) if times else None,
        "interruptions": interruptions,
        "waiting_for": sorted(initial_of[rank] for rank in initial_of if rank not in arrived),
    }


def render_status(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}: " + ("closed" if status["closed"] else "open")]
    if status["round"] is None:
        lines.append("no round has completed yet")
    else:
        lines.append(
            f"round {status['round']} ({status['rounds_completed']} completed), "
            f"{len(status['members'])} member(s), MASTER {status['master']}"
        )
        lines.append(f"  {'rank':>4}  {'state':<6}  {'host':<20}  {'pid':>7}  node")
        for m in status["members"]:
            late = "  (hot spare, joined while running)" if m.get("late") else ""
            lines.append(
                f"  {m['rank']:>4}  {m['state']:<6}  {m['host'] or '-':<20}  {m['pid'] or '-':>7}  {m['node']}{late}"
            )
    if status["workers"]:
        lines.append(f"  workers: {'rank':>4}  {'state':<16}  {'iteration':>9}  {'pid':>7}  node")
        for w in status["workers"]:
            iteration = "-" if w["iteration"] is None else f"{w['iteration']} (rank {w['rank_in_iteration']})"
            state = w["state"] if w.get("mode") != "reserve" or w["state"] != "running" else "reserve"
            lines.append(f"           {w['rank']:>4}  {state:<16}  {iteration:>9}  {w['pid']:>7}  {w['node']}")
    if status["spare_nodes"] or status["respawns"] or status["activations"]:
        reserve = [w["rank"] for w in status["workers"] if w.get("mode") == "reserve"]
        lines.append(
            f"hot spares: {status['spare_nodes']} node(s); active world size {status['active_world_size'] or '-'}; "
            f"reserve ranks: {reserve or 'none'}; respawned workers: {status['respawns']}"
        )
        for joined in status["joined"]:
            lines.append(f"  respawned rank {joined['initial_rank']}: admitted {joined['admitted'] or 'not yet'}")
        for activation in status["activations"]:
            lines.append(f"  rank {activation['initial_rank']} activated in iteration {activation['iteration']}")
    lines.append(
        f"terminated ranks: {status['terminated_ranks'] or 'none'}; "
        f"in-process restarts: {status['in_process_restarts'] or 0}; "
        f"process-level restarts: {status['process_restarts']}"
    )
    lines += _restart_and_health_lines(status)
    joined = status["joined_next_round"]
    lines.append(f"round {status['next_round']} (next): {len(joined)} node(s) joined")
    for j in joined:
        lines.append(f"        {j['role']:<8}  {j['host'] or '-':<20}  {j['node']}")
    for entry in status["malformed"]:
        lines.append(f"malformed, ignored: {entry['key']}: {entry['reason']}")
    config = status["config"]
    if config is None:
        lines.append("config: none stored, or not valid (elastic-ft config put)")
    else:
        nodes = config["nodes"]
        lines.append(
            f"config: nodes {nodes['min']}..{nodes['max']} (+{nodes['spares']} spare), "
            f"nproc_per_node {config['nproc_per_node']}, max_restarts {config['max_restarts']}"
        )
    return "\n".join(lines)


def _restart_and_health_lines(status: dict[str, Any]) -> list[str]:
    """The status's lines about faults under way: the restart in progress, escalations, unhealthy nodes, etcd
    outages."""
    lines: list[str] = []
    restart = status.get("restart_in_progress")
    if restart is not None:
        when = (
            "?"
            if restart["interrupted_at"] is None
            else time.strftime("%H:%M:%S", time.localtime(restart["interrupted_at"]))
        )
        lines.append(f"restart in progress: iteration {restart['iteration']} interrupted at {when}")
        for record in restart["interruptions"]:
            lines.append(f"  by rank {record['initial_rank']} ({record['kind']}): {one_line(record['message'], 120)}")
        lines.append(f"  waiting for ranks: {restart['waiting_for'] or 'none'}")
    for escalation in status["escalations"]:
        lines.append(f"  escalated round {escalation['round']} on {escalation['node']}: {escalation['reason']}")
    for verdict in status.get("node_health", []):
        if not verdict["healthy"]:
            when = time.strftime("%H:%M:%S", time.localtime(verdict["checked_at"]))
            lines.append(
                f"unhealthy, not joining: {verdict['node']} (checked {when}): {'; '.join(verdict['problems'])}"
            )
    for outage in status.get("etcd_outages", []):
        lines.append(f"etcd outage: {describe_outage(outage)}")
    return lines
