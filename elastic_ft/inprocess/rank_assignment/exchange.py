"""The grouping-key all-gather through the store that topology-aware policies share.

The only I/O of rank assignment: each rank publishes its keys, the last to
arrive publishes one compact table, everyone reads it. What the policies
then decide from the table is pure.
"""

from __future__ import annotations

import array
import base64
import binascii
import datetime
import json
import sys
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from elastic_ft.coordination.barriers import await_value, counting_store
from elastic_ft.inprocess.exception import RankAssignmentTimeout
from elastic_ft.inprocess.rank_assignment.base import grouping_key
from elastic_ft.inprocess.state import State
from elastic_ft.keys import exchange_arrived, exchange_published, exchange_table
from elastic_ft.untrusted import MalformedRecord

if TYPE_CHECKING:
    import torch.distributed

#: The most bytes a table may inflate to: 16 M ranks of one key, well past any job.
_TABLE_LIMIT = 256 * 2**20


def gather_keys(
    store: torch.distributed.Store,
    prefix: str,
    rank: int,
    ranks: Sequence[int],
    keys: list[str],
    timeout: datetime.timedelta,
    what: str,
) -> list[list[str]]:
    """All-gather every rank's list of string keys through the store.

    Each rank publishes its keys under its own store key and counts itself
    in; the last to arrive reads them all and publishes one compact table
    (distinct keys once, then an index per rank), which everyone reads. That
    is one round of O(1) store operations per rank, not one read per peer.

    Returns columns: ``columns[i][j]`` is ``keys[i]`` of ``ranks[j]``.

    Raises:
        RankAssignmentTimeout: naming the ranks that never published.
        ValueError: ranks published differently shaped keys.
    """

    if isinstance(store, KeyExchangeStore):
        return _gather_through_nvidia_protocol(store, rank, ranks, keys, what)

    def rank_key(peer: int) -> str:
        return exchange_published(prefix, peer)

    table_key = exchange_table(prefix)
    # Values are JSON text; the store keeps a str as its UTF-8 bytes.
    published = json.dumps(keys)
    counting = counting_store(store)
    if counting is not None:
        # An etcd store publishes and counts in one transaction (a rank's keys are its token: a resend,
        # or another process of the rank with the same keys, is counted once).
        base, view = counting
        slots = view + exchange_arrived(prefix)
        (number,) = base.arrive_batch([(view + rank_key(rank), published)], slots)
        arrived = base.arrivals(slots) if number is None else number
    else:
        store.set(rank_key(rank), published)
        arrived = store.add(exchange_arrived(prefix), 1)
    if arrived == len(ranks):
        values = store.multi_get([rank_key(peer) for peer in ranks])
        # torch's Store.set takes bytes as well as str; its stub names only str.
        store.set(table_key, _encode_table(values, len(keys)))  # type: ignore[arg-type]
    table = await_value(store, table_key, timeout)
    if table is None:
        missing = [peer for peer in ranks if not store.check([rank_key(peer)])]
        if missing:
            detail = f"{len(missing)} of {len(ranks)} ranks did not publish: {missing[:32]}"
        else:
            detail = "every rank published, but the last to arrive never published the table"
        raise RankAssignmentTimeout(
            f"{what}: timed out after {timeout.total_seconds():g} s gathering grouping keys under {prefix!r}; {detail}"
        )
    return _decode_table(table, len(ranks), len(keys), what, table_key)


def _encode_table(values: list[bytes], width: int) -> bytes:
    """The table every rank reads: each column's distinct keys, and each rank's index into them.

    Every rank reads it, so its size is paid once per rank: the indices go
    as packed 32-bit little-endian integers (base64), and the whole as
    zlib-compressed JSON. At 16k ranks in hosts of 8 that is about 20 KB,
    not the 200 KB of plain JSON lists.
    """
    try:
        # One decode of all values as a JSON array is far cheaper than one per rank.
        published = json.loads(b"[" + b",".join(values) + b"]")
    except ValueError:
        return _error_table("a rank published keys that are not JSON")
    for value in published:
        if not isinstance(value, list) or len(value) != width:
            return _error_table(f"every rank must publish {width} keys, one rank published {value!r:.200}")
    distinct: list[list[str]] = []
    packed: list[str] = []
    for column in range(width):
        index: dict[str, int] = {}
        codes = array.array("I", [index.setdefault(value[column], len(index)) for value in published])
        if sys.byteorder == "big":
            codes.byteswap()
        packed.append(base64.b64encode(codes.tobytes()).decode())
        distinct.append(list(index))
    return zlib.compress(json.dumps({"distinct": distinct, "codes": packed}).encode())


def _error_table(message: str) -> bytes:
    """A table that tells every rank why there is no table."""
    return zlib.compress(json.dumps({"error": message}).encode())


def _decode_table(raw: bytes, ranks: int, width: int, what: str, table_key: str) -> list[list[str]]:
    """The columns a table holds; it is an untrusted store value, so any flaw raises ``ValueError``."""
    try:
        inflate = zlib.decompressobj()
        text = inflate.decompress(raw, _TABLE_LIMIT)
        if inflate.unconsumed_tail or not inflate.eof:
            raise MalformedRecord(f"not one zlib stream of at most {_TABLE_LIMIT} bytes")
        table = json.loads(text)
        if "error" in table:
            raise ValueError(f"{what}: {table['error']}")
        columns: list[list[str]] = []
        for distinct, packed in zip(table["distinct"], table["codes"], strict=True):
            if not all(isinstance(key, str) for key in distinct):
                raise MalformedRecord("a key is not a string")
            raw_codes = base64.b64decode(packed, validate=True)
            if len(raw_codes) % 4:
                raise MalformedRecord(f"{len(raw_codes)} bytes of indices, not a whole number of 4-byte indices")
            codes = array.array("I", raw_codes)
            if sys.byteorder == "big":
                codes.byteswap()
            if len(codes) != ranks:
                raise MalformedRecord(f"{len(codes)} indices for {ranks} ranks")
            columns.append([distinct[code] for code in codes])
        if len(columns) != width:
            raise MalformedRecord(f"{len(columns)} columns for {width} keys")
        return columns
    except MalformedRecord as error:
        raise ValueError(f"{what}: the table under {table_key!r} is malformed ({error})") from None
    except (TypeError, KeyError, IndexError, RecursionError, zlib.error, binascii.Error, json.JSONDecodeError) as error:
        raise ValueError(
            f"{what}: the table under {table_key!r} is malformed ({type(error).__name__}: {error})"
        ) from None


@runtime_checkable
class KeyExchangeStore(Protocol):
    """A store with NVIDIA's ``StoreMixin`` key methods: it keeps every rank's grouping keys, the failed
    ranks' too (a ``Tree`` over such a store is built over all of them, as NVIDIA's is)."""

    def send_key(self, key: Any, rank: int) -> None: ...

    def get_keys(self, ranks: list[int]) -> Any: ...


def _gather_through_nvidia_protocol(
    store: KeyExchangeStore, rank: int, ranks: Sequence[int], keys: list[str], what: str
) -> list[list[str]]:
    """The same all-gather over a store with NVIDIA's ``StoreMixin`` key methods (``send_key``, ``get_keys``).

    What such a store returns is untrusted like any other value: each rank's
    keys must be a list as long as this rank's, each key one ``grouping_key``
    can encode (raw values, as NVIDIA's ranks send them, are encoded here).
    """
    store.send_key(keys, rank)
    published = list(store.get_keys(list(ranks)))
    if len(published) != len(ranks):
        raise ValueError(f"{what}: the store's get_keys returned {len(published)} entries for {len(ranks)} ranks")
    columns: list[list[str]] = [[] for _ in keys]
    for peer, peer_keys in zip(ranks, published, strict=True):
        if not isinstance(peer_keys, (list, tuple)) or len(peer_keys) != len(keys):
            raise ValueError(f"{what}: rank {peer} published {peer_keys!r:.200}; expected {len(keys)} keys")
        for column, key in zip(columns, peer_keys, strict=True):
            column.append(grouping_key(key, State(0, 1), what))
    return columns
