"""A training script a user would write, made fault tolerant with ``elastic_ft.Wrapper``.

DDP, ``torch.optim.AdamW``, a ``DataLoader`` with ``DistributedSampler``, and
an atomic checkpoint. Run it under ``ftrun``::

    ftrun --nproc-per-node=4 examples/train_ftrun.py --workdir /tmp/run

The Wrapper calls :func:`train` again, in the same processes, after any
fault on any rank (an exception, a dead process, a hang). Each call is one
*iteration* and must rebuild whatever depends on the ranks still there:

* the process group: a new one per iteration, bootstrapped from the
  Wrapper's store (``call_wrapper.base_store``, the round's etcd store under
  ``ftrun``: no rank hosts it);
* DDP around the model;
* the sampler (``num_replicas`` and ``rank`` come from ``WORLD_SIZE`` and
  ``RANK``, which the Wrapper sets for each iteration) and the per-rank batch
  size: the *global* batch stays the same, so the learning rate stays valid
  when the world shrinks.

The training state (:class:`TrainingState`: model, optimizer, position in
the data) lives outside :func:`train` and survives iterations. The Wrapper
gets its ``state_dict`` and ``load_state_dict``, so a rank that comes back
behind the others (a hot spare activated, a respawned process, a rank whose
last optimizer step was cut) takes the state from a live peer before
:func:`train` is called: no checkpoint is read after a fault and no step is
redone. The checkpoint serves process restarts (read by the first
iteration only).
``--reload-checkpoint`` keeps the older path: every iteration reloads the
last checkpoint (and redoes the steps since), as without healing.

``--no-wrapper`` runs the same loop without the Wrapper (under plain
``torchrun``, for comparisons). ``--fault`` injects one fault, for the demo,
the tests and the benchmarks (see :func:`inject`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_ft import CallWrapper, Wrapper

#: Process groups the script keeps a reference to (``--hold-group``): a restart must not depend on them being freed.
HELD_GROUPS: list[Any] = []


def build_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


def dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(size, 32, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    return TensorDataset(inputs, targets)


class TrainingState:
    """Model, optimizer and position (step, epoch, batch in the epoch): what every replica holds alike.

    The position moves in an optimizer step post hook, so it moves with the
    parameters: under the Wrapper an optimizer step and its hooks are never
    cut by a restart, so a rank's state is never half a step.
    """

    def __init__(self, hidden: int, samples: int, lazy_optimizer: bool = False) -> None:
        self.model = build_model(hidden)
        self._optimizer: torch.optim.Optimizer | None = None
        self.data = dataset(samples)
        self.position = {"step": 0, "epoch": 0, "batch": 0}
        self._next: dict[str, int] | None = None
        if not lazy_optimizer:
            self.optimizer  # noqa: B018 (built now, before the Wrapper)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Built on first use: before the Wrapper by default, else (``--lazy-optimizer``) inside the wrapped
        function or a heal, as in a script that builds its optimizer in the function."""
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            self._optimizer.register_step_post_hook(self._commit_position)
        return self._optimizer

    def advance(self, epoch: int, batch: int) -> None:
        """The position the next optimizer step reaches (committed by the step itself)."""
        self._next = {"step": self.position["step"] + 1, "epoch": epoch, "batch": batch}

    def _commit_position(self, *_: object) -> None:
        if self._next is not None:
            self.position, self._next = self._next, None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.position = dict(state["position"])

    def load_checkpoint(self, path: Path) -> bool:
        if not path.exists():
            return False
        self.load_state_dict(torch.load(path, weights_only=True))
        return True

    def digest(self) -> str:
        """A hash of every tensor of the state, bit for bit (the tests compare ranks with it)."""
        hasher = hashlib.sha256()
        state = self.state_dict()
        tensors = [*state["model"].values()]
        for param_state in state["optimizer"]["state"].values():
            tensors += [value for value in param_state.values() if isinstance(value, torch.Tensor)]
        for tensor in tensors:
            hasher.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return hasher.hexdigest()[:16]

    def save_checkpoint(self, path: Path) -> None:
        """Write to a temporary file, then rename: a reader sees the old checkpoint or the new one, never half."""
        temporary = path.with_suffix(".tmp")
        torch.save(self.state_dict(), temporary)
        os.replace(temporary, path)


_PROCESS_STORE: list[dist.Store] = []


def process_group_store(call_wrapper: CallWrapper | None, iteration: int) -> dist.Store | None:
    """Where this iteration's process group meets: the Wrapper's store for it (a fresh one per iteration).

    Without a Wrapper, torchrun's ``env://`` rendezvous (``None``). Under a
    Wrapper without a store of its own to share (NVIDIA's), a TCPStore on
    ``MASTER_PORT`` made once per process, hosted by initial rank 0.
    """
    if call_wrapper is None:
        return None
    if hasattr(call_wrapper, "process_group_store"):
        return call_wrapper.process_group_store()
    base = getattr(call_wrapper, "base_store", None)
    if base is None:
        if not _PROCESS_STORE:
            host = int(os.environ["ELASTIC_FT_INITIAL_RANK"]) == 0
            _PROCESS_STORE.append(
                dist.TCPStore(
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, host, wait_for_workers=False
                )
            )
        base = _PROCESS_STORE[0]
    return dist.PrefixStore(f"pg/{iteration}", base)


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that starts ``skip`` indices into its epoch (the batches done before a checkpoint).

    Skipping indices, not loaded batches, keeps a resume from reading and
    collating data that is thrown away.
    """

    def __init__(self, *args: Any, skip: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip)


def train(args: argparse.Namespace, state: TrainingState, call_wrapper: CallWrapper | None = None) -> dict:
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    if iteration > 0:
        record(args, "enter", iteration=iteration)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = process_group_store(call_wrapper, iteration)
    if store is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        if args.hold_group:
            HELD_GROUPS.append(dist.group.WORLD)
        # The first iteration resumes from disk (a process restart); later ones from memory, healed
        # from a peer where behind, unless --reload-checkpoint.
        if (args.reload_checkpoint or iteration == 0) and state.load_checkpoint(args.workdir / "checkpoint.pt"):
            record(args, "checkpoint_read", iteration=iteration, step=state.position["step"])
        model, optimizer, position = state.model, state.optimizer, dict(state.position)
        ddp = DistributedDataParallel(model)
        data = state.data
        local_batch = args.global_batch // world_size
        sampler = ResumableSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=local_batch, sampler=sampler, num_workers=args.workers)
        record(
            args,
            "start",
            iteration=iteration,
            world_size=world_size,
            resumed_at=position["step"],
            digest=state.digest() if args.record_digests else None,
        )
        step, epoch, batch = position["step"], position["epoch"], position["batch"]
        loss = torch.zeros(())
        first_step_done = time.perf_counter()
        first_step_cpu = (time.thread_time(), time.process_time())
        while step < stop_step(args):
            sampler.set_epoch(epoch)
            sampler.skip = batch * local_batch  # the batches of this epoch done before the checkpoint
            for index, (inputs, targets) in enumerate(loader, start=batch):
                inject(args, call_wrapper, step)
                if args.step_wait:  # an accelerator's share of the step, ahead of its collective: this CPU idles
                    time.sleep(args.step_wait)
                loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                state.advance(epoch, index + 1)
                optimizer.step()
                step, batch = step + 1, index + 1
                if args.record_steps:
                    record(args, "step", iteration=iteration, step=step, world_size=world_size)
                if step == position["step"] + 1:
                    record(args, "first_step", iteration=iteration, step=step, world_size=world_size)
                    first_step_done = time.perf_counter()
                    first_step_cpu = (time.thread_time(), time.process_time())
                if step % args.checkpoint_every == 0 and rank == 0:
                    with call_wrapper.atomic() if call_wrapper is not None else contextlib.nullcontext():
                        state.save_checkpoint(args.workdir / "checkpoint.pt")
                if step >= stop_step(args):
                    break
            else:
                epoch, batch = epoch + 1, 0
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        steps_timed = step - position["step"] - 1
        step_seconds = (time.perf_counter() - first_step_done) / steps_timed if steps_timed > 0 else None
        # CPU seconds per step of the main thread, and of this process's other threads (gloo's, the Wrapper's).
        main_cpu = time.thread_time() - first_step_cpu[0]
        other_cpu = time.process_time() - first_step_cpu[1] - main_cpu
        step_cpu = (
            {"main": main_cpu / steps_timed, "other_threads": other_cpu / steps_timed} if steps_timed > 0 else None
        )
        return {
            "step": step,
            "iteration": iteration,
            "world_size": world_size,
            "rank": rank,
            "loss": float(loss.detach()),
            "checksum": checksum,
            "resumed_at": position["step"],
            "step_seconds": step_seconds,
            "step_cpu_seconds": step_cpu,
            "digest": state.digest() if args.record_digests else None,
        }
    finally:
        dist.destroy_process_group()


# ---- for the demo, the tests and the benchmarks -------------------------------------------------


def record(args: argparse.Namespace, event: str, **fields: Any) -> None:
    """Append an event (wall time, initial rank, pid) to ``--workdir``/events-<initial rank>.jsonl."""
    line = {
        "event": event,
        "t": time.time(),
        "rank": int(os.environ["ELASTIC_FT_INITIAL_RANK"]),
        "pid": os.getpid(),
        **fields,
    }
    with open(args.workdir / f"events-{line['rank']}.jsonl", "a") as file:
        file.write(json.dumps(line) + "\n")


FAULTS = ("raise", "sigkill", "hang_gil_held", "hang_gil_released", "sigstop", "slow_step")


def inject(args: argparse.Namespace, call_wrapper: CallWrapper | None, step: int) -> None:
    """``--fault KIND --fault-rank R --fault-step S``: once, in the first iteration of the first process.

    ``--fault-file PATH``: initial rank ``--fault-file-rank`` raises at the first step of
    a later iteration at which PATH exists (and removes it): a fault a
    benchmark triggers when it is ready.
    """
    if args.fault_dir is not None:
        inject_requested(args, step)
    later = call_wrapper is not None and call_wrapper.iteration > 0
    mine = int(os.environ["ELASTIC_FT_INITIAL_RANK"]) == args.fault_file_rank
    if later and mine and args.fault_file is not None and args.fault_file.exists():
        args.fault_file.unlink()
        record(args, "fault", kind="raise", step=step)
        raise RuntimeError(f"injected fault at step {step} ({args.fault_file} appeared)")
    if args.fault is None or step != args.fault_step or int(os.environ["ELASTIC_FT_INITIAL_RANK"]) != args.fault_rank:
        return
    if (call_wrapper is not None and call_wrapper.iteration > 0) or int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    ):
        return
    record(args, "fault", kind=args.fault, step=step)
    if args.fault == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if args.fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if args.fault == "hang_gil_held":
        ctypes.PyDLL(None).sleep(3600)  # a C call that never releases the GIL
    if args.fault == "hang_gil_released":
        time.sleep(3600)
    if args.fault == "slow_step":
        slow_computation(args.slow_seconds)


#: The faults ``--fault-dir`` injects from inside a rank (the others come from outside: signals).
REQUESTED_FAULTS = ("raise", "hang_gil_held", "hang_gil_released")


def inject_requested(args: argparse.Namespace, step: int) -> None:
    """``--fault-dir DIR``: the fault a benchmark asks of this rank now, in ``DIR/fault-<initial rank>`` (once)."""
    path = args.fault_dir / f"fault-{os.environ['ELASTIC_FT_INITIAL_RANK']}"
    if not path.exists():
        return
    try:
        kind = path.read_text().strip()
        path.unlink()
    except OSError:  # taken meanwhile
        return
    record(args, "fault", kind=kind, step=step)
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if kind == "hang_gil_held":
        ctypes.PyDLL(None).sleep(3600)
    if kind == "hang_gil_released":
        time.sleep(3600)


def stop_step(args: argparse.Namespace) -> int:
    """The step training ends at: ``--steps``, or the one a benchmark wrote in ``--stop-file`` (every rank reads
    the same number, so every rank stops at the same step)."""
    if args.stop_file is not None and args.stop_file.exists():
        with contextlib.suppress(OSError, ValueError):
            return min(args.steps, int(args.stop_file.read_text()))
    return args.steps


def _claim_once(path: Path) -> bool:
    """True for the first process of the job to claim ``path``, False for every other."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


KILL_SENDER_CLAIM = "kill-first-sender.claim"


def kill_once_sending(args: argparse.Namespace, step: int) -> None:
    """``--kill-first-sender``: SIGKILL this process ``--kill-sender-delay`` seconds after its healing send started,
    unless another process of the job claimed the fault first.

    The Wrapper reads ``state_dict()`` before the ranks agree on the plan (for the state's layout), so a delay
    counted from that call could end before the send starts on a loaded host. The send runs in the Wrapper's
    ``elastic_ft-heal-send`` thread: its start is what the delay is counted from. A rank the plan does not make a
    sender gives up after a minute."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (args.workdir / KILL_SENDER_CLAIM).exists():
        if any(thread.name == "elastic_ft-heal-send" for thread in threading.enumerate()):
            if _claim_once(args.workdir / KILL_SENDER_CLAIM):
                record(args, "fault", kind="kill_sender", step=step)
                time.sleep(args.kill_sender_delay)
                os.kill(os.getpid(), signal.SIGKILL)
            return
        time.sleep(0.005)


def faulty_healing(args: argparse.Namespace, state: TrainingState) -> dict[str, Any]:
    """``state_dict``/``load_state_dict`` with the faults of ``--kill-first-sender`` and ``--fail-load-rank``."""
    initial_rank = int(os.environ["ELASTIC_FT_INITIAL_RANK"])

    def state_dict() -> dict[str, Any]:
        if args.kill_first_sender and not (args.workdir / KILL_SENDER_CLAIM).exists():
            step = state.position["step"]
            threading.Thread(target=kill_once_sending, args=(args, step), daemon=True).start()
        return state.state_dict()

    def load_state_dict(received: dict[str, Any]) -> None:
        if initial_rank == args.fail_load_rank:
            record(args, "fault", kind="fail_load", step=state.position["step"])
            raise ValueError("injected: this state does not fit the model")
        state.load_state_dict(received)

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}


def slow_computation(seconds: float) -> None:
    """About ``seconds`` of CPU work in one C call (no Python code runs meanwhile): a slow but healthy step."""
    probe = torch.randn(512, 512)
    start = time.perf_counter()
    probe @ probe
    per_flop = (time.perf_counter() - start) / 512**3
    size = int((seconds / per_flop) ** (1 / 3))
    matrix = torch.randn(size, size)
    matrix @ matrix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoint, results and events")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=24, help="samples per step over all ranks")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4800)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--no-wrapper", action="store_true", help="run without elastic_ft.Wrapper")
    parser.add_argument(
        "--reload-checkpoint", action="store_true", help="every iteration reloads the checkpoint (no peer healing)"
    )
    parser.add_argument(
        "--monitor-logs", action="store_true", help="monitor processes log to --workdir/monitor-<rank>.log"
    )
    parser.add_argument("--hold-group", action="store_true", help="keep a reference to every process group")
    parser.add_argument("--pin-cpu", action="store_true", help="pin each worker to one CPU (steadier step times)")
    parser.add_argument(
        "--step-wait",
        type=float,
        default=0.0,
        help="seconds each step waits with the CPU idle, as it waits on a GPU (simulated hosts sharing CPUs)",
    )
    parser.add_argument("--fault", choices=FAULTS)
    parser.add_argument("--fault-rank", type=int, default=1, help="initial rank that faults")
    parser.add_argument("--fault-step", type=int, default=30)
    parser.add_argument("--slow-seconds", type=float, default=4.0, help="length of --fault slow_step")
    parser.add_argument("--fault-file", type=Path, help="raise once this file appears (in an iteration > 0)")
    parser.add_argument("--fault-file-rank", type=int, default=0, help="initial rank that raises on --fault-file")
    parser.add_argument("--record-digests", action="store_true", help="record a hash of the state at every start")
    parser.add_argument("--record-steps", action="store_true", help="record every step (for benchmarks)")
    parser.add_argument(
        "--kill-first-sender", action="store_true", help="the first rank to send its state is SIGKILLed while it does"
    )
    parser.add_argument("--kill-sender-delay", type=float, default=0.05, help="seconds into the send")
    parser.add_argument(
        "--fail-load-rank", type=int, help="load_state_dict raises on this initial rank (each time it runs there)"
    )
    parser.add_argument(
        "--fault-dir", type=Path, help=f"inject the fault a file DIR/fault-<initial rank> names: {REQUESTED_FAULTS}"
    )
    parser.add_argument(
        "--lazy-optimizer",
        action="store_true",
        help="build the optimizer on first use (inside the wrapped function, or a heal), not before the Wrapper",
    )
    parser.add_argument("--no-warmup", action="store_true", help="Wrapper(warmup=None): no warm-up while waiting")
    parser.add_argument("--stop-file", type=Path, help="end training at the step this file holds, once it exists")
    args = parser.parse_args(argv)
    if not args.step_wait >= 0:  # NaN too
        parser.error(f"--step-wait must be a number of seconds >= 0, got {args.step_wait}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    initial_rank = int(os.environ["RANK"])
    os.environ["ELASTIC_FT_INITIAL_RANK"] = str(initial_rank)
    if args.pin_cpu:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
    state = TrainingState(args.hidden, args.samples, lazy_optimizer=args.lazy_optimizer)
    if args.record_steps:  # the process is ready to train: what a join is timed from
        record(args, "ready", node=os.environ.get("NODE_TAG", "?"))
    settings: dict[str, Any] = {}  # the Wrapper's defaults, but for these flags
    if args.monitor_logs:
        settings["monitor_process_logfile"] = str(args.workdir.resolve() / "monitor-{rank}.log")
    if args.no_warmup:
        settings["warmup"] = None
    if args.no_wrapper:
        result = train(args, state)
    elif args.reload_checkpoint:
        result = Wrapper(**settings)(train)(args, state)
    else:
        healing = {"state_dict": state.state_dict, "load_state_dict": state.load_state_dict}
        if args.kill_first_sender or args.fail_load_rank is not None:
            healing = faulty_healing(args, state)
        result = Wrapper(**settings, **healing)(train)(args, state)
    if result is None:
        return  # a spare rank: it never trained
    done = {
        **result,
        "initial_rank": initial_rank,
        "pid": os.getpid(),
        "node": os.environ.get("NODE_TAG", "?"),
        "process_restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    path = args.workdir / f"done-{initial_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(done))
    os.replace(path.with_suffix(".tmp"), path)
    record(args, "done", step=result["step"], iteration=result["iteration"])


if __name__ == "__main__":
    main(sys.argv[1:])
