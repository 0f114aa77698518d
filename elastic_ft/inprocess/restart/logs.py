"""Logging of the in-process restart machinery.

Every in-process module logs under ``elastic_ft.inprocess``. While a
Wrapper call runs, that logger does not propagate to the root logger, so an application's handlers (files,
log shippers) do not receive the Wrapper's messages twice or unexpectedly;
instead it gets one ``logging.StreamHandler`` modelled on the nearest
stream handler among its ancestors (same stream, formatter and level), or a
stderr handler in elastic-ft's log format (:mod:`elastic_ft.observability.log_format`)
when there is none; the call removes it when it ends.

NVIDIA's Wrapper warns when logging is not configured (a ``UserWarning``),
then drops its logs. Ours keeps them, on stderr, so the warning says
nothing a user must act on: it is a :class:`LoggingNotConfiguredWarning`,
which Python does not show unless asked to (``-W default``, or a test's
``assertWarns``/``pytest.warns``, as NVIDIA's tests do), like its own
``ResourceWarning``.
The monitor process replaces all of this with a file handler
(:func:`log_to_file`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings

from elastic_ft.observability.log_format import Formatter

LOGGER_NAME = "elastic_ft.inprocess"
#: The whole package's logger: the monitor process logs all of it to its file.
PACKAGE_LOGGER_NAME = "elastic_ft"


class LoggingNotConfiguredWarning(UserWarning):
    """A Wrapper call began with no logging configured: its restart reports go to stderr in elastic-ft's format.

    Not shown by default (the filter below); ``-W default`` or
    ``warnings.simplefilter("default", LoggingNotConfiguredWarning)`` shows it.
    """


# Appended, so the interpreter's -W options, PYTHONWARNINGS and any filter the application adds come first.
warnings.filterwarnings("ignore", category=LoggingNotConfiguredWarning, append=True)

#: The package's directory: a warning points at the first frame outside it (the application's call).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def get_logger(module: str) -> logging.Logger:
    """The logger of one in-process module, e.g. ``get_logger("wrapper")``."""
    return logging.getLogger(f"{LOGGER_NAME}.{module}")


def _nearest_stream_handler(logger: logging.Logger) -> logging.StreamHandler | None:
    current: logging.Logger | None = logger.parent
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                return handler
        current = current.parent if current.propagate else None
    return None


#: NVIDIA inprocess 0.6 logs under this logger: an application that gave it handlers gets the Wrapper's logs there.
NVIDIA_LOGGER_NAME = "nvrx"


class _ToNvidiaLogger(logging.Handler):
    """Hands each record to the ``nvrx`` logger's handlers, at that logger's level."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(NVIDIA_LOGGER_NAME)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


@dataclasses.dataclass(frozen=True)
class LoggingSetup:
    """What :func:`configure_logging` changed, for :func:`release_logging` to undo."""

    handlers: tuple[logging.Handler, ...]
    previous_level: int


def configure_logging() -> LoggingSetup | None:
    """Give the package logger its own stream handler and stop propagation, for one Wrapper call.

    The level stays the application's: only when nothing configured one
    that shows INFO (the logger unset, and its effective level above INFO,
    as with an unconfigured root) is it INFO for the call, so the restart
    reports show. Returns what it changed, for :func:`release_logging` when
    the call ends (the package leaves no handler or level behind, as NVIDIA's
    does not), or ``None`` when the logger has handlers already (an outer
    call's, or the application's own).
    """
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers:
        return None
    previous = logger.level
    nvidia = logging.getLogger(NVIDIA_LOGGER_NAME)
    if nvidia.handlers:  # configured as for NVIDIA 0.6: its handlers, at its level, get the Wrapper's logs
        handlers: tuple[logging.Handler, ...] = (_ToNvidiaLogger(),)
        if previous == logging.NOTSET and nvidia.level != logging.NOTSET:
            logger.setLevel(min(nvidia.level, logger.getEffectiveLevel()))
    else:
        template = _nearest_stream_handler(logger)
        if template is None:
            _warn_not_configured()
        handler = logging.StreamHandler(template.stream if template is not None else sys.stderr)
        formatter = template.formatter if template is not None and template.formatter is not None else Formatter()
        handler.setFormatter(formatter)
        if template is not None:
            handler.setLevel(template.level)
        handlers = (handler,)
    if previous == logging.NOTSET and logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    for added in handlers:
        logger.addHandler(added)
    return LoggingSetup(handlers, previous)


def _warn_not_configured() -> None:
    """Issue the :class:`LoggingNotConfiguredWarning`, pointing at the application's line that called the Wrapper.

    Under ``-W error`` the warning would be raised into the Wrapper's
    set-up; it is dropped instead: the reports still reach stderr, so
    nothing is lost by not stopping the call.
    """
    frame, level = sys._getframe(1), 2  # level 2: this function's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    with contextlib.suppress(LoggingNotConfiguredWarning):
        warnings.warn(
            "logging is not configured: elastic_ft.inprocess writes its restart reports to stderr "
            "(logging.basicConfig() or a handler of your own routes them)",
            LoggingNotConfiguredWarning,
            stacklevel=level,
        )


def release_logging(setup: LoggingSetup | None) -> None:
    """Undo :func:`configure_logging`: remove the handler it added, restore the level, propagate again."""
    if setup is None:
        return
    logger = logging.getLogger(LOGGER_NAME)
    for handler in setup.handlers:
        logger.removeHandler(handler)
    logger.setLevel(setup.previous_level)
    if not logger.handlers:
        logger.propagate = True


def log_to_file(path: str | None, level: int) -> None:
    """Send every log of the package (the etcd client's outage records too) only to ``path`` (nowhere when
    ``None``); for the monitor process, whose stderr is not the rank's."""
    inprocess = logging.getLogger(LOGGER_NAME)
    for handler in list(inprocess.handlers):
        inprocess.removeHandler(handler)
    inprocess.propagate = True
    inprocess.setLevel(logging.NOTSET)
    package = logging.getLogger(PACKAGE_LOGGER_NAME)
    for handler in list(package.handlers):
        package.removeHandler(handler)
    package.propagate = False
    package.setLevel(level)
    if path is None:
        package.addHandler(logging.NullHandler())
        return
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(Formatter())
    package.addHandler(handler)
