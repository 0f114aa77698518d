"""The watch-create request carries the id the client picked, in etcd's field 7, beside the stubs' fields."""

from __future__ import annotations

import pytest
from etcd3 import etcdrpc

from elastic_ft.etcd.client import _watch_create_request, _WatchCreateRequest


@pytest.mark.parametrize("watch_id", [1, 127, 128, 300, 2**40])
def test_the_request_carries_the_watch_id_in_field_7(watch_id: int) -> None:
    sent = _watch_create_request(b"/run/k", b"/run/l", 42, watch_id).SerializeToString()
    create = etcdrpc.WatchRequest.FromString(sent).create_request
    assert (create.key, create.range_end, create.start_revision) == (b"/run/k", b"/run/l", 42)
    # What etcd reads: the declared message parses every field of the wire bytes, watch_id included.
    assert _WatchCreateRequest.FromString(create.SerializeToString()).watch_id == watch_id


def test_field_7_is_watch_id_in_the_wire_format() -> None:
    create = _WatchCreateRequest(watch_id=5)
    assert create.SerializeToString() == bytes([7 << 3, 5])  # tag: field 7, varint; value 5


@pytest.mark.parametrize("watch_id", [0, -1])
def test_a_watch_id_must_be_positive(watch_id: int) -> None:
    with pytest.raises(ValueError, match=f"a watch id must be positive, got {watch_id}"):
        _watch_create_request(b"/k", b"", 1, watch_id)
