"""A small data-parallel training job for torchrun (gloo, CPU).

Used by the demo, the end-to-end tests and the benchmarks.  It resumes from
its checkpoint after a restart, so a job that loses a node finishes with the
nodes it has left.  The checkpoint is written to a temporary file and renamed
into place, so a fault never leaves a half-written one.

Each worker writes ``<out>/pid-<NODE_TAG>-<LOCAL_RANK>`` at start (so tests can
kill it) and ``<out>/done-<RANK>.json`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step (simulated work)")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoint and result files go here")
    parser.add_argument(
        "--until-world-size",
        type=int,
        default=0,
        help="train past --steps while the world is smaller than this (a test whose late node must find the job)",
    )
    return parser.parse_args()


def save_checkpoint(path: Path, model: torch.nn.Module, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("NODE_TAG", "node")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    (args.workdir / f"pid-{tag}-{local_rank}").write_text(str(os.getpid()))

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    checkpoint = args.workdir / "checkpoint.pt"
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    for param in model.parameters():
        dist.broadcast(param.data, src=0)

    loss = torch.tensor(0.0)
    step = start
    while step < args.steps or world_size < args.until_world_size:
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param -= 0.01 * param.grad / world_size
        if rank == 0 and step % args.checkpoint_every == 0:
            save_checkpoint(checkpoint, model, step)
        time.sleep(args.step_time)
        step += 1

    result = {
        "rank": rank,
        "world_size": world_size,
        "group_rank": int(os.environ.get("GROUP_RANK", "0")),
        "node": tag,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "resumed_from": start,
        "loss": float(loss),
        "finished_at": time.time(),
    }
    (args.workdir / f"done-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
