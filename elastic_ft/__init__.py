"""elastic-ft: make PyTorch distributed training survive faults fast.

Node side: :mod:`elastic_ft.rendezvous` (the ``etcdft`` torchrun backend) and
:mod:`elastic_ft.launcher` (``ftrun``, the job config).
Worker side: :class:`Wrapper` (in-process restart) with its hooks
(:mod:`initialize`, :mod:`abort`, :mod:`finalize`, :mod:`health_check`,
:mod:`store`), and :mod:`rank_assignment` with :class:`State`, :class:`Mode`
and :class:`Compose`.
"""

from elastic_ft import abort, finalize, health_check, initialize, rank_assignment, store
from elastic_ft.compose import Compose
from elastic_ft.state import Mode, State
from elastic_ft.wrapper import CallWrapper, Wrapper

__all__ = [
    "CallWrapper",
    "Compose",
    "Mode",
    "State",
    "Wrapper",
    "abort",
    "finalize",
    "health_check",
    "initialize",
    "rank_assignment",
    "store",
]
