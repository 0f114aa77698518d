"""NVIDIA 0.6's abort additions: Flight Recorder traces per iteration, and persistent checkpoint processes ended."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_ft.inprocess.abort import AbortTorchDistributed, flight_recorder_on
from elastic_ft.runtime.net import free_port

FR_SCRIPT = """
import sys, threading
import torch, torch.distributed as dist
from elastic_ft.inprocess.abort import AbortTorchDistributed
from elastic_ft.inprocess.state import State

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
abort = AbortTorchDistributed()  # the path from NVRX_FR_TRACE_PATH
state = State(rank=0, world_size=1, iteration=4)
written = []
monitor = threading.Thread(target=lambda: written.append(abort.collect_fr_trace(state)))
monitor.start(); monitor.join()
assert abort.collect_fr_trace(state) is None  # once per iteration
abort(state)  # from the main thread: destroys the group
assert not dist.is_initialized()
print(written[0])
"""

DCP_SCRIPT = """
import sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint import _async_process_executor as executor
from elastic_ft.inprocess.abort import AbortPersistentCheckpointProcesses
from elastic_ft.inprocess.state import State


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
    state = {"w": torch.arange(4.0)}
    save = dict(async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    dcp.async_save(state, checkpoint_id=f"{out}/a", **save).result()
    first = executor._CHECKPOINT_PROCESS._save_process
    AbortPersistentCheckpointProcesses()(State(rank=0, world_size=1))
    assert executor._CHECKPOINT_PROCESS is None and not first.is_alive(), first
    dcp.async_save(state, checkpoint_id=f"{out}/b", **save).result()  # a fresh daemon
    second = executor._CHECKPOINT_PROCESS._save_process
    assert second.pid != first.pid and second.is_alive()
    AbortPersistentCheckpointProcesses()(State(rank=0, world_size=1))
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, checkpoint_id=f"{out}/b")
    assert torch.equal(loaded["w"], state["w"])
    dist.destroy_process_group()
    print("ok", first.pid, second.pid)


if __name__ == "__main__":  # the daemon is spawned: it imports this file again
    main()
"""


def test_a_buffer_size_that_is_not_an_integer_is_refused_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not flight_recorder_on({})
    assert flight_recorder_on({"TORCH_FR_BUFFER_SIZE": "2000"})
    assert flight_recorder_on({"TORCH_NCCL_TRACE_BUFFER_SIZE": "1"})
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "lots")
    with pytest.raises(ValueError, match="TORCH_FR_BUFFER_SIZE must be an integer .*got 'lots'"):
        AbortTorchDistributed(torch_fr_trace_path=tmp_path)
    AbortTorchDistributed()  # no trace path: the buffer size is not read


@pytest.mark.integration
def test_the_flight_recorder_trace_is_written_once_per_iteration(tmp_path: Path) -> None:
    script = tmp_path / "fr.py"
    script.write_text(FR_SCRIPT)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64", "NVRX_FR_TRACE_PATH": str(tmp_path / "traces")}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = Path(done.stdout.strip().splitlines()[-1])
    assert written == tmp_path / "traces" / "iter_4" / "_dump_0"
    trace = pickle.loads(written.read_bytes())
    assert [entry["profiling_name"] for entry in trace["entries"]] == ["gloo:all_reduce"]
    assert all("frames" not in entry or not entry["frames"] for entry in trace["entries"])  # no stack traces


@pytest.mark.integration
def test_dcp_async_save_process_is_ended_and_the_next_save_starts_a_fresh_one(tmp_path: Path) -> None:
    script = tmp_path / "dcp_abort.py"
    script.write_text(DCP_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("ok ")
