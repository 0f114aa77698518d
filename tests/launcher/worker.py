"""One worker of an ``ftrun`` test job; the scenario comes as JSON in ``EFT_SCENARIO``.

Trains a tiny all-reduce loop with gloo under ``elastic_ft.Wrapper`` with its
default store, which under ``ftrun`` is the etcd store of the rendezvous
round; the process group bootstraps from a prefix of that store too, so no
rank hosts anything. Writes ``$EFT_OUT/start-<node>-<local rank>-<restart>.json``
when it starts, ``$EFT_OUT/step-<initial rank>.json`` (its iteration) once
it trains, and ``$EFT_OUT/done-<initial rank>-<restart>.json`` with the
result, keyed by ``TORCHELASTIC_RESTART_COUNT``. A reserve rank never
activated, or a respawned process the job finished without, has a ``None``
result.

Faults (``faults``: list of ``{"rank", "kind", "restart", "iteration", "step"}``,
``rank`` the initial global rank): ``raise``, ``exit`` (``os._exit(17)``),
``sigkill``. A fault with ``"after_file": NAME`` fires at the first step from
``step`` on at which ``$EFT_OUT/NAME`` exists, so a test can time it by an
event rather than a step count. ``steps`` is each iteration's length;
``iteration_steps`` (``{"<iteration>": steps}``) overrides it for some.
``stop_file``: NAME ends the loop, at the same step on every rank (the
ranks agree on it in the step's all-reduce), once ``$EFT_OUT/NAME`` exists:
a test ends the job at an event, not a step count.
``exit_after_wrapper``: ``{"rank", "code"}``: that initial rank exits with
``code`` once its Wrapper completed (a failed epilogue).
``node_exit``: ``{"group_rank", "restart"}`` makes every worker of that node
exit with code 19 at step 2 of its first iteration.
``slow_start_group_rank``: the workers of that node sleep 60 s before entering
the Wrapper. ``respawn_blocks``: a respawned process blocks before the Wrapper
(as one waiting for a store its completed peers hosted would). ``no_wrapper``: run the loop without the Wrapper; ``retry``: keyword arguments
of a ``RetryController``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic_ft.inprocess.initialize import RetryController
from elastic_ft.inprocess.wrapper import CallWrapper, Wrapper
from elastic_ft.testing.workers import init_gloo

SCENARIO: dict[str, Any] = json.loads(os.environ["EFT_SCENARIO"])
OUT = os.environ["EFT_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
RESTART = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
NODE = os.environ["NODE_TAG"]
GROUP_RANK = int(os.environ["GROUP_RANK"])


def write(name: str, record: dict[str, Any]) -> None:
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as file:
        json.dump(record, file)
    os.replace(path + ".tmp", path)


def inject(iteration: int, step: int) -> None:
    node_exit = SCENARIO.get("node_exit")
    if node_exit and (node_exit["group_rank"], node_exit["restart"], iteration, step) == (GROUP_RANK, RESTART, 0, 2):
        os._exit(19)
    for fault in SCENARIO.get("faults", []):
        if (fault["rank"], fault.get("restart", 0), fault.get("iteration", 0)) != (INITIAL_RANK, RESTART, iteration):
            continue
        if "after_file" in fault:
            if step < fault.get("step", 2) or not os.path.exists(os.path.join(OUT, fault["after_file"])):
                continue
        elif step != fault.get("step", 2):
            continue
        if fault["kind"] == "raise":
            raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK}")
        if fault["kind"] == "exit":
            os._exit(17)
        if fault["kind"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)


def train(store: dist.Store | None, iteration: int) -> dict[str, Any]:
    rank, world_size = init_gloo(store, iteration, datetime.timedelta(seconds=30))
    try:
        value = torch.ones(2)
        steps = SCENARIO.get("iteration_steps", {}).get(str(iteration), SCENARIO.get("steps", 20))
        stop = os.path.join(OUT, SCENARIO["stop_file"]) if "stop_file" in SCENARIO else None
        for step in range(steps):
            inject(iteration, step)
            if step == 1:
                write(f"step-{INITIAL_RANK}.json", {"iteration": iteration, "world_size": world_size, "node": NODE})
            value = torch.tensor([1.0, float(stop is not None and os.path.exists(stop))])
            dist.all_reduce(value)
            if value[1] > 0:
                break
            time.sleep(SCENARIO.get("step_seconds", 0.05))
        return {"iteration": iteration, "rank": rank, "world_size": world_size, "value": value[0].item()}
    finally:
        dist.destroy_process_group()


def wrapped(call_wrapper: CallWrapper | None = None) -> dict[str, Any]:
    assert call_wrapper is not None
    # Whether a first torch.optim optimizer built here would still import torch._dynamo on this call's path
    # (this loop builds none: a rank that warmed up while it waited has it imported).
    warm = "torch._dynamo" in sys.modules
    result = train(call_wrapper.base_store, call_wrapper.iteration)
    return {**result, "store": type(call_wrapper.base_store).__name__, "dynamo_imported": warm}


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    write(f"start-{NODE}-{local_rank}-{RESTART}.json", {"pid": os.getpid(), "rank": INITIAL_RANK})
    if SCENARIO.get("slow_start_group_rank") == GROUP_RANK:
        time.sleep(60)  # set-up work before the Wrapper: the node may die meanwhile
    if SCENARIO.get("respawn_blocks") and INITIAL_RANK >= WORLD_SIZE:
        time.sleep(600)
    if SCENARIO.get("no_wrapper"):
        result = train(None, 0)
    else:
        seconds = {name: datetime.timedelta(seconds=value) for name, value in SCENARIO.get("wrapper", {}).items()}
        hooks: dict[str, Any] = {}
        if "retry" in SCENARIO:
            hooks["initialize"] = RetryController(**SCENARIO["retry"])
        result = Wrapper(
            **hooks,
            monitor_thread_interval=datetime.timedelta(seconds=0.05),
            last_call_wait=datetime.timedelta(seconds=0.05),
            heartbeat_interval=datetime.timedelta(seconds=0.5),
            heartbeat_timeout=datetime.timedelta(seconds=20),
            soft_timeout=datetime.timedelta(seconds=30),
            hard_timeout=datetime.timedelta(seconds=40),
            barrier_timeout=datetime.timedelta(seconds=60),
            completion_timeout=datetime.timedelta(seconds=60),
            **seconds,
        )(wrapped)()
    write(
        f"done-{INITIAL_RANK}-{RESTART}.json",
        {"pid": os.getpid(), "node": NODE, "initial_rank": INITIAL_RANK, "restart": RESTART, "result": result},
    )
    epilogue = SCENARIO.get("exit_after_wrapper", {})
    if epilogue.get("rank") == INITIAL_RANK and result is not None:
        os._exit(epilogue["code"])


if __name__ == "__main__":
    main()
