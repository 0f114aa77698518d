"""The worker side: in-process restart, its hooks and monitors, rank assignment.

Mirrors ``nvidia_resiliency_ext.inprocess`` so that a migration is an
import swap: the modules at this level are NVIDIA's public names, thin
(they re-export or adapt); one error family (:mod:`.exception`). Names are
imported on first use.

* :mod:`.wrapper`: :class:`Wrapper` and its arguments; :mod:`.wrap`, NVIDIA's name for it;
* :mod:`.store`: the default store, and NVIDIA's ``StoreMixin`` (the
  protocol itself is :mod:`elastic_ft.coordination`, shared with ``ftrun``);
* :mod:`.monitor_thread`, :mod:`.monitor_process`, :mod:`.progress_watchdog`,
  :mod:`.sibling_monitor`: NVIDIA's names for the monitors;
* :mod:`.initialize`, :mod:`.abort`, :mod:`.finalize`, :mod:`.health_check`,
  :mod:`.completion`, :mod:`.terminate`: the composable hooks;
  :mod:`.nested_restarter`: hooks that report to an outer restarter's log;
  :mod:`.compose`, :mod:`.state`;
* :mod:`.rank_assignment`: renumbering and spare activation; :mod:`.rank_filter`:
  the deprecated filters on a state alone;
* :mod:`.tools`: fault injection for rehearsing recoveries (NVIDIA's ``inject_fault``).

The engine is in folders by concern: ``restart/`` (the loop, one iteration
and its unwind), ``delivery/`` (a fault delivered to the main thread),
``hangs/`` (heartbeats, the monitor process, the verdicts), ``steps/`` (the
step gate), ``healing/`` (peer state healing), ``compat/`` (NVIDIA's API the
Wrapper does not use); ``docs/design.md`` walks a fault through them.
``docs/migration.md`` lists every public name of NVIDIA's package 0.4.1 and
its status here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_ft.runtime.lazy import lazy_exports

__all__ = [
    "CallWrapper",
    "Compose",
    "FrozenState",
    "Mode",
    "State",
    "Wrapper",
    "abort",
    "completion",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "monitor_process",
    "monitor_thread",
    "nested_restarter",
    "progress_watchdog",
    "rank_assignment",
    "rank_filter",
    "state",
    "store",
    "terminate",
    "tools",
    "wrap",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CallWrapper": "elastic_ft.inprocess.restart.call:CallWrapper",
        "Wrapper": "elastic_ft.inprocess.wrapper:Wrapper",
        "Compose": "elastic_ft.inprocess.compose:Compose",
        "FrozenState": "elastic_ft.inprocess.state:FrozenState",
        "Mode": "elastic_ft.inprocess.state:Mode",
        "State": "elastic_ft.inprocess.state:State",
        **{name: f"elastic_ft.inprocess.{name}" for name in __all__ if name[0].islower()},
    },
    globals(),
)

if TYPE_CHECKING:
    from elastic_ft.inprocess import (
        abort,
        completion,
        exception,
        finalize,
        health_check,
        initialize,
        monitor_process,
        monitor_thread,
        nested_restarter,
        progress_watchdog,
        rank_assignment,
        rank_filter,
        state,
        store,
        terminate,
        tools,
        wrap,
    )
    from elastic_ft.inprocess.compose import Compose
    from elastic_ft.inprocess.restart.call import CallWrapper
    from elastic_ft.inprocess.state import FrozenState, Mode, State
    from elastic_ft.inprocess.wrapper import Wrapper
