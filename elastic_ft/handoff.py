"""The node -> worker hand-off: what ``ftrun``'s agent tells its workers, in their environment.

Three variables, each JSON, encoded and decoded here only:

``ELASTIC_FT_STORE``       the round's etcd store (:class:`StoreHandoff`): the
                           Wrapper's default ``store_factory`` builds it, so
                           no worker hosts the job's coordination
``ELASTIC_FT_JOB_CONFIG``  the job config: the Wrapper takes from it the
                           timeouts and the rank assignment the code leaves
                           unset
``ELASTIC_FT_WORKER``      this worker's place (:class:`WorkerHandoff`): how
                           many ranks of the round are active (the others
                           are hot spares' reserve ranks), and whether the
                           process joins a running world (a respawned worker)

A replicated job (:mod:`elastic_ft.replicas`) finds etcd in ``ELASTIC_FT_STORE``
under ``ftrun``, or, with one launcher per replica group (TorchFT's way, a
``torchrun`` each), in two variables of its own (:class:`ReplicaHandoff`)::

``ELASTIC_FT_ETCD_ENDPOINTS``  host:port[,host:port...] of the etcd servers
``ELASTIC_FT_RUN_ID``          the job's name: every replica group of the job gives the same
``ELASTIC_FT_ETCD_PREFIX``     optional, the key prefix (``/elastic_ft``, as ``--rdzv-conf``'s)

Decoding checks every field and raises a ``ValueError`` naming the variable
and the problem; nothing here touches etcd or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_ft.etcd.endpoints import EndpointError, EtcdCredentials, EtcdEndpoint, TlsFiles, parse_endpoints
from elastic_ft.job_config import JobConfig, JobConfigError, parse_stored_job_config
from elastic_ft.keys import RunKeys, run_root_of_round_store
from elastic_ft.timeouts import check_seconds
from elastic_ft.untrusted import json_document, json_object

STORE_ENV = "ELASTIC_FT_STORE"
JOB_CONFIG_ENV = "ELASTIC_FT_JOB_CONFIG"
WORKER_ENV = "ELASTIC_FT_WORKER"
#: The warm standby process (:mod:`elastic_ft.inprocess.restart.standby`) that ``ftrun``'s agent
#: (:mod:`elastic_ft.launcher.standby`) starts: the module it runs, named here so that the node side starts it
#: without importing the worker side; the variable naming its status pipe's write end; what it writes there once
#: warm.
ETCD_ENDPOINTS_ENV = "ELASTIC_FT_ETCD_ENDPOINTS"
RUN_ID_ENV = "ELASTIC_FT_RUN_ID"
ETCD_PREFIX_ENV = "ELASTIC_FT_ETCD_PREFIX"
DEFAULT_ETCD_PREFIX = "/elastic_ft"
STANDBY_PROCESS_MODULE = "elastic_ft.inprocess.restart.standby"
STANDBY_STATUS_FD_ENV = "ELASTIC_FT_STANDBY_STATUS_FD"
STANDBY_READY = b"ready\n"


@dataclass(frozen=True)
class StoreHandoff:
    """Where the round's etcd store is, and how to reach it."""

    endpoints: tuple[EtcdEndpoint, ...]
    prefix: str
    tls: TlsFiles
    connect_timeout: float
    request_timeout: float
    timeout: float
    credentials: EtcdCredentials | None = None  # the password file's path travels, never the password

    def to_env(self) -> dict[str, str]:
        document = {
            "endpoints": [str(endpoint) for endpoint in self.endpoints],
            "prefix": self.prefix,
            "cacert": self.tls.cacert,
            "cert": self.tls.cert,
            "key": self.tls.key,
            "connect_timeout": self.connect_timeout,
            "request_timeout": self.request_timeout,
            "user": self.credentials.user if self.credentials else None,
            "password_file": self.credentials.password_file if self.credentials else None,
            "timeout": self.timeout,
        }
        return {STORE_ENV: json.dumps(document)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> StoreHandoff | None:
        """The hand-off in ``environ``, ``None`` when there is none.

        Raises:
            ValueError: the variable is set but does not describe a store.
        """
        text = environ.get(STORE_ENV)
        if not text:
            return None
        try:
            return cls._decode(json_document(text, "the store description"))
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{STORE_ENV}={text!r} is not a valid etcd store description: {error}") from None

    @classmethod
    def _decode(cls, document: dict[str, Any]) -> StoreHandoff:
        endpoints = document["endpoints"]
        if not isinstance(endpoints, list) or not endpoints or not all(isinstance(e, str) for e in endpoints):
            raise ValueError(f"endpoints={endpoints!r}: expected a non-empty list of strings")
        try:
            parsed = parse_endpoints(",".join(endpoints))
        except EndpointError as error:
            raise ValueError(str(error)) from None
        prefix = document["prefix"]
        if not isinstance(prefix, str) or not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"prefix={prefix!r}: expected an absolute key prefix ending with '/'")
        tls = TlsFiles(*(_optional_text(document, name) for name in ("cacert", "cert", "key")))
        user, password_file = _optional_text(document, "user"), _optional_text(document, "password_file")
        if (user is None) != (password_file is None):
            raise ValueError("user and password_file go together: give both or neither")
        credentials = None if user is None or password_file is None else EtcdCredentials(user, password_file)
        try:
            tls.check()
            if credentials is not None:
                credentials.check()
        except EndpointError as error:
            raise ValueError(str(error)) from None
        return cls(
            endpoints=parsed,
            prefix=prefix,
            tls=tls,
            credentials=credentials,
            connect_timeout=_seconds(document, "connect_timeout"),
            request_timeout=_seconds(document, "request_timeout"),
            timeout=_seconds(document, "timeout"),
        )


@dataclass(frozen=True)
class ReplicaHandoff:
    """Where a replicated job's replica groups meet: the etcd servers and the run's key prefix."""

    endpoints: tuple[EtcdEndpoint, ...]
    keys: RunKeys
    tls: TlsFiles = field(default_factory=TlsFiles)
    credentials: EtcdCredentials | None = None
    connect_timeout: float = 10.0
    request_timeout: float = 5.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ReplicaHandoff | None:
        """From ``ftrun``'s store hand-off, else from ``ELASTIC_FT_ETCD_ENDPOINTS`` and ``ELASTIC_FT_RUN_ID``;
        None when neither is set.

        Raises:
            ValueError: a variable is set but malformed, or only one of the two is set.
        """
        store = StoreHandoff.from_env(environ)
        if store is not None:
            root = run_root_of_round_store(store.prefix)
            if root is None:
                raise ValueError(f"{STORE_ENV} has prefix={store.prefix!r}; expected a round's store prefix")
            etcd_prefix, _, run = root.rstrip("/").rpartition("/")
            return cls(
                store.endpoints,
                RunKeys(etcd_prefix or "/", run),
                store.tls,
                store.credentials,
                store.connect_timeout,
                store.request_timeout,
            )
        endpoints, run_id = environ.get(ETCD_ENDPOINTS_ENV), environ.get(RUN_ID_ENV)
        if endpoints is None and run_id is None:
            return None
        if not endpoints or not run_id:
            raise ValueError(
                f"{ETCD_ENDPOINTS_ENV}={endpoints!r} and {RUN_ID_ENV}={run_id!r}: a replica group outside ftrun "
                "needs both (the etcd servers, and the job's name every replica group gives)"
            )
        try:
            parsed = parse_endpoints(endpoints)
        except EndpointError as error:
            raise ValueError(f"{ETCD_ENDPOINTS_ENV}: {error}") from None
        if "/" in run_id or len(run_id) > 256:
            raise ValueError(f"{RUN_ID_ENV}={run_id!r}: expected a name without '/', at most 256 characters")
        prefix = environ.get(ETCD_PREFIX_ENV) or DEFAULT_ETCD_PREFIX
        if not prefix.startswith("/"):
            raise ValueError(f"{ETCD_PREFIX_ENV}={prefix!r}: expected an absolute key prefix")
        return cls(parsed, RunKeys(prefix, run_id))


def _optional_text(document: dict[str, Any], name: str) -> str | None:
    value = document.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name}={value!r}: expected a file path or null")
    return value


def _seconds(document: dict[str, Any], name: str) -> float:
    value = document[name]
    try:
        return check_seconds(value, may_be_zero=False)
    except ValueError as error:
        raise ValueError(f"{name}={value!r} {error}") from None


@dataclass(frozen=True)
class WorkerHandoff:
    """What the agent tells one worker about its place in the world.

    Args:
        active_world_size: how many ranks of the round run the training
            function at first; the ranks above it (the hot spare nodes'
            workers) start as reserve ranks. ``None``: every rank is active.
        joining: the process enters a world that is already running (the
            agent respawned it): it waits as a joiner until a restart
            admits it, instead of taking part in the initial barrier.
        segment: its node's segment label, when the job trains in whole
            segments (``ftrun --segment-size``); ``None`` otherwise.
        segment_ranks: the ranks of one segment (its nodes times the workers
            per node), with ``segment``.
    """

    active_world_size: int | None = None
    joining: bool = False
    segment: str | None = None
    segment_ranks: int | None = None

    def to_env(self) -> dict[str, str]:
        document: dict[str, object] = {"active_world_size": self.active_world_size, "joining": self.joining}
        if self.segment is not None:
            document.update(segment=self.segment, segment_ranks=self.segment_ranks)
        return {WORKER_ENV: json.dumps(document)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerHandoff | None:
        """The hand-off in ``environ``, ``None`` when there is none.

        Raises:
            ValueError: the variable is set but does not describe a worker's place.
        """
        text = environ.get(WORKER_ENV)
        if not text:
            return None
        document = json_object(text) or {}
        size = document.get("active_world_size")
        joining = document.get("joining")
        segment, segment_ranks = document.get("segment"), document.get("segment_ranks")
        if (
            not isinstance(joining, bool)
            or not _count_or_none(size)
            or not (segment is None or (isinstance(segment, str) and 0 < len(segment) <= 128))
            or not _count_or_none(segment_ranks)
            or (segment is None) != (segment_ranks is None)
        ):
            raise ValueError(
                f"{WORKER_ENV}={text!r:.200} is not a valid worker hand-off; expected a JSON object with "
                '"active_world_size" (a positive integer or null) and "joining" (true or false), and optionally '
                '"segment" (a label) with "segment_ranks" (a positive integer)'
            )
        return cls(size, joining, segment, segment_ranks)


def _count_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**31)


def job_config_to_env(config: JobConfig) -> dict[str, str]:
    return {JOB_CONFIG_ENV: config.to_json().decode()}


def job_config_from_env(environ: Mapping[str, str]) -> JobConfig | None:
    """The job config in ``environ``, ``None`` when there is none.

    Raises:
        ValueError: the variable is set but holds no valid job config.
    """
    text = environ.get(JOB_CONFIG_ENV)
    if not text:
        return None
    try:
        return parse_stored_job_config(text, JOB_CONFIG_ENV)
    except JobConfigError as error:
        raise ValueError(f"{JOB_CONFIG_ENV} holds an invalid job config: {error}") from error
