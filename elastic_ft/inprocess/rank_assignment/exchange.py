"""The grouping-key all-gather through the store that topology-aware policies share.

The only I/O of rank assignment: each rank publishes its keys, the last to
arrive publishes one compact table, everyone reads it. What the policies
then decide from the table is pure.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic_ft.inprocess.exception import RankAssignmentTimeout
from elastic_ft.inprocess.rank_assignment.base import grouping_key
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.store import counting_store
from elastic_ft.keys import exchange_arrived, exchange_published, exchange_table

if TYPE_CHECKING:
    import torch.distributed


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

    if callable(getattr(store, "get_keys", None)) and callable(getattr(store, "send_key", None)):
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
        _, arrived = base.arrive_once(view + rank_key(rank), view + exchange_arrived(prefix), published)
    else:
        store.set(rank_key(rank), published)
        arrived = store.add(exchange_arrived(prefix), 1)
    if arrived == len(ranks):
        values = store.multi_get([rank_key(peer) for peer in ranks])
        store.set(table_key, json.dumps(_encode_columns(values, len(keys))))
    try:
        store.wait([table_key], timeout)
    except RuntimeError as error:  # torch.distributed.DistStoreError on timeout
        missing = [peer for peer in ranks if not store.check([rank_key(peer)])]
        if missing:
            detail = f"{len(missing)} of {len(ranks)} ranks did not publish: {missing[:32]}"
        else:
            detail = "every rank published, but the last to arrive never published the table"
        raise RankAssignmentTimeout(
            f"{what}: timed out after {timeout.total_seconds():g} s gathering grouping keys under {prefix!r}; {detail}"
        ) from error
    raw = store.get(table_key)
    try:
        table = json.loads(raw)
        if "error" in table:
            raise ValueError(f"{what}: {table['error']}")
        return [
            [distinct[code] for code in codes]
            for distinct, codes in zip(table["distinct"], table["codes"], strict=True)
        ]
    except (TypeError, KeyError, IndexError, RecursionError, json.JSONDecodeError) as error:  # untrusted store value
        raise ValueError(f"{what}: the table under {table_key!r} is malformed ({type(error).__name__})") from None


def _encode_columns(values: list[bytes], width: int) -> dict[str, Any]:
    """The table every rank reads: each column's distinct keys, and each rank's index into them."""
    try:
        # One decode of all values as a JSON array is far cheaper than one per rank.
        published = json.loads(b"[" + b",".join(values) + b"]")
    except ValueError:
        return {"error": "a rank published keys that are not JSON"}
    for value in published:
        if not isinstance(value, list) or len(value) != width:
            return {"error": f"every rank must publish {width} keys, one rank published {value!r}"}
    distinct: list[list[str]] = []
    codes: list[list[int]] = []
    for column in range(width):
        index: dict[str, int] = {}
        codes.append([index.setdefault(value[column], len(index)) for value in published])
        distinct.append(list(index))
    return {"distinct": distinct, "codes": codes}


def _gather_through_nvidia_protocol(
    store: Any, rank: int, ranks: Sequence[int], keys: list[str], what: str
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
