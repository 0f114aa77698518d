"""One rank of a Wrapper test job; the scenario comes as JSON in ``EFT_SCENARIO``.

Every rank trains a tiny all-reduce loop with gloo under ``elastic_ft.Wrapper``
and writes what happened to ``$EFT_OUT/rank<initial rank>.json``: the function's
result, or the exception that left the Wrapper, and every call of the function.
Faults are injected for real: exceptions, ``os._exit``, SIGKILL, hangs in C code
with the GIL released (``ctypes.CDLL``) or held (``ctypes.PyDLL``).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.inprocess import rank_filter
from elastic_ft.inprocess.abort import Abort, AbortTorchDistributed
from elastic_ft.inprocess.completion import Completion
from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.exception import RankShouldRestart
from elastic_ft.inprocess.finalize import Finalize
from elastic_ft.inprocess.health_check import FaultCounter, HealthCheck
from elastic_ft.inprocess.initialize import Initialize, RetryController
from elastic_ft.inprocess.rank_assignment import MaxActiveWorldSize, ShiftRanks
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.terminate import Terminate
from elastic_ft.inprocess.wrapper import CallWrapper, Wrapper

SCENARIO: dict[str, Any] = json.loads(os.environ["EFT_SCENARIO"])
OUT = os.environ["EFT_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
CALLS: list[dict[str, Any]] = []
HOOK_CALLS: list[dict[str, Any]] = []
WARMUPS: list[dict[str, Any]] = []
ABORTS: list[dict[str, Any]] = []


def seconds(name: str, default: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=SCENARIO.get(name, default))


def write(record: dict[str, Any]) -> None:
    path = os.path.join(OUT, f"rank{INITIAL_RANK}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(record, file)
    os.replace(path + ".tmp", path)


def fault_here(iteration: int, step: int) -> str | None:
    """The fault this rank must inject now, if any."""
    for fault in SCENARIO.get("faults", []):
        if "until_iteration" in fault:  # every iteration before it
            if_iteration = iteration < fault["until_iteration"]
        else:
            if_iteration = fault.get("iteration", 0) == iteration
        if fault["rank"] == INITIAL_RANK and if_iteration and fault.get("step", 0) == step:
            return fault["kind"]
    return None


def resources() -> dict[str, int]:
    """This process's threads, open file descriptors and resident memory (KiB), from /proc."""
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss_pages * os.sysconf("SC_PAGE_SIZE") // 1024,
    }


def inject(kind: str, call_wrapper: CallWrapper) -> None:
    if kind == "raise_later":
        time.sleep(SCENARIO.get("raise_delay", 0.3))
        raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK}")
    if kind == "raise":
        raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK}")
    if kind == "key_error":
        settings: dict[str, int] = {}
        settings["learning_rate"] += 1  # the bug: a missing key, on every call
    if kind == "sleep_python":
        time.sleep(1000)  # a hang in the rank's own code, outside any collective
    if kind == "unprotected_sleep":  # longer than both timeouts, with the rank's hang protection off
        with call_wrapper.disable_hang_protection():
            time.sleep(SCENARIO["unprotected_seconds"])
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "sigstop_with_monitor":
        # A frozen host as its peers see it: the rank and its monitor process stop, so no heartbeat comes.
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as children:
                for child in children.read().split():
                    os.kill(int(child), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "wedged":
        # Blocked in C code that neither the interrupt signal nor released connections end (as gloo
        # is when it misses its peer's closed connection): the restart cannot reach this thread.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        try:
            ctypes.CDLL(None).sleep(1000)
        finally:
            # Only a signal ends the sleep early: the monitor process's stack dump, when this thread takes
            # it; the restart scheduled long before raises then. By now this rank must be counted out of
            # the iteration (it is terminated next), or its arrival completes the restart with it counted in.
            iteration = iteration_store(call_wrapper.job_store.base, call_wrapper.iteration)
            counted_out = INITIAL_RANK in iteration.terminated_ranks()
            with open(os.path.join(OUT, f"woke{INITIAL_RANK}.json"), "w") as file:
                json.dump({"counted_out": counted_out}, file)
    if kind == "sigkill_soon":
        # Dies while the others build the iteration's process group.
        delay = SCENARIO.get("kill_delay", 0.0) + INITIAL_RANK * 0.001
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if kind == "exit":
        os._exit(17)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sleep_gil_released":
        ctypes.CDLL(None).sleep(SCENARIO["hang_seconds"])
    if kind == "sleep_gil_held":
        ctypes.PyDLL(None).sleep(1000)
    if kind == "sleep_gil_held_ignoring_sigterm":
        signal.signal(signal.SIGTERM, lambda *_: None)
        while True:
            ctypes.PyDLL(None).sleep(1000)
    if kind == "slow_python":
        deadline = time.monotonic() + SCENARIO["slow_seconds"]
        while time.monotonic() < deadline:
            time.sleep(0.01)
    if kind == "slow_c_call_with_pings":
        stop = threading.Event()

        def pinger() -> None:
            while not stop.wait(0.1):
                call_wrapper.ping()

        helper = threading.Thread(target=pinger, daemon=True)
        helper.start()
        ctypes.CDLL(None).sleep(SCENARIO["slow_seconds"])
        stop.set()
        helper.join()
    if kind == "livelock_after_ping":
        call_wrapper.ping()
        while True:
            pass
    if kind == "swallow_once":
        swallowed = False
        while True:
            try:
                while True:
                    time.sleep(0.005)
            except BaseException:
                if swallowed:
                    raise
                swallowed = True
    if kind == "wait_for_restart":
        while True:
            time.sleep(0.005)
    if kind in ("slow_optimizer_step", "failing_optimizer_step"):
        optimizer_step(kind, call_wrapper)
    if kind == "atomic_checkpoint":
        path = os.path.join(OUT, "checkpoint.txt")
        with call_wrapper.atomic():
            CALLS[-1]["atomic_entered"] = time.time()
            with open(path, "w") as file:
                for line in range(SCENARIO["checkpoint_lines"]):
                    file.write(f"line {line}\n")
                    file.flush()
                    time.sleep(0.01)
            CALLS[-1]["atomic_left"] = time.time()
        while True:
            time.sleep(0.005)


class SlowSGD(torch.optim.Optimizer):
    """Plain SGD whose step takes ``optimizer_seconds`` of Python code, and may raise after its update."""

    def __init__(self, params: Any, fail: bool) -> None:
        super().__init__(params, {"lr": 0.1})
        self.fail = fail

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        deadline = time.monotonic() + SCENARIO.get("optimizer_seconds", 1.0)
        while time.monotonic() < deadline:
            time.sleep(0.005)  # bytecode throughout: a restart could land anywhere in here
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"])
        if self.fail:
            raise RuntimeError("injected: the optimizer step failed")


if any(f["kind"].endswith("optimizer_step") for f in SCENARIO.get("faults", [])):
    # The first optimizer step of a process imports torch._dynamo (seconds): done here, before the Wrapper.
    _warm = torch.nn.Parameter(torch.ones(1))
    _warm.sum().backward()
    SlowSGD([_warm], fail=False).step()


def optimizer_step(kind: str, call_wrapper: CallWrapper) -> None:
    """One step of an optimizer that is slow (``slow_optimizer_step``) or raises (``failing_optimizer_step``)."""
    weight = torch.nn.Parameter(torch.ones(4))
    weight.sum().backward()
    optimizer = SlowSGD([weight], fail=kind == "failing_optimizer_step")
    optimizer.register_step_post_hook(lambda *_: CALLS[-1].__setitem__("step_left", time.time()))
    CALLS[-1]["step_entered"] = time.time()
    optimizer.step()
    while True:
        time.sleep(0.005)


def train(pg_store: dist.Store, call_wrapper: CallWrapper | None = None) -> dict[str, Any]:
    assert call_wrapper is not None
    iteration = call_wrapper.iteration
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    call = {
        "iteration": iteration,
        "rank": rank,
        "world_size": world_size,
        "optimizer_steps": call_wrapper.step,
        "entered": time.time(),
    }
    if SCENARIO.get("record_resources"):
        call["resources"] = resources()
    CALLS.append(call)
    kind = fault_here(iteration, "init")
    if kind is not None:
        call["fault"] = kind
        inject(kind, call_wrapper)
    if SCENARIO.get("pg_on_wrapper_store"):
        pg_store = call_wrapper.base_store  # as under ftrun: the group meets in the Wrapper's (etcd) store
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"pg/{iteration}", pg_store),
        rank=rank,
        world_size=world_size,
        timeout=seconds("gloo_timeout", 30),
    )
    try:
        if "dcp_optimizer_steps" in SCENARIO:
            call.update(dcp_steps(call_wrapper, SCENARIO["dcp_optimizer_steps"]))
        if SCENARIO.get("dtensor_gather"):
            call["gathered"] = dtensor_gather(iteration, world_size)
        value = torch.ones(1)
        for step in range(SCENARIO.get("steps", 5)):
            kind = fault_here(iteration, step)
            if kind is not None:
                call["fault"] = kind
                inject(kind, call_wrapper)
            dist.all_reduce(value)
            if SCENARIO.get("ping"):
                call_wrapper.ping()
            time.sleep(SCENARIO.get("step_sleep", 0.0))
        kind = fault_here(iteration, "end")
        if kind is not None:
            inject(kind, call_wrapper)
        return {**call, "value": value.item()}
    except RankShouldRestart:
        call["restart_received"] = time.time()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def dtensor_gather(iteration: int, world_size: int) -> list[float]:
    """A 2-D mesh of the whole world, a sharded tensor detached and gathered back, as ``get_model_state_dict``
    does. Each iteration first makes ``iteration`` more groups than the last, so the mesh's groups get other
    names than the same mesh's in earlier iterations, as a restart with new groups (a healing, a new policy)
    can give them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for _ in range(iteration):
        dist.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    tensor = distribute_tensor(torch.arange(8.0), mesh, [Replicate(), Shard(0)])
    return tensor.detach().full_tensor().tolist()


def dcp_steps(call_wrapper: CallWrapper, steps: int) -> dict[str, Any]:
    """What the Wrapper counts around ``torch.distributed.checkpoint``'s optimizer initialisation (an lr-0 step
    of an optimizer with no state), ``steps`` training steps, and a checkpoint load that sets the count."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    get_optimizer_state_dict(model, optimizer)  # steps the optimizer once, lr 0, to build its state
    record: dict[str, Any] = {
        "after_dcp_init": call_wrapper.step,
        "params_unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
    }
    for _ in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    record["after_training"] = call_wrapper.step
    call_wrapper.step = 100  # what a script does once it loaded a checkpoint written at step 100
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    record["after_load_and_one_step"] = call_wrapper.step
    return record


class FailOn(Initialize, Finalize, HealthCheck):
    """Raises ``error`` on the listed initial ranks at the listed iterations and calls."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.calls = 0

    def __call__(self, state: State) -> State:
        self.calls += 1
        spec = self.spec
        if (
            state.initial_rank in spec["ranks"]
            and state.iteration == spec.get("iteration", 0)
            and self.calls in spec.get("calls", [self.calls])
        ):
            error = {"Exception": RuntimeError, "BaseException": KeyboardInterrupt}[spec["error"]]
            raise error(f"{spec['hook']} fails on initial rank {state.initial_rank}")
        return state


class RecordHook(Finalize, Completion, Terminate):
    """Records each call (hook name, iteration, mode, the state's ``fn_exception``) for the report."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    def __call__(self, state: State) -> State:
        exception = None if state.fn_exception is None else type(state.fn_exception).__name__
        HOOK_CALLS.append(
            {"hook": self.hook, "iteration": state.iteration, "mode": state.mode.name, "fn_exception": exception}
        )
        return state


class CountedAbort(Abort):
    """The default abort, each call recorded (the iteration, and the thread that made it) for the report."""

    def __init__(self) -> None:
        self.inner = AbortTorchDistributed()

    def __call__(self, state: State) -> State:
        ABORTS.append({"iteration": state.iteration, "thread": threading.current_thread().name})
        return self.inner(state)


def nvidia_hooks() -> dict[str, Any]:
    """NVIDIA 0.4.1's hook forms: the deprecated rank_filter, FaultCounter, completion and terminate."""
    return {
        "rank_filter": Compose(rank_filter.WorldSizeDivisibleBy(2), rank_filter.MaxActiveWorldSize(4)),
        # Only rank 1 has a fault budget of 0: a peer's collective may also fail on the fault (racy).
        "health_check": FaultCounter(max_rank_faults=0 if INITIAL_RANK == 1 else None),
        "finalize": RecordHook("finalize"),
        "completion": RecordHook("completion"),
        "terminate": RecordHook("terminate"),
    }


def probed_warmup() -> None:
    """The default warm-up, recording when it ran and whether a process group existed then."""
    from elastic_ft.inprocess.restart.warmup import import_lazy_modules
    from elastic_ft.runtime.torch_compat import registered_groups

    WARMUPS.append({"at": time.time(), "groups": len(registered_groups()), "initialized": dist.is_initialized()})
    import_lazy_modules()


def build_wrapper() -> Wrapper:
    hooks: dict[str, Any] = {}
    if SCENARIO.get("warmup_probe"):
        hooks["warmup"] = probed_warmup
    if SCENARIO.get("nvidia_hooks"):
        hooks.update(nvidia_hooks())
    if SCENARIO.get("count_aborts"):
        hooks["abort"] = CountedAbort()
    if "rank_filter_divisor" in SCENARIO:
        hooks["rank_filter"] = rank_filter.ActiveWorldSizeDivisibleBy(SCENARIO["rank_filter_divisor"])
    for spec in SCENARIO.get("failing_hooks", []):
        hooks[spec["hook"]] = FailOn(spec)
    if "retry" in SCENARIO:
        hooks["initialize"] = RetryController(**SCENARIO["retry"])
    if "max_active_world_size" in SCENARIO:
        hooks["rank_assignment"] = Compose(MaxActiveWorldSize(SCENARIO["max_active_world_size"]), ShiftRanks())
    if "etcd_endpoints" in SCENARIO:
        hooks["store_factory"] = functools.partial(etcd_store, SCENARIO["etcd_endpoints"], SCENARIO["etcd_prefix"])
    else:
        hooks["store_kwargs"] = {"timeout": datetime.timedelta(seconds=20)}
    for name in (
        "max_identical_faults",
        "max_restarts_without_progress",
        "min_progress_steps",
        "monitor_process_pidfile",
    ):
        if name in SCENARIO:
            hooks[name] = SCENARIO[name]
    return Wrapper(
        monitor_thread_interval=seconds("monitor_thread_interval", 0.05),
        monitor_process_interval=seconds("monitor_process_interval", 0.05),
        progress_watchdog_interval=seconds("progress_watchdog_interval", 0.05),
        heartbeat_interval=seconds("heartbeat_interval", 0.2),
        heartbeat_timeout=seconds("heartbeat_timeout", 10),
        soft_timeout=seconds("soft_timeout", 20),
        hard_timeout=seconds("hard_timeout", 25),
        barrier_timeout=seconds("barrier_timeout", 40),
        completion_timeout=seconds("completion_timeout", 30),
        last_call_wait=seconds("last_call_wait", 0.05),
        termination_grace_time=seconds("termination_grace_time", 1),
        monitor_process_logfile=os.path.join(OUT, "monitor{rank}.log"),
        **hooks,
    )


def etcd_store(endpoints: list[tuple[str, int]], prefix: str) -> dist.Store:
    """A store_factory keeping the Wrapper's coordination in etcd; no rank hosts it."""
    from elastic_ft.etcd.client import EtcdClient, EtcdEndpoint
    from elastic_ft.etcd.store import EtcdStore

    client = EtcdClient([EtcdEndpoint(host, port) for host, port in endpoints])
    return EtcdStore(client, prefix, datetime.timedelta(seconds=20))


def main() -> None:
    if SCENARIO.get("debug_log"):
        logging.getLogger("elastic_ft.inprocess").setLevel(logging.DEBUG)
    pg_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        INITIAL_RANK == 0,
        datetime.timedelta(seconds=30),
        wait_for_workers=False,
    )
    record: dict[str, Any] = {"calls": CALLS, "warmups": WARMUPS}
    if SCENARIO.get("profiled"):
        profiled_calls = [0]

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                profiled_calls[0] += 1

        sys.setprofile(profile)  # the main thread's, as cProfile sets it
        record["profiled_calls"] = profiled_calls
    if SCENARIO.get("count_aborts"):
        record["aborts"] = ABORTS
    if SCENARIO.get("nvidia_hooks"):
        record["hooks"] = HOOK_CALLS
    try:
        record["result"] = build_wrapper()(train)(pg_store)
    except BaseException as error:
        record["error"] = type(error).__name__
        record["error_message"] = str(error)
        write(record)
        raise
    write(record)


if __name__ == "__main__":
    sys.exit(main())
