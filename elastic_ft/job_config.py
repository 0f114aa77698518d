"""The job configuration kept in etcd: schema and validation.

A job config is a YAML (or JSON) mapping; ``configs/job.yaml`` shows every
field. It is checked whole before anything is written: an error names the
field, the value and what was expected. It is stored as JSON under
``/<etcd_prefix>/<run_id>/config``.

Sections (all optional; omitted fields keep their defaults):

``nodes``            ``min``, ``max`` (node counts) and ``spares`` (hot
                     spare nodes admitted beyond ``max``: their workers
                     start and wait as reserve ranks)
``nproc_per_node``   workers per node
``max_restarts``     process-level restarts, as torchrun's ``--max-restarts``
``respawn``          ``per_rank`` and ``per_job``: how many times a worker
                     that died inside the Wrapper is replaced by a new
                     process that joins the running world (0: never);
                     ``rejoin``: ``next_fault`` (the new process waits in
                     reserve for the next restart) or ``at_once`` (its node
                     asks for an in-process restart to admit it as soon as
                     it is ready, restoring the world size)
``rendezvous``       ``join_timeout``, ``last_call_timeout``, ``lease_ttl``
                     (the etcdft ``--rdzv-conf`` keys of the same names)
``wrapper``          the in-process restart timeouts, in seconds, by the
                     ``elastic_ft.Wrapper`` argument names
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

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from elastic_ft.timeouts import MAY_BE_ZERO, WRAPPER_DEFAULTS, SecondsError, check_seconds, first_misordered

_LAYER_FLAGS = ("RESERVE", "BACKFILL")
#: When a respawned worker joins the running world: at the next restart, or through one asked for at once.
REJOIN_CHOICES = ("next_fault", "at_once")


class JobConfigError(ValueError):
    """The job config is malformed; nothing was written."""


@dataclass(frozen=True)
class LayerConfig:
    min_ranks: int = 1
    max_ranks: int | None = None
    key: str = "job"
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobConfig:
    min_nodes: int = 1
    max_nodes: int = 1
    spare_nodes: int = 0
    nproc_per_node: int = 1
    max_restarts: int = 0
    respawns_per_rank: int = 2
    respawns_per_job: int = 16
    respawn_rejoin: str = "next_fault"
    rendezvous: Mapping[str, float] = field(default_factory=dict)
    wrapper: Mapping[str, float] = field(default_factory=dict)
    tree: tuple[LayerConfig, ...] = ()
    max_active_world_size: int | None = None
    active_world_size_divisible_by: int = 1

    def to_json(self) -> bytes:
        return json.dumps(self.to_document(), sort_keys=True).encode()

    def to_document(self) -> dict[str, Any]:
        """The config as the nested mapping users write (round-trips through :func:`parse_job_config`)."""
        return {
            "nodes": {"min": self.min_nodes, "max": self.max_nodes, "spares": self.spare_nodes},
            "nproc_per_node": self.nproc_per_node,
            "max_restarts": self.max_restarts,
            "respawn": {
                "per_rank": self.respawns_per_rank,
                "per_job": self.respawns_per_job,
                "rejoin": self.respawn_rejoin,
            },
            "rendezvous": dict(self.rendezvous),
            "wrapper": dict(self.wrapper),
            "rank_assignment": {
                "tree": [dict(asdict(layer), flags=list(layer.flags)) for layer in self.tree],
                "max_active_world_size": self.max_active_world_size,
                "active_world_size_divisible_by": self.active_world_size_divisible_by,
            },
        }


# ---- validation ----------------------------------------------------------------


def _fail(path: str, value: Any, expected: str) -> JobConfigError:
    shown = repr(value)
    if len(shown) > 200:  # the value may be huge (a long list, or an integer of thousands of digits)
        shown = shown[:200] + f"... ({len(shown)} characters)"
    return JobConfigError(f"job config field {path}={shown} is invalid; expected {expected}")


def _mapping(value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(path, value, "a mapping")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise JobConfigError(
            f"job config {path} has unknown field(s) {', '.join(map(repr, unknown))}; expected some of "
            + ", ".join(allowed)
        )
    return dict(value)


#: The largest count any field may hold (nodes, processes, ranks, restarts): far beyond any job.
MAX_COUNT = 1_000_000


def _integer(value: Any, path: str, *, minimum: int, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise _fail(path, value, f"an integer from {minimum} to {MAX_COUNT}")
    return value


def _count(value: Any, path: str, *, minimum: int, default: int) -> int:
    """:func:`_integer` for a field that always has a value."""
    checked = _integer(value, path, minimum=minimum, default=default)
    return default if checked is None else checked


def _seconds(value: Any, path: str, *, may_be_zero: bool) -> float:
    if isinstance(value, str):  # YAML gives numbers as numbers; quoted text is a mistake
        raise _fail(path, value, "a number of seconds")
    try:
        return check_seconds(value, may_be_zero=may_be_zero)
    except SecondsError as error:
        raise JobConfigError(f"job config field {path}={value!r} is invalid; {error.expected}") from None


def _check_wrapper_relations(wrapper: Mapping[str, float]) -> None:
    """The orderings the Wrapper requires, with its defaults for what the config leaves out."""
    seconds = {**WRAPPER_DEFAULTS, **wrapper}
    misordered = first_misordered(seconds)
    if misordered is not None:
        shorter, longer = misordered

        def shown(name: str) -> str:
            origin = "" if name in wrapper else " (the Wrapper's default)"
            return f"wrapper.{name}={seconds[name]:g}{origin}"

        raise JobConfigError(f"job config {shown(shorter)} must be less than {shown(longer)}")


def _layer(value: Any, path: str) -> LayerConfig:
    data = _mapping(value, path, ("min_ranks", "max_ranks", "key", "flags"))
    min_ranks = _count(data.get("min_ranks"), f"{path}.min_ranks", minimum=1, default=1)
    max_ranks = _integer(data.get("max_ranks"), f"{path}.max_ranks", minimum=1, default=None)
    if max_ranks is not None and min_ranks > max_ranks:
        raise JobConfigError(f"job config {path}.min_ranks={min_ranks} exceeds {path}.max_ranks={max_ranks}")
    key = data.get("key", "job")
    if not isinstance(key, str) or not (key in ("job", "host") or (key.startswith("env:") and len(key) > 4)):
        raise _fail(f"{path}.key", key, "'job', 'host' or 'env:NAME'")
    flags = data.get("flags") or []
    if isinstance(flags, str):
        flags = [flags]
    if not isinstance(flags, list) or any(f not in _LAYER_FLAGS for f in flags):
        raise _fail(f"{path}.flags", data.get("flags"), f"a list of {', '.join(_LAYER_FLAGS)}")
    return LayerConfig(min_ranks, max_ranks, key, tuple(flags))


def parse_job_config(document: Any) -> JobConfig:
    """Validate a parsed YAML/JSON document into a :class:`JobConfig`."""
    top = _mapping(
        document,
        "(top level)",
        ("nodes", "nproc_per_node", "max_restarts", "respawn", "rendezvous", "wrapper", "rank_assignment"),
    )
    respawn = _mapping(top.get("respawn"), "respawn", ("per_rank", "per_job", "rejoin"))
    rejoin = respawn.get("rejoin", "next_fault")
    if rejoin not in REJOIN_CHOICES:
        raise _fail("respawn.rejoin", rejoin, " or ".join(map(repr, REJOIN_CHOICES)))
    nodes = _mapping(top.get("nodes"), "nodes", ("min", "max", "spares"))
    min_nodes = _count(nodes.get("min"), "nodes.min", minimum=1, default=1)
    max_nodes = _count(nodes.get("max"), "nodes.max", minimum=1, default=min_nodes)
    if min_nodes > max_nodes:
        raise JobConfigError(f"job config nodes.min={min_nodes} exceeds nodes.max={max_nodes}")
    rendezvous = _mapping(top.get("rendezvous"), "rendezvous", ("join_timeout", "last_call_timeout", "lease_ttl"))
    checked_rdzv = {}
    for key, value in rendezvous.items():
        checked_rdzv[key] = _seconds(value, f"rendezvous.{key}", may_be_zero=key == "last_call_timeout")
    if "lease_ttl" in checked_rdzv and not float(checked_rdzv["lease_ttl"]).is_integer():
        raise _fail("rendezvous.lease_ttl", rendezvous["lease_ttl"], "whole seconds (etcd leases)")
    wrapper = _mapping(top.get("wrapper"), "wrapper", tuple(WRAPPER_DEFAULTS))
    checked_wrapper = {k: _seconds(v, f"wrapper.{k}", may_be_zero=k in MAY_BE_ZERO) for k, v in wrapper.items()}
    _check_wrapper_relations(checked_wrapper)
    policy = _mapping(
        top.get("rank_assignment"),
        "rank_assignment",
        ("tree", "max_active_world_size", "active_world_size_divisible_by"),
    )
    tree_value = policy.get("tree") or []
    if not isinstance(tree_value, list):
        raise _fail("rank_assignment.tree", tree_value, "a list of layers, root first")
    tree = tuple(_layer(layer, f"rank_assignment.tree[{i}]") for i, layer in enumerate(tree_value))
    if tree and tree[0].key != "job":
        raise _fail("rank_assignment.tree[0].key", tree[0].key, "'job' (the root: one group for every rank)")
    divisor = _count(
        policy.get("active_world_size_divisible_by"), "rank_assignment.active_world_size_divisible_by",
        minimum=1, default=1,
    )  # fmt: skip
    return JobConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        spare_nodes=_count(nodes.get("spares"), "nodes.spares", minimum=0, default=0),
        nproc_per_node=_count(top.get("nproc_per_node"), "nproc_per_node", minimum=1, default=1),
        max_restarts=_count(top.get("max_restarts"), "max_restarts", minimum=0, default=0),
        respawns_per_rank=_count(respawn.get("per_rank"), "respawn.per_rank", minimum=0, default=2),
        respawns_per_job=_count(respawn.get("per_job"), "respawn.per_job", minimum=0, default=16),
        respawn_rejoin=rejoin,
        rendezvous=checked_rdzv,
        wrapper=checked_wrapper,
        tree=tree,
        max_active_world_size=_integer(
            policy.get("max_active_world_size"), "rank_assignment.max_active_world_size", minimum=1, default=None
        ),
        active_world_size_divisible_by=divisor,
    )


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


def load_job_config(text: str, source: str = "job config") -> JobConfig:
    """Parse YAML (JSON is YAML too) within :data:`MAX_YAML_BYTES`, depth and node limits, and validate it."""
    if len(text.encode(errors="replace")) > MAX_YAML_BYTES:
        raise JobConfigError(f"{source} is larger than {MAX_YAML_BYTES} bytes")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            document = None
        else:
            _check_yaml_shape(node, source)
            document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobConfigError(f"{source} is not valid YAML: {str(exc)[:500]}") from None
    except RecursionError:
        raise JobConfigError(f"{source} nests deeper than {MAX_YAML_DEPTH} levels") from None
    return parse_job_config(document)
