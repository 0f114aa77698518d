"""Which failed etcd requests are resent: what etcd did not answer, never what it refused."""

from __future__ import annotations

import grpc
import pytest

from elastic_ft.etcd.channels import transient


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        # A member that lost its leader, or was frozen, while it held the request: measured in the soak.
        (grpc.StatusCode.UNKNOWN, "context deadline exceeded"),
        (grpc.StatusCode.UNKNOWN, "etcdserver: request timed out"),
        (grpc.StatusCode.UNKNOWN, "etcdserver: leader changed"),
    ],
)
def test_what_etcd_did_not_answer_is_resent(code: grpc.StatusCode, details: str) -> None:
    assert transient(Failed(code, details))


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.UNKNOWN, "etcdserver: duplicate key given in txn request"),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large"),
        (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found"),
    ],
)
def test_what_etcd_refused_is_not_resent(code: grpc.StatusCode, details: str) -> None:
    assert not transient(Failed(code, details))
