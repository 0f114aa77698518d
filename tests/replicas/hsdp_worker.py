"""A replica group of 2 ranks sharding its model with FSDP2 (HSDP: shards within the group, replicas across).

Run by ``tests/replicas/test_ftrun_replica_groups.py`` under ``ftrun --replica-groups --nproc-per-node=2``:
within a group, FSDP2 reduce-scatters the gradients; across groups, rank r of every group averages its own
shard with the Manager. ``state_dict()`` returns the model's DTensors: a group that comes back receives each
rank's shard from the same rank of a live group, checked against the shard the rank holds.
``EFT_EXAMPLE`` as for ``examples/torchft_ddp.py`` (``steps``, ``step_sleep``, ``out``), and ``fault``:
``{"replica", "rank", "step"}``, a SIGKILL on that rank's first run, at that step or the first one after it that
every group takes part in (its step is written to ``<out>.fault.json``). ``stop_file``: a file that, once it exists,
holds the step every group stops at (a test ends the job at an event, not at a step count).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_ft.torchft import Manager, Optimizer, ProcessGroupGloo

SETTINGS = json.loads(os.environ.get("EFT_EXAMPLE", "{}"))
REPLICA = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ["NUM_REPLICA_GROUPS"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7 + REPLICA)  # groups start apart: the Manager's first quorum makes them one
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict() -> dict:
        return model.state_dict()  # DTensors: the Manager checks a healed shard against this rank's own

    def load_state_dict(state: dict) -> None:
        with torch.no_grad():
            for name, mine in model.state_dict().items():
                mine.to_local().copy_(state[name])  # a DTensor arrives as its local shard

    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"hsdp_{REPLICA}",
    )
    optimizer = Optimizer(manager, optimizer)
    torch.manual_seed(100 + rank)  # each rank of a group its own batches, the same in every group
    inputs, labels = torch.randn(64, 16), torch.randn(64, 1)
    commits = []
    fault = SETTINGS.get("fault")
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while manager.current_step() < last_step():
        started = time.monotonic()
        optimizer.zero_grad()
        step = manager.current_step()
        if (
            fault
            and first_run
            and (fault["replica"], fault["rank"]) == (REPLICA, rank)
            and step >= fault["step"]
            and manager.num_participants() == GROUPS
        ):
            with open(f"{SETTINGS['out']}.fault.json", "w") as out:
                json.dump({"at": time.time(), "step": step}, out)
            os.kill(os.getpid(), signal.SIGKILL)
        nn.functional.mse_loss(model(inputs), labels).backward()
        with torch.no_grad():
            for parameter in model.parameters():
                manager.allreduce(parameter.grad.to_local())  # type: ignore[union-attr]
        optimizer.step()
        commits.append((manager.current_step(), time.time(), manager.num_participants()))
        time.sleep(max(0.0, SETTINGS.get("step_sleep", 0.0) - (time.monotonic() - started)))
    shard = [p.to_local().flatten().tolist() for p in model.parameters()]  # type: ignore[attr-defined]
    with open(f"{SETTINGS['out']}.{REPLICA}.{os.getpid()}.json", "w") as out:
        json.dump({"pid": os.getpid(), "rank": rank, "commits": commits, "weights": shard}, out)
    manager.shutdown()
    dist.destroy_process_group()


def last_step() -> int:
    """``steps``, or the step the stop file names once it exists."""
    stop = SETTINGS.get("stop_file")
    if stop and os.path.exists(stop):
        with open(stop) as file:
            return int(file.read())
    return SETTINGS.get("steps", 100)


if __name__ == "__main__":
    main()
