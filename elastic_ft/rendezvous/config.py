"""Settings of the ``etcdft`` rendezvous, parsed and checked before any etcd traffic.

Every ``--rdzv-conf`` key the backend understands is listed in
:data:`CONF_KEYS` with its default and meaning; anything else is rejected so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ft.etcd_client import EtcdEndpoint, TlsFiles

DEFAULT_ETCD_PORT = 2379

#: key -> (default, description).  ``timeout`` is torchrun's name for
#: ``join_timeout``; torchrun always passes it (900 s unless set), so an
#: explicit ``join_timeout`` wins over it.
CONF_KEYS: dict[str, tuple[Any, str]] = {
    "join_timeout": (600.0, "seconds next_rendezvous() may take before it raises RendezvousTimeoutError"),
    "timeout": (None, "torchrun's name for join_timeout (used when join_timeout is not given)"),
    "last_call_timeout": (30.0, "seconds to wait for more nodes once min_nodes have joined"),
    "lease_ttl": (10, "whole seconds a node stays in the rendezvous after its agent stops refreshing its lease"),
    "etcd_prefix": ("/elastic_ft", "key prefix; every key lives under <etcd_prefix>/<run_id>/"),
    "connect_timeout": (10.0, "seconds to keep trying unreachable endpoints before failing"),
    "request_timeout": (5.0, "seconds one etcd request may take"),
    "store_timeout": (300.0, "default timeout of the round's store (get, wait, multi_get)"),
    "cacert": (None, "CA bundle (PEM) to verify https endpoints"),
    "cert": (None, "client certificate (PEM) for https endpoints"),
    "key": (None, "client private key (PEM) for https endpoints"),
}

_ENDPOINT_RE = re.compile(
    r"^(?:(?P<scheme>[a-zA-Z]+)://)?(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\[\]]+)(?::(?P<port>[^/]*))?/?$"
)
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class RendezvousConfigError(ValueError):
    """A rendezvous setting is malformed; raised before contacting etcd."""


@dataclass(frozen=True)
class EtcdftSettings:
    run_id: str
    endpoints: tuple[EtcdEndpoint, ...]
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    join_timeout: float
    last_call_timeout: float
    lease_ttl: int
    etcd_prefix: str
    connect_timeout: float
    request_timeout: float
    store_timeout: float
    tls: TlsFiles

    @property
    def run_prefix(self) -> str:
        """``/<etcd_prefix>/<run_id>/``: the root of every key of this run."""
        return f"{self.etcd_prefix.rstrip('/')}/{self.run_id}/"


def parse_endpoints(text: str) -> tuple[EtcdEndpoint, ...]:
    """Parse ``host[:port][,host[:port]...]``, each optionally ``http://`` or ``https://``."""
    if not isinstance(text, str) or not text.strip():
        raise RendezvousConfigError(
            f"rdzv endpoint {text!r} is empty; expected host:port[,host:port...] of etcd servers"
        )
    endpoints = []
    for item in text.split(","):
        item = item.strip()
        match = _ENDPOINT_RE.match(item)
        if not item or match is None:
            raise RendezvousConfigError(
                f"rdzv endpoint {item!r} (in {text!r}) is malformed; expected [http://|https://]host[:port]"
            )
        scheme = (match.group("scheme") or "http").lower()
        if scheme not in ("http", "https"):
            raise RendezvousConfigError(f"rdzv endpoint {item!r} has scheme {scheme!r}; expected http or https")
        port_text = match.group("port")
        if port_text is None:
            port = DEFAULT_ETCD_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise RendezvousConfigError(f"rdzv endpoint {item!r} has port {port_text!r}; expected 1..65535")
        endpoints.append(EtcdEndpoint(match.group("host").strip("[]"), port, scheme == "https"))
    return tuple(endpoints)


def _seconds(key: str, value: Any, *, allow_zero: bool) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise RendezvousConfigError(f"rdzv conf {key}={value!r} is not a number; expected seconds") from None
    if not math.isfinite(seconds):
        raise RendezvousConfigError(f"rdzv conf {key}={value!r} is not finite; expected seconds")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        expected = ">= 0" if allow_zero else "> 0"
        raise RendezvousConfigError(f"rdzv conf {key}={value!r} is out of range; expected seconds {expected}")
    return seconds


def settings_from_parameters(params: RendezvousParameters) -> EtcdftSettings:
    """Validate torchrun's rendezvous parameters into :class:`EtcdftSettings`."""
    unknown = sorted(set(params.config) - set(CONF_KEYS))
    if unknown:
        raise RendezvousConfigError(
            f"unknown etcdft rdzv conf key(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(CONF_KEYS)}"
        )
    return make_settings(
        run_id=params.run_id,
        endpoint=params.endpoint,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **params.config,
    )


def make_settings(
    *,
    run_id: str,
    endpoint: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None = None,
    **conf: Any,
) -> EtcdftSettings:
    """Build settings from plain values (what the handler, tests and tools use)."""
    unknown = sorted(set(conf) - set(CONF_KEYS))
    if unknown:
        raise RendezvousConfigError(
            f"unknown etcdft rdzv conf key(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(CONF_KEYS)}"
        )
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise RendezvousConfigError(
            f"rdzv id {run_id!r} is invalid; expected a non-empty string of letters, digits, '_', '-' or '.'"
        )
    for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RendezvousConfigError(f"{name}={value!r} is invalid; expected an integer >= 1")
    if min_nodes > max_nodes:
        raise RendezvousConfigError(f"min_nodes={min_nodes} exceeds max_nodes={max_nodes}; expected min <= max")

    def get(key: str) -> Any:
        value = conf.get(key)
        return CONF_KEYS[key][0] if value is None else value

    join_source = "join_timeout" if conf.get("join_timeout") is not None else "timeout"
    join_value = conf.get(join_source)
    join_timeout = _seconds(
        join_source, join_value if join_value is not None else CONF_KEYS["join_timeout"][0], allow_zero=False
    )
    lease_value = get("lease_ttl")
    lease_seconds = _seconds("lease_ttl", lease_value, allow_zero=False)
    if lease_seconds != int(lease_seconds):
        raise RendezvousConfigError(f"rdzv conf lease_ttl={lease_value!r} is not whole; etcd leases take whole seconds")
    prefix = str(get("etcd_prefix"))
    if not prefix.startswith("/") or "//" in prefix or any(c.isspace() for c in prefix):
        raise RendezvousConfigError(
            f"rdzv conf etcd_prefix={prefix!r} is invalid; expected an absolute key path like /elastic_ft"
        )
    endpoints = parse_endpoints(endpoint)
    tls = TlsFiles(conf.get("cacert"), conf.get("cert"), conf.get("key"))
    if (tls.cacert or tls.cert or tls.key) and not any(e.secure for e in endpoints):
        raise RendezvousConfigError("rdzv conf cacert/cert/key given but no endpoint uses https://")
    return EtcdftSettings(
        run_id=run_id,
        endpoints=endpoints,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr or None,
        join_timeout=join_timeout,
        last_call_timeout=_seconds("last_call_timeout", get("last_call_timeout"), allow_zero=True),
        lease_ttl=int(lease_seconds),
        etcd_prefix=prefix.rstrip("/") or "/",
        connect_timeout=_seconds("connect_timeout", get("connect_timeout"), allow_zero=False),
        request_timeout=_seconds("request_timeout", get("request_timeout"), allow_zero=False),
        store_timeout=_seconds("store_timeout", get("store_timeout"), allow_zero=False),
        tls=tls,
    )
