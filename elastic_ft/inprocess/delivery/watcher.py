"""The monitor thread: turns a fault recorded anywhere in the job into a restart here.

One thread per restart iteration waits for the iteration's outcome in the
store: through a watch on an etcd store (the fault reaches it within
milliseconds), by polling every ``interval`` elsewhere. A planned restart
(one nothing forces: admitting joiners) first lets the main thread reach an
agreed step boundary, where no collective is in flight, and become an
interruption there (see ``_await_step_boundary``). When some rank
recorded an interruption, it waits ``last_call_wait`` so that concurrent
faults on other ranks get recorded too, then, holding the lock of
``CallWrapper.atomic()`` (so it never starts while the main thread is
inside an atomic block):

1. releases the wrapped function's connections
   (:func:`elastic_ft.inprocess.delivery.connections.release_connections`): every peer
   blocked in a collective with this rank fails at once, whatever still
   holds the process group;
2. calls ``abort`` (by default, NCCL communicators aborted and process
   groups destroyed). Steps 1 and 2 go through the iteration's
   :class:`MainThreadSide`, which runs them once per iteration: not again if the
   main thread, leaving the function on its own exception, ran them first;
3. arms the iteration's :class:`~elastic_ft.inprocess.exception.RestartDelivery`
   and sends the main thread the interrupt signal, whose handler raises
   :class:`~elastic_ft.inprocess.exception.RankShouldRestart`: at the next
   bytecode instruction, or out of a blocking call such as ``time.sleep`` or
   a lock wait, but never inside a finalizer (a data loader's shutdown, say),
   where the exception would be dropped with the cleanup half done. One
   exception is delivered; while it unwinds the function nothing else is
   raised. Until the main thread acknowledges the restart, the signal is
   sent again every ``interval`` as long as nothing was delivered (after a
   few tries the exception is also scheduled asynchronously, with
   ``PyThreadState_SetAsyncExc``, as it is from the start when no signal is
   installed), and the exception is raised again if the function swallowed
   it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from elastic_ft.coordination.barriers import KeyWatch
from elastic_ft.coordination.iteration import COMPLETED, INTERRUPTED, PLANNED, IterationView
from elastic_ft.etcd import shield
from elastic_ft.etcd.outage import bounded
from elastic_ft.inprocess.delivery.interrupt import (
    InterruptSignal,
    clear_main_thread_pending_exception,
    raise_in_main_thread,
)
from elastic_ft.inprocess.delivery.main_thread import main_thread_stack
from elastic_ft.inprocess.exception import RankShouldRestart, RestartDelivery
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.state import State
from elastic_ft.runtime.waits import Backoff

log = get_logger("monitor_thread")

#: Signal intervals without delivery after which the asynchronous exception is scheduled as well.
_SCHEDULE_AFTER = 4
#: Rounds (of ``interval``) after which a restart still not delivered releases every connection of the
#: function, initiated ones too: a peer that is frozen, not dead, releases none (see delivery/connections.py).
_RELEASE_EVERYTHING_AFTER = 10
#: Rounds after which a main thread still blocked, with no connection of the function left open, is reported
#: as out of reach (see delivery/connections.py: a gloo send in flight when its connection failed); checked every round
#: from then on, as the monitor process's hard timeout may come soon after.
_OUT_OF_REACH_AFTER = _RELEASE_EVERYTHING_AFTER + 4
#: How that report starts: the benchmarks and tests look for it in the rank's log.
OUT_OF_REACH = "the main thread stays blocked with no connection of the function left open"


class MainThreadSide(Protocol):
    """Everything of the main thread's side the monitor thread touches: the one object it acts through
    (``restart.iteration.Unwinding``, one per iteration, shared with the main thread, which runs each step of an
    unwind once).

    ``atomic_lock``: the lock of ``CallWrapper.atomic()`` and of optimizer steps, which a restart takes;
    ``delivery``: the iteration's restart delivery; ``interrupt``: the interrupt signal (None: the scheduled
    exception alone).
    """

    atomic_lock: threading.RLock
    delivery: RestartDelivery
    interrupt: InterruptSignal | None

    def release_and_abort(self) -> None:
        """Release the iteration's connections, then run ``abort``: once per iteration, by either thread."""

    def release_everything(self) -> int:
        """Release every connection of the function, initiated ones too (a peer may be frozen)."""

    def connections_open(self) -> int | None:
        """How many connections of the function are still established (None: not counted)."""

    def restart_pending(self, pending: bool) -> None:
        """A restart is being delivered (True), or the main thread took it (False): the monitor process
        terminates a rank whose main thread a restart cannot reach
        (:func:`~elastic_ft.inprocess.hangs.verdicts.judge_stall`)."""


class MonitorThread(threading.Thread):
    """Watches one restart iteration; see the module docstring.

    Args:
        store: the iteration's store view.
        state: this rank's state (its rank, for the logs).
        side: the main thread's side of the iteration (:class:`MainThreadSide`).
        interval: seconds between two polls of a store that cannot watch,
            and between two raises of an unacknowledged restart.
        last_call_wait: seconds to wait for concurrent faults.
        planned_bound: how long a planned restart waits for the main
            thread's step boundary before it interrupts anyway.
    """

    #: How long one wait for the outcome lasts before the thread checks whether it was stopped.
    WAIT_SLICE = 1.0

    def __init__(
        self,
        store: IterationView,
        state: State,
        side: MainThreadSide,
        interval: float,
        last_call_wait: float,
        planned_bound: float = 1.5,
    ) -> None:
        super().__init__(name=f"elastic_ft-monitor-thread-{state.rank}", daemon=True)
        self.store = store
        self.state = state
        self.side = side
        self.delivery = side.delivery
        self.interval = interval
        self.last_call_wait = last_call_wait
        self.atomic_lock = side.atomic_lock
        self.interrupt = side.interrupt
        self._stop_requested = threading.Event()
        self._acknowledged = threading.Event()
        self._raise_lock = threading.Lock()
        self._held = False  # the main thread left the wrapped function: nothing more is delivered to it
        self.restart_started = threading.Event()
        #: When the restart started (``time.time()``): its connections released, ``abort`` called.
        self.restart_started_at: float | None = None
        #: A planned restart waits for the main thread at a step boundary (see _await_step_boundary).
        self.restart_planned = threading.Event()
        self.planned_bound = planned_bound

    def run(self) -> None:
        """Watch until the iteration ends or a restart is delivered; a store that does not answer (etcd away) is
        waited for, however long: the thread that delivers the next fault must outlive any outage."""
        backoff = Backoff()
        failures: set[str] = set()  # each kind of failure is logged once
        watch: KeyWatch | None = None
        try:
            while not self._stop_requested.is_set():
                if watch is None or watch.broken:
                    if watch is not None:
                        watch.stop()
                    watch = self._watch_outcome()
                if self._look(watch, backoff, failures):
                    return
        finally:
            if watch is not None:
                watch.stop()

    def _watch_outcome(self) -> KeyWatch | None:
        """The iteration's outcome watch (None: the store cannot watch, or did not answer: the wait makes its own)."""
        try:
            with bounded(self.WAIT_SLICE, "the monitor thread's wait slice"):  # the thread stays free to stop
                return self.store.watch_outcome()
        except ConnectionError:
            return None

    def _look(self, watch: KeyWatch | None, backoff: Backoff, failures: set[str]) -> bool:
        """One wait for the outcome, and what it calls for; True when the thread is done."""
        try:
            outcome = self.store.wait_for_outcome(self.WAIT_SLICE, self.interval, watch)
            if outcome == PLANNED:
                outcome = self._await_step_boundary()
            if self._stop_requested.is_set() or outcome == COMPLETED:
                return True
            if outcome is not None:
                self._restart()
                return True
            backoff.reset()
        except ConnectionError:
            self._stop_requested.wait(backoff.next())  # the process's outage record logs the outage once
        except Exception as error:
            if self._stop_requested.is_set():
                return True
            if type(error).__name__ not in failures:
                failures.add(type(error).__name__)
                log.exception("rank %s: the monitor thread's look at the store failed; looking again", self.state.rank)
            self._stop_requested.wait(backoff.next())
        return False

    def _await_step_boundary(self) -> str | None:
        """A planned restart: let the main thread reach the agreed step boundary, where it turns the outcome
        into an interruption itself (``CallWrapper``'s optimizer hook, with no collective in flight); after
        ``planned_bound`` (no step comes: a reserve rank, a long section, no ``torch.optim``), interrupt."""
        self.restart_planned.set()
        deadline = time.monotonic() + self.planned_bound
        while not self._stop_requested.wait(self.interval):
            outcome = self.store.outcome()
            if outcome != PLANNED:
                return outcome
            if time.monotonic() >= deadline:
                log.debug(
                    "rank %s: no step boundary within %g s: interrupting now", self.state.rank, self.planned_bound
                )
                return self.store.decide_outcome(INTERRUPTED)
        return None

    def _restart(self) -> None:
        if self._stop_requested.wait(self.last_call_wait):
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %s: restarting after interruptions %s", self.state.rank, self.store.interruptions())
        with self.atomic_lock:
            if self._stop_requested.is_set():
                return
            self._deliver_until_taken(self._begin_restart())

    def _begin_restart(self) -> RestartDelivery:
        """Start the restart (under the atomic lock): release the connections and call ``abort`` (unless the
        main thread did already), and arm the delivery for a main thread still in the function."""
        self.restart_started_at = time.time()
        self.restart_started.set()
        self.side.release_and_abort()
        with self._raise_lock:
            # Nothing is armed for a main thread that left the function already (it raises the restart
            # itself) or took it: a signal or a shielded section's end would raise it again later.
            if not (self._held or self._acknowledged.is_set() or self._stop_requested.is_set()):
                self.side.restart_pending(True)
                if self.interrupt is not None:
                    self.interrupt.arm(self.delivery)
        return self.delivery

    def _deliver_until_taken(self, delivery: RestartDelivery) -> None:
        """Deliver the restart to the main thread until it takes it: by signal, then scheduled as well, then
        with every connection of the function released (a peer may be frozen)."""
        started = time.monotonic()
        scheduled = self._deliver(schedule=self.interrupt is None)
        blocked_logged = released_everything = out_of_reach = False
        while not self._acknowledged.wait(self.interval):
            if self._stop_requested.is_set():
                return
            if delivery.swallowed.is_set():
                log.warning(
                    "rank %s: the wrapped function swallowed RankShouldRestart; raising it again", self.state.rank
                )
                delivery.delivered.clear()
                delivery.swallowed.clear()
                started = time.monotonic()
                scheduled = self._deliver(schedule=self.interrupt is None)
            elif not delivery.delivered.is_set() and not self._held:
                # Inside a blocking call or a finalizer: signal again; after a few tries schedule the
                # exception too (a handler replaced by the application, a call deaf to signals).
                if not blocked_logged:
                    log.warning(
                        "rank %s: restart not delivered yet (main thread blocked in C code); signalling it every %g s",
                        self.state.rank,
                        self.interval,
                    )
                    blocked_logged = True
                late = time.monotonic() - started > _SCHEDULE_AFTER * self.interval
                scheduled = self._deliver(schedule=late and not scheduled) or scheduled
                if not released_everything and time.monotonic() - started > (_RELEASE_EVERYTHING_AFTER * self.interval):
                    released_everything = True
                    try:
                        released = self.side.release_everything()
                        if self._acknowledged.is_set():  # it came back meanwhile: nothing held it
                            return
                        log.warning(
                            "rank %s: still blocked; released every connection of the function (%s), "
                            "initiated ones too: a peer may be frozen; the main thread is at %s",
                            self.state.rank,
                            released,
                            main_thread_stack(),
                        )
                    except Exception:
                        log.exception("rank %s: releasing connections failed", self.state.rank)
                elif not out_of_reach and time.monotonic() - started > _OUT_OF_REACH_AFTER * self.interval:
                    out_of_reach = self._report_out_of_reach()

    def _report_out_of_reach(self) -> bool:
        """Say so when nothing a release can end holds the main thread: every connection of the function is
        closed and it still has not come back (a gloo send in flight when its connection failed waits for the
        group's timeout). The monitor process replaces the process; the warning names the cause first. True when
        nothing is left to check: reported, or nothing to count with."""
        try:
            still_open = self.side.connections_open()
        except OSError as error:  # /proc unreadable: nothing to conclude
            log.debug("rank %s: could not count the open connections: %s", self.state.rank, error)
            return True
        if still_open is None:
            return True
        if still_open == 0:
            log.warning(
                "rank %s: %s: nothing a release can end holds it (gloo never fails a send that was in flight when "
                "its connection failed, until the group's timeout); its monitor process replaces this process. "
                "The main thread is at %s",
                self.state.rank,
                OUT_OF_REACH,
                main_thread_stack(),
            )
        return still_open == 0

    def _deliver(self, schedule: bool) -> bool:
        """Signal the main thread; with ``schedule``, schedule the exception too. True if it was scheduled."""
        with self._raise_lock:
            if self._acknowledged.is_set() or self._stop_requested.is_set() or self._held:
                return False
            schedule = schedule and not shield.active()  # not into the etcd client: the next round tries again
            if schedule:
                raise_in_main_thread(self.delivery.exception_type)
            if self.interrupt is not None:
                self.interrupt.send()
            return schedule

    def hold(self) -> None:
        """The main thread left the wrapped function (it raised): deliver nothing more to it.

        It is about to write to the store (gRPC, locks): an asynchronous
        exception landing between a lock's acquire and its ``with`` block
        would leave that lock held forever, and every later call on the same
        channel (the next iteration's monitor thread) blocked. The main thread
        waits for :attr:`restart_started` and raises the restart itself.
        """
        with self._raise_lock:
            self._held = True
            self.side.restart_pending(False)
            if self.interrupt is not None:
                self.interrupt.disarm()
            clear_main_thread_pending_exception()

    def acknowledge(self) -> None:
        """Called by the main thread once it caught the restart exception."""
        self._close(self._acknowledged)

    def stop(self) -> None:
        """Stop watching: the iteration ended without a restart, or the rank leaves."""
        self._close(self._stop_requested)

    def _close(self, event: threading.Event) -> None:
        # A restart exception already scheduled may hit the main thread anywhere in
        # here; retry until the flag is set under the raise lock and nothing is pending.
        while True:
            try:
                with self._raise_lock:
                    event.set()
                    self.side.restart_pending(False)
                    if self.interrupt is not None:
                        self.interrupt.disarm()
                    clear_main_thread_pending_exception()
                self.join()
                clear_main_thread_pending_exception()
                return
            except RankShouldRestart:
                continue
