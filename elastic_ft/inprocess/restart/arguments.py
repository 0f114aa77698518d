"""The Wrapper's arguments: their defaults, their checks, and the defaults ``ftrun`` passes down.

The durations, their defaults and their orderings are the table of
:mod:`elastic_ft.timeouts`, which the job config checks against too.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import signal
from typing import Any

from elastic_ft.handoff import job_config_from_env
from elastic_ft.inprocess.hangs.verdicts import AdaptiveTimeouts
from elastic_ft.inprocess.rank_assignment.from_config import policy_from_config
from elastic_ft.timeouts import MAX_SECONDS, MAY_BE_ZERO, WRAPPER_DEFAULTS, WRAPPER_ORDER

#: The default of each duration argument. The Wrapper's signature uses these
#: very objects, so an argument still identical to one was not given in code.
DEFAULT_DURATIONS: dict[str, datetime.timedelta] = {
    name: datetime.timedelta(seconds=seconds) for name, seconds in WRAPPER_DEFAULTS.items()
}


class _DefaultCount(int):
    """A default count the Wrapper's signature holds: equal to the number, but not the same object as a count
    given in code, so the job config replaces only the default."""


#: The defaults of the restart limits (see :func:`elastic_ft.coordination.fault_records.give_up`).
DEFAULT_LIMITS: dict[str, int] = {
    "max_identical_faults": _DefaultCount(3),
    "max_restarts_without_progress": _DefaultCount(10),
}
#: The default of ``min_progress_steps``: any step is progress.
DEFAULT_MIN_PROGRESS_STEPS = _DefaultCount(1)


def validate_arguments(arguments: dict[str, Any]) -> None:
    """Check the Wrapper's arguments and the relations between its timeouts.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a value out of range, or timeouts in the wrong order,
            naming the arguments involved.
    """
    for name in WRAPPER_DEFAULTS:
        value = arguments[name]
        if not isinstance(value, datetime.timedelta):
            raise TypeError(f"Wrapper {name} must be a datetime.timedelta, got {value!r}")
        may_be_zero = name in MAY_BE_ZERO
        zero = datetime.timedelta(0)
        if value < zero or (value == zero and not may_be_zero):
            raise ValueError(f"Wrapper {name} must be {'>= 0' if may_be_zero else 'positive'}, got {value}")
        if value.total_seconds() > MAX_SECONDS:
            raise ValueError(f"Wrapper {name} must be at most 30 days, got {value}")
    for name in ("store_factory", "rank_assignment"):
        if not callable(arguments[name]):
            raise TypeError(f"Wrapper {name} must be callable, got {_shown(arguments[name])}")
    hooks = ("initialize", "abort", "finalize", "health_check", "completion", "terminate", "rank_filter")
    for name in (*hooks, "state_dict", "load_state_dict", "warmup"):
        if arguments[name] is not None and not callable(arguments[name]):
            hint = ""
            if name in ("state_dict", "load_state_dict"):
                hint = f" (the method itself, e.g. {name}=model.{name}, not what it returns)"
            raise TypeError(f"Wrapper {name} must be callable or None{hint}, got {_shown(arguments[name])}")
    for name in DEFAULT_LIMITS:
        value = arguments[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Wrapper {name} must be a whole number >= 1, or None for no limit; got {value!r}")
    steps = arguments["min_progress_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Wrapper min_progress_steps must be a whole number >= 1, got {steps!r}")
    if (arguments["state_dict"] is None) != (arguments["load_state_dict"] is None):
        given = "state_dict" if arguments["state_dict"] is not None else "load_state_dict"
        raise ValueError(
            f"Wrapper {given} was given alone: peer state healing needs both state_dict and load_state_dict"
        )
    if arguments["store_kwargs"] is not None and not isinstance(arguments["store_kwargs"], dict):
        raise TypeError(f"Wrapper store_kwargs must be a dict or None, got {arguments['store_kwargs']!r}")
    if not isinstance(arguments["enabled"], bool):
        raise TypeError(f"Wrapper enabled must be a bool, got {arguments['enabled']!r}")
    adaptive = arguments["adaptive_timeouts"]
    if adaptive is not None and not isinstance(adaptive, AdaptiveTimeouts):
        raise TypeError(f"Wrapper adaptive_timeouts must be an AdaptiveTimeouts or None, got {adaptive!r}")
    interrupt = arguments["interrupt_signal"]
    if interrupt is not None and (isinstance(interrupt, bool) or interrupt not in signal.valid_signals()):
        raise ValueError(f"Wrapper interrupt_signal must be a signal (e.g. signal.SIGUSR2) or None, got {interrupt!r}")
    if interrupt in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"Wrapper interrupt_signal cannot be {interrupt!r}: it cannot be handled")
    for name in ("monitor_process_logfile", "monitor_process_pidfile"):
        path = arguments[name]
        if path is None:
            continue
        if not isinstance(path, str) or not pathlib.Path(path).is_absolute():
            raise ValueError(f"Wrapper {name} must be an absolute path, got {path!r}")
        try:
            path.format(rank=0)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"Wrapper {name} may only contain the {{rank}} placeholder, got {path!r}") from error
    for smaller, larger in WRAPPER_ORDER:
        if not arguments[smaller] < arguments[larger]:
            raise ValueError(
                f"Wrapper needs {smaller} < {larger}, got {smaller}={arguments[smaller]} and {larger}={arguments[larger]}"
            )


def job_config_defaults() -> dict[str, Any]:
    """Defaults from the job config ``ftrun`` passed down; arguments given in code take precedence."""
    config = job_config_from_env(os.environ)
    if config is None:
        return {}
    defaults: dict[str, Any] = {
        name: datetime.timedelta(seconds=value) for name, value in config.wrapper.durations().items()
    }
    defaults.update({name: value or None for name, value in config.wrapper.limits().items()})  # 0: no limit
    if config.wrapper.min_progress_steps is not None:
        defaults["min_progress_steps"] = config.wrapper.min_progress_steps
    policy = policy_from_config(config)
    if policy is not None:
        defaults["rank_assignment"] = policy
    return defaults


def apply_job_config_defaults(arguments: dict[str, Any]) -> None:
    """Replace, in ``arguments``, the defaults the code left alone by the job config's values."""
    for name, value in job_config_defaults().items():
        given = arguments[name]
        default = {**DEFAULT_DURATIONS, **DEFAULT_LIMITS, "min_progress_steps": DEFAULT_MIN_PROGRESS_STEPS}.get(name)
        if given is default or (name == "rank_assignment" and given is None):
            arguments[name] = value


def _shown(value: object) -> str:
    """A bad argument in an error message: its type, and its repr cut short (a state dict's runs to megabytes)."""
    text = repr(value)
    return f"a {type(value).__name__}: {text[:80]}..." if len(text) > 80 else f"a {type(value).__name__}: {text}"
