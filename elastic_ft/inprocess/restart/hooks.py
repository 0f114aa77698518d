"""What a restart does on a rank before the store hears of it: the connections released, then the user's hooks.

:class:`RankHooks` runs, for the Wrapper, the steps of a restart that touch
the rank's own process: the release of the failed iteration's gloo
connections (:mod:`elastic_ft.inprocess.delivery.connections`), which is what unblocks
a collective waiting for a lost peer, and the user's ``abort``,
``health_check``, ``completion`` and ``terminate`` hooks, each with the
consequence NVIDIA's Wrapper gives its failure. A rank that must leave the
job is told by :class:`_RankLeaves`. :class:`ProcessHooks` is what makes a
restart reach the rank at all: the process-wide hooks the call installs
while it runs.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import signal
import threading
from collections.abc import Callable
from typing import Any

from elastic_ft.inprocess.delivery.connections import (
    close_inherited_in_child,
    established_connections,
    gloo_listeners,
    release_connections,
    tcp_sockets,
    unblock_listeners,
)
from elastic_ft.inprocess.delivery.interrupt import InterruptSignal
from elastic_ft.inprocess.delivery.process_groups import ProcessGroupKeeper
from elastic_ft.inprocess.exception import HealthCheckError
from elastic_ft.inprocess.hangs.monitor import STACK_DUMP_SIGNAL
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.inprocess.steps.gate import StepGate

log = get_logger("wrapper")

StateHook = Callable[[State], Any]


class _RankLeaves(BaseException):
    """Internal: this rank leaves the job; ``error`` is what the Wrapper raises to the caller."""

    def __init__(self, error: BaseException, kind: str) -> None:
        super().__init__(kind)
        self.error = error
        self.kind = kind

    def release(self) -> BaseException:
        """The error to raise, no longer held here.

        Raised while this is being handled, the error takes this as its
        ``__context__``; still held here, the two would make a reference
        cycle through their tracebacks' frames that keeps the call's
        ``CallWrapper`` alive until a garbage collection.
        """
        error, self.error = self.error, _Released()
        return error


class _Released(BaseException):
    """What a released ``_RankLeaves`` holds instead of its error (see ``_RankLeaves.release``)."""


@dataclasses.dataclass
class RankHooks:
    """The rank's side of a restart. ``socket_baseline``: the sockets the process held before the wrapped
    function ran (never released); set once the call's set-up is done."""

    groups: ProcessGroupKeeper
    abort_hook: StateHook | None
    health_check_hook: StateHook | None
    completion_hook: StateHook | None
    terminate_hook: StateHook | None
    socket_baseline: frozenset[int] = frozenset()

    def release_connections(self, state: State, everything: bool = False) -> int:
        """The iteration is lost: keep its gloo groups from being destroyed, then cut their connections.

        With ``everything`` (the main thread ignored the first release), also
        end gloo's waits for peers that never connect (:func:`unblock_listeners`):
        a peer that died while the ranks built a process group.
        """
        self.groups.retire()
        released = release_connections(self.socket_baseline, everything=everything)
        if everything:
            listeners = gloo_listeners(tcp_sockets(), self.socket_baseline)
            unblocked = unblock_listeners(listeners, range(state.world_size))
            if unblocked:
                log.info("rank %s: ended gloo's waits on %d listener(s)", state.rank, len(listeners))
        return released

    def connections_open(self) -> int:
        """How many connections of the function are still established (see :func:`established_connections`)."""
        return established_connections(self.socket_baseline)

    def abort(self, state: State) -> None:
        """Release the function's connections, then the ``abort`` hook (once per restart: ``Unwinding`` calls it)."""
        try:
            self.release_connections(state)
        except Exception:
            log.exception("rank %s: releasing connections failed", state.rank)
        if self.abort_hook is None:
            return
        try:
            self.abort_hook(state)
        except Exception:
            log.exception("rank %s: abort failed", state.rank)

    def check_health(self, state: State, *, leave: bool = True) -> None:
        """Run the health check; a failure raises ``HealthCheckError``, as the rank leaving when ``leave``."""
        if self.health_check_hook is None:
            return
        try:
            self.health_check_hook(state)
        except Exception as error:  # noqa: BLE001 - any failure of the check is ill health, raised below
            health_error = HealthCheckError(f"rank {state.rank} failed its health check: {error!r}")
            try:
                if not leave:
                    raise health_error from error
                raise _RankLeaves(health_error, "health_check") from error
            finally:
                # ``error``'s traceback holds this frame: naming its wrapper here would make a reference cycle.
                del health_error

    def run_completion(self, state: State) -> None:
        """The ``completion`` hook, once the iteration completed; its failure is logged, not raised."""
        if self.completion_hook is None:
            return
        try:
            self.completion_hook(state)
        except Exception:
            log.exception("rank %s: completion failed", state.rank)

    def terminate(self, state: State, reason: BaseException) -> None:
        """The ``terminate`` hook of a rank that leaves; its own failure is raised from ``reason``, as NVIDIA's
        Wrapper does."""
        if self.terminate_hook is None:
            return
        try:
            self.terminate_hook(dataclasses.replace(state, mode=Mode.TERMINATED))
        except Exception as error:
            log.exception("rank %s: terminate failed", state.rank)
            raise error from reason


class ProcessHooks:
    """What a call installs process-wide while it runs, each removed at its end (or as far as it got): the
    closing of the process's own sockets in its children, the interrupt signal that delivers a restart into a
    blocking call, the stack dump the monitor process asks for before it terminates the rank, and the optimizer
    hooks of the step gate."""

    def __init__(self, gate: StepGate) -> None:
        self._gate = gate
        #: The interrupt signal installed (None: none, or outside the main thread).
        self.interrupt: InterruptSignal | None = None

    def install(self, signum: signal.Signals | None, socket_baseline: frozenset[int]) -> None:
        close_inherited_in_child(socket_baseline)
        if signum is not None and threading.current_thread() is threading.main_thread():
            self.interrupt = InterruptSignal(signum)
            self.interrupt.install()
        elif signum is not None:
            log.warning(
                "the Wrapper runs outside the main thread: no interrupt signal, blocking calls end a restart late"
            )
        # The monitor process sends this before it terminates the rank: every thread's stack goes to
        # stderr, from a C handler that runs even when the GIL is held.
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
        self._gate.install()

    def remove(self) -> None:
        close_inherited_in_child(None)
        faulthandler.unregister(STACK_DUMP_SIGNAL)
        self._gate.remove()
        if self.interrupt is not None:
            self.interrupt.uninstall()
            self.interrupt = None
