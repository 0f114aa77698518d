"""Parsing etcd endpoint lists: accepted forms, and a clear error for each bad one."""

from __future__ import annotations

import pytest

from elastic_ft.etcd.endpoints import EndpointError, EtcdEndpoint, parse_endpoints


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:2379", [EtcdEndpoint("10.0.0.1", 2379)]),
        ("a:1,b:2", [EtcdEndpoint("a", 1), EtcdEndpoint("b", 2)]),
        ("http://a:1, https://b:2", [EtcdEndpoint("a", 1), EtcdEndpoint("b", 2, secure=True)]),
        ("etcd.example", [EtcdEndpoint("etcd.example", 2379)]),
        ("[::1]:2380", [EtcdEndpoint("::1", 2380)]),
        ("HTTP://a:5/", [EtcdEndpoint("a", 5)]),
    ],
)
def test_endpoints(text: str, expected: list[EtcdEndpoint]) -> None:
    assert list(parse_endpoints(text)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("a:1,", "'' .*malformed"),
        ("a:notaport", "port 'notaport'"),
        ("a:70000", "port '70000'"),
        ("a:0", "port '0'"),
        ("ftp://a:1", "scheme 'ftp'"),
        ("a:1/path", "malformed"),
    ],
)
def test_bad_endpoints(text: str, message: str) -> None:
    with pytest.raises(EndpointError, match=message):
        parse_endpoints(text)


def test_endpoint_text_round_trips_through_the_parser() -> None:
    endpoints = parse_endpoints("a:1,https://[::1]:2380")
    assert parse_endpoints(",".join(str(e) for e in endpoints)) == endpoints
