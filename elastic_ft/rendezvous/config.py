"""Settings of the ``etcdft`` rendezvous, parsed and checked before any etcd traffic.

Every ``--rdzv-conf`` key the backend understands is a field of
:class:`RendezvousConf`, a pydantic model of the value types the job config
is made of too (:mod:`elastic_ft.config_fields`), with its default and
meaning (:data:`CONF_KEYS` lists them); anything else is rejected so a typo
never silently falls back to a default. :class:`EtcdftSettings` is that
model with torchrun's launch arguments and the connection they describe.
Every problem is named in one error, before any side effect.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from elastic_ft import config_fields as fields
from elastic_ft.etcd.endpoints import EndpointError, EtcdCredentials, EtcdEndpoint, TlsFiles, parse_endpoints
from elastic_ft.keys import RunKeys
from elastic_ft.timeouts import check_seconds

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_ft.etcd.client import EtcdClient

log = logging.getLogger(__name__)

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


def _etcd_prefix_check(value: Any) -> str:
    """An absolute key path whose segments no run's own keys use; returned without its trailing '/'."""
    prefix = value if isinstance(value, str) else ""
    segments = prefix.rstrip("/").split("/")[1:]
    if (
        not prefix.startswith("/")
        or len(prefix) > 256
        or not all(_NAME_RE.fullmatch(s) and s not in _RESERVED for s in segments)
    ):
        raise fields.invalid(
            "an absolute key path like /elastic_ft (at most 256 characters; segments of letters, digits, "
            f"'_', '-' or '.', none of {', '.join(sorted(_RESERVED))})"
        )
    return prefix.rstrip("/") or "/"


def _spare_nodes_check(value: Any, info: ValidationInfo) -> int:
    """``spare_nodes``: whole nodes that fit, with ``max_nodes`` (the validation context's), in MAX_NODES."""
    max_nodes = (info.context or {}).get("max_nodes") or 0
    try:
        return fields.count_check(0, MAX_NODES - max_nodes)(value, info)
    except PydanticCustomError:
        raise fields.invalid(
            f"a whole number of nodes from 0 to {MAX_NODES - max_nodes} (max_nodes={max_nodes} plus spares at most "
            f"{MAX_NODES})"
        ) from None


class RendezvousConf(BaseModel):
    """The ``--rdzv-conf`` keys etcdft understands: their types, bounds, defaults and meanings.

    Validate with ``context={**config_fields.TEXT, "max_nodes": N}``: ``--rdzv-conf``
    gives text, and ``spare_nodes`` is bounded by the launch's ``max_nodes``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    join_timeout: fields.Seconds = Field(600.0, description=fields.JOIN_TIMEOUT_HELP)
    timeout: fields.Seconds | None = Field(
        None, description="torchrun's name for join_timeout (used when join_timeout is not given)"
    )
    last_call_timeout: fields.SecondsOrZero = Field(30.0, description=fields.LAST_CALL_TIMEOUT_HELP)
    spare_nodes: Annotated[int, BeforeValidator(_spare_nodes_check)] = Field(
        0, description="nodes admitted beyond max_nodes as hot spares: members whose workers are reserve ranks"
    )
    segment: Annotated[int, Field(ge=1, le=MAX_NODES), BeforeValidator(fields.count_check(1, MAX_NODES))] | None = (
        Field(
            None,
            description="nodes train in whole segments of this many nodes of one label (ft_launcher's --ft-segment; "
            "the label: ELASTIC_FT_NODE_SEGMENT or Slurm's topology); min_nodes and max_nodes must be multiples",
        )
    )
    lease_ttl: fields.LeaseSeconds = Field(10, description=fields.LEASE_TTL_HELP)
    etcd_prefix: Annotated[str, BeforeValidator(_etcd_prefix_check)] = Field(
        "/elastic_ft", description="key prefix; every key lives under <etcd_prefix>/<run_id>/"
    )
    connect_timeout: fields.Seconds = Field(
        10.0, description="seconds to keep trying unreachable endpoints before failing"
    )
    request_timeout: fields.Seconds = Field(5.0, description="seconds one etcd request may take")
    store_timeout: fields.Seconds = Field(
        300.0, description="default timeout of the round's store (get, wait, multi_get)"
    )
    events_kept: fields.EventsKept = Field(fields.EVENTS_KEPT_DEFAULT, description=fields.EVENTS_KEPT_HELP)
    cacert: str | None = Field(None, description="CA bundle (PEM) to verify https endpoints")
    cert: str | None = Field(None, description="client certificate (PEM) for https endpoints")
    key: str | None = Field(None, description="client private key (PEM) for https endpoints")
    user: str | None = Field(None, description="etcd user (RBAC); needs password_file")
    password_file: str | None = Field(
        None, description="file holding the etcd user's password (never the password itself)"
    )


#: key -> (default, description), from :class:`RendezvousConf`. ``timeout`` is torchrun's name for
#: ``join_timeout``; torchrun always passes it (900 s unless set), so an explicit ``join_timeout`` wins.
CONF_KEYS: dict[str, tuple[Any, str]] = {
    name: (field.default, field.description or "") for name, field in RendezvousConf.model_fields.items()
}


class EtcdftSettings(RendezvousConf):
    """Everything a rendezvous needs: the ``--rdzv-conf`` settings, torchrun's launch arguments, the connection.

    Built by :func:`make_settings` only, once every value is checked;
    ``join_timeout`` is the one in effect (``timeout`` when no
    ``join_timeout`` was given) and ``lease_ttl`` whole.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    run_id: str
    endpoints: tuple[EtcdEndpoint, ...]
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    tls: TlsFiles
    credentials: EtcdCredentials | None = None

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
    if protocol == "https":
        endpoint = ",".join(
            item if "://" in item or not item.strip() else f"https://{item.strip()}"
            for item in str(endpoint).split(",")
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
    given = {key: value for key, value in conf.items() if value is not None}
    if not nodes_valid:
        given.pop("spare_nodes", None)  # its bound depends on max_nodes, already reported
    checked = _validated_conf(given, max_nodes if nodes_valid else None, problems)
    segment = checked.segment
    if segment is not None and nodes_valid and (min_nodes % segment or max_nodes % segment):
        problems.add(
            f"segment={segment} needs min_nodes and max_nodes that are multiples of it, got "
            f"min_nodes={min_nodes}, max_nodes={max_nodes} (nodes train in whole segments)"
        )
    endpoints: tuple[EtcdEndpoint, ...] = ()
    try:
        endpoints = parse_endpoints(endpoint)
    except EndpointError as error:
        problems.add(str(error))
    tls, credentials = _secrets(conf, endpoints, problems)
    problems.raise_any()  # before any side effect: nothing is built from a configuration with a problem
    join_timeout = checked.join_timeout
    if "join_timeout" not in checked.model_fields_set and checked.timeout is not None:
        join_timeout = checked.timeout
    return EtcdftSettings.model_construct(
        **{**dict(checked), "join_timeout": join_timeout},
        run_id=run_id,
        endpoints=endpoints,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr or None,
        tls=tls,
        credentials=credentials,
    )


def _secrets(
    conf: dict[str, Any], endpoints: tuple[EtcdEndpoint, ...], problems: _Problems
) -> tuple[TlsFiles, EtcdCredentials | None]:
    """The TLS files and the credentials the conf names, checked (their problems added to ``problems``)."""
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
    return tls, credentials


def _validated_conf(given: dict[str, Any], max_nodes: int | None, problems: _Problems) -> RendezvousConf:
    """``given`` as a :class:`RendezvousConf` (text allowed); the defaults once each of its problems is noted."""
    try:
        return RendezvousConf.model_validate(given, context={**fields.TEXT, "max_nodes": max_nodes})
    except ValidationError as error:
        unknown = []
        for item in error.errors():
            key = str(item["loc"][0]) if item["loc"] else "(rdzv conf)"
            if item["type"] == "extra_forbidden":
                unknown.append(key)
            elif item["type"] == fields.ERROR_TYPE:
                context = item.get("ctx") or {}
                problems.add(
                    f"rdzv conf {key}={fields.shown(item['input'])} {context['problem']}; expected {context['expected']}"
                )
            else:
                problems.add(f"rdzv conf {key}={fields.shown(item['input'])} is invalid; {item['msg']}")
        if unknown:
            problems.add(
                f"unknown etcdft rdzv conf key(s) {', '.join(map(repr, sorted(unknown)))}; expected some of "
                f"{', '.join(CONF_KEYS)} (or torch's {', '.join(TORCH_CONF_KEYS)})"
            )
        return RendezvousConf()


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
