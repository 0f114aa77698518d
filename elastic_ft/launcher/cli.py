"""``elastic-ft``: the job's configuration and status, kept in etcd.

::

    elastic-ft config validate configs/job.yaml
    elastic-ft config schema > job-config.schema.json
    elastic-ft config put configs/job.yaml --rdzv-endpoint=HOST:PORT --rdzv-id=job42
    elastic-ft config get --rdzv-endpoint=HOST:PORT --rdzv-id=job42
    elastic-ft status --rdzv-endpoint=HOST:PORT --rdzv-id=job42 [--json | --watch]
    elastic-ft events --rdzv-endpoint=HOST:PORT --rdzv-id=job42 [--json]
    elastic-ft timeline --rdzv-endpoint=HOST:PORT --rdzv-id=job42 -o timeline.png
    elastic-ft timeline --events run/events.jsonl -o timeline.png      (ftrun --record run)
    elastic-ft report --rdzv-endpoint=HOST:PORT --rdzv-id=job42 [--json]
    elastic-ft report --events run/events.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.job_config import JobConfig, JobConfigError, json_schema, load_job_config, parse_stored_job_config
from elastic_ft.keys import RunKeys
from elastic_ft.observability.events import JobEvent
from elastic_ft.observability.timeline import TimelineUnavailable
from elastic_ft.rendezvous.config import RendezvousConfigError, connect, make_settings
from elastic_ft.untrusted import MalformedRecord

if TYPE_CHECKING:
    from elastic_ft.etcd.client import EtcdClient


def _connection_options(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--rdzv-endpoint", required=required, help="etcd endpoints, host:port[,host:port...]")
    parser.add_argument("--rdzv-id", required=required, help="the job's run id (torchrun's --rdzv-id)")
    parser.add_argument("--etcd-prefix", default="/elastic_ft", help="key prefix (default: /elastic_ft)")
    parser.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds the command may wait for etcd in all (default: 10)"
    )
    for name in ("cacert", "cert", "key"):
        parser.add_argument(f"--{name}", default=None, help=f"TLS {name} file for https endpoints")
    parser.add_argument("--user", default=None, help="etcd user (RBAC); needs --password-file")
    parser.add_argument("--password-file", default=None, help="file holding the etcd user's password")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-ft", description="elastic-ft job configuration and status")
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="write, read or check the job config")
    actions = config.add_subparsers(dest="action", required=True)
    validate = actions.add_parser("validate", help="check a config file; touches nothing")
    validate.add_argument("file", type=Path)
    schema = actions.add_parser("schema", help="print the job config's JSON Schema (for editors and CI checks)")
    schema.add_argument("-o", "--output", type=Path, help="write it to this file instead")
    put = actions.add_parser("put", help="check a config file and store it for the run")
    put.add_argument("file", type=Path)
    _connection_options(put)
    get = actions.add_parser("get", help="print the run's stored config as YAML")
    get.add_argument("--json", action="store_true", help="print JSON instead")
    _connection_options(get)
    status = commands.add_parser("status", help="the run's rounds, members, waiting nodes and config")
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print JSON instead of a table")
    shown.add_argument("--watch", action="store_true", help="a live view, redrawn until Ctrl-C")
    status.add_argument("--interval", type=_seconds, default=1.0, help="seconds between two redraws (--watch)")
    _connection_options(status)
    events = commands.add_parser("events", help="the run's events, oldest first (the last observability.events_kept)")
    events.add_argument("--json", action="store_true", help="one JSON event a line (what ftrun --record saves)")
    _connection_options(events)
    timeline = commands.add_parser("timeline", help="draw the run's timeline as a PNG picture")
    timeline.add_argument("-o", "--output", type=Path, required=True, help="the PNG file to write")
    timeline.add_argument(
        "--events",
        type=Path,
        help="draw from this events file (ftrun --record DIR writes DIR/events.jsonl) instead of etcd",
    )
    timeline.add_argument("--title", help="the picture's title (default: the run id)")
    _connection_options(timeline, required=False)
    report = commands.add_parser(
        "report", help="goodput: the job's wall time, what trained, and where the rest went (ETTR)"
    )
    report.add_argument("--events", type=Path, help="report on this events file (ftrun --record) instead of etcd")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _connection_options(report, required=False)
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not an interval; expected seconds from 0.05 to 3600")
    return value


def _client(args: argparse.Namespace) -> tuple[EtcdClient, RunKeys]:
    """The connection and the run's keys, from the command line (checked before any connection)."""
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
        user=args.user,
        password_file=args.password_file,
    )
    # A request's bound is connect_timeout + request_timeout: split the one the user gave.
    half = settings.connect_timeout / 2
    return connect(settings, timeouts=(half, half)), settings.keys


class UnknownRunError(ValueError):
    """The run id names no run at these endpoints."""


def _check_run_exists(client: EtcdClient, keys: RunKeys) -> None:
    if client.count_prefix(keys.root) == 0:
        raise UnknownRunError(
            f"no run {keys.run_id!r} at {client.describe_endpoints()}: nothing is stored under {keys.root} "
            "(check --rdzv-id and --etcd-prefix; an embedded etcd's runs are gone once ftrun ends: use ftrun --record)"
        )


def _read_events(client: EtcdClient, keys: RunKeys) -> list[JobEvent]:
    from elastic_ft.etcd.event_log import EventLog

    return EventLog(client, keys).read_all().events


def _events_of(args: argparse.Namespace) -> list[JobEvent]:
    """The run's events: from ``--events FILE`` (``ftrun --record``), or from etcd."""
    from elastic_ft.observability.event_files import read_events_file

    if args.events is not None:
        if args.rdzv_endpoint or args.rdzv_id:
            raise MalformedRecord("give --events FILE or --rdzv-endpoint with --rdzv-id, not both")
        try:
            events = read_events_file(str(args.events))
        except OSError as error:
            raise MalformedRecord(f"cannot read the events file {str(args.events)!r}: {error.strerror}") from None
    else:
        if not args.rdzv_endpoint or not args.rdzv_id:
            raise MalformedRecord(
                "give --events FILE, or --rdzv-endpoint and --rdzv-id to read the run's events from etcd"
            )
        client, keys = _client(args)
        try:
            _check_run_exists(client, keys)
            events = _read_events(client, keys)
        finally:
            client.close()
        if not events:
            raise MalformedRecord(f"run {keys.run_id!r} has recorded no events yet")
    return events


def _timeline(args: argparse.Namespace) -> int:
    from elastic_ft.observability.timeline import build_timeline, draw

    events = _events_of(args)
    counts = draw(build_timeline(events), str(args.output), args.title)
    drawn = ", ".join(f"{count} {name}" for name, count in counts.items())
    print(f"wrote {args.output} from {len(events)} event(s): {drawn}")
    return 0


def _read_config_file(path: Path) -> JobConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobConfigError(f"cannot read job config {str(path)!r}: {exc.strerror}") from None
    return load_job_config(text, source=str(path))


def _show_config(args: argparse.Namespace, client: EtcdClient, keys: RunKeys) -> int:
    """``elastic-ft config``: the run's stored job config, as YAML (or JSON)."""
    kv, _ = client.get(keys.config)
    if kv is None:
        print(f"no job config stored for run {args.rdzv_id!r}", file=sys.stderr)
        return 1
    try:
        document = parse_stored_job_config(kv.value, kv.key).to_document()
    except JobConfigError as error:  # an untrusted etcd value
        print(f"elastic-ft: {str(error)[:400]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(document, sort_keys=False), end="")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.command == "config" and args.action == "schema":
        text = json.dumps(json_schema(), indent=2) + "\n"
        if args.output is None:
            print(text, end="")
        else:
            args.output.write_text(text)
            print(f"wrote the job config schema to {args.output}")
        return 0
    if args.command == "config" and args.action == "validate":
        _read_config_file(args.file)
        print(f"{args.file}: valid")
        return 0
    if args.command == "config" and args.action == "put":
        config = _read_config_file(args.file)  # validated before any etcd traffic
        client, keys = _client(args)
        try:
            client.put(keys.config, config.to_json())
        finally:
            client.close()
        print(f"stored {args.file} as {keys.config}")
        return 0
    if args.command == "timeline":
        return _timeline(args)
    if args.command == "report":
        from elastic_ft.observability.goodput import goodput, report_lines

        found = goodput(_events_of(args), now=time.time())
        print(json.dumps(found.to_document(), indent=2) if args.json else "\n".join(report_lines(found)))
        return 0
    client, keys = _client(args)
    try:
        if args.command != "config":
            _check_run_exists(client, keys)
        if args.command == "events":
            for event in _read_events(client, keys):
                print(
                    event.to_json()
                    if args.json
                    else f"{event.seq:>6} {time.strftime('%H:%M:%S', time.localtime(event.time))} "
                    f"{event.source:<10} {event.describe()}"
                )
            return 0
        if args.command == "status" and args.watch:
            from elastic_ft.launcher.status import collect_status
            from elastic_ft.observability.live import watch

            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the view, not with a traceback

                def read() -> tuple[dict[str, Any], list[Any]]:
                    events = _read_events(client, keys)
                    return collect_status(client, keys, events), events

                watch(read, args.interval)
            return 0
        if args.command == "config":
            return _show_config(args, client, keys)
        from elastic_ft.launcher.status import collect_status, render_status

        status = collect_status(client, keys)
    finally:
        client.close()
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except (JobConfigError, RendezvousConfigError, MalformedRecord, UnknownRunError, TimelineUnavailable) as exc:
        print(f"elastic-ft: {exc}", file=sys.stderr)
        code = 2
    except (EtcdUnavailableError, EtcdRequestError) as exc:
        print(f"elastic-ft: {exc}", file=sys.stderr)
        code = 3
    raise SystemExit(code)


if __name__ == "__main__":
    main()
