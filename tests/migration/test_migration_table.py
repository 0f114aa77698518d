"""docs/migration.md lists every public name of NVIDIA inprocess 0.4.1, and its "same" rows are true."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import warnings
from typing import Any

import pytest

from tests.migration import nvidia_api

DOC = pathlib.Path(__file__).parents[2] / "docs" / "migration.md"
STATUSES = {"same", "differs", "internal"}
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<status>\w+) \| (?P<notes>.*) \|$")


def table() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    body = text.split("<!-- nvidia-api-table:start -->", 1)[1].split("<!-- nvidia-api-table:end -->", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in body.strip().splitlines()[2:]:
        match = ROW.match(line)
        assert match, f"malformed row in docs/migration.md: {line!r}"
        assert match["name"] not in rows, f"{match['name']} listed twice"
        rows[match["name"]] = (match["status"], match["notes"].strip())
    return rows


def resolve(path: str) -> Any:
    """``elastic_ft.inprocess.<path>``, importing submodules on the way; None when absent."""
    obj: Any = importlib.import_module("elastic_ft.inprocess")
    for part in path.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        except (ImportError, AttributeError):
            return None
    return obj


def accepted_parameters(obj: Any) -> tuple[set[str], bool]:
    signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    names = {p.name for p in signature.parameters.values()}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    return names, takes_any


SNAPSHOT = nvidia_api.load()
ROWS = table()


def test_every_public_name_has_exactly_one_row() -> None:
    assert SNAPSHOT["version"] == "0.4.1"
    assert set(ROWS) == set(SNAPSHOT["names"]), (
        f"missing: {sorted(set(SNAPSHOT['names']) - set(ROWS))}, unknown: {sorted(set(ROWS) - set(SNAPSHOT['names']))}"
    )
    for name, (status, notes) in ROWS.items():
        assert status in STATUSES, f"{name}: status {status!r}"
        if status != "same":
            assert notes, f"{name} is {status}: the notes must say how"


@pytest.mark.parametrize("name", sorted(n for n, (status, _) in ROWS.items() if status == "same"))
def test_a_same_row_exists_with_every_argument_and_member(name: str) -> None:
    spec = SNAPSHOT["names"][name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ours = resolve(name)
    assert ours is not None, f"elastic_ft.inprocess.{name} does not exist"
    kind = spec["kind"]
    if kind == "module":
        assert inspect.ismodule(ours), name
        return
    assert inspect.isclass(ours) if kind == "class" else callable(ours), name
    names, takes_any = accepted_parameters(ours)
    missing = [p for p in spec.get("parameters", []) if p not in names and not takes_any]
    assert not missing, f"{name} does not take NVIDIA's argument(s) {missing}"
    absent = [m for m in spec.get("members", []) if not hasattr(ours, m)]
    assert not absent, f"{name} lacks NVIDIA's member(s) {absent}"


def test_an_internal_or_different_row_names_what_it_is_instead() -> None:
    for name, (status, notes) in ROWS.items():
        if status in ("differs", "internal") and SNAPSHOT["names"][name]["kind"] != "module":
            assert len(notes) > 20, f"{name}: say what replaces it"


def test_the_snapshot_is_the_installed_package() -> None:
    pytest.importorskip("nvidia_resiliency_ext.inprocess")
    live = nvidia_api.extract()
    if live["version"] != SNAPSHOT["version"]:
        pytest.skip(f"nvidia-resiliency-ext {live['version']} installed; the snapshot is of {SNAPSHOT['version']}")
    assert live == SNAPSHOT
