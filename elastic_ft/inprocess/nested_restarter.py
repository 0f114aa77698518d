"""Hooks that report the in-process restarter's stages to an outer (in-job) restarter's log.

NVIDIA's ``ft_launcher`` reads lines ``[NestedRestarter] name=[InProcess]
state=<state> stage=<stage>`` from its workers to know where the
in-process layer stands. These hooks write the same lines, on one rank
(``special_rank``, an initial rank), to the logger named
``"elastic_ft.nested_restarter"``, so that tools reading them keep working. ``ftrun`` itself does not
need them: its agent learns of faults and give-ups from the job's records
in etcd.

Use them as NVIDIA's examples do::

    Wrapper(
        initialize=NestedRestarterHandlingCompleted(),
        abort=Compose(AbortTorchDistributed(), NestedRestarterHandlingStarting()),
        completion=NestedRestarterFinalized(),
        terminate=NestedRestarterAborted(),
    )
"""

from __future__ import annotations

import logging

from elastic_ft.inprocess.abort import Abort
from elastic_ft.inprocess.completion import Completion
from elastic_ft.inprocess.initialize import Initialize
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.terminate import Terminate

#: The logger these hooks write to.
NESTED_RESTARTER_LOGGER = "elastic_ft.nested_restarter"


class NestedRestarterLogger:
    """Writes the restarter's lines to the logger named ``"elastic_ft.nested_restarter"`` (on stderr if nothing is
    set up).

    NVIDIA's is a ``RankMonitorLogger`` of its fault-tolerance launcher; this
    one keeps the two calls the hooks make.
    """

    def __init__(self) -> None:
        #: The ``logging.Logger`` written to (NVIDIA's attribute name).
        self.restarter_logger = logging.getLogger(NESTED_RESTARTER_LOGGER)
        self.connected_rank: int | None = None

    def set_connected_rank(self, rank: int | None) -> None:
        self.connected_rank = rank

    def log_for_restarter(self, message: str) -> None:
        log = self.restarter_logger
        if not log.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        log.info(message)


_shared_logger = NestedRestarterLogger()


class NestedRestarterCallback:
    """Logs ``[NestedRestarter] name=[InProcess] state=<restarter_state> stage=<restarter_stage>`` on ``special_rank``.

    Args:
        restarter_state: the state to report (``initialize``, ``handling``,
            ``finalized``, ``aborted``).
        restarter_stage: the stage within it (``starting``, ``completed``) or ``None``.
        logger: where to write; default one shared :class:`NestedRestarterLogger`.
        special_rank: the initial rank that reports.
    """

    restarter_state: str = ""
    restarter_stage: str | None = None
    logger: NestedRestarterLogger = _shared_logger
    special_rank: int = 0

    def __init__(
        self,
        restarter_state: str,
        restarter_stage: str | None = None,
        logger: NestedRestarterLogger | None = None,
        special_rank: int = 0,
    ) -> None:
        if not isinstance(restarter_state, str) or not restarter_state:
            raise ValueError(f"restarter_state must be a non-empty string, got {restarter_state!r}")
        if isinstance(special_rank, bool) or not isinstance(special_rank, int) or special_rank < 0:
            raise ValueError(f"special_rank must be an int >= 0, got {special_rank!r}")
        self.restarter_state = restarter_state
        self.restarter_stage = restarter_stage
        self.logger = logger if logger is not None else _shared_logger
        self.special_rank = special_rank

    def message(self) -> str:
        text = f"[NestedRestarter] name=[InProcess] state={self.restarter_state}"
        return text if self.restarter_stage is None else f"{text} stage={self.restarter_stage}"

    def __call__(self, state: State) -> State:
        if state.initial_rank == self.special_rank:
            self.logger.set_connected_rank(state.initial_rank)
            self.logger.log_for_restarter(self.message())
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self.restarter_state!r}, stage={self.restarter_stage!r})"


class NestedRestarterHandlingCompleted(NestedRestarterCallback, Initialize):
    """``initialize``: reports ``state=initialize`` at the first iteration, ``state=handling stage=completed`` after."""

    restarter_state = "initialize"

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "initialize", None, special_rank=special_rank)

    def __call__(self, state: State) -> State:
        NestedRestarterCallback.__call__(self, state)
        self.restarter_state, self.restarter_stage = "handling", "completed"
        return state


class NestedRestarterHandlingStarting(NestedRestarterCallback, Abort):
    """``abort``: reports ``state=handling stage=starting`` when a restart begins."""

    restarter_state = "handling"
    restarter_stage = "starting"

    def __init__(
        self,
        restarter_state: str = "handling",
        restarter_stage: str | None = "starting",
        logger: NestedRestarterLogger | None = None,
        special_rank: int = 0,
    ) -> None:
        NestedRestarterCallback.__init__(self, restarter_state, restarter_stage, logger, special_rank)


class NestedRestarterFinalized(NestedRestarterCallback, Completion):
    """``completion``: reports ``state=finalized`` when the Wrapper completed."""

    restarter_state = "finalized"

    def __init__(
        self,
        restarter_state: str = "finalized",
        restarter_stage: str | None = None,
        logger: NestedRestarterLogger | None = None,
        special_rank: int = 0,
    ) -> None:
        NestedRestarterCallback.__init__(self, restarter_state, restarter_stage, logger, special_rank)


class NestedRestarterAborted(NestedRestarterCallback, Terminate):
    """``terminate``: reports ``state=aborted`` when the rank leaves the job."""

    restarter_state = "aborted"

    def __init__(
        self,
        restarter_state: str = "aborted",
        restarter_stage: str | None = None,
        logger: NestedRestarterLogger | None = None,
        special_rank: int = 0,
    ) -> None:
        NestedRestarterCallback.__init__(self, restarter_state, restarter_stage, logger, special_rank)
