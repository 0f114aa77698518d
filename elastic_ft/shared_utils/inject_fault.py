"""Fault injection for rehearsing recoveries, under NVIDIA's names (``nvidia_resiliency_ext.shared_utils.inject_fault``).

A *fault handler* ``handler(delay, callback)`` arranges one fault ``delay``
seconds from now, off the caller's thread, and calls ``callback`` (if any)
just before the fault strikes. :func:`inject_fault` draws, from a seed every
rank passes alike, which ranks fail, with which fault and after which delay,
so every rank agrees on the scenario without talking to the others; only the
chosen ranks arm their fault.

The built-in faults, :class:`Fault`:

* ``WORKLOAD_EXC``: the next :func:`maybe_raise_workload_exception` call
  (the training loop's) raises :class:`InjectedException`;
* ``ASYNC_EXC``: :class:`InjectedException` raised asynchronously in the
  main thread, wherever it runs;
* ``SIGNAL_EXC``: ``SIGUSR1``, whose handler raises :class:`InjectedException`;
* ``LOCK_GIL``: a regular expression that backtracks for good while
  holding the GIL (no Python thread of the process runs again);
* ``SEGFAULT``, ``OS_ABORT``: the process crashes (``SIGSEGV``, ``SIGABRT``);
* ``SIGINT``, ``SIGTERM``, ``SIGKILL``, ``SIGSTOP``: the signal, sent to the
  process itself;
* ``GPU_ERROR``, ``GPU_SLEEP``: an out-of-bounds index on the current CUDA
  device (a device-side assertion), a kernel that never ends.

:func:`register_fault` adds a fault of your own, or replaces a built-in
fault's handler. Differences from NVIDIA's module: signals come from a timer
thread rather than a forked child process (forking a process whose threads
hold locks is unsafe), and a fault registered under a new name is a
:class:`CustomFault` returned to the caller, not a new member of the
:class:`Fault` enum.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import logging
import os
import random
import re
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from elastic_ft.inprocess.delivery.interrupt import async_raise

log = logging.getLogger(__name__)


class Fault(enum.Enum):
    GPU_ERROR = enum.auto()
    GPU_SLEEP = enum.auto()
    WORKLOAD_EXC = enum.auto()
    ASYNC_EXC = enum.auto()
    SIGNAL_EXC = enum.auto()
    OS_ABORT = enum.auto()
    LOCK_GIL = enum.auto()
    SEGFAULT = enum.auto()
    SIGINT = enum.auto()
    SIGKILL = enum.auto()
    SIGTERM = enum.auto()
    SIGSTOP = enum.auto()


@dataclasses.dataclass(frozen=True)
class CustomFault:
    """A fault registered under a name of its own (:func:`register_fault`)."""

    name: str


class InjectedException(Exception):
    """The exception an injected fault raises in the training process."""


FaultHandler = Callable[[float, Callable[[], Any] | None], Any]
_handlers: dict[Fault | CustomFault, FaultHandler] = {}
_workload_fault = threading.Event()


def register_fault(fault_name_or_enum: str | Fault, handler: FaultHandler) -> Fault | CustomFault:
    """Make ``handler(delay, callback)`` inject the fault named or given; returns the fault to pass to
    :func:`inject_fault`."""
    if isinstance(fault_name_or_enum, Fault):
        fault: Fault | CustomFault = fault_name_or_enum
    elif isinstance(fault_name_or_enum, str) and fault_name_or_enum:
        name = fault_name_or_enum
        fault = Fault[name] if name in Fault.__members__ else CustomFault(name)
    else:
        raise TypeError(f"register_fault takes a Fault or a non-empty name, got {fault_name_or_enum!r}")
    if not callable(handler):
        raise TypeError(f"register_fault needs a callable handler(delay, callback), got {handler!r}")
    _handlers[fault] = handler
    return fault


def dispatch_fault_injection(fault: Fault | CustomFault, delay: float, callback: Callable[[], Any] | None) -> None:
    """Arm ``fault`` with its registered handler."""
    handler = _handlers.get(fault)
    if handler is None:
        raise RuntimeError(f"no handler is registered for fault {fault!r} (see register_fault)")
    handler(delay, callback)


def maybe_raise_workload_exception() -> None:
    """Raise :class:`InjectedException` if a ``WORKLOAD_EXC`` fault struck since the last call (call it from the
    training loop)."""
    if _workload_fault.is_set():
        _workload_fault.clear()
        raise InjectedException("injected workload exception")


def clear_workload_exception() -> None:
    """Forget a ``WORKLOAD_EXC`` fault that struck and was not raised yet."""
    _workload_fault.clear()


def _after(delay: float, name: str, strike: Callable[[], Any]) -> Callable[[Callable[[], Any] | None], None]:
    """A handler body: in a daemon thread, wait ``delay`` seconds, log, call the callback, strike."""

    def arm(callback: Callable[[], Any] | None) -> None:
        def run() -> None:
            threading.Event().wait(delay)
            log.critical("injecting fault %s into pid %d", name, os.getpid())
            if callback is not None:
                callback()
            strike()

        threading.Thread(target=run, name=f"inject-{name}", daemon=True).start()

    return arm


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)  # the pid when the fault strikes: a forked process signals itself


def _register(fault: Fault, strike: Callable[[], Any]) -> None:
    register_fault(fault, lambda delay, callback: _after(delay, fault.name, strike)(callback))


def _raise_on_signal(signum: int, frame: object) -> None:
    raise InjectedException(f"injected by signal {signal.Signals(signum).name}")


def _signal_exception(delay: float, callback: Callable[[], Any] | None) -> None:
    signal.signal(signal.SIGUSR1, _raise_on_signal)  # now: a handler is installed from the main thread only
    _after(delay, Fault.SIGNAL_EXC.name, lambda: os.kill(os.getpid(), signal.SIGUSR1))(callback)


def _hold_the_gil() -> None:
    # Nested quantifiers backtrack exponentially inside the re module, which never releases the GIL.
    re.fullmatch(r"(?:x+x+)+y", "x" * 64)


def _gpu_error() -> None:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    values = torch.zeros(1, device=device)
    values[torch.tensor([2], device=device)] = 1.0  # out of bounds: a device-side assertion
    torch.cuda.synchronize(device)


def _gpu_sleep() -> None:
    import torch

    torch.cuda._sleep(1 << 62)
    torch.cuda.synchronize()


_register(Fault.WORKLOAD_EXC, _workload_fault.set)
_register(Fault.ASYNC_EXC, lambda: async_raise(threading.main_thread().ident or 0, InjectedException))
_register(Fault.LOCK_GIL, _hold_the_gil)
_register(Fault.SEGFAULT, lambda: ctypes.string_at(1))
_register(Fault.OS_ABORT, os.abort)
_register(Fault.GPU_ERROR, _gpu_error)
_register(Fault.GPU_SLEEP, _gpu_sleep)
for _fault, _signum in (
    (Fault.SIGINT, signal.SIGINT),
    (Fault.SIGTERM, signal.SIGTERM),
    (Fault.SIGKILL, signal.SIGKILL),
    (Fault.SIGSTOP, signal.SIGSTOP),
):
    _register(_fault, functools.partial(_signal_self, _signum))
register_fault(Fault.SIGNAL_EXC, _signal_exception)


def _range(value: Any, name: str, kind: type) -> tuple[Any, Any]:
    low, high = (value, value) if isinstance(value, kind) and not isinstance(value, bool) else tuple(value)
    if low > high or low < 0:
        raise ValueError(
            f"inject_fault {name}={value!r} is invalid; expected a {kind.__name__} or (low, high), 0 <= low <= high"
        )
    return low, high


def inject_fault(
    faults: Sequence[Fault | CustomFault],
    num_faults: int | tuple[int, int],
    keep_alive: int,
    delay: float | tuple[float, float],
    seed: int,
    callback: Callable[[], Any] | None = None,
) -> None:
    """Arm one of ``faults`` on some ranks, chosen alike on every rank from ``seed``.

    ``num_faults`` ranks (or a number drawn from ``(low, high)``) among those
    from ``keep_alive`` up (ranks below ``keep_alive`` are never chosen) get
    the same fault, ``delay`` seconds (or a delay drawn from ``(low, high)``)
    after this call. The rank and world size are read from ``RANK`` and
    ``WORLD_SIZE``, as the Wrapper sets them for each iteration.
    """
    if not faults:
        raise ValueError("inject_fault needs at least one fault")
    unknown = [f for f in faults if f not in _handlers]
    if unknown:
        raise ValueError(f"inject_fault: no handler is registered for {unknown} (see register_fault)")
    min_faults, max_faults = _range(num_faults, "num_faults", int)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    draw = random.Random(seed)
    low, high = _range(float(delay) if isinstance(delay, int) else delay, "delay", float)
    seconds = draw.uniform(low, high)
    candidates = list(range(max(0, keep_alive), world_size))
    count = min(draw.randint(min_faults, max_faults), len(candidates))
    chosen = draw.sample(candidates, count)
    fault = draw.choice(list(faults))
    if rank in chosen:
        log.info("seed %d: ranks %s get fault %s in %.3f s", seed, sorted(chosen), fault, seconds)
        dispatch_fault_injection(fault, seconds, callback)
