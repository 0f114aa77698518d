"""The job config reports every error at once, with its place; relations are checked; the JSON Schema agrees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from elastic_ft.job_config import JobConfigError, json_schema, load_job_config, parse_job_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

MANY_MISTAKES = """\
nodes:
  min: 0
  max: lots
nproc_per_node: 2
respawn: {rejoin: later, per_node: 1}
wrapper:
  soft_timeout: 100
  bogus: 1
rendezvous: {lease_ttl: 1.5}
rank_assignment:
  tree:
    - {key: job, flags: [SPARE]}
    - {key: rack}
"""


def test_every_error_is_reported_at_once_with_its_line_and_field() -> None:
    with pytest.raises(JobConfigError) as caught:
        load_job_config(MANY_MISTAKES, source="job.yaml")
    found = {(issue.field, issue.line, issue.kind) for issue in caught.value.issues}
    assert found == {
        ("nodes.min", 2, "field"),
        ("nodes.max", 3, "field"),
        ("respawn.rejoin", 5, "field"),
        ("respawn.per_node", 5, "field"),
        ("wrapper.bogus", 8, "field"),
        ("wrapper.soft_timeout", 7, "relation"),
        ("rendezvous.lease_ttl", 9, "field"),
        ("rank_assignment.tree[0].flags", 12, "field"),
        ("rank_assignment.tree[1].key", 13, "field"),
    }
    text = str(caught.value)
    assert text.startswith("job config has 9 errors:\n")
    assert "  job.yaml:2:3: nodes.min=0 is invalid; expected an integer from 1 to 1000000" in text
    assert (
        "job.yaml:7:3: wrapper.soft_timeout=100 must be less than wrapper.hard_timeout=90 (the Wrapper's default)"
        in text
    )
    assert "rank_assignment.tree[1].key='rack' is invalid; expected 'job', 'host' or 'env:NAME'" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # The issue's examples: each field is fine, together they cannot work.
        (
            "nodes: {min: 4, max: 4}\nnproc_per_node: 2\nrank_assignment: {tree: [{key: job, min_ranks: 64}]}",
            r"tree\[0\].min_ranks=64 needs more ranks than the job has at its smallest: nodes.min=4 x nproc_per_node=2",
        ),
        (
            "rank_assignment: {active_world_size_divisible_by: 3, max_active_world_size: 2}",
            "active_world_size_divisible_by=3 exceeds rank_assignment.max_active_world_size=2: no active world size",
        ),
        (
            "nodes: {min: 1, max: 8}\nnproc_per_node: 8\nrank_assignment: {active_world_size_divisible_by: 16}",
            "active_world_size_divisible_by=16 exceeds the ranks of the job at its smallest",
        ),
        (
            "nproc_per_node: 4\nrank_assignment: {tree: [{key: job}, {key: host, min_ranks: 8}]}",
            r"tree\[1\].min_ranks=8 exceeds the ranks of one host \(nproc_per_node=4\)",
        ),
    ],
)
def test_relations_between_fields_are_checked_against_the_node_and_process_counts(text: str, message: str) -> None:
    with pytest.raises(JobConfigError, match=message) as caught:
        load_job_config(text)
    assert [issue.kind for issue in caught.value.issues] == ["relation"]


def test_relations_with_an_invalid_section_are_not_guessed() -> None:
    # nodes.min is wrong: the tree cannot be checked against it, and no made-up relation error appears.
    with pytest.raises(JobConfigError) as caught:
        load_job_config("nodes: {min: 0}\nrank_assignment: {tree: [{key: job, min_ranks: 64}]}")
    assert [issue.field for issue in caught.value.issues] == ["nodes.min"]


def test_an_untrusted_document_from_etcd_gets_paths_without_lines() -> None:
    with pytest.raises(JobConfigError, match=r"^job config nodes.spares=-1 is invalid"):
        parse_job_config(json.loads('{"nodes": {"spares": -1}}'))


@pytest.mark.parametrize("name", ["job.yaml", "single-host.yaml"])
def test_the_shipped_configs_follow_the_schema(name: str) -> None:
    jsonschema.validate(yaml.safe_load((CONFIGS / name).read_text()), json_schema())


@pytest.mark.integration
def test_schema_command_prints_the_schema(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_ft.launcher.cli", "config", "schema"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    schema = json.loads(done.stdout)
    assert schema == json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    out = tmp_path / "schema.json"
    written = subprocess.run(
        [sys.executable, "-m", "elastic_ft.launcher.cli", "config", "schema", "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert written.returncode == 0 and json.loads(out.read_text()) == schema


# Values a user might write for any field: right and wrong ones.
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from([0.5, 1.5, 2.0, 90.0, 1e300, float("inf")]),
    st.sampled_from(["job", "host", "env:RACK", "rack", "RESERVE", "BACKFILL", "next_fault", "at_once", "x", "3"]),
    st.lists(st.sampled_from(["RESERVE", "BACKFILL", "SPARE"]), max_size=2),
)
LAYER = st.dictionaries(st.sampled_from(["min_ranks", "max_ranks", "key", "flags", "other"]), VALUES, max_size=3)
SECTIONS = {
    "nodes": st.dictionaries(st.sampled_from(["min", "max", "spares", "size"]), VALUES, max_size=3),
    "nproc_per_node": VALUES,
    "max_restarts": VALUES,
    "respawn": st.dictionaries(st.sampled_from(["per_rank", "per_job", "rejoin"]), VALUES, max_size=3),
    "rendezvous": st.dictionaries(
        st.sampled_from(["join_timeout", "last_call_timeout", "lease_ttl"]), VALUES, max_size=2
    ),
    "wrapper": st.dictionaries(
        st.sampled_from(["soft_timeout", "hard_timeout", "last_call_wait", "x"]), VALUES, max_size=2
    ),
    "observability": st.dictionaries(
        st.sampled_from(["events_kept", "progress_interval", "metrics_port", "x"]),
        st.one_of(VALUES, st.sampled_from([100_000, 100_001, 65535, 65536])),
        max_size=2,
    ),
    "rank_assignment": st.fixed_dictionaries(
        {}, optional={"tree": st.one_of(st.lists(LAYER, max_size=3), VALUES), "max_active_world_size": VALUES}
    ),
    "unknown": VALUES,
}
DOCUMENTS = st.fixed_dictionaries({}, optional=SECTIONS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS)
def test_schema_accepts_exactly_what_the_parser_accepts_field_by_field(document: dict[str, Any]) -> None:
    try:
        parse_job_config(document)
        field_errors = []
    except JobConfigError as error:
        field_errors = [issue for issue in error.issues if issue.kind == "field"]
    schema_errors = list(jsonschema.Draft202012Validator(json_schema()).iter_errors(document))
    assert bool(field_errors) == bool(schema_errors), (document, field_errors, [e.message for e in schema_errors])


def test_observability_fields_are_checked() -> None:
    with pytest.raises(JobConfigError) as caught:
        load_job_config(
            "observability:\n  events_kept: 0\n  progress_interval: -1\n  metrics_port: 70000\n", source="job.yaml"
        )
    text = str(caught.value)
    assert "job.yaml:2:3: observability.events_kept=0 is invalid; expected an integer from 1 to 100000" in text
    assert "job.yaml:3:3: observability.progress_interval=-1 is invalid" in text
    assert "job.yaml:4:3: observability.metrics_port=70000 is invalid; expected an integer from 0 to 65535" in text
    config = load_job_config("observability: {events_kept: 100, progress_interval: 0.5, metrics_port: 0}\n")
    observability = config.observability
    assert (observability.events_kept, observability.progress_interval, observability.metrics_port) == (100, 0.5, 0)
    assert parse_job_config(config.to_document()) == config


def test_the_wrapper_section_has_a_field_for_every_wrapper_duration_and_limit() -> None:
    from elastic_ft.job_config import RESTART_LIMITS, WrapperSection
    from elastic_ft.timeouts import MAY_BE_ZERO, WRAPPER_DEFAULTS

    assert list(WrapperSection.model_fields) == [*WRAPPER_DEFAULTS, *RESTART_LIMITS, "min_progress_steps"]
    assert WrapperSection.model_validate({"min_progress_steps": 5}).min_progress_steps == 5
    with pytest.raises(ValidationError):
        WrapperSection.model_validate({"min_progress_steps": 0})  # progress needs at least one step
    for name in MAY_BE_ZERO:
        assert WrapperSection.model_validate({name: 0}).model_dump()[name] == 0
    for name in set(WRAPPER_DEFAULTS) - set(MAY_BE_ZERO):
        with pytest.raises(ValidationError):
            WrapperSection.model_validate({name: 0})
