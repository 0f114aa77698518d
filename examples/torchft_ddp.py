"""A TorchFT training script on elastic-ft's replica groups: TorchFT's imports changed, no Lighthouse.

One replica group per launcher, as with TorchFT (each group's launcher
restarts its own processes; the other groups keep training)::

    etcd &   # or any etcd cluster
    export ELASTIC_FT_ETCD_ENDPOINTS=127.0.0.1:2379 ELASTIC_FT_RUN_ID=my-job
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node=1 --max-restarts=10 \\
        examples/torchft_ddp.py &
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node=1 --max-restarts=10 \\
        examples/torchft_ddp.py

``EFT_EXAMPLE`` (JSON, for tests and benchmarks) may set ``steps``, ``step_sleep`` (seconds a step takes at
least), ``fault`` (``{"replica": 1, "step": 20, "kind": "raise" | "sigkill" | "sigkill_group" | "sigkill_in_vote" |
"cut"}``, on its first run only, at that step or the first one after it that every replica group takes part in, so
that a group still starting on a loaded host does not miss it; ``sigkill_group`` kills the process's whole group,
its lease sentinel with it, so that its records stay until their lease expires, as after an OOM kill of the
group; ``cut`` shuts the group's cross-replica connections down mid-step, as a network fault would, and the
process trains on) and
``out`` (a file for each run's record: its commits and final weights).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_ft.torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo

SETTINGS = json.loads(os.environ.get("EFT_EXAMPLE", "{}"))
REPLICA_GROUP_ID = int(os.environ.get("REPLICA_GROUP_ID", "0"))
NUM_REPLICA_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))


BATCH_SIZE = 32
LEARNING_RATE = 1e-3


def make_model() -> nn.Module:
    """A smooth model (Tanh, not ReLU): the tests replay the committed steps and expect the same weights within
    1e-6, and the all-reduce sums the groups' gradients in an order of its own; a ReLU's kink can turn that
    rounding (1e-7) into another step (1e-5 by the end, in 2 of 30 perturbed replays)."""
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))


def make_dataset() -> TensorDataset:
    """The same samples in every replica group (a linear target with noise)."""
    torch.manual_seed(0)
    features = torch.randn(4096, 32)
    return TensorDataset(features, features @ torch.randn(32, 1) + 0.1 * torch.randn(4096, 1))


def main() -> None:
    dataset = make_dataset()
    sampler = DistributedSampler(
        dataset, replica_rank=REPLICA_GROUP_ID, num_replica_groups=NUM_REPLICA_GROUPS, group_rank=0, num_replicas=1
    )
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(1 + REPLICA_GROUP_ID)  # replicas initialize differently; the Manager syncs them
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"train_ddp_{REPLICA_GROUP_ID}",
        timeout=timedelta(seconds=10),
    )
    if SETTINGS.get("fault", {}).get("kind") == "sigkill_in_vote":
        fail_in_vote(manager)
    model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optimizer)
    record = Record(manager)
    steps = SETTINGS.get("steps", 200)
    while manager.current_step() < steps:
        for inputs, labels in loader:
            started = time.monotonic()
            optimizer.zero_grad()  # joins (and heals into) a new quorum when there is one
            record.before_step(manager, model)
            maybe_fail(manager, pg=pg)
            loss = nn.functional.mse_loss(model(inputs), labels)
            loss.backward()
            optimizer.step()
            record.step(manager, loss.item())
            time.sleep(max(0.0, SETTINGS.get("step_sleep", 0.0) - (time.monotonic() - started)))
            if manager.current_step() >= steps:
                break
    record.finish(manager, model)
    manager.shutdown()


#: The injected fault strikes once per process (a ``cut`` process lives on, and retries the step).
_STRUCK: list[int] = []


def maybe_fail(manager: Manager, where: str = "step", pg: ProcessGroupGloo | None = None) -> None:
    fault, step = SETTINGS.get("fault"), manager.current_step()
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not _STRUCK
    in_vote = fault and fault["kind"] == "sigkill_in_vote"
    if (
        fault
        and first_run
        and fault["replica"] == REPLICA_GROUP_ID
        and step >= fault["step"]
        and manager.num_participants() == NUM_REPLICA_GROUPS
        and in_vote == (where == "vote")
    ):
        _STRUCK.append(step)
        if SETTINGS.get("out"):
            with open(f"{SETTINGS['out']}.fault.json", "w") as out:
                json.dump({"at": time.time(), "step": step}, out)
        if fault["kind"] in ("sigkill", "sigkill_in_vote"):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault["kind"] == "sigkill_group":  # the launcher started this process in a session of its own
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if fault["kind"] == "cut" and pg is not None:
            pg.abort()  # this step's all-reduce fails on every group; nobody commits it, nobody restarts
            return
        raise RuntimeError(f"injected fault at step {step}")


def fail_in_vote(manager: Manager) -> None:
    """The fault strikes after this group's gradients were averaged, as the commit vote begins."""
    vote = manager.should_commit

    def dying_vote(*args: object, **kwargs: object) -> bool:
        maybe_fail(manager, where="vote")
        return vote(*args, **kwargs)

    manager.should_commit = dying_vote  # type: ignore[method-assign]


class Record:
    """What a test or benchmark reads back. At the end: each step's outcome (the step count after it, wall time,
    quorum size) and the final weights. As it goes (so that a killed process leaves it too), one JSON line per
    step in ``<out>.<replica>.<pid>.steps.jsonl``: the weights the process started from, then each step's count
    before and after it, its quorum size and the process's batch number; a test replays the committed steps."""

    def __init__(self, manager: Manager) -> None:
        self.commits: list[tuple[int, float, int]] = []
        self.path = SETTINGS.get("out")
        self.pid = os.getpid()
        self.ready = time.time()  # built, about to take its first step
        self.attempts = 0
        self.before = 0
        self.log = None if self.path is None else f"{self.path}.{REPLICA_GROUP_ID}.{self.pid}.steps.jsonl"

    def before_step(self, manager: Manager, model: nn.Module) -> None:
        self.before = manager.current_step()
        if self.log is not None and self.attempts == 0:
            self._write({"start": [p.detach().flatten().tolist() for p in model.parameters()]})

    def step(self, manager: Manager, loss: float) -> None:
        after, participants = manager.current_step(), manager.num_participants()
        self.commits.append((after, time.time(), participants))
        if self.log is not None:
            self._write({"before": self.before, "after": after, "participants": participants, "batch": self.attempts})
        self.attempts += 1

    def _write(self, entry: dict) -> None:
        if self.log is not None:
            with open(self.log, "a") as log:
                log.write(json.dumps(entry) + "\n")

    def finish(self, manager: Manager, model: nn.Module) -> None:
        if self.path is None:
            print(f"replica {REPLICA_GROUP_ID}: {manager.current_step()} steps committed")
            return
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
        with open(f"{self.path}.{REPLICA_GROUP_ID}.{self.pid}.json", "w") as out:
            json.dump({"pid": self.pid, "ready": self.ready, "commits": self.commits, "weights": weights}, out)


if __name__ == "__main__":
    main()
