"""Training under ``ftrun`` with in-process restart: a small MLP, gloo, ``elastic_ft.Wrapper``.

Run by ``ftrun --nproc-per-node=N examples/train_ftrun.py --workdir DIR``.
The Wrapper uses its default store, which under ``ftrun`` is the etcd store
of the rendezvous round; the process group bootstraps from a prefix of the
same store, so no rank hosts anything and any worker may die. With
``--kill-rank R --kill-step S`` the worker of initial rank R SIGKILLs itself
at step S: the others go on without it, in the same processes.

Each rank that finishes writes ``DIR/done-<initial rank>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ft import CallWrapper, Wrapper


def train(args: argparse.Namespace, call_wrapper: CallWrapper | None = None) -> dict:
    assert call_wrapper is not None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(f"pg/{call_wrapper.iteration}", call_wrapper.base_store)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30)
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        generator = torch.Generator().manual_seed(rank)
        loss = torch.zeros(())
        for step in range(args.steps):
            if call_wrapper.state.initial_rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            inputs = torch.randn(16, 32, generator=generator)
            loss = (model(inputs) - inputs.sum(dim=1, keepdim=True)).square().mean()
            model.zero_grad()
            loss.backward()
            # One collective per step, and a plain SGD update rather than torch.optim: the
            # first torch.optim step imports torch._dynamo, after which (torch 2.13) freeing
            # a gloo group no longer closes its connections, so a peer blocked in a
            # collective waits for the gloo timeout (docs/inprocess.md, known limitations).
            grads = [parameter.grad for parameter in model.parameters()]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / world_size, grads)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 0.05 * parameter.grad
            time.sleep(args.step_time)
        return {"rank": rank, "world_size": world_size, "iteration": call_wrapper.iteration, "loss": loss.item()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()
    initial_rank = int(os.environ["RANK"])
    result = Wrapper(
        monitor_thread_interval=datetime.timedelta(seconds=0.1), last_call_wait=datetime.timedelta(seconds=0.1)
    )(train)(args)
    record = {
        **result,
        "initial_rank": initial_rank,
        "pid": os.getpid(),
        "node": os.environ.get("NODE_TAG", "?"),
        "process_restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    }
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / f"done-{initial_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(path.with_suffix(".tmp"), path)


if __name__ == "__main__":
    main()
