"""The warm-up of a waiting rank: once per process, never once a process group exists, never raising."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

from elastic_ft.inprocess.restart import warmup


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "_warmed", False)


def test_the_warm_up_runs_once_per_process() -> None:
    calls = []
    assert warmup.warm_up(lambda: calls.append(1), "a test") is True
    assert warmup.warm_up(lambda: calls.append(2), "a test") is False
    assert calls == [1]


def test_no_warm_up_runs_once_a_process_group_exists() -> None:
    """Importing torch._dynamo after a gloo group exists keeps the group alive: a process that has one skips."""
    calls = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert warmup.warm_up(lambda: calls.append(1), "a test") is False
    finally:
        dist.destroy_process_group()
    assert calls == [] and warmup.warm_up(lambda: calls.append(1), "a test") is False  # and never later


def test_a_warm_up_that_raises_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise OSError("no such dataset")

    assert warmup.warm_up(broken, "a test") is False
    assert "the warm-up raised" in caplog.text and "no such dataset" in caplog.text
    assert warmup.warm_up(None, "a test") is False


@pytest.mark.integration  # starts a process
def test_the_default_warm_up_imports_what_a_first_optimizer_would() -> None:
    """In a fresh interpreter, the default warm-up leaves a first AdamW nothing to import: torch._dynamo
    and every module it brings are loaded already, and no process group was made."""
    code = (
        "import sys, torch\n"
        "from elastic_ft.inprocess.restart.warmup import import_lazy_modules, warm_up\n"
        "from elastic_ft.runtime.torch_compat import registered_groups\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "assert warm_up(import_lazy_modules, 'a test')\n"
        "before = set(sys.modules)\n"
        "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])\n"
        "import torch.distributed.checkpoint\n"
        "print(sorted(set(sys.modules) - before), 'torch._dynamo' in sys.modules, registered_groups())\n"
        # A DataLoader's first worker process: multiprocessing's modules were imported too.
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "next(iter(DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2, num_workers=1)))\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('multiprocessing')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True", "[]", "[]"], result.stdout
