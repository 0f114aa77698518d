"""``elastic-ft``: the job's configuration and status, kept in etcd.

::

    elastic-ft config validate configs/job.yaml
    elastic-ft config schema > job-config.schema.json
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
from typing import TYPE_CHECKING

from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.job_config import JobConfig, JobConfigError, json_schema, load_job_config, parse_job_config
from elastic_ft.keys import RunKeys
from elastic_ft.rendezvous.config import RendezvousConfigError, make_settings

if TYPE_CHECKING:
    from elastic_ft.etcd.client import EtcdClient


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rdzv-endpoint", required=True, help="etcd endpoints, host:port[,host:port...]")
    parser.add_argument("--rdzv-id", required=True, help="the job's run id (torchrun's --rdzv-id)")
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
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _connection_options(status)
    return parser


def _client(args: argparse.Namespace) -> tuple[EtcdClient, RunKeys]:
    """The connection and the run's keys, from the command line (checked before any connection)."""
    from elastic_ft.etcd.client import EtcdClient

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
    client = EtcdClient(
        settings.endpoints,
        connect_timeout=half,
        request_timeout=half,
        tls=settings.tls,
        credentials=settings.credentials,
    )
    return client, settings.keys


def _read_config_file(path: Path) -> JobConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobConfigError(f"cannot read job config {str(path)!r}: {exc.strerror}") from None
    return load_job_config(text, source=str(path))


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
    client, keys = _client(args)
    try:
        if args.command == "config":
            kv, _ = client.get(keys.config)
            if kv is None:
                print(f"no job config stored for run {args.rdzv_id!r}", file=sys.stderr)
                return 1
            try:
                document = parse_job_config(json.loads(kv.value)).to_document()
            except (ValueError, RecursionError) as error:  # bad JSON or a JobConfigError: untrusted etcd value
                print(
                    f"elastic-ft: the job config stored at {kv.key} is not valid: {str(error)[:300]}", file=sys.stderr
                )
                return 2
            if args.json:
                print(json.dumps(document, indent=2))
            else:
                import yaml

                print(yaml.safe_dump(document, sort_keys=False), end="")
            return 0
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
    except (JobConfigError, RendezvousConfigError) as exc:
        print(f"elastic-ft: {exc}", file=sys.stderr)
        code = 2
    except (EtcdUnavailableError, EtcdRequestError) as exc:
        print(f"elastic-ft: {exc}", file=sys.stderr)
        code = 3
    raise SystemExit(code)


if __name__ == "__main__":
    main()
