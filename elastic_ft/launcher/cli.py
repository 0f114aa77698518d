"""``elastic-ft``: the job's configuration and status, kept in etcd.

::

    elastic-ft config validate configs/job.yaml
    elastic-ft config put configs/job.yaml --rdzv-endpoint=HOST:PORT --rdzv-id=job42
    elastic-ft config get --rdzv-endpoint=HOST:PORT --rdzv-id=job42
    elastic-ft status --rdzv-endpoint=HOST:PORT --rdzv-id=job42 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from elastic_ft.etcd_client import EtcdClient, EtcdRequestError, EtcdUnavailableError
from elastic_ft.launcher.agent import ESCALATIONS, EXITS, NODES
from elastic_ft.launcher.job_config import JobConfigError, load_job_config
from elastic_ft.rendezvous.config import RendezvousConfigError, make_settings
from elastic_ft.rendezvous.state import RawKey, parse_state


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rdzv-endpoint", required=True, help="etcd endpoints, host:port[,host:port...]")
    parser.add_argument("--rdzv-id", required=True, help="the job's run id (torchrun's --rdzv-id)")
    parser.add_argument("--etcd-prefix", default="/elastic_ft", help="key prefix (default: /elastic_ft)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to reach etcd (default: 10)")
    for name in ("cacert", "cert", "key"):
        parser.add_argument(f"--{name}", default=None, help=f"TLS {name} file for https endpoints")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-ft", description="elastic-ft job configuration and status")
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="write, read or check the job config")
    actions = config.add_subparsers(dest="action", required=True)
    validate = actions.add_parser("validate", help="check a config file; touches nothing")
    validate.add_argument("file", type=Path)
    put = actions.add_parser("put", help="check a config file and store it for the run")
    put.add_argument("file", type=Path)
    _connection_options(put)
    get = actions.add_parser("get", help="print the run's stored config as YAML")
    get.add_argument("--json", action="store_true", help="print JSON instead")
    _connection_options(get)
    status = commands.add_parser("status", help="the run's rounds, members, waiting nodes and config")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _connection_options(status)
    return parser


def _client(args: argparse.Namespace) -> tuple[EtcdClient, str]:
    settings = make_settings(
        run_id=args.rdzv_id,
        endpoint=args.rdzv_endpoint,
        min_nodes=1,
        max_nodes=1,
        etcd_prefix=args.etcd_prefix,
        connect_timeout=args.connect_timeout,
        cacert=args.cacert,
        cert=args.cert,
        key=args.key,
    )
    client = EtcdClient(settings.endpoints, connect_timeout=settings.connect_timeout, tls=settings.tls)
    return client, settings.run_prefix


def _read_config_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobConfigError(f"cannot read job config {str(path)!r}: {exc.strerror}") from None
    return load_job_config(text, source=str(path))


def collect_status(client: EtcdClient, run_prefix: str) -> dict[str, Any]:
    """Everything ``elastic-ft status`` shows, read from etcd in one range request."""
    kvs, revision = client.get_prefix(run_prefix + "rdzv/")
    config_kv, _ = client.get(run_prefix + "config")
    prefix = run_prefix + "rdzv/"
    raw = {kv.key[len(prefix) :]: RawKey(kv.value, kv.lease, kv.create_revision) for kv in kvs}
    state = parse_state(raw)
    hosts = {}
    for key, value in raw.items():
        if key.startswith("alive/"):
            hosts[key[len("alive/") :]] = json.loads(value.value)
    current = state.last_closed
    members = []
    if current is not None:
        left = state.round(current.round).left
        for rank, member in enumerate(current.members):
            if member.node in left:
                health = "left"
            elif state.is_alive(member):
                health = "alive"
            else:
                health = "dead"
            info = hosts.get(member.node, {})
            members.append({"rank": rank, "node": member.node, "host": info.get("host"), "pid": info.get("pid"),
                            "state": health})  # fmt: skip
    open_round = state.round(state.open_round)
    member_nodes = {m["node"] for m in members}
    full = current is not None and len(current.members) >= _max_nodes(config_kv)
    joined = []
    for node in sorted(open_round.joins, key=lambda n: open_round.joins[n].create_revision):
        role = "rejoined" if node in member_nodes else ("spare" if full else "waiting")
        joined.append({"node": node, "role": role, "host": hosts.get(node, {}).get("host")})
    workers, terminated, iteration = ([], [], None)
    if current is not None:
        dead_nodes = {m["node"] for m in members if m["state"] == "dead"}
        workers, terminated, iteration = _worker_status(client, f"{run_prefix}round/{current.round}/store/", dead_nodes)
    escalation_kvs, _ = client.get_prefix(run_prefix + ESCALATIONS)
    escalations = [
        {"round": int(kv.key.rsplit("/", 1)[1]), **json.loads(kv.value)}
        for kv in sorted(escalation_kvs, key=lambda kv: int(kv.key.rsplit("/", 1)[1]))
    ]
    return {
        "run": run_prefix.rstrip("/").rsplit("/", 1)[-1],
        "revision": revision,
        "closed": state.closed,
        "round": None if current is None else current.round,
        "rounds_completed": 0 if current is None else current.round + 1,
        "master": None if current is None else f"{current.master_addr}:{current.master_port}",
        "members": members,
        "next_round": state.open_round,
        "joined_next_round": joined,
        "config": json.loads(config_kv.value) if config_kv else None,
        "workers": workers,
        "terminated_ranks": terminated,
        "in_process_restarts": iteration,
        "process_restarts": len(escalations),
        "escalations": escalations,
    }


def _worker_status(
    client: EtcdClient, store_prefix: str, dead_nodes: set[str]
) -> tuple[list[dict[str, Any]], list[int], int | None]:
    """The workers of the round from ftrun's and the Wrappers' records in the round's store.

    Returns the workers by global rank, the ranks that left the job (failed
    or on a dead node), and the highest in-process restart iteration reached.
    """
    nodes = {
        kv.key[len(store_prefix + NODES) :]: json.loads(kv.value) for kv in client.get_prefix(store_prefix + NODES)[0]
    }
    exits = {int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value) for kv in client.get_prefix(store_prefix + EXITS)[0]}
    inprocess = store_prefix + "elastic_ft/inprocess/job/"
    positions = {
        int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value) for kv in client.get_prefix(inprocess + "position/")[0]
    }
    workers = []
    for node, record in nodes.items():
        for rank, pid in zip(record["global_ranks"], record["pids"], strict=True):
            exit_record = exits.get(rank)
            if exit_record is not None:
                state = f"{exit_record['kind']} ({exit_record['exitcode']})"
            elif node in dead_nodes:
                state = "node dead"
            else:
                state = "running"
            position = positions.get(rank, {})
            workers.append({"rank": rank, "node": node, "pid": pid, "state": state,
                            "iteration": position.get("iteration"), "rank_in_iteration": position.get("rank")})  # fmt: skip
    workers.sort(key=lambda worker: worker["rank"])
    terminated = sorted(
        w["rank"]
        for w in workers
        if w["state"] == "node dead" or (w["rank"] in exits and exits[w["rank"]]["kind"] != "succeeded")
    )
    iterations = [position["iteration"] for position in positions.values()]
    return workers, terminated, max(iterations) if iterations else None


def _max_nodes(config_kv: Any) -> int:
    if config_kv is None:
        return sys.maxsize
    return int(json.loads(config_kv.value)["nodes"]["max"])


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
            lines.append(
                f"  {m['rank']:>4}  {m['state']:<6}  {m['host'] or '-':<20}  {m['pid'] or '-':>7}  {m['node']}"
            )
    if status["workers"]:
        lines.append(f"  workers: {'rank':>4}  {'state':<16}  {'iteration':>9}  {'pid':>7}  node")
        for w in status["workers"]:
            iteration = "-" if w["iteration"] is None else f"{w['iteration']} (rank {w['rank_in_iteration']})"
            lines.append(f"           {w['rank']:>4}  {w['state']:<16}  {iteration:>9}  {w['pid']:>7}  {w['node']}")
    lines.append(
        f"terminated ranks: {status['terminated_ranks'] or 'none'}; "
        f"in-process restarts: {status['in_process_restarts'] or 0}; "
        f"process-level restarts: {status['process_restarts']}"
    )
    for escalation in status["escalations"]:
        lines.append(f"  escalated round {escalation['round']} on {escalation['node']}: {escalation['reason']}")
    joined = status["joined_next_round"]
    lines.append(f"round {status['next_round']} (next): {len(joined)} node(s) joined")
    for j in joined:
        lines.append(f"        {j['role']:<8}  {j['host'] or '-':<20}  {j['node']}")
    config = status["config"]
    if config is None:
        lines.append("config: none stored (elastic-ft config put)")
    else:
        nodes = config["nodes"]
        lines.append(
            f"config: nodes {nodes['min']}..{nodes['max']} (+{nodes['spares']} spare), "
            f"nproc_per_node {config['nproc_per_node']}, max_restarts {config['max_restarts']}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.command == "config" and args.action == "validate":
        _read_config_file(args.file)
        print(f"{args.file}: valid")
        return 0
    if args.command == "config" and args.action == "put":
        config = _read_config_file(args.file)  # validated before any etcd traffic
        client, run_prefix = _client(args)
        try:
            client.put(run_prefix + "config", config.to_json())
        finally:
            client.close()
        print(f"stored {args.file} as {run_prefix}config")
        return 0
    client, run_prefix = _client(args)
    try:
        if args.command == "config":
            kv, _ = client.get(run_prefix + "config")
            if kv is None:
                print(f"no job config stored for run {args.rdzv_id!r}", file=sys.stderr)
                return 1
            document = json.loads(kv.value)
            print(json.dumps(document, indent=2) if args.json else yaml.safe_dump(document, sort_keys=False), end="")
            return 0
        status = collect_status(client, run_prefix)
    finally:
        client.close()
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except (JobConfigError, RendezvousConfigError) as exc:
        print(f"elastic-ft: {exc}", file=sys.stderr)
        code = 2
    except (EtcdUnavailableError, EtcdRequestError) as exc:
        print(f"elastic-ft: {exc}", file=sys.stderr)
        code = 3
    raise SystemExit(code)


if __name__ == "__main__":
    main()
