"""What a host's devices say about its health: NIC links, GPUs, storage paths.

Shared by the worker side (the Wrapper's chained restart health checks,
:mod:`elastic_ft.inprocess.health_check`) and the launcher (``ftrun``'s
checks before a node joins a rendezvous). Each function reads the host and
returns data; deciding what a finding means is the caller's job.

* NIC links come from sysfs: InfiniBand/RoCE ports under
  ``class/infiniband/<device>/ports/<port>/`` (``state``, and the
  ``counters/link_downed`` counter), Ethernet interfaces under
  ``class/net/<name>/operstate``. Without a list of interfaces, only
  physical ones (those with a ``device`` entry) are read: a container's veth
  or a bridge coming and going says nothing about the host's network.
* GPUs: through NVML (``pynvml``) when it is installed and the driver has
  GPU recovery actions; otherwise a CUDA synchronize within a timeout.
  A host without CUDA has no GPU to fail.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NicLink:
    """One NIC port's state, as sysfs shows it."""

    name: str  #: ``mlx5_0/1`` for an InfiniBand port, ``eth0`` for an Ethernet interface
    up: bool
    state: str  #: sysfs's words: ``ACTIVE``, ``DOWN``, ``up``, ``down``...
    link_downed: int | None = None  #: times the port went down (InfiniBand only)


def nic_links(sysfs_root: str | os.PathLike[str] = "/sys", interfaces: list[str] | None = None) -> dict[str, NicLink]:
    """The host's NIC links by name; ``interfaces`` limits them (InfiniBand ports are named ``device/port``)."""
    root = Path(sysfs_root)
    links: dict[str, NicLink] = {}
    infiniband = root / "class" / "infiniband"
    for device in _listdir(infiniband):
        for port in _listdir(infiniband / device / "ports"):
            port_dir = infiniband / device / "ports" / port
            state = _read(port_dir / "state")
            if state is None:
                continue
            words = state.split(":", 1)[-1].strip()  # "4: ACTIVE"
            counter = _read(port_dir / "counters" / "link_downed")
            name = f"{device}/{port}"
            links[name] = NicLink(name, words == "ACTIVE", words, _int_or_none(counter))
    net = root / "class" / "net"
    for name in _listdir(net):
        if interfaces is None and not (net / name / "device").exists():
            continue  # virtual: loopback, veth, bridge, tunnel
        state = _read(net / name / "operstate")
        if state is not None:
            links[name] = NicLink(name, state == "up", state)
    if interfaces is not None:
        missing = sorted(set(interfaces) - set(links))
        if missing:
            raise ValueError(f"no NIC named {missing} under {root} (found: {sorted(links) or 'none'})")
        links = {name: links[name] for name in interfaces}
    return links


def lost_links(baseline: dict[str, NicLink], now: dict[str, NicLink]) -> list[str]:
    """Why each link that was up in ``baseline`` is not healthy ``now``: gone, down, or went down in between."""
    problems = []
    for name, before in sorted(baseline.items()):
        if not before.up:
            continue  # down from the start: not this host's change
        after = now.get(name)
        if after is None:
            problems.append(f"{name} disappeared")
        elif not after.up:
            problems.append(f"{name} is {after.state} (was {before.state})")
        elif (
            before.link_downed is not None and after.link_downed is not None and after.link_downed > before.link_downed
        ):
            problems.append(f"{name} went down {after.link_downed - before.link_downed} time(s) since")
    return problems


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def gpu_problems(device_index: int | None, timeout: float = 30.0) -> list[str]:
    """What is wrong with the GPU ``device_index`` (every GPU when None); empty when healthy or when no CUDA.

    NVML's GPU recovery action, when the driver reports one, says whether a
    GPU needs a reset or a reboot; without NVML, a GPU that does not
    finish its pending work within ``timeout`` seconds, or reports an error
    doing so, is unhealthy.
    """
    if not cuda_available():
        return []
    import torch

    indices = list(range(torch.cuda.device_count())) if device_index is None else [device_index]
    problems = _nvml_recovery_actions(indices)
    if problems is not None:
        return problems
    return [p for index in indices if (p := _synchronize(index, timeout)) is not None]


def nvlink_problems(device_index: int | None) -> list[str]:
    """NVLinks of the GPU(s) that are not active, per NVML; empty without CUDA or NVML."""
    if not cuda_available():
        return []
    nvml = _nvml()
    if nvml is None:
        return []
    import torch

    indices = list(range(torch.cuda.device_count())) if device_index is None else [device_index]
    problems = []
    for index in indices:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except nvml.NVMLError:
                continue  # no such link on this GPU
            if not active:
                problems.append(f"GPU {index} NVLink {link} is inactive")
    return problems


def storage_problems(paths: list[str], timeout: float = 10.0) -> list[str]:
    """Paths that are not a writable directory: each gets a file written, read back and removed within ``timeout``.

    The probe runs in a thread, so a hung network filesystem makes the
    check fail after ``timeout`` rather than hang its caller.
    """
    problems = []
    for path in paths:
        outcome: list[str] = []
        probe = threading.Thread(
            target=_probe_storage, args=(path, outcome), name="elastic_ft-storage-probe", daemon=True
        )
        probe.start()
        probe.join(timeout)
        if probe.is_alive():
            problems.append(f"storage {path}: no answer within {timeout:g} s")
        elif outcome:
            problems.append(f"storage {path}: {outcome[0]}")
    return problems


def _probe_storage(path: str, outcome: list[str]) -> None:
    try:
        if not os.path.isdir(path):
            outcome.append("not a directory")
            return
        payload = os.urandom(16)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".elastic-ft-probe-") as probe:
            probe.write(payload)
            probe.flush()
            os.fsync(probe.fileno())
            probe.seek(0)
            if probe.read() != payload:
                outcome.append("read back something else than was written")
    except OSError as error:
        outcome.append(f"{type(error).__name__}: {error}")


def _nvml() -> Any:
    """The ``pynvml`` module, initialised, or None when it is not installed or finds no driver."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        log.info("NVML is not usable (%s): GPU checks use CUDA alone", error)
        return None
    return pynvml


def _nvml_recovery_actions(indices: list[int]) -> list[str] | None:
    """GPUs whose driver asks for a recovery action; None when NVML or the query is not there."""
    nvml = _nvml()
    if nvml is None or not hasattr(nvml, "nvmlDeviceGetGpuRecoveryAction"):
        return None
    problems = []
    for index in indices:
        try:
            action = nvml.nvmlDeviceGetGpuRecoveryAction(nvml.nvmlDeviceGetHandleByIndex(index))
        except nvml.NVMLError_NotSupported:
            return None  # a driver older than recovery actions
        if action != getattr(nvml, "NVML_GPU_RECOVERY_ACTION_NONE", 0):
            problems.append(f"GPU {index}: the driver asks for recovery action {action}")
    return problems


def synchronize_within(device: int | None, timeout: float) -> tuple[bool, BaseException | None]:
    """Wait for ``device``'s pending CUDA work (the current device when None), in a thread so that a device
    that never finishes cannot block the caller: ``(finished, error)``."""
    import torch

    errors: list[BaseException] = []

    def synchronize() -> None:
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as error:
            errors.append(error)

    worker = threading.Thread(target=synchronize, name="elastic_ft-cuda-synchronize", daemon=True)
    worker.start()
    worker.join(timeout)
    return not worker.is_alive(), errors[0] if errors else None


def _synchronize(index: int, timeout: float) -> str | None:
    finished, error = synchronize_within(index, timeout)
    if not finished:
        return f"GPU {index} did not finish its work within {timeout:g} s"
    if error is not None:
        return f"GPU {index}: {error}"
    return None


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
