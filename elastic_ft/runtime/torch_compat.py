"""torch's private internals that elastic-ft relies on, in one place, checked against the torch versions tested.

Two sides reach below torch's public API:

* the worker side reads ``torch.distributed``'s process-group registry
  (``distributed_c10d._world``: which groups exist, and the counter that
  names the next one);
* ``ftrun``'s agent extends ``SimpleElasticAgent`` through its protected
  members (``_rendezvous``, ``_start_workers``, ``_invoke_run``,
  ``_exit_barrier``, ``_remaining_restarts``, ``_pcontext``,
  ``_exit_barrier_timeout``) and replaces one worker's
  ``SubprocessHandler`` in its ``SubprocessContext`` when it respawns it.

Every such use goes through this module. :func:`check_torch` runs before
either side touches one (the Wrapper's first call, the agent's
construction): on a torch outside :data:`TESTED` it fails with a message
naming the version and the range, unless the user opts in with
``ELASTIC_FT_UNTESTED_TORCH=1`` (then it warns once), and it fails on any
torch, tested or not, that lacks one of the members named here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

#: The oldest and newest torch minor versions CI runs (the whole suite on one, the end-to-end tests on the other).
TESTED = ((2, 13), (2, 15))
#: Opt in to a torch outside :data:`TESTED` (a warning instead of an error).
UNTESTED_OPT_IN = "ELASTIC_FT_UNTESTED_TORCH"
#: The agent members ``FtAgent`` overrides or reads; torch renaming one would silently bypass elastic-ft.
AGENT_MEMBERS = ("_rendezvous", "_start_workers", "_invoke_run", "_exit_barrier", "_restart_workers", "_stop_workers")


class UnsupportedTorchError(RuntimeError):
    """The installed torch is one elastic-ft was not tested with, or lacks an internal it relies on."""


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.15.0+cu130`` or ``2.16.0a0+git1234`` (pure)."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise UnsupportedTorchError(f"torch.__version__={text!r} is not a version; expected MAJOR.MINOR[...]")
    return int(match[1]), int(match[2])


def version_verdict(version: tuple[int, int], opted_in: bool) -> str | None:
    """None when ``version`` is tested; otherwise the message: an error, or a warning when ``opted_in`` (pure)."""
    oldest, newest = TESTED
    if oldest <= version <= newest:
        return None
    found = ".".join(map(str, version))
    tested = f"{oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}"
    if opted_in:
        return f"torch {found} is outside the versions elastic-ft is tested with ({tested}); {UNTESTED_OPT_IN} is set"
    return (
        f"torch {found} is outside the versions elastic-ft is tested with ({tested}): elastic-ft uses torch "
        f"internals that change between versions. Install a tested torch, or set {UNTESTED_OPT_IN}=1 to try it"
    )


@functools.cache
def check_torch() -> None:
    """Fail (or warn, when opted in) on an untested torch; fail on one lacking an internal used here. Once per
    process."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    verdict = version_verdict(parse_version(torch.__version__), os.environ.get(UNTESTED_OPT_IN) == "1")
    if verdict is not None:
        if os.environ.get(UNTESTED_OPT_IN) != "1":
            raise UnsupportedTorchError(verdict)
        warnings.warn(verdict, stacklevel=2)
    missing = [f"SimpleElasticAgent.{name}" for name in AGENT_MEMBERS if not hasattr(SimpleElasticAgent, name)]
    if "subprocess_handlers" not in SubprocessContext.__init__.__code__.co_names:
        missing.append("SubprocessContext.subprocess_handlers")
    if dist.is_available() and not hasattr(dist.distributed_c10d, "_world"):
        missing.append("torch.distributed.distributed_c10d._world")
    if dist.is_available() and not hasattr(dist.ProcessGroup, "_get_backend"):
        missing.append("torch.distributed.ProcessGroup._get_backend")
    if missing:
        raise UnsupportedTorchError(f"torch {torch.__version__} lacks what elastic-ft relies on: {', '.join(missing)}")


# ---- the worker side: torch.distributed's process-group registry ----


def registered_groups() -> list[Any]:
    """Every process group this process has registered (the default group included)."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    return list(dist.distributed_c10d._world.pg_map)


def group_names() -> list[Any]:
    """The process groups torch names (what ``destroy_process_group`` would destroy)."""
    import torch.distributed as dist

    return list(dist.distributed_c10d._world.pg_names)


def group_backend(group: Any, device: Any) -> Any:
    """The backend (``ProcessGroupGloo``, ``ProcessGroupNCCL``) that serves ``group`` on ``device``: torch's
    private ``ProcessGroup._get_backend``, the one way to reach a group's communicator to abort it."""
    return group._get_backend(device)


def forget_group_numbers() -> None:
    """Restart the counter that names new groups, as ``destroy_process_group()`` of every group does, and free
    the names of groups the Python side never learned of.

    An ``init_process_group`` interrupted before it registered its group
    still took a number; without this, the next init on this rank would name
    its group differently from the ranks whose init succeeded.
    """
    import torch
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    if world.pg_map and not dist.is_initialized():
        # An init interrupted after torch registered its group, but before the group became the default one:
        # with no default group no other can be live, and the next init would clash with the name it took
        # ("The specified group name has already been created").
        for group in list(world.pg_map):
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(group)
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
            table.clear()
    world.group_count = 0
    if not world.pg_map:
        # An init interrupted after torch's C++ registry took its group's name, but before the Python side
        # knew the group: no destroy_process_group frees the name, and every later init on this rank fails
        # with "A process group is already registered under the name 0". No group is live here.
        unregister = getattr(torch._C._distributed_c10d, "_unregister_all_process_groups", None)
        if unregister is not None:
            unregister()


def forget_mesh_caches() -> None:
    """Empty torch's DTensor caches that keep device meshes, once the process groups behind them are gone.

    A ``DeviceMesh`` compares equal to any other of the same layout and
    dimension names, whatever its process groups. DTensor caches results
    keyed by meshes (the sharding propagation of each operator, the
    redistribution planners, the mesh topology): after a restart, an
    operator on the new mesh (a ``detach`` in ``get_model_state_dict``) is
    answered from the cache with the *old* mesh, and its collectives then
    look up the old iteration's group names, unknown or another group's
    by now ("Could not resolve the process group registered under the
    name 4"). The caches are per process (the Python sharding propagation's
    per thread: this clears the calling thread's, the main thread's at a
    restart).
    """
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return  # DTensor was never used: nothing is cached
    import torch
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor import _collective_utils, _redistribute

    propagator = dtensor.DTensor._op_dispatcher.sharding_propagator
    for cached in (
        propagator.propagate_op_sharding,
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    ):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    # The C++ fast path of DTensor's dispatch keeps its own copy of the sharding propagation (torch >= 2.9).
    for clear_module_cache in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ):
        if clear_module_cache is not None:
            clear_module_cache()


def dump_flight_recorder() -> bytes:
    """This process's Flight Recorder entries (every backend's, gloo included), pickled, without stack traces:
    collecting those takes the GIL, which a hung main thread may hold."""
    import torch

    dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
    return bytes(dump(includeCollectives=True, includeStackTraces=False))


def stop_dcp_async_save_process() -> int | None:
    """End torch DCP's process-based ``async_save`` daemon, if one runs, so the next save starts a fresh one.

    The daemon joined a process group of the world it was started in; after
    a restart that world is gone. Returns the PID ended, or None.
    """
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return None
    process = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if process is None:
        return None
    executor._CHECKPOINT_PROCESS = None
    save_process = getattr(process, "_save_process", None)
    if save_process is None:
        return None
    pid = save_process.pid
    if save_process.is_alive():
        save_process.kill()
    save_process.join(timeout=5)
    return pid


# ---- the node side: torch's elastic agent ----


def worker_processes(agent: Any) -> Any:
    """The agent's ``SubprocessContext`` (``ftrun`` starts script or binary workers, never functions)."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    context = agent._pcontext
    if not isinstance(context, SubprocessContext):
        raise TypeError(f"FtAgent expected worker subprocesses, got {type(context).__name__}")
    return context


@contextlib.contextmanager
def launched_agent_class(agent_class: type) -> Iterator[None]:
    """Have torch's ``launch_agent`` build ``agent_class`` instead of ``LocalElasticAgent``.

    ``launch_agent`` constructs the agent by this module-level name; swapping
    it for the call reuses all of torch's launcher (worker spec, rendezvous
    handler, error files, exit codes) rather than forking it.
    """
    from torch.distributed.launcher import api as launcher_api

    original = launcher_api.LocalElasticAgent
    setattr(launcher_api, "LocalElasticAgent", agent_class)  # noqa: B010 - a module's class, swapped: no mypy error
    try:
        yield
    finally:
        setattr(launcher_api, "LocalElasticAgent", original)  # noqa: B010


def group_store(worker_group: Any) -> Any:
    """The worker group's store (torch declares ``WorkerGroup.store`` as ``None``; its rendezvous sets it before
    any worker starts, which is when the agent reads it)."""
    store = worker_group.store
    if store is None:
        raise RuntimeError("the worker group has no store yet: its rendezvous has not completed")
    return store


def replace_worker_process(context: Any, local_rank: int, handler: Any) -> None:
    """Watch ``handler`` (a new process) as ``local_rank`` from now on: torch's ``_poll`` reads this list."""
    context.subprocess_handlers[local_rank] = handler


def set_remaining_restarts(agent: Any, remaining: int) -> None:
    """What torch's agent exports as ``TORCHELASTIC_MAX_RESTARTS`` left and counts down on a failure."""
    agent._remaining_restarts = remaining


def exit_barrier_timeout(agent: Any) -> float:
    """Seconds torch's agent gives the exit barrier (``LaunchConfig.exit_barrier_timeout``)."""
    return float(agent._exit_barrier_timeout)
