"""The warm standby process (``python -m elastic_ft.inprocess.restart.standby``): warm, wait, then run a script.

Started by ``ftrun``'s agent (``elastic_ft.launcher.standby.Standby``)
with the interpreter options of its workers. It imports what every worker
imports first (torch, ``torch.distributed``, elastic-ft's Wrapper and the
etcd store it connects to under ``ftrun``, with gRPC), runs the
Wrapper's default warm-up
(:func:`elastic_ft.inprocess.restart.warmup.import_lazy_modules`: ``torch._dynamo``
through a throwaway optimizer, distributed checkpointing), says ``ready`` on
its status pipe, and blocks on stdin.

The hand-over is one JSON line: the worker's whole environment, its script
(or module) and arguments, and its log files. The process takes them as its
own (environment, ``sys.argv``, ``sys.path[0]``, stdout and stderr) and runs
the script as ``__main__`` with :mod:`runpy`, as ``python script.py`` would;
its exit is the script's. A closed stdin without a hand-over (the agent
stopped it, or died) ends it quietly.

It warms and waits at the lowest CPU priority, so that its imports take
only cores nobody else wants, never one from training, from a recovering
job, or from another node's processes on a shared machine: its session's
autogroup at nice 19 (the standby leads a session of its own, and with
autogroups the kernel shares the CPU between sessions first, whatever the
threads' own policies: :func:`_set_session_nice`), and its threads at
``SCHED_IDLE`` where it may leave that policy again (:func:`_may_leave_idle`).
Both are undone at the hand-over: the worker it becomes runs at the usual
priority.

It creates no process group and no CUDA context while it waits, so the
warm-up's imports keep nothing alive, and the user's own warm-up
(``Wrapper(warmup=...)``) still runs in the Wrapper, once. A variable read
when a module is imported takes the value torch's workers of the node get
(the standby starts with their environment); what differs per rank (``RANK``,
``LOCAL_RANK``, the hand-offs) is read when used, after the hand-over.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
import threading
from typing import Any

from elastic_ft.handoff import STANDBY_READY, STANDBY_STATUS_FD_ENV
from elastic_ft.runtime.waits import pause
from elastic_ft.untrusted import json_document


def _warm() -> None:
    import torch
    import torch.distributed
    import torch.nn.parallel  # noqa: F401 (DistributedDataParallel)

    import elastic_ft.etcd.event_log  # the rank's event log in the store
    import elastic_ft.etcd.group_store  # the process groups' stores
    import elastic_ft.etcd.node_relay  # the node relay's client
    import elastic_ft.etcd.store  # the Wrapper's default store under ftrun: gRPC, etcd's API
    import elastic_ft.inprocess.wrapper  # noqa: F401 (the Wrapper and what it imports)
    from elastic_ft.inprocess.restart.warmup import import_lazy_modules

    import_lazy_modules()


def _may_leave_idle() -> bool:
    """Whether a thread of this process may go back from ``SCHED_IDLE`` to the usual policy: Linux counts
    ``SCHED_IDLE`` as nice 20, and an unprivileged process may leave it only with an ``RLIMIT_NICE`` that allows
    nice 0 (``CAP_SYS_NICE`` may always). Tried on a thread of its own, which ends either way."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    thread = threading.Thread(target=probe, name="elastic-ft-sched-probe")
    thread.start()
    thread.join()
    return allowed == [True]


def _session_nice() -> int | None:
    """This session's autogroup nice value (``/autogroup-N nice V``); None where there is none."""
    try:
        with open("/proc/self/autogroup") as autogroup:
            words = autogroup.read().split()
    except OSError:
        return None
    return int(words[-1]) if len(words) == 3 and words[1] == "nice" and words[2].lstrip("-").isdigit() else None


def _set_session_nice(nice: int) -> bool:
    """Set this session's autogroup nice value; False where there is none (no autogroups: the kernel's, or
    the process is in a cgroup of its own) or the kernel refuses. Raising it needs no privilege, nor does
    lowering it back to 0; the kernel takes one change a tenth of a second from an unprivileged process
    (so a value already set, as the agent sets 0 before a hand-over, is not set again)."""
    if _session_nice() == nice:
        return True
    for _ in range(10):
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(nice))
            return True
        except OSError as error:
            if error.errno != errno.EAGAIN:
                return False
            pause(0.11)
    return False


def _leave_idle() -> None:
    """Every thread of this process back to the usual policy (the threads torch started while it warmed
    inherited ``SCHED_IDLE``; the agent may have moved them already); one that fails is said on stderr, the
    worker's log by then."""
    for name in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(name)) == os.SCHED_OTHER:
                continue
            os.sched_setscheduler(int(name), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as error:
            print(f"elastic_ft standby: thread {name} stays at idle CPU priority: {error}", file=sys.stderr)


def _say_ready() -> None:
    text = os.environ.pop(STANDBY_STATUS_FD_ENV, None)
    if text is None or not text.isdigit():
        return
    fd = int(text)
    try:
        os.write(fd, STANDBY_READY)
    except OSError:
        pass  # the agent closed its end: it reads the hand-over's outcome instead
    finally:
        os.close(fd)


def _redirect(path: str, fd: int) -> None:
    """Point ``fd`` (1 or 2) at ``path``, truncated, as torch opens a worker's log file."""
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _parse(line: bytes) -> dict[str, Any]:
    """The agent's hand-over, checked: every field of the expected type."""
    message = json_document(line, "a standby's hand-over")
    env, arguments = message.get("env"), message.get("arguments")
    script, module = message.get("script"), message.get("module")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("a standby's hand-over needs 'env', an object of strings")
    if not isinstance(arguments, list) or not all(isinstance(a, str) for a in arguments):
        raise ValueError("a standby's hand-over needs 'arguments', a list of strings")
    if (script is None) == (module is None) or not isinstance(script or module, str):
        raise ValueError("a standby's hand-over names exactly one of 'script' and 'module'")
    for stream in ("stdout", "stderr"):
        if not isinstance(message.get(stream), str):
            raise TypeError(f"a standby's hand-over needs {stream!r}, a path or ''")
    return message


def main() -> None:
    lowered = _set_session_nice(19)
    idle = _may_leave_idle()
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # before any thread: they inherit it
    _warm()
    _say_ready()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return  # stopped before any hand-over
    message = _parse(line)
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(message["stdout"], 1)
    _redirect(message["stderr"], 2)
    if idle:
        _leave_idle()
    if lowered and not _set_session_nice(0):
        print("elastic_ft standby: the worker's session stays at nice 19: it could not be set back", file=sys.stderr)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the agent's pipe is spent; a worker reads nothing from it
    os.close(devnull)
    os.environ.clear()
    os.environ.update(message["env"])
    if message["script"] is not None:
        script = message["script"]
        sys.argv = [script, *message["arguments"]]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = [message["module"], *message["arguments"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(message["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
