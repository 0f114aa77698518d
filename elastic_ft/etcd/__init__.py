"""The one etcd adapter, used by both sides.

* :mod:`.client`: :class:`~.client.EtcdClient`, endpoint failover, retry
  policy, KV, leases, transaction building blocks;
* :mod:`.endpoints`, :mod:`.kv`: what it connects to and what it returns;
* :mod:`.watch`: the long-lived streams (watch, lease keep-alive);
* :mod:`.session`: a lease on one keep-alive stream (etcd's Session);
* :mod:`.view`: a watch-fed copy of a prefix (informer);
* :mod:`.store`: a ``torch.distributed.Store`` in etcd;
* :mod:`.server`: the embedded single-member etcd.
"""

import os

# gRPC's fork handlers pause and resume its threads around every fork() of
# this process (each DataLoader worker), and, when calls are in flight, skip
# that and leave them to chance; either way a call of this process later hung
# for good, deadline included. No child of ours uses the parent's channels
# (the Wrapper's monitor process is forked before any channel exists), so
# gRPC has nothing to do at a fork. Set before gRPC is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
