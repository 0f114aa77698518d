"""torch's internals stay behind elastic_ft.runtime.torch_compat, which knows the torch versions they were tested on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

from elastic_ft.runtime import torch_compat
from elastic_ft.runtime.torch_compat import TESTED, UnsupportedTorchError, check_torch, parse_version, version_verdict

PACKAGE = Path(torch_compat.__file__).resolve().parents[1]  # the whole elastic_ft package
#: torch internals (private members) only torch_compat may name.
INTERNALS = re.compile(
    r"distributed_c10d\._world|\._remaining_restarts|\._pcontext\b|\._exit_barrier_timeout|"
    r"subprocess_handlers\[[^]]*\]\s*=|\._get_backend\(|setattr\([^,]+, .LocalElasticAgent."
)


@pytest.mark.parametrize(
    ("text", "version"),
    [("2.13.0", (2, 13)), ("2.15.0+cu130", (2, 15)), ("2.16.0a0+git1234", (2, 16)), ("10.1", (10, 1))],
)
def test_versions_are_read_as_major_and_minor(text: str, version: tuple[int, int]) -> None:
    assert parse_version(text) == version


def test_a_version_that_is_no_version_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedTorchError, match=r"torch.__version__='nightly' is not a version"):
        parse_version("nightly")


def test_the_tested_range_passes_and_the_rest_fails_unless_opted_in() -> None:
    oldest, newest = TESTED
    assert version_verdict(oldest, opted_in=False) is None and version_verdict(newest, opted_in=False) is None
    too_new = (newest[0], newest[1] + 1)
    error = version_verdict(too_new, opted_in=False)
    assert error is not None and f"torch {too_new[0]}.{too_new[1]} is outside" in error
    assert "ELASTIC_FT_UNTESTED_TORCH=1" in error and f"{oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}" in error
    warning = version_verdict((2, 4), opted_in=True)
    assert warning is not None and "ELASTIC_FT_UNTESTED_TORCH is set" in warning


def test_the_installed_torch_is_a_tested_one() -> None:
    """CI runs on the versions TESTED names: a torch outside them means the range or CI is stale."""
    oldest, newest = TESTED
    assert oldest <= parse_version(torch.__version__) <= newest
    check_torch()


def test_an_internal_torch_removed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(SimpleElasticAgent, "_exit_barrier")
    with pytest.raises(
        UnsupportedTorchError, match=r"lacks what elastic-ft relies on: SimpleElasticAgent\._exit_barrier"
    ):
        check_torch.__wrapped__()


def test_an_untested_torch_fails_unless_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.delenv(torch_compat.UNTESTED_OPT_IN, raising=False)
    with pytest.raises(UnsupportedTorchError, match="torch 2.99 is outside"):
        check_torch.__wrapped__()
    monkeypatch.setenv(torch_compat.UNTESTED_OPT_IN, "1")
    with pytest.warns(UserWarning, match="torch 2.99 is outside"):
        check_torch.__wrapped__()


def test_no_module_but_torch_compat_reaches_torch_internals() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "torch_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if INTERNALS.search(line)
    ]
    assert offenders == []
