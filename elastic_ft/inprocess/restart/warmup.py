"""Warm-up of a rank that waits: what torch would otherwise do on the critical path of its first iteration.

A rank that trains for the first time after a fault (a hot spare, an
admitted joiner, a respawned process) runs the user's function from its
first line, and torch does much of its work lazily, on first use: the
first ``torch.optim`` optimizer built in a process imports ``torch._dynamo``
(about 800 modules, 1.5 to 2 s on two cores), while the survivors wait for
that rank at their first collective. Such a rank waits before it is needed
(for its admission, or in reserve), so the Wrapper spends that wait on the
same work, once per process (:func:`warm_up`).

The warm-up runs only while the process has no process group: importing
``torch._dynamo`` after a gloo group exists keeps that group, and its
connections, alive past its abort. A process that already has a group
skips it (it trained before, and paid the imports then).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.runtime.torch_compat import registered_groups

log = get_logger("warmup")

_lock = threading.Lock()
_warmed = False


def import_lazy_modules() -> None:
    """The Wrapper's default warm-up: what a training script's set-up makes torch import on first use.

    Building an optimizer is what imports ``torch._dynamo`` (with sympy and
    the compiler's modules behind it), whichever optimizer the script builds;
    a throwaway one on a one-element tensor does it without touching the
    job's state. Distributed checkpointing is imported too: a script that
    resumes from a checkpoint reads it in its first iteration; and what a
    ``DataLoader`` with worker processes imports when it starts them.
    """
    for name in ("multiprocessing.popen_fork", "multiprocessing.queues"):  # a DataLoader's worker processes
        importlib.import_module(name)

    import torch
    import torch.distributed.checkpoint  # the modules a first checkpoint read loads

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def warm_up(warmup: Callable[[], Any] | None, why: str) -> bool:
    """Run ``warmup`` if this process has not, and has no process group yet; True if it ran now.

    ``why`` says which wait pays for it (for the log). An exception of the
    warm-up is logged and not raised: a warm-up is an optimisation, and the
    first iteration does the same work if it failed.
    """
    global _warmed
    if warmup is None:
        return False
    with _lock:
        if _warmed:
            return False
        _warmed = True
        if registered_groups():
            log.info("warm-up skipped: this process has a process group already (it trained before)")
            return False
        begun = time.monotonic()
        try:
            warmup()
        except Exception:  # logged: the first iteration pays the same work instead
            log.warning("the warm-up raised; the first iteration pays what it would have done", exc_info=True)
            return False
        log.info("warm-up done in %.2f s while %s", time.monotonic() - begun, why)
        return True
