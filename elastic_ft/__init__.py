"""elastic-ft: make PyTorch distributed training survive faults fast.

The package is cut by side and by adapter:

* :mod:`elastic_ft.etcd`: the one etcd adapter (client, watch, session,
  view, store, embedded server), used by both sides;
* :mod:`elastic_ft.rendezvous`: the ``etcdft`` torchrun backend (node side);
* :mod:`elastic_ft.launcher`: ``ftrun``, its agent and the ``elastic-ft`` tool (node side);
* :mod:`elastic_ft.inprocess`: in-process restart (:class:`Wrapper`), its
  hooks and monitors, and rank assignment (worker side);
* :mod:`elastic_ft.keys`, :mod:`elastic_ft.handoff`, :mod:`elastic_ft.job_config`:
  what the sides share (the key schema, the node -> worker hand-off, the job config);
* :mod:`elastic_ft.testing`: helpers for tests, the demo and benchmarks.

The worker API is re-exported here lazily: ``import elastic_ft`` loads
neither torch nor the worker side until a name below is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_ft.runtime.lazy import lazy_exports

__all__ = [
    "CallWrapper",
    "Compose",
    "Mode",
    "State",
    "Wrapper",
    "abort",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "rank_assignment",
    "store",
]

# Every name is the worker package's own, resolved (lazily) there.
__getattr__, __dir__ = lazy_exports(__name__, {name: f"elastic_ft.inprocess:{name}" for name in __all__}, globals())

if TYPE_CHECKING:
    from elastic_ft.inprocess import (
        CallWrapper,
        Compose,
        Mode,
        State,
        Wrapper,
        abort,
        exception,
        finalize,
        health_check,
        initialize,
        rank_assignment,
        store,
    )
