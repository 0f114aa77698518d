"""Settings of the ``etcdft`` rendezvous, parsed and checked before any etcd traffic.

Every ``--rdzv-conf`` key the backend understands is listed in
:data:`CONF_KEYS` with its default and meaning; anything else is rejected so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from elastic_ft.etcd.endpoints import EndpointError, EtcdCredentials, EtcdEndpoint, TlsFiles, parse_endpoints
from elastic_ft.keys import RunKeys
from elastic_ft.timeouts import check_seconds

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_ft.etcd.client import EtcdClient

log = logging.getLogger(__name__)

#: key -> (default, description).  ``timeout`` is torchrun's name for
#: ``join_timeout``; torchrun always passes it (900 s unless set), so an
#: explicit ``join_timeout`` wins over it.
CONF_KEYS: dict[str, tuple[Any, str]] = {
    "join_timeout": (600.0, "seconds next_rendezvous() may take before it raises RendezvousTimeoutError"),
    "timeout": (None, "torchrun's name for join_timeout (used when join_timeout is not given)"),
    "last_call_timeout": (30.0, "seconds to wait for more nodes once min_nodes have joined"),
    "spare_nodes": (0, "nodes admitted beyond max_nodes as hot spares: members whose workers are reserve ranks"),
    "lease_ttl": (10, "whole seconds a node stays in the rendezvous after its agent stops refreshing its lease"),
    "etcd_prefix": ("/elastic_ft", "key prefix; every key lives under <etcd_prefix>/<run_id>/"),
    "connect_timeout": (10.0, "seconds to keep trying unreachable endpoints before failing"),
    "request_timeout": (5.0, "seconds one etcd request may take"),
    "store_timeout": (300.0, "default timeout of the round's store (get, wait, multi_get)"),
    "events_kept": (4096, "events the run's event log keeps in etcd; the oldest are overwritten (1 to 100000)"),
    "cacert": (None, "CA bundle (PEM) to verify https endpoints"),
    "cert": (None, "client certificate (PEM) for https endpoints"),
    "key": (None, "client private key (PEM) for https endpoints"),
    "user": (None, "etcd user (RBAC); needs password_file"),
    "password_file": (None, "file holding the etcd user's password (never the password itself)"),
}

#: Keys of torch's other rendezvous backends (c10d, etcd, etcd-v2, static) and launchers, so that a
#: ``--rdzv-conf`` written for them works here: key -> (etcdft key it stands for, or None when it has
#: no meaning here and is ignored with one warning; what it is).
TORCH_CONF_KEYS: dict[str, tuple[str | None, str]] = {
    "read_timeout": ("request_timeout", "c10d/etcd: seconds a store read may take"),
    "heartbeat_timeout": ("lease_ttl", "c10d: seconds without a heartbeat before a node is dead (rounded up)"),
    "ca_cert": ("cacert", "etcd: CA bundle"),
    "ssl_cert": ("cert", "etcd: client certificate"),
    "ssl_cert_key": ("key", "etcd: client key"),
    "protocol": (None, "etcd/etcd-v2: http or https; https makes endpoints without a scheme https://"),
    "close_timeout": (None, "c10d: time to close the rendezvous; closing here is one etcd request"),
    "keep_alive_interval": (None, "c10d: heartbeat period; the lease keeper refreshes at a third of lease_ttl"),
    "keep_alive_max_attempt": (None, "c10d: missed heartbeats before death; lease_ttl decides"),
    "is_host": (None, "c10d: whether this node hosts the TCPStore; etcd is the store"),
    "store_type": (None, "c10d: TCPStore or FileStore; etcd is the store"),
    "use_libuv": (None, "c10d: TCPStore's server; etcd is the store"),
    "rank": (None, "static: this node's rank; etcdft assigns ranks"),
}

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
#: Key names a run uses right under its root (see elastic_ft.keys). A run id or a prefix segment may
#: not take one, so a run placed under another run's root can never write that run's keys.
_RESERVED = frozenset({"config", "rdzv", "round", "ftrun", ".", ".."})
#: The most nodes a rendezvous admits: far beyond any job, small enough to keep every count cheap.
MAX_NODES = 100_000


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
    credentials: EtcdCredentials | None = None
    spare_nodes: int = 0
    events_kept: int = 4096

    @property
    def capacity(self) -> int:
        """The most members a round admits: ``max_nodes`` active ones plus ``spare_nodes`` hot spares."""
        return self.max_nodes + self.spare_nodes

    @property
    def keys(self) -> RunKeys:
        """The run's etcd keys, all under ``<etcd_prefix>/<run_id>/``."""
        return RunKeys(self.etcd_prefix, self.run_id)

    @property
    def run_prefix(self) -> str:
        """``/<etcd_prefix>/<run_id>/``: the root of every key of this run."""
        return self.keys.root


def _seconds(key: str, value: Any, *, allow_zero: bool) -> float:
    try:
        return check_seconds(value, may_be_zero=allow_zero)
    except ValueError as error:
        raise RendezvousConfigError(f"rdzv conf {key}={value!r} {error}") from None


_T = TypeVar("_T")


class _Problems:
    """Every problem of one rendezvous configuration, so that one error names them all (not the first only)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)

    def check(self, validate: Callable[[], _T], fallback: _T) -> _T:
        """``validate()``, or ``fallback`` once its :class:`RendezvousConfigError` is noted."""
        try:
            return validate()
        except RendezvousConfigError as error:
            self.add(str(error))
            return fallback

    def raise_any(self) -> None:
        if len(self.messages) == 1:
            raise RendezvousConfigError(self.messages[0])
        if self.messages:
            listed = "; ".join(f"({number}) {message}" for number, message in enumerate(self.messages, 1))
            raise RendezvousConfigError(f"{len(self.messages)} rendezvous settings are invalid: {listed}")


def settings_from_parameters(params: RendezvousParameters) -> EtcdftSettings:
    """Validate torchrun's rendezvous parameters into :class:`EtcdftSettings`."""
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
    """Build settings from plain values (what the handler, tests and tools use).

    Keys of torch's other backends (:data:`TORCH_CONF_KEYS`) are translated
    or ignored, with one warning naming the ignored ones.
    """
    problems = _Problems()
    conf, protocol = _translate_torch_keys(conf, problems)
    unknown = sorted(set(conf) - set(CONF_KEYS))
    if unknown:
        problems.add(
            f"unknown etcdft rdzv conf key(s) {', '.join(map(repr, unknown))}; expected some of "
            f"{', '.join(CONF_KEYS)} (or torch's {', '.join(TORCH_CONF_KEYS)})"
        )
    if protocol == "https":
        endpoint = ",".join(
            item if "://" in item or not item.strip() else f"https://{item.strip()}" for item in str(endpoint).split(",")
        )
    if not isinstance(run_id, str) or not _NAME_RE.fullmatch(run_id) or run_id in _RESERVED:
        problems.add(
            f"rdzv id {run_id!r:.200} is invalid; expected 1 to 128 letters, digits, '_', '-' or '.', "
            f"and none of {', '.join(sorted(_RESERVED))}"
        )
    nodes_valid = True
    for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NODES:
            problems.add(f"{name}={value!r:.40} is invalid; expected an integer from 1 to {MAX_NODES}")
            nodes_valid = False
    if nodes_valid and min_nodes > max_nodes:
        problems.add(f"min_nodes={min_nodes} exceeds max_nodes={max_nodes}; expected min <= max")

    def get(key: str) -> Any:
        value = conf.get(key)
        return CONF_KEYS[key][0] if value is None else value

    def seconds(key: str, *, allow_zero: bool = False) -> float:
        return problems.check(lambda: _seconds(key, get(key), allow_zero=allow_zero), 1.0)

    spare_nodes = 0
    if nodes_valid:
        spare_nodes = problems.check(lambda: _spare_nodes(get("spare_nodes"), max_nodes), 0)

    join_source = "join_timeout" if conf.get("join_timeout") is not None else "timeout"
    join_value = conf.get(join_source)
    join_timeout = problems.check(
        lambda: _seconds(
            join_source, join_value if join_value is not None else CONF_KEYS["join_timeout"][0], allow_zero=False
        ),
        1.0,
    )
    lease_value = get("lease_ttl")
    lease_seconds = seconds("lease_ttl")
    if lease_seconds != int(lease_seconds):
        problems.add(f"rdzv conf lease_ttl={lease_value!r} is not whole; etcd leases take whole seconds")
    prefix = str(get("etcd_prefix"))
    segments = prefix.rstrip("/").split("/")[1:]
    if (
        not prefix.startswith("/")
        or len(prefix) > 256
        or not all(_NAME_RE.fullmatch(s) and s not in _RESERVED for s in segments)
    ):
        problems.add(
            f"rdzv conf etcd_prefix={prefix!r:.300} is invalid; expected an absolute key path like /elastic_ft "
            f"(at most 256 characters; segments of letters, digits, '_', '-' or '.', none of "
            f"{', '.join(sorted(_RESERVED))})"
        )
    endpoints: tuple[EtcdEndpoint, ...] = ()
    try:
        endpoints = parse_endpoints(endpoint)
    except EndpointError as error:
        problems.add(str(error))
    tls = TlsFiles(conf.get("cacert"), conf.get("cert"), conf.get("key"))
    if endpoints and (tls.cacert or tls.cert or tls.key) and not any(e.secure for e in endpoints):
        problems.add("rdzv conf cacert/cert/key given but no endpoint uses https://")
    user, password_file = conf.get("user"), conf.get("password_file")
    credentials = None
    if (user is None) != (password_file is None):
        problems.add("rdzv conf user and password_file go together: give both or neither")
    elif user is not None:
        credentials = EtcdCredentials(str(user), str(password_file))
    for files in (tls, credentials):
        try:
            if files is not None:
                files.check()
        except EndpointError as error:
            problems.add(f"rdzv conf: {error}")
    last_call_timeout = seconds("last_call_timeout", allow_zero=True)
    connect_timeout, request_timeout = seconds("connect_timeout"), seconds("request_timeout")
    store_timeout = seconds("store_timeout")
    events_kept = problems.check(lambda: _events_kept(get("events_kept")), 1)
    problems.raise_any()  # before any side effect: nothing is built from a configuration with a problem
    return EtcdftSettings(
        run_id=run_id,
        endpoints=endpoints,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr or None,
        join_timeout=join_timeout,
        lease_ttl=int(lease_seconds),
        etcd_prefix=prefix.rstrip("/") or "/",
        tls=tls,
        credentials=credentials,
        spare_nodes=spare_nodes,
        last_call_timeout=last_call_timeout,
        connect_timeout=connect_timeout,
        request_timeout=request_timeout,
        store_timeout=store_timeout,
        events_kept=events_kept,
    )


def connect(settings: EtcdftSettings, *, timeouts: tuple[float, float] | None = None) -> EtcdClient:
    """A client of the run's etcd with the settings' endpoints, TLS and credentials.

    ``timeouts``: ``(connect_timeout, request_timeout)`` instead of the
    settings'. gRPC is imported here, not with this module.
    """
    from elastic_ft.etcd.client import EtcdClient

    connect_timeout, request_timeout = timeouts or (settings.connect_timeout, settings.request_timeout)
    return EtcdClient(
        settings.endpoints,
        connect_timeout=connect_timeout,
        request_timeout=request_timeout,
        tls=settings.tls,
        credentials=settings.credentials,
    )


def _events_kept(value: Any) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[0-9]{1,6}", text) or not 1 <= int(text) <= 100_000:
        raise RendezvousConfigError(
            f"rdzv conf events_kept={value!r:.40} is invalid; expected a whole number of events from 1 to 100000"
        )
    return int(text)


def _spare_nodes(value: Any, max_nodes: int) -> int:
    """``spare_nodes``: a whole number of nodes (``--rdzv-conf`` gives it as text), all of them fitting in MAX_NODES."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[0-9]{1,6}", text) or max_nodes + int(text) > MAX_NODES:
        raise RendezvousConfigError(
            f"rdzv conf spare_nodes={value!r:.40} is invalid; expected a whole number of nodes from 0 to "
            f"{MAX_NODES - max_nodes} (max_nodes={max_nodes} plus spares at most {MAX_NODES})"
        )
    return int(text)


_warned_ignored: set[tuple[str, ...]] = set()


def _translate_torch_keys(conf: dict[str, Any], problems: _Problems) -> tuple[dict[str, Any], str | None]:
    """``conf`` with torch's keys put under etcdft's names; and the ``protocol`` asked for, if any.

    A torch key never overrides the etcdft key it stands for when both are
    given. ``heartbeat_timeout`` becomes a whole ``lease_ttl``, rounded up.
    """
    translated = {key: value for key, value in conf.items() if key not in TORCH_CONF_KEYS}
    ignored = []
    protocol = None
    for key, value in conf.items():
        if key not in TORCH_CONF_KEYS or value is None:
            continue
        target, _ = TORCH_CONF_KEYS[key]
        if key == "protocol":
            protocol = str(value).strip().lower()
            if protocol not in ("http", "https"):
                problems.add(f"rdzv conf protocol={value!r:.40} is invalid; expected http or https")
                protocol = None
        elif target is None:
            ignored.append(key)
        elif translated.get(target) is None:
            if key in ("read_timeout", "heartbeat_timeout"):  # checked here, under the name the user gave
                seconds: float | None = problems.check(functools.partial(_seconds, key, value, allow_zero=False), None)
                if seconds is None:
                    continue  # noted; the etcdft key keeps its default meanwhile
                value = math.ceil(seconds) if key == "heartbeat_timeout" else seconds
            translated[target] = value
    if ignored:
        names = tuple(sorted(ignored))
        if names not in _warned_ignored:
            _warned_ignored.add(names)
            log.warning(
                "etcdft ignores rdzv conf key(s) %s of torch's other backends: %s",
                ", ".join(names),
                "; ".join(f"{name}: {TORCH_CONF_KEYS[name][1]}" for name in names),
            )
    return translated, protocol
