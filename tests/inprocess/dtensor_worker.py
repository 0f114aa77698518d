"""HSDP with the Wrapper's default rank assignment, healing a ``state_dict()`` of DTensors (run under ``ftrun``).

Each iteration builds the mesh its world allows (2 x 2 on 4 ranks, 1 x 3 on 3), an FSDP2 model on it and an
SGD optimizer, and fills the model from the DTensors this rank kept (its own shard, held or healed), from the
checkpoint, or from the seed. ``state_dict()`` returns the live model's DTensors: the Wrapper keys healing by
their mesh and placements. ``EFT_DTENSOR`` (JSON): ``workdir``, ``steps``, ``fault`` (``lag``: rank 3 raises
after its backward, before its optimizer step, so it restarts one step behind the others; ``sigkill``: rank 3's
process dies) at ``fault_step``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elastic_ft import CallWrapper, Wrapper

SETTINGS = json.loads(os.environ["EFT_DTENSOR"])
WORKDIR = Path(SETTINGS["workdir"])
INITIAL_RANK = int(os.environ["RANK"])


def record(event: str, **fields: Any) -> None:
    with (WORKDIR / f"events-{INITIAL_RANK}.jsonl").open("a") as out:
        out.write(json.dumps({"event": event, "rank": INITIAL_RANK, "t": time.time(), **fields}) + "\n")


class Kept:
    """The model's state across iterations: the live model's DTensors, or the local shards healing delivered."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            if isinstance(tensor, DTensor):
                raise TypeError(f"{name}: a healed DTensor arrives as its local shard")
        self.state = {name: tensor.clone() for name, tensor in state.items()}


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train(kept: Kept, call_wrapper: CallWrapper) -> dict[str, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=call_wrapper.process_group_store(), rank=rank, world_size=world)
    try:
        shape = (world // 2, 2) if world % 2 == 0 else (1, world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        source = "seed"
        if call_wrapper.holds_state and kept.state:
            with torch.no_grad():
                for name, tensor in model.state_dict().items():
                    local(tensor).copy_(local(kept.state[name]))
            source = "kept"
        elif (WORKDIR / "checkpoint.json").exists():
            saved = json.loads((WORKDIR / "checkpoint.json").read_text())["step"]
            state = model.state_dict()
            dcp.load(state, checkpoint_id=WORKDIR / f"checkpoint-{saved}")
            model.load_state_dict(state)
            call_wrapper.step = saved
            source = "checkpoint"
        elif call_wrapper.step:
            raise RuntimeError(f"rank {rank} at step {call_wrapper.step} holds no state and there is no checkpoint")
        kept.state = model.state_dict()
        record("start", iteration=call_wrapper.iteration, step=call_wrapper.step, mesh=list(shape), source=source)
        while call_wrapper.step < SETTINGS["steps"]:
            step = call_wrapper.step
            generator = torch.Generator().manual_seed(step)
            inputs, labels = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
            nn.functional.mse_loss(model(inputs), labels).backward()
            first_try = call_wrapper.iteration == 0 and INITIAL_RANK == 3 and step == SETTINGS["fault_step"]
            if first_try and SETTINGS["fault"] == "lag":
                time.sleep(0.5)  # the others take their optimizer step and wait in the next one's all-gather
                raise RuntimeError("rank 3 fails before its optimizer step")
            if first_try and SETTINGS["fault"] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()  # the Wrapper counts it: call_wrapper.step is step + 1 after it
            optimizer.zero_grad()
            if call_wrapper.step % 5 == 0:
                with call_wrapper.long_section():
                    dcp.save(model.state_dict(), checkpoint_id=WORKDIR / f"checkpoint-{call_wrapper.step}")
                    dist.barrier()
                    if rank == 0:
                        (WORKDIR / "checkpoint.json.tmp").write_text(json.dumps({"step": call_wrapper.step}))
                        (WORKDIR / "checkpoint.json.tmp").replace(WORKDIR / "checkpoint.json")
            time.sleep(0.05)
        shard = [local(tensor).flatten().tolist() for tensor in model.state_dict().values()]
        record(
            "done", step=call_wrapper.step, world=world, mesh=list(shape), coordinate=mesh.get_coordinate(), shard=shard
        )
        return {"step": call_wrapper.step}
    finally:
        dist.destroy_process_group()


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    kept = Kept()
    Wrapper(state_dict=kept.state_dict, load_state_dict=kept.load_state_dict)(train)(kept)


if __name__ == "__main__":
    main()
