"""Turn on etcd's authentication (RBAC) on a test server: a root user, and users limited to key prefixes."""

from __future__ import annotations

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from elastic_ft.etcd.client import prefix_end
from elastic_ft.etcd.server import EtcdServer


def enable_auth(server: EtcdServer, root_password: str, users: dict[str, tuple[str, list[str]]]) -> None:
    """Create ``users`` (name -> (password, prefixes it may read and write)), then enable authentication.

    Each user gets a role of its own name granting read-write on each of its
    prefixes and nothing else. Plain-http servers only.
    """
    endpoint = server.endpoints[0]
    with grpc.insecure_channel(endpoint.target) as channel:
        auth = etcdrpc.AuthStub(channel)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password), timeout=5)
        auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=5)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        for name, (password, prefixes) in users.items():
            auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=name), timeout=5)
            for prefix in prefixes:
                permission = auth_pb2.Permission(
                    permType=auth_pb2.Permission.READWRITE, key=prefix.encode(), range_end=prefix_end(prefix)
                )
                auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name=name, perm=permission), timeout=5)
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name=name, password=password), timeout=5)
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=name, role=name), timeout=5)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)
