"""The job configuration kept in etcd: schema and validation.

A job config is a YAML (or JSON) mapping; ``configs/job.yaml`` shows every
field. It is checked whole before anything is written, and every error is
reported at once (:class:`JobConfigError` lists them), each with its place
(``file:line:column`` and the field's path), the value, and what was
expected. The fields are pydantic v2 models, which also give the JSON Schema
``elastic-ft config schema`` prints for editors. After the fields, the
config is checked against itself: the node and process counts bound what
the rank-assignment tree and filters may ask for. It is stored as JSON
under ``/<etcd_prefix>/<run_id>/config``.

Sections (all optional; omitted fields keep their defaults):

``nodes``            ``min``, ``max`` (node counts) and ``spares`` (hot
                     spare nodes admitted beyond ``max``: their workers
                     start and wait as reserve ranks)
``nproc_per_node``   workers per node
``max_restarts``     process-level restarts, as torchrun's ``--max-restarts``
``respawn``          ``per_rank`` and ``per_job``: how many times a worker
                     that died inside the Wrapper is replaced by a new
                     process that joins the running world (0: never):
                     ``per_rank`` counts a local rank's new processes in
                     a row that died before they trained (a crash loop),
                     ``per_job`` all of the job's;
                     ``rejoin``: ``at_once`` (the default: its node asks
                     for an in-process restart to admit it as soon as it
                     is ready, restoring the world size) or ``next_fault``
                     (the new process waits in reserve for the next
                     restart)
``rendezvous``       ``join_timeout``, ``last_call_timeout``, ``lease_ttl``
                     (the etcdft ``--rdzv-conf`` keys of the same names)
``wrapper``          the in-process restart timeouts, in seconds, and its
                     restart limits (``max_identical_faults``,
                     ``max_restarts_without_progress``; 0: no limit), by
                     the ``elastic_ft.Wrapper`` argument names
``observability``    ``events_kept`` (the run's event log in etcd keeps
                     the last this many events), ``progress_interval``
                     (seconds between two samples of a rank's optimizer
                     steps for the timeline), ``metrics_port`` (each
                     agent serves Prometheus metrics on this port; off
                     when unset)
``rank_assignment``  ``tree``: the layers of a ``Tree`` (root first), each
                     ``min_ranks``, ``max_ranks``, ``key`` and ``flags``;
                     ``max_active_world_size`` and
                     ``active_world_size_divisible_by`` filters

A layer's ``key`` says how a rank finds its group: ``job`` (one group, the
root), ``host`` (the rank's hostname), or ``env:NAME`` (the value of an
environment variable, e.g. ``env:RACK``).

This module imports nothing of the worker side: the policy a config
describes is built there (:mod:`elastic_ft.inprocess.rank_assignment.from_config`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from elastic_ft.config_fields import (
    ERROR_TYPE,
    EVENTS_KEPT_DEFAULT,
    EVENTS_KEPT_HELP,
    JOIN_TIMEOUT_HELP,
    LAST_CALL_TIMEOUT_HELP,
    LEASE_TTL_HELP,
    Count0,
    Count1,
    EventsKept,
    LeaseSeconds,
    Seconds,
    SecondsOrZero,
    count_check,
    invalid,
    shown,
)
from elastic_ft.timeouts import WRAPPER_DEFAULTS, WRAPPER_ORDER
from elastic_ft.untrusted import MalformedRecord, json_document

_LAYER_FLAGS = ("RESERVE", "BACKFILL")
#: When a respawned worker joins the running world: at the next restart, or through one asked for at once.
REJOIN_CHOICES = ("next_fault", "at_once")

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class ConfigIssue:
    """One error of a job config: where (the field's path, and its line and column in the file when known) and what."""

    path: Path
    message: str
    line: int | None = None
    column: int | None = None
    #: ``field``: a value is wrong on its own (what the JSON Schema checks too); ``relation``:
    #: values that are each fine conflict (min above max, a tree larger than the job, ...).
    kind: str = "field"

    @property
    def field(self) -> str:
        """The path as the config writes it: ``rank_assignment.tree[1].min_ranks``."""
        text = ""
        for part in self.path:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
        return text or "(top level)"

    def describe(self, source: str | None) -> str:
        """``file:line:column: message`` (the place as far as it is known)."""
        if source and self.line is not None:
            return f"{source}:{self.line}:{self.column}: {self.message}"
        if self.line is not None:
            return f"line {self.line}:{self.column}: {self.message}"
        return f"{source}: {self.message}" if source else self.message


class JobConfigError(ValueError):
    """The job config is malformed; nothing was written. ``issues`` lists every error found."""

    def __init__(self, message: str, issues: tuple[ConfigIssue, ...] = ()) -> None:
        super().__init__(message)
        self.issues = issues


# ---- field checks of the job config's own (the shared ones are in elastic_ft.config_fields) ----


def _choice_check(choices: tuple[str, ...], expected: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise invalid(expected)
        return value

    return check


def _key_check(value: Any) -> str:
    if not isinstance(value, str) or not (value in ("job", "host") or (value.startswith("env:") and len(value) > 4)):
        raise invalid("'job', 'host' or 'env:NAME'")
    return value


def _flags_check(value: Any) -> list[str]:
    flags = [value] if isinstance(value, str) else value
    if not isinstance(flags, list) or any(flag not in _LAYER_FLAGS for flag in flags):
        raise invalid(f"a list of {', '.join(_LAYER_FLAGS)}")
    return flags


class _Section(BaseModel):
    """A mapping of the config: unknown fields are errors; ``None`` (an empty YAML value) means the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_default(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, Mapping):
            return {key: item for key, item in value.items() if item is not None or key not in cls.model_fields}
        raise invalid("a mapping")


def _ordered(error_path: str, smaller: str, smaller_value: float, larger: str, larger_value: float) -> None:
    if smaller_value > larger_value:
        raise PydanticCustomError(
            "job_config_relation",
            "{message}",
            {
                "message": f"{error_path}.{smaller}={smaller_value:g} exceeds {error_path}.{larger}={larger_value:g}",
                "field": smaller,
            },
        )


class NodesSection(_Section):
    min: Count1 = Field(1, description="nodes the rendezvous waits for before the job starts")
    max: Count1 | None = Field(None, description="most nodes that train at once; default: min")
    spares: Count0 = Field(
        0, description="hot spare nodes admitted beyond max: their workers start and wait as reserve ranks"
    )

    @property
    def max_nodes(self) -> int:
        """``max``, or ``min`` when unset."""
        return self.max if self.max is not None else self.min

    @model_validator(mode="after")
    def _min_at_most_max(self) -> NodesSection:
        if self.max is not None:
            _ordered("nodes", "min", self.min, "max", self.max)
        return self


class RespawnSection(_Section):
    per_rank: Count0 = Field(
        2,
        description="replacements in a row of a local rank's worker that died before it trained (a crash loop; "
        "0: never)",
    )
    per_job: Count0 = Field(256, description="replacements of dead workers in the whole job")
    rejoin: Annotated[
        Literal["next_fault", "at_once"],
        Field(
            description="next_fault: the new process waits in reserve for the next restart; "
            "at_once: its node asks for a restart to admit it as soon as it is ready"
        ),
        BeforeValidator(_choice_check(REJOIN_CHOICES, " or ".join(map(repr, REJOIN_CHOICES)))),
    ] = "at_once"


class ObservabilitySection(_Section):
    events_kept: EventsKept = Field(EVENTS_KEPT_DEFAULT, description=EVENTS_KEPT_HELP)
    progress_interval: Seconds = Field(
        5.0, description="seconds between two samples of a rank's optimizer steps (timeline)"
    )
    metrics_port: (
        Annotated[
            int,
            Field(
                ge=0,
                le=65535,
                description="port of each agent's Prometheus endpoint (0: any free port); unset: no endpoint",
            ),
            BeforeValidator(count_check(0, 65535)),
        ]
        | None
    ) = None


class RendezvousSection(_Section):
    """The etcdft ``--rdzv-conf`` keys a job config may set, of the same types (unset: ``--rdzv-conf``'s or the default)."""

    join_timeout: Seconds | None = Field(None, description=JOIN_TIMEOUT_HELP)
    last_call_timeout: SecondsOrZero | None = Field(None, description=LAST_CALL_TIMEOUT_HELP)
    lease_ttl: LeaseSeconds | None = Field(None, description=LEASE_TTL_HELP)

    def values(self) -> dict[str, float]:
        return {name: value for name, value in self.model_dump().items() if value is not None}


_WRAPPER_HELP = {
    "monitor_thread_interval": "how often the monitor thread polls a store that cannot watch",
    "monitor_process_interval": "how often the monitor process checks the rank's progress",
    "progress_watchdog_interval": "how often the automatic heartbeat is taken",
    "heartbeat_interval": "how often the monitor process heartbeats into the store",
    "heartbeat_timeout": "silence after which a rank is reported unresponsive",
    "soft_timeout": "no progress for this long restarts every rank (ceiling of the adaptive timeout)",
    "hard_timeout": "no progress for this long terminates the rank (ceiling of the adaptive timeout)",
    "barrier_timeout": "timeout of the Wrapper's barriers",
    "completion_timeout": "how long ranks that finished wait for the others",
    "last_call_wait": "how long to wait for concurrent faults before restarting",
    "termination_grace_time": "time between SIGTERM and SIGKILL at a hard timeout",
}
#: The Wrapper's restart limits (counts) a job config may set, with their help; 0 means no limit.
RESTART_LIMITS = {
    "max_identical_faults": "iterations in a row that may end on the same exception (type, line, step) with no "
    "progress in between before the job stops; default 3, 0: no limit",
    "max_restarts_without_progress": "iterations in a row that may end on a fault without progress (fewer than "
    "min_progress_steps steps) before the Wrapper gives up; default 10, 0: no limit",
}


def _wrapper_field(name: str) -> Any:
    return Field(None, description=f"{_WRAPPER_HELP[name]}; default {WRAPPER_DEFAULTS[name]:g} s")


class WrapperSection(_Section):
    """The elastic_ft.Wrapper durations, in seconds, and restart limits, by argument name."""

    monitor_thread_interval: Seconds | None = _wrapper_field("monitor_thread_interval")
    monitor_process_interval: Seconds | None = _wrapper_field("monitor_process_interval")
    progress_watchdog_interval: Seconds | None = _wrapper_field("progress_watchdog_interval")
    heartbeat_interval: Seconds | None = _wrapper_field("heartbeat_interval")
    heartbeat_timeout: Seconds | None = _wrapper_field("heartbeat_timeout")
    soft_timeout: Seconds | None = _wrapper_field("soft_timeout")
    hard_timeout: Seconds | None = _wrapper_field("hard_timeout")
    barrier_timeout: Seconds | None = _wrapper_field("barrier_timeout")
    completion_timeout: Seconds | None = _wrapper_field("completion_timeout")
    last_call_wait: SecondsOrZero | None = _wrapper_field("last_call_wait")
    termination_grace_time: SecondsOrZero | None = _wrapper_field("termination_grace_time")
    max_identical_faults: Count0 | None = Field(None, description=RESTART_LIMITS["max_identical_faults"])
    max_restarts_without_progress: Count0 | None = Field(
        None, description=RESTART_LIMITS["max_restarts_without_progress"]
    )
    min_progress_steps: Count1 | None = Field(
        None,
        description="training steps an iteration must make to count as progress for max_restarts_without_progress "
        "(ft_launcher's min_progress_iterations); default 1",
    )

    def durations(self) -> dict[str, float]:
        """The Wrapper durations the config sets, in seconds, by argument name."""
        return {name: value for name, value in self.model_dump(exclude_none=True).items() if name in WRAPPER_DEFAULTS}

    def limits(self) -> dict[str, int]:
        """The Wrapper restart limits the config sets (``max_identical_faults``, ...; 0: no limit)."""
        return {name: value for name, value in self.model_dump(exclude_none=True).items() if name in RESTART_LIMITS}


class LayerSection(_Section):
    min_ranks: Count1 = Field(1, description="a group with fewer healthy ranks than this is terminated as a whole")
    max_ranks: Count1 | None = Field(
        None, description="at most this many ranks of a group are active; no limit when absent"
    )
    key: Annotated[
        str,
        Field(pattern=r"^(job|host|env:.+)$", description="how a rank finds its group: job, host or env:NAME"),
        BeforeValidator(_key_check),
    ] = "job"
    flags: Annotated[
        list[Literal["RESERVE", "BACKFILL"]],
        Field(description="RESERVE: spares are searched in this group; BACKFILL: gaps are filled from it"),
        BeforeValidator(_flags_check),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "array", "items": {"enum": list(_LAYER_FLAGS)}},
                    {"enum": list(_LAYER_FLAGS)},
                ]
            }
        ),
    ] = []

    @model_validator(mode="after")
    def _min_at_most_max(self) -> LayerSection:
        if self.max_ranks is not None and self.min_ranks > self.max_ranks:
            raise PydanticCustomError(
                "job_config_relation",
                "{message}",
                {"message": f"min_ranks={self.min_ranks} exceeds max_ranks={self.max_ranks}", "field": "min_ranks"},
            )
        return self


class RankAssignmentSection(_Section):
    tree: Annotated[
        list[LayerSection],
        Field(description="the layers of a Tree, root first; the root's key is job"),
        BeforeValidator(lambda value: _as_list(value, "a list of layers, root first")),
    ] = []
    max_active_world_size: Count1 | None = Field(
        None, description="at most this many active ranks; the rest wait as reserve"
    )
    active_world_size_divisible_by: Count1 = Field(1, description="the active world size is kept a multiple of this")

    @model_validator(mode="after")
    def _root_is_the_job(self) -> RankAssignmentSection:
        if self.tree and self.tree[0].key != "job":
            raise PydanticCustomError(
                "job_config_relation",
                "{message}",
                {
                    "message": f"rank_assignment.tree[0].key={self.tree[0].key!r} is invalid; expected 'job' "
                    "(the root: one group for every rank)",
                    "field": "tree",
                },
            )
        return self


def _as_list(value: Any, expected: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(expected)
    return value


class JobConfig(_Section):
    """An elastic-ft job config (``elastic-ft config put FILE``); every field is optional.

    The validated config is this model itself: ``config.nodes.min``,
    ``config.wrapper.durations()``, ... (:func:`parse_job_config`,
    :func:`load_job_config` build it with every error at once).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="elastic-ft job config")

    nodes: NodesSection = NodesSection()
    nproc_per_node: Count1 = Field(1, description="workers per node")
    max_restarts: Count0 = Field(0, description="process-level restarts, as torchrun's --max-restarts")
    respawn: RespawnSection = RespawnSection()
    rendezvous: RendezvousSection = RendezvousSection()
    wrapper: WrapperSection = WrapperSection()
    observability: ObservabilitySection = ObservabilitySection()
    rank_assignment: RankAssignmentSection = RankAssignmentSection()

    def to_document(self) -> dict[str, Any]:
        """The config as the nested mapping users write (round-trips through :func:`parse_job_config`)."""
        return self.model_dump(mode="json")

    def to_json(self) -> bytes:
        return json.dumps(self.to_document(), sort_keys=True).encode()


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a job config document (draft 2020-12), for editors and CI checks.

    It checks every field on its own, as :func:`parse_job_config` does; the
    relations between fields (min above max, a tree larger than the job)
    are beyond a schema and are checked by ``elastic-ft config validate``.
    An empty value (YAML ``null``) means the default, as in the parser.
    """
    schema = JobConfig.model_json_schema()
    for definition in [schema, *schema.get("$defs", {}).values()]:
        for name, prop in definition.get("properties", {}).items():
            definition["properties"][name] = _nullable(prop)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://elastic-ft.invalid/job-config.schema.json"
    return schema


def _nullable(prop: dict[str, Any]) -> dict[str, Any]:
    options = prop.get("anyOf")
    if options is not None and any(option.get("type") == "null" for option in options):
        return prop
    notes: dict[str, Any] = {key: prop[key] for key in ("default", "description", "title") if key in prop}
    kept = {key: value for key, value in prop.items() if key not in notes}
    return {"anyOf": [kept, {"type": "null"}], **notes}


# ---- validation ----------------------------------------------------------------


def _issue_from(error: Any, document: Any) -> ConfigIssue:
    """One pydantic error as a :class:`ConfigIssue` whose message names the field, the value and what was expected."""
    path: Path = tuple(error["loc"])
    kind, context = error["type"], error.get("ctx") or {}
    issue = ConfigIssue(path, "")
    if kind == "extra_forbidden":
        parent = ConfigIssue(path[:-1], "").field
        allowed = ", ".join(_fields_at(path[:-1]))
        return ConfigIssue(path, f"{parent} has unknown field {path[-1]!r}; expected some of {allowed}")
    if kind == "job_config_relation":
        return ConfigIssue((*path, context["field"]), context["message"], kind=context.get("kind", "relation"))
    if kind == ERROR_TYPE:
        return ConfigIssue(path, f"{issue.field}={shown(error['input'])} is invalid; expected {context['expected']}")
    return ConfigIssue(path, f"{issue.field}={shown(error['input'])} is invalid; {error['msg']}")


def _fields_at(path: Path) -> list[str]:
    """The fields allowed in the mapping at ``path`` (for an unknown field's message)."""
    model: Any = JobConfig
    for part in path:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[part].annotation
        model = getattr(annotation, "__args__", (annotation,))[0] if part == "tree" else annotation
    return list(model.model_fields)


def _world_checks(document: JobConfig, valid: set[str]) -> Iterator[ConfigIssue]:
    """What the tree and filters ask of the world, against the node and process counts (valid sections only)."""
    if not {"nodes", "nproc_per_node", "rank_assignment"} <= valid:
        return
    nodes, nproc, policy = document.nodes, document.nproc_per_node, document.rank_assignment
    max_nodes = nodes.max if nodes.max is not None else nodes.min
    smallest, largest = nodes.min * nproc, (max_nodes + nodes.spares) * nproc
    sizes = (
        f"nodes.min={nodes.min} x nproc_per_node={nproc} = {smallest} ranks at the job's smallest, "
        f"(nodes.max={max_nodes} + nodes.spares={nodes.spares}) x {nproc} = {largest} at its largest"
    )
    for index, layer in enumerate(policy.tree):
        where: Path = ("rank_assignment", "tree", index, "min_ranks")
        if index == 0 and layer.min_ranks > smallest:
            yield ConfigIssue(
                where,
                f"rank_assignment.tree[0].min_ranks={layer.min_ranks} needs more ranks than the job has at its "
                f"smallest: {sizes}; the root would terminate every rank",
                kind="relation",
            )
        if layer.key == "host" and layer.min_ranks > nproc:
            yield ConfigIssue(
                where,
                f"rank_assignment.tree[{index}].min_ranks={layer.min_ranks} exceeds the ranks of one host "
                f"(nproc_per_node={nproc}); every host would be terminated",
                kind="relation",
            )
    divisor, limit = policy.active_world_size_divisible_by, policy.max_active_world_size
    where = ("rank_assignment", "active_world_size_divisible_by")
    if limit is not None and divisor > limit:
        yield ConfigIssue(
            where,
            f"rank_assignment.active_world_size_divisible_by={divisor} exceeds "
            f"rank_assignment.max_active_world_size={limit}: no active world size is possible",
            kind="relation",
        )
    elif divisor > smallest:
        yield ConfigIssue(
            where,
            f"rank_assignment.active_world_size_divisible_by={divisor} exceeds the ranks of the job at its "
            f"smallest ({sizes}): no rank would be active",
            kind="relation",
        )


def _wrapper_checks(wrapper: Mapping[str, float]) -> Iterator[ConfigIssue]:
    """The orderings the Wrapper requires, every violated one, with its defaults for what the config leaves out."""
    seconds = {**WRAPPER_DEFAULTS, **wrapper}

    def described(name: str) -> str:
        origin = "" if name in wrapper else " (the Wrapper's default)"
        return f"wrapper.{name}={seconds[name]:g}{origin}"

    for shorter, longer in WRAPPER_ORDER:
        if not seconds[shorter] < seconds[longer]:
            culprit = shorter if shorter in wrapper else longer
            yield ConfigIssue(
                ("wrapper", culprit), f"{described(shorter)} must be less than {described(longer)}", kind="relation"
            )


def _validate(document: Any) -> tuple[JobConfig | None, list[ConfigIssue]]:
    """Every section on its own, so that one bad section hides no error of another; then the cross checks."""
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        return None, [ConfigIssue((), f"(top level)={shown(document)} is invalid; expected a mapping")]
    issues: list[ConfigIssue] = []
    valid: dict[str, Any] = {}
    fields = JobConfig.model_fields
    for name, value in document.items():
        if name not in fields:
            issues.append(
                ConfigIssue((name,), f"(top level) has unknown field {name!r}; expected some of {', '.join(fields)}")
            )
            continue
        if value is None:
            continue
        try:
            JobConfig.model_validate({name: value})
        except ValidationError as error:
            issues.extend(_issue_from(e, document) for e in error.errors())
        else:
            valid[name] = value
    checked = JobConfig.model_validate(valid)
    issues.extend(_wrapper_checks(_valid_wrapper_fields(document.get("wrapper"))))
    issues.extend(_world_checks(checked, set(valid) | (set(fields) - set(document))))
    return checked, issues


def _valid_wrapper_fields(wrapper: Any) -> dict[str, float]:
    """The wrapper durations that are valid on their own, so their orderings are checked beside other errors."""
    if not isinstance(wrapper, Mapping):
        return {}
    valid = {}
    for name, value in wrapper.items():
        try:
            checked = WrapperSection.model_validate({name: value})
        except ValidationError:
            continue
        valid[name] = getattr(checked, name)
    return {name: value for name, value in valid.items() if value is not None and name in WRAPPER_DEFAULTS}


def _raise(issues: list[ConfigIssue], source: str | None) -> NoReturn:
    if len(issues) == 1:
        raise JobConfigError(f"job config {issues[0].describe(source)}", tuple(issues))
    listed = "\n".join(f"  {issue.describe(source)}" for issue in issues)
    raise JobConfigError(f"job config has {len(issues)} errors:\n{listed}", tuple(issues))


def parse_stored_job_config(raw: bytes | str, where: str) -> JobConfig:
    """A job config as ``to_json`` stored it (in etcd, in a worker's environment), read back at ``where``: the
    value is untrusted, so bad JSON is an error like any invalid field.

    Raises:
        JobConfigError: ``where`` holds no valid job config; every problem listed.
    """
    try:
        return parse_job_config(json_document(raw, "the value"))
    except (MalformedRecord, RecursionError, JobConfigError) as error:
        issues = error.issues if isinstance(error, JobConfigError) else ()
        raise JobConfigError(f"the job config stored at {where} is not valid: {str(error)[:500]}", issues) from None


def parse_job_config(
    document: Any, *, source: str | None = None, marks: Mapping[Path, tuple[int, int]] | None = None
) -> JobConfig:
    """Validate a parsed YAML/JSON document into a :class:`JobConfig`.

    Raises:
        JobConfigError: listing every error at once, each with its field
            path, and ``source:line:column`` when ``marks`` (from
            :func:`load_job_config`) place it in a file.
    """
    checked, issues = _validate(document)
    if issues or checked is None:
        if marks:
            issues = [_placed(issue, marks) for issue in issues]
        _raise(issues, source)
    return checked


def _placed(issue: ConfigIssue, marks: Mapping[Path, tuple[int, int]]) -> ConfigIssue:
    """The issue with the line and column of the deepest part of its path the file has."""
    for length in range(len(issue.path), -1, -1):
        mark = marks.get(issue.path[:length])
        if mark is not None:
            return dataclasses.replace(issue, line=mark[0], column=mark[1])
    return issue


#: Limits on a job config's YAML, far beyond any real config: its size, its nesting, and how many
#: nodes it holds once aliases are expanded (a 500-byte "billion laughs" document expands to 10^9).
MAX_YAML_BYTES = 256 * 1024
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 10_000


def _check_yaml_shape(node: yaml.Node, source: str) -> None:
    """Count ``node``'s tree as it would expand (each alias counts again), stopping at the limits."""
    budget = MAX_YAML_NODES
    stack: list[tuple[yaml.Node, int]] = [(node, 1)]
    while stack:
        current, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise JobConfigError(f"{source} expands to more than {MAX_YAML_NODES} YAML nodes (aliases included)")
        if depth > MAX_YAML_DEPTH:
            raise JobConfigError(f"{source} nests deeper than {MAX_YAML_DEPTH} levels")
        if isinstance(current, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in current.value)
        elif isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                stack.extend(((key, depth + 1), (value, depth + 1)))


def _marks(node: yaml.Node) -> dict[Path, tuple[int, int]]:
    """Where each value (and each mapping key) of a composed YAML document starts: path -> (line, column), from 1."""
    marks: dict[Path, tuple[int, int]] = {}
    stack: list[tuple[yaml.Node, Path]] = [(node, ())]
    while stack:
        current, path = stack.pop()
        marks.setdefault(path, (current.start_mark.line + 1, current.start_mark.column + 1))
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode):
                    child = (*path, key.value)
                    marks[child] = (key.start_mark.line + 1, key.start_mark.column + 1)
                    stack.append((value, child))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend((item, (*path, index)) for index, item in enumerate(current.value))
    return marks


def load_job_config(text: str, source: str | None = None) -> JobConfig:
    """Parse YAML (JSON is YAML too) within :data:`MAX_YAML_BYTES`, depth and node limits, and validate it.

    ``source`` (a file name) prefixes every error's ``line:column``.
    """
    name = source or "job config"
    if len(text.encode(errors="replace")) > MAX_YAML_BYTES:
        raise JobConfigError(f"{name} is larger than {MAX_YAML_BYTES} bytes")
    marks: dict[Path, tuple[int, int]] = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            document = None
        else:
            _check_yaml_shape(node, name)
            marks = _marks(node)
            document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobConfigError(f"{name} is not valid YAML: {str(exc)[:500]}") from None
    except RecursionError:
        raise JobConfigError(f"{name} nests deeper than {MAX_YAML_DEPTH} levels") from None
    return parse_job_config(document, source=source, marks=marks)


__all__ = [
    "ConfigIssue",
    "JobConfig",
    "JobConfigError",
    "LayerSection",
    "json_schema",
    "load_job_config",
    "parse_job_config",
]
