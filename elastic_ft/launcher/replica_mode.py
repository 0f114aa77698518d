"""``ftrun --replica-groups``: each node runs one replica group of ``--nproc-per-node`` ranks.

What TorchFT does with one ``torchrun`` per replica group and a Lighthouse,
``ftrun`` does on every node of one command line, without the Lighthouse:

* the node takes a replica group id (:mod:`elastic_ft.launcher.replica_slots`)
  and hands it to its workers as ``REPLICA_GROUP_ID``, with
  ``NUM_REPLICA_GROUPS`` (the ``--nnodes`` maximum) and where the job's etcd
  is (``ELASTIC_FT_ETCD_ENDPOINTS``, ``ELASTIC_FT_RUN_ID``,
  ``ELASTIC_FT_ETCD_PREFIX``), from which :class:`elastic_ft.torchft.Manager`
  finds the other groups;
* its workers form a world of their own (``RANK`` is the local rank,
  ``WORLD_SIZE`` the node's ranks, a store on a free local port), so
  ``init_process_group()`` builds the group's own process group, as under a
  ``torchrun`` per group;
* a worker that fails restarts the node's workers, up to ``--max-restarts``
  (torch's agent, as TorchFT's ``torchrun``); the other nodes' workers never
  stop: the Manager's quorum leaves the group out until it comes back and
  heals from a live replica.

The cross-node rendezvous, hot spares, segments, the node relay, the
metrics endpoint and ``--record`` are the whole-job restart's; a replica
group is a unit of its own, so they are refused here with the flag named.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import MutableMapping
from contextlib import ExitStack

from torch.distributed import run as torchrun

from elastic_ft.handoff import ETCD_ENDPOINTS_ENV, ETCD_PREFIX_ENV, RUN_ID_ENV
from elastic_ft.launcher.replica_slots import ReplicaSlot
from elastic_ft.rendezvous.config import EtcdftSettings, connect

#: The flags of the whole-job restart that mean nothing to a replica group, by argparse destination.
EXCLUSIVE_FLAGS = {
    "spare_nodes": "--spare-nodes",
    "segment_size": "--segment-size",
    "node_segment": "--node-segment",
    "node_relay": "--node-relay",
    "metrics_port": "--metrics-port",
    "record": "--record",
    "standalone": "--standalone",
}


def conflicts(args: argparse.Namespace, given: set[str]) -> str | None:
    """Why ``args`` cannot run as replica groups, or None."""
    clashing = [flag for dest, flag in EXCLUSIVE_FLAGS.items() if dest in given]
    if clashing:
        return f"--replica-groups runs each node as a replica group of its own; {', '.join(clashing)} do not apply"
    if args.rdzv_backend != "etcdft":
        return (
            f"--replica-groups keeps the job's quorum in etcd: it needs --rdzv-backend=etcdft, not {args.rdzv_backend}"
        )
    return None


def transport_conflict(settings: EtcdftSettings) -> str | None:
    """Why the workers could not reach the job's etcd as ``settings`` does, or None: the variables they are
    given carry no TLS files or credentials."""
    if settings.tls.cacert or settings.tls.cert or settings.tls.key or settings.credentials is not None:
        return (
            "--replica-groups does not hand TLS files or etcd credentials to the workers (--rdzv-conf names them); "
            "use an etcd without them, or one launcher per replica group with ELASTIC_FT_ETCD_ENDPOINTS"
        )
    return None


def worker_environment(settings: EtcdftSettings, replica: int, groups: int) -> dict[str, str]:
    """What a replica group's workers are told: their group, the number of groups, and the job's etcd."""
    return {
        "REPLICA_GROUP_ID": str(replica),
        "NUM_REPLICA_GROUPS": str(groups),
        ETCD_ENDPOINTS_ENV: ",".join(str(endpoint) for endpoint in settings.endpoints),
        RUN_ID_ENV: settings.run_id,
        ETCD_PREFIX_ENV: settings.etcd_prefix,
    }


#: torch's variable that makes each attempt's rank 0 host the workers' store instead of the agent.
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def as_local_world(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """torchrun's arguments for this node alone: a world of its workers, as ``--standalone`` makes one.

    Each attempt's workers get a store of their own (rank 0 hosts it): the agent's store outlives a restart
    with every key of the last attempt in it, and a restarted rank that reads its peer's address before the
    peer wrote its new one connects to the dead process's port (gloo's ``connectFullMesh`` fails with
    "Connection refused", seen in 4 restarts of 4 here).
    """
    environ[UNSHARED_STORE_ENV] = "1"
    args.nnodes = "1:1"
    args.node_rank = 0
    args.rdzv_backend = "c10d"
    args.rdzv_endpoint = "localhost:0"
    args.rdzv_id = str(uuid.uuid4())
    args.rdzv_conf = ""
    args.standalone = False


def claim_replica_group(
    args: argparse.Namespace, settings: EtcdftSettings, environ: MutableMapping[str, str], stack: ExitStack
) -> int:
    """Take this node's replica group id (waiting up to the rendezvous's join timeout for a free one), hold it
    until ``stack`` closes, and put the workers' variables in ``environ``; returns the id.

    Raises:
        SlotError: no id within the join timeout (the message says whether etcd was unreachable).
    """
    _, groups = torchrun.parse_min_max_nnodes(args.nnodes)
    client = connect(settings)
    stack.callback(client.close)
    owner = f"{socket.gethostname()}:{os.getpid()}"
    slot = ReplicaSlot(client, settings.keys.replicas, owner, groups, settings.lease_ttl)
    replica = slot.claim(settings.join_timeout)
    stack.callback(slot.release)
    slot.keep()
    environ.update(worker_environment(settings, replica, groups))
    print(f"ftrun: this node runs replica group {replica} of {groups} (run {settings.run_id})", flush=True)
    return replica
