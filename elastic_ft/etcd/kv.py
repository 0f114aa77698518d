"""What etcd gives back: key-values, watch events, transaction results, and its errors.

Plain data, shared by the client and its streams; no gRPC calls here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The most arrivals one barrier transaction counts (``EtcdStore.arrive_batch``): ``2k + 1`` operations, within
#: etcd's default limit of 128 per transaction (``--max-txn-ops``).
BATCH_ARRIVALS = 32


class EtcdUnavailableError(ConnectionError):
    """No etcd endpoint answered within the allowed time."""


class EtcdRequestError(RuntimeError):
    """etcd answered, but refused the request."""


class EtcdLeaseNotFoundError(EtcdRequestError):
    """A write named a lease etcd no longer has: it expired (its holder could not refresh it in time)."""


class EtcdCompactedError(EtcdRequestError):
    """A watch asked for history that etcd has already compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_proto(cls, kv: Any) -> KeyValue:
        return cls(
            # Keys are untrusted bytes: one that is not UTF-8 must not stop a reader.
            key=kv.key.decode(errors="replace"),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    kv: KeyValue


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One entry per operation of the branch taken; a range op gives its
    # key-values, other ops give None.
    ranges: list[list[KeyValue] | None]


class RelayUnavailable(ConnectionError):
    """A node relay (:mod:`elastic_ft.etcd.node_relay`) did not take or answer a request: the caller sends it to
    etcd itself."""
