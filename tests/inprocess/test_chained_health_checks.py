"""The device checks the Wrapper chains before the user's (NVIDIA inprocess 0.6's ``restart_health_check``)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from elastic_ft.inprocess import Wrapper
from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.exception import HealthCheckError
from elastic_ft.inprocess.health_check import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
    HealthCheck,
)
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.wrapper import chain_health_checks
from elastic_ft.runtime.node_checks import NicLink, lost_links, nic_links, storage_problems


def _port(root: Path, device: str, state: str, link_downed: int) -> Path:
    port = root / "class" / "infiniband" / device / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text(f"{state}\n")
    (port / "counters" / "link_downed").write_text(f"{link_downed}\n")
    return port


def _ethernet(root: Path, name: str, operstate: str, physical: bool = True) -> Path:
    interface = root / "class" / "net" / name
    interface.mkdir(parents=True)
    (interface / "operstate").write_text(f"{operstate}\n")
    if physical:
        (interface / "device").mkdir()
    return interface


def test_links_are_read_from_sysfs_physical_interfaces_only(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", "4: ACTIVE", 2)
    _port(tmp_path, "mlx5_1", "1: DOWN", 0)
    _ethernet(tmp_path, "eth0", "up")
    _ethernet(tmp_path, "veth9", "up", physical=False)
    assert nic_links(tmp_path) == {
        "mlx5_0/1": NicLink("mlx5_0/1", True, "ACTIVE", 2),
        "mlx5_1/1": NicLink("mlx5_1/1", False, "DOWN", 0),
        "eth0": NicLink("eth0", True, "up"),
    }
    assert list(nic_links(tmp_path, ["veth9"])) == ["veth9"]  # named: virtual ones too
    with pytest.raises(ValueError, match=r"no NIC named \['eth7'\]"):
        nic_links(tmp_path, ["eth7"])


def test_a_link_that_goes_down_or_flaps_fails_the_check(tmp_path: Path) -> None:
    port = _port(tmp_path, "mlx5_0", "4: ACTIVE", 0)
    _port(tmp_path, "mlx5_1", "1: DOWN", 0)  # down from the start: not this host's new fault
    eth = _ethernet(tmp_path, "eth0", "up")
    check = ChainedNicHealthCheck(device_index=0, sysfs_root=str(tmp_path))
    state = State(rank=0, world_size=1)
    assert check(state) is state

    (port / "counters" / "link_downed").write_text("1\n")  # it went down and came back
    with pytest.raises(HealthCheckError, match="mlx5_0/1 went down 1 time"):
        check(state)
    (port / "counters" / "link_downed").write_text("0\n")
    (eth / "operstate").write_text("down\n")
    with pytest.raises(HealthCheckError, match=r"eth0 is down \(was up\)"):
        check(state)
    shutil.rmtree(eth)
    with pytest.raises(HealthCheckError, match="eth0 disappeared"):
        check(state)


def test_lost_links_names_each_problem() -> None:
    before = {"a": NicLink("a", True, "up"), "b": NicLink("b", False, "down")}
    assert lost_links(before, before) == []
    assert lost_links(before, {"b": NicLink("b", False, "down")}) == ["a disappeared"]


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for a veth pair")
def test_a_real_interface_taken_down_fails_the_check() -> None:
    name = f"eft{uuid.uuid4().hex[:6]}"
    peer = f"{name}p"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", peer], check=True)
    try:
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        subprocess.run(["ip", "link", "set", peer, "up"], check=True)
        for _ in range(100):  # operstate follows the peer within milliseconds
            if nic_links("/sys", [name])[name].up:
                break
            time.sleep(0.02)
        check = ChainedNicHealthCheck(interfaces=[name])
        assert check.baseline[name].up
        state = State(rank=0, world_size=1)
        assert check(state) is state
        subprocess.run(["ip", "link", "set", name, "down"], check=True)
        with pytest.raises(HealthCheckError, match=f"{name} is down"):
            check(state)
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


def test_gpu_and_nvlink_checks_pass_on_a_host_without_cuda_and_say_so_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    state = State(rank=0, world_size=1)
    with caplog.at_level(logging.DEBUG, logger="elastic_ft.inprocess.health_check"):
        for check in (ChainedGPUHealthCheck(device_index=0), ChainedNVLHealthCheck()):
            assert check(state) is state
            assert check(state) is state
    said = [r.getMessage() for r in caplog.records if "has no CUDA device" in r.getMessage()]
    assert {r.levelno for r in caplog.records if "has no CUDA device" in r.getMessage()} == {logging.DEBUG}
    assert said == [
        "ChainedGPUHealthCheck passes: this host has no CUDA device",
        "ChainedGPUHealthCheck passes: this host has no CUDA device",
        "ChainedNVLHealthCheck passes: this host has no CUDA device",
        "ChainedNVLHealthCheck passes: this host has no CUDA device",
    ]


def test_device_index_is_checked() -> None:
    with pytest.raises(TypeError, match="device_index must be an int or None, got '0'"):
        ChainedGPUHealthCheck(device_index="0")  # type: ignore[arg-type]


class _Recorder(HealthCheck):
    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order = name, order

    def __call__(self, state: State) -> State:
        self.order.append(self.name)
        return state


def test_the_chain_holds_the_users_parts_then_the_device_checks_of_local_rank() -> None:
    order: list[str] = []
    users = Compose(_Recorder("user1", order), _Recorder("user2", order))
    chain = chain_health_checks(users, {"LOCAL_RANK": "3"})
    assert isinstance(chain, Compose)
    kinds = [type(part) for part in chain.instances]
    assert kinds == [_Recorder, _Recorder, ChainedGPUHealthCheck, ChainedNVLHealthCheck, ChainedNicHealthCheck]
    assert [part.device_index for part in chain.instances[2:]] == [3, 3, 3]  # type: ignore[attr-defined]


def test_the_device_checks_run_first_nic_nvlink_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    def recorder(name: str) -> type[HealthCheck]:
        class Device(HealthCheck):
            def __init__(self, device_index: int | None = None) -> None:
                self.device_index = device_index

            def __call__(self, state: State) -> State:
                order.append(name)
                return state

        return Device

    from elastic_ft.inprocess import wrap

    monkeypatch.setattr(wrap, "ChainedGPUHealthCheck", recorder("gpu"))
    monkeypatch.setattr(wrap, "ChainedNVLHealthCheck", recorder("nvl"))
    monkeypatch.setattr(wrap, "ChainedNicHealthCheck", recorder("nic"))
    chain = chain_health_checks(Compose(_Recorder("user1", order), _Recorder("user2", order)), {"LOCAL_RANK": "0"})
    assert chain is not None
    state = State(rank=0, world_size=1)
    assert chain(state) is state
    assert order == ["nic", "nvl", "gpu", "user2", "user1"]


def test_without_local_rank_only_the_users_check_runs() -> None:
    only = _Recorder("user", [])
    assert chain_health_checks(None, {}) is None
    chain = chain_health_checks(only, {})
    assert isinstance(chain, Compose) and chain.instances == (only,)
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer, got 'x'"):
        chain_health_checks(only, {"LOCAL_RANK": "x"})


def test_the_wrapper_keeps_the_users_check_and_runs_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    user = _Recorder("user", [])
    wrapper = Wrapper(health_check=user)
    assert wrapper.health_check is user
    assert isinstance(wrapper.restart_health_check, Compose)
    assert wrapper.restart_health_check.instances[0] is user


def test_storage_paths_are_probed(tmp_path: Path) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    assert storage_problems([str(tmp_path)]) == []
    assert storage_problems([str(tmp_path / "missing"), str(afile)]) == [
        f"storage {tmp_path / 'missing'}: not a directory",
        f"storage {afile}: not a directory",
    ]
    assert list(tmp_path.iterdir()) == [afile]  # the probe file is gone
