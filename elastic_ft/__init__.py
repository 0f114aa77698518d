"""elastic-ft: make PyTorch distributed training survive faults fast.

Node side: :mod:`elastic_ft.rendezvous` (the ``etcdft`` torchrun backend).
Worker side: :class:`State`, :class:`Mode`, :class:`Compose` and
:mod:`elastic_ft.rank_assignment` (rank reassignment and spare activation).
"""

from elastic_ft import rank_assignment
from elastic_ft.compose import Compose
from elastic_ft.state import Mode, State

__all__ = ["Compose", "Mode", "State", "rank_assignment"]
