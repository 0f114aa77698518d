"""A sharded training script, torchtitan style, made fault tolerant with ``elastic_ft.Wrapper``.

FSDP2 (``fully_shard`` per block and on the root) on an HSDP mesh
(``replicate`` x ``shard``), ``torch.optim.AdamW``, a ``DataLoader``, and a
``torch.distributed.checkpoint`` (DCP) checkpoint. Run it under ``ftrun``::

    ftrun --nproc-per-node=4 examples/train_fsdp.py --workdir /tmp/run --shard-size 2

``--shard-size 2`` on 4 ranks is HSDP 2 x 2; ``--shard-size 0`` is FSDP
alone (one shard group of every rank).

The Wrapper's rank assignment is ``ShardedReplicas(shard_size)``: a lost
rank takes its replica group out of the active world (2 x 2 becomes
1 x 2), and no survivor reshards or reads the checkpoint. The group's
survivor waits in reserve; when a process comes back (respawned by
``ftrun``, or a hot spare), the group is whole again and the new rank
receives exactly its own shard from the other replica's rank holding it.
Each call of :func:`train` is one *iteration*: it builds the mesh the
Wrapper gives it (``call_wrapper.mesh``), the model sharded on it and the
optimizer, and fills them from this rank's :class:`ShardState` (the local
shards, kept across iterations and healed by the Wrapper) when
``call_wrapper.holds_state``, else from the checkpoint. FSDP alone has no
replica to heal from: a lost rank shrinks the mesh, the shard layout
changes, and every rank reloads the checkpoint (DCP reshards it).

The global batch is the same at every world size (each rank takes its part
of the step's samples), so a run that lost a replica for some steps ends
with the model a fault-free run ends with, up to the order of the gradient
reduction (the test allows 1e-6 relative).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Sampler, TensorDataset

from elastic_ft import CallWrapper, Wrapper
from elastic_ft.inprocess.rank_assignment import ShardedReplicas


class Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(hidden) for _ in range(depth))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_model(args: argparse.Namespace, mesh: Any) -> Net:
    """The model, the same initial weights on every rank, sharded on ``mesh`` (FSDP2 per block, then the root)."""
    torch.manual_seed(0)
    model = Net(args.hidden, args.depth)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ShardState:
    """This rank's shard of the training state, kept across iterations: what the Wrapper heals.

    It refers to the live model's and optimizer's local shards while an
    iteration trains, and holds what healing delivered in between. The
    Wrapper sends exactly a rank's own shard (``ShardedReplicas``), so the
    tensors fit the receiver's model as they are.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def capture(self, model: Net, optimizer: torch.optim.Optimizer) -> None:
        tensors = {f"param/{name}": _local(p) for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"optim/{name}/{key}"] = _local(value)
        self.tensors = tensors

    def restore(self, model: Net, optimizer: torch.optim.Optimizer) -> None:
        """Copy the kept shards into a model and optimizer built for the same shard."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                _local(p).copy_(self.tensors[f"param/{name}"])
                state: dict[str, torch.Tensor] = {}
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    saved = self.tensors.get(f"optim/{name}/{key}")
                    if saved is None:
                        continue
                    if key == "step":
                        state[key] = saved.clone()
                    else:
                        state[key] = torch.zeros_like(p)
                        _local(state[key]).copy_(saved)
                if state:
                    optimizer.state[p] = state

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors}  # the step travels with it: the Wrapper's count, call_wrapper.step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = {name: tensor.clone() for name, tensor in state["tensors"].items()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StepSampler(Sampler[list[int]]):
    """This rank's part of each step's global batch, from step ``start`` on: the same samples per step at every
    world size."""

    def __init__(self, size: int, global_batch: int, rank: int, world_size: int, start: int, stop: int) -> None:
        self.size, self.global_batch, self.rank, self.world_size = size, global_batch, rank, world_size
        self.start, self.stop = start, stop

    def __iter__(self) -> Iterator[list[int]]:
        part = self.global_batch // self.world_size
        for step in range(self.start, self.stop):
            first = step * self.global_batch + self.rank * part
            yield [(first + i) % self.size for i in range(part)]

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


def dataset(args: argparse.Namespace) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(512, args.hidden, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def latest_checkpoint(workdir: Path) -> tuple[int, Path] | None:
    pointer = workdir / "latest.json"
    if not pointer.exists():
        return None
    step = int(json.loads(pointer.read_text())["step"])
    return step, workdir / f"checkpoint-{step}"


def save_checkpoint(workdir: Path, model: Net, optimizer: torch.optim.Optimizer, step: int) -> None:
    """DCP, every rank its shards; then rank 0 points ``latest.json`` at it (a reader sees a whole checkpoint)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=workdir / f"checkpoint-{step}")
    if dist.get_rank() == 0:
        temporary = workdir / "latest.json.tmp"
        temporary.write_text(json.dumps({"step": step}))
        temporary.replace(workdir / "latest.json")


def load_checkpoint(path: Path, model: Net, optimizer: torch.optim.Optimizer) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


#: This process's initial rank (``RANK`` at its start; a respawned process has a new one).
INITIAL_RANK = int(os.environ.get("RANK", "0"))


def save_full_model(path: Path, model: Net, rank: int) -> None:
    """The whole model, gathered from its shards, written by rank 0 (to compare runs)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, path)


def stop_step(args: argparse.Namespace) -> int:
    """``--steps``, or the step ``--stop-file`` names once it exists (a test ends the run when it has seen what
    it waits for; it names a step far enough ahead for every rank to read it first)."""
    if args.stop_file is not None and args.stop_file.exists():
        return min(args.steps, int(args.stop_file.read_text()))
    return args.steps


def record(args: argparse.Namespace, event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, "rank": INITIAL_RANK, "t": time.time(), **fields})
    with (args.workdir / f"events-{INITIAL_RANK}.jsonl").open("a") as f:
        f.write(line + "\n")


def inject(args: argparse.Namespace, first: bool, step: int) -> None:
    """The one fault of ``--fault`` on ``--fault-rank`` at ``--fault-step`` of the ``first`` iteration of the first
    process."""
    if args.fault is None or not first or step != args.fault_step:
        return
    if args.fault == "node_lost":
        # Every rank ends the step before first. Starting this step proves only that this rank's own gradient
        # reduction ended: its node's other rank may still be in its reduction with the other replica, and losing
        # the node then leaves the survivors a step apart (lose_node). After the barrier it falls between steps.
        dist.barrier()
    if args.fault_rank != INITIAL_RANK:
        return
    record(args, "fault", kind=args.fault, step=step)
    if args.fault == "exception":
        raise RuntimeError(f"injected fault at step {step}")
    if args.fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "node_lost":
        lose_node()
    if args.fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if args.fault == "hang_gil_held":
        ctypes.PyDLL(None).sleep(3600)  # a C call that never releases the GIL
    time.sleep(3600)  # hang_gil_released: its peers wait for it in the next collective


def train(args: argparse.Namespace, shards: ShardState, call_wrapper: CallWrapper | None = None) -> dict[str, Any]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if call_wrapper is not None:
        iteration, holds_state, place = call_wrapper.iteration, call_wrapper.holds_state, call_wrapper.mesh
        if place is None:
            raise RuntimeError("train_fsdp.py runs under Wrapper(rank_assignment=ShardedReplicas(...))")
        shape, shard = place.shape, place.shard
        dist.init_process_group("gloo", store=call_wrapper.process_group_store(), rank=rank, world_size=world_size)
    else:  # --no-wrapper, under torchrun: a fault restarts every process, which resume from the checkpoint
        iteration, holds_state = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), False
        size = args.shard_size or world_size
        shape, shard = (world_size // size, size), (rank % size, size)
        dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model = sharded_model(args, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        # Inside the optimizer step, which the Wrapper makes atomic: the kept shards always match its step count.
        optimizer.register_step_post_hook(lambda *_: shards.capture(model, optimizer))
        if holds_state and call_wrapper is not None and shards.tensors:
            shards.restore(model, optimizer)  # its own shard: kept in memory, or healed from a peer
            start = call_wrapper.step
        elif (found := latest_checkpoint(args.workdir)) is not None:
            load_checkpoint(found[1], model, optimizer)
            start = found[0]
            record(args, "checkpoint_read", iteration=iteration, step=start)
        else:
            start = 0
        if call_wrapper is not None:
            call_wrapper.step = start  # the training step, which healing compares
        record(
            args,
            "start",
            iteration=iteration,
            step=start,
            mesh=list(shape),
            shard=shard,
            pid=os.getpid(),
            healed=holds_state,
        )
        sampler = StepSampler(512, args.global_batch, rank, world_size, start, args.steps)
        loader = DataLoader(dataset(args), batch_sampler=sampler)
        step = start
        for inputs, targets in loader:
            if step >= stop_step(args):
                break
            inject(args, iteration == 0, step)
            if args.step_wait:  # an accelerator's share of the step: this CPU idles
                time.sleep(args.step_wait)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            record(args, "step", iteration=iteration, step=step, world=world_size)
            if step % args.checkpoint_every == 0 and step < args.steps:
                with call_wrapper.long_section() if call_wrapper is not None else contextlib.nullcontext():
                    save_checkpoint(args.workdir, model, optimizer, step)
            if args.save_full_every and step % args.save_full_every == 0:
                save_full_model(args.workdir / f"full-{step}.pt", model, rank)
        save_full_model(args.workdir / "final.pt", model, rank)
        return {"step": step, "iteration": iteration, "world_size": world_size}
    finally:
        dist.destroy_process_group()


def lose_node() -> None:
    """SIGKILL this rank's launcher and every process below it, this one last: the whole node is lost between two
    steps (``inject`` has every rank end the step before first). A node lost at another point may die between the
    gradient reductions of two of its ranks: the other replica's ranks then end the step at different steps, and
    the job rightly reloads the checkpoint (docs/inprocess.md, Sharded models)."""
    from elastic_ft.testing.local_cluster import descendants  # the /proc walk the tests kill nodes with

    launcher = os.getppid()
    for pid in [launcher, *descendants(launcher)]:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoints, events and the final model")
    parser.add_argument("--shard-size", type=int, default=2, help="ranks per replica group; 0: FSDP alone")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--step-wait", type=float, default=0.0, help="seconds each step idles (simulated compute)")
    parser.add_argument("--no-wrapper", action="store_true", help="no Wrapper: under torchrun (for comparisons)")
    parser.add_argument("--stop-file", type=Path, help="the step to stop at, once this file exists (tests)")
    parser.add_argument("--save-full-every", type=int, default=0, help="write full-<step>.pt every N steps (tests)")
    parser.add_argument(
        "--fault", choices=("exception", "sigkill", "node_lost", "sigstop", "hang_gil_held", "hang_gil_released")
    )
    parser.add_argument("--fault-rank", type=int, default=3)
    parser.add_argument("--fault-step", type=int, default=20)
    return parser.parse_args(argv)


def main() -> None:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    shards = ShardState()
    record(args, "ready")  # the process is up: what a respawned process's admission is timed from
    if args.no_wrapper:
        record(args, "done", **train(args, shards))
        return
    wrapper = Wrapper(
        rank_assignment=ShardedReplicas(args.shard_size or None),
        state_dict=shards.state_dict,
        load_state_dict=shards.load_state_dict,
    )
    result = wrapper(train)(args, shards)
    if result is not None:
        record(args, "done", **result)


if __name__ == "__main__":
    main()
