"""``--step-wait`` (the reference script and the benchmarks that pass it on) and the benchmarks' other arguments:
a bad value is refused up front."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _reference_script() -> object:
    spec = importlib.util.spec_from_file_location("train_ftrun", ROOT / "examples" / "train_ftrun.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", ["-0.05", "nan"])
def test_the_reference_script_refuses_a_negative_or_nan_step_wait(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _reference_script()
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(["--workdir", str(workdir), "--step-wait", value])  # type: ignore[attr-defined]
    assert exit_.value.code == 2
    assert f"--step-wait must be a number of seconds >= 0, got {float(value)}" in capsys.readouterr().err
    assert script.parse_args(["--workdir", str(workdir), "--step-wait", "0.05"]).step_wait == 0.05  # type: ignore[attr-defined]
    assert not workdir.exists()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("script", "arguments", "message"),
    [
        ("soak.py", ["--step-wait", "-1"], "--step-wait must be a number of seconds >= 0, got -1.0"),
        ("network_faults.py", ["--step-wait", "-1"], "--step-wait must be a number of seconds >= 0, got -1.0"),
        (
            "network_faults.py",
            ["--one-job", "--scenarios", "cut,arrival"],
            "with --one-job, arrival must come first: it starts the job without host 2",
        ),
    ],
)
def test_the_benchmarks_refuse_bad_arguments_before_starting_anything(
    script: str, arguments: list[str], message: str
) -> None:
    before = set(Path(tempfile.gettempdir()).glob("eft-bench-*"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *arguments, "--out", "/nonexistent/x.json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert set(Path(tempfile.gettempdir()).glob("eft-bench-*")) == before  # no job directory made
