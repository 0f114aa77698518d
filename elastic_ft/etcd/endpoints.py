"""Where etcd is and how to reach it: endpoints and TLS files, parsed without a connection.

Kept apart from :mod:`elastic_ft.etcd.client` so that configuration can be
checked (by the rendezvous, the job hand-off and the ``elastic-ft`` tool)
without loading gRPC.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

DEFAULT_ETCD_PORT = 2379

# A host is a bracketed IPv6 address or a DNS name / IPv4 address (letters, digits, '-', '_', '.').
_ENDPOINT_RE = re.compile(
    r"(?:(?P<scheme>[a-zA-Z]+)://)?(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]{1,253})(?::(?P<port>[^/]*))?/?"
)


class EndpointError(ValueError):
    """An etcd endpoint list that cannot be parsed."""


@dataclass(frozen=True)
class EtcdEndpoint:
    host: str
    port: int
    secure: bool = False

    def __str__(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.target}"

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for https endpoints; all optional (system roots by default)."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def any(self) -> bool:
        return bool(self.cacert or self.cert or self.key)

    def check(self) -> None:
        """Raise :class:`EndpointError` naming any given file that cannot be read, and a cert without its key."""
        for name, path in (("cacert", self.cacert), ("cert", self.cert), ("key", self.key)):
            if path is None:
                continue
            try:
                with open(path, "rb"):
                    pass
            except OSError as error:
                raise EndpointError(f"TLS {name} file {path!r} cannot be read: {error.strerror}") from None
        if bool(self.cert) != bool(self.key):
            raise EndpointError("TLS cert and key go together: give both or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.cacert),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


@dataclass(frozen=True)
class EtcdCredentials:
    """etcd's user/password authentication (RBAC): a user name and a file holding the password.

    The password itself is read only when the client authenticates, and
    never kept in settings, the environment or logs: only the file's path
    travels (``--rdzv-conf``, the worker hand-off).
    """

    user: str
    password_file: str

    def check(self) -> None:
        """Raise :class:`EndpointError` for a bad user name or a password file that cannot be read or is empty."""
        if not self.user or len(self.user) > 256 or any(c.isspace() or c == "," for c in self.user):
            raise EndpointError(f"etcd user {self.user[:80]!r} is invalid; expected a name without spaces or commas")
        self.password()

    def password(self) -> str:
        try:
            with open(self.password_file, encoding="utf-8") as file:
                password = file.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as error:
            raise EndpointError(
                f"etcd password_file {self.password_file!r} cannot be read: {getattr(error, 'strerror', error)}"
            ) from None
        if not password:
            raise EndpointError(f"etcd password_file {self.password_file!r} is empty")
        return password

    def __repr__(self) -> str:
        return f"EtcdCredentials(user={self.user!r}, password_file={self.password_file!r})"


def parse_endpoints(text: str) -> tuple[EtcdEndpoint, ...]:
    """Parse ``host[:port][,host[:port]...]``, each optionally ``http://`` or ``https://``.

    Raises:
        EndpointError: naming the bad item and what was expected.
    """
    if not isinstance(text, str) or not text.strip():
        raise EndpointError(f"rdzv endpoint {text!r} is empty; expected host:port[,host:port...] of etcd servers")
    endpoints = []
    for item in text.split(","):
        item = item.strip()
        match = _ENDPOINT_RE.fullmatch(item)
        if not item or match is None:
            raise EndpointError(
                f"rdzv endpoint {item!r} (in {text!r}) is malformed; expected [http://|https://]host[:port]"
            )
        scheme = (match.group("scheme") or "http").lower()
        if scheme not in ("http", "https"):
            raise EndpointError(f"rdzv endpoint {item!r} has scheme {scheme!r}; expected http or https")
        port_text = match.group("port")
        if port_text is None:
            port = DEFAULT_ETCD_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise EndpointError(f"rdzv endpoint {item!r} has port {port_text!r}; expected 1..65535")
        endpoints.append(EtcdEndpoint(match.group("host").strip("[]"), port, scheme == "https"))
    return tuple(endpoints)
