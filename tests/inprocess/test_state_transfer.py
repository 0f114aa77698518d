"""The state transfer over real gloo groups (ranks as threads of this process): structure, chunks, checksums."""

from __future__ import annotations

import collections
import datetime
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.inprocess.exception import StateTransferError
from elastic_ft.inprocess.healing.transfer import (
    flatten_state,
    receive_state,
    run_interruptibly,
    send_state,
    unflatten_state,
)

TIMEOUT = datetime.timedelta(seconds=20)


def run_ranks(size: int, body: Callable[[int, Any], Any]) -> list[Any]:
    """``body(rank, group)`` on ``size`` threads sharing one store; what each returned or raised."""
    store = dist.HashStore()
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, dist.ProcessGroupGloo(store, rank, size, TIMEOUT))
        except BaseException as error:  # noqa: BLE001 - returned to the test
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return results


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "position": {"step": 7, "epoch": 0, "batch": 7},
        "rng": torch.get_rng_state(),
        "odd": {
            3: (1, 2.5, None, "x", True, float("inf")),
            "bf16": torch.randn(5, 3).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.25, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
            "large": torch.randn(100_000),  # above SMALL_BYTES: streamed on its own
            "strided": torch.arange(40.0).reshape(5, 8)[:, ::3],
        },
    }


def assert_same(sent: object, got: object, path: str = "") -> None:
    assert type(got) is type(sent) or (isinstance(sent, dict) and isinstance(got, dict)), path
    if isinstance(sent, torch.Tensor):
        assert got.dtype == sent.dtype and got.shape == sent.shape, path
        assert torch.equal(
            got.view(-1).view(torch.uint8) if got.numel() else got,
            sent.contiguous().view(-1).view(torch.uint8) if sent.numel() else sent,
        ), path
    elif isinstance(sent, dict):
        assert list(got) == list(sent), path
        for key in sent:
            assert_same(sent[key], got[key], f"{path}[{key!r}]")
    elif isinstance(sent, (list, tuple)):
        assert len(got) == len(sent), path
        for index, (a, b) in enumerate(zip(sent, got, strict=True)):
            assert_same(a, b, f"{path}[{index}]")
    else:
        assert got == sent, path


def test_a_training_state_arrives_bit_for_bit_at_two_receivers_in_many_chunks() -> None:
    state = training_state()

    def body(rank: int, group: Any) -> Any:
        if rank == 0:
            return send_state(group, [1, 2], state, step=7, chunk_bytes=4096)
        return receive_state(group, 0)

    sent, first, second = run_ranks(3, body)
    _, tensors, _ = flatten_state(state)
    assert sent > sum(t.numel() * t.element_size() for t in tensors)
    for received in (first, second):
        assert received.step == 7 and received.nbytes == sent
        assert_same(state, received.state)
        assert isinstance(received.state["model"], collections.OrderedDict)
        assert received.state["model"]._metadata == state["model"]._metadata  # module versions survive
    # What arrived loads into a fresh model and optimizer.
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model.load_state_dict(first.state["model"])
    optimizer.load_state_dict(first.state["optimizer"])
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)


class CorruptingGroup:
    """A real gloo group whose ``nth`` receive has one byte flipped once it arrived: a corrupted chunk."""

    def __init__(self, group: Any, nth: int) -> None:
        self.group, self.nth, self.count = group, nth, 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        work, self.count = self.group.recv(tensors, src, tag), self.count + 1
        return _Corrupting(work, tensors[0]) if self.count == self.nth else work


class _Corrupting:
    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        self.tensor.view(-1).view(torch.uint8)[0] ^= 0x40
        return done


def test_a_corrupted_chunk_is_caught_by_its_tensors_checksum_before_anything_is_returned() -> None:
    state = {"weights": {"big": torch.randn(100_000), "small": torch.randn(3)}}

    def body(rank: int, group: Any) -> Any:
        if rank == 0:
            return send_state(group, [1], state, step=3, chunk_bytes=8192)
        return receive_state(CorruptingGroup(group, nth=5), 0)  # length, header, "small" packed, chunk 2 of "big"

    _, error = run_ranks(2, body)
    assert isinstance(error, StateTransferError), error
    assert "state['weights']['big']: checksum" in str(error)


def test_a_corrupted_packed_tensor_is_caught_too() -> None:
    state = {"bias": torch.randn(7), "scale": torch.randn(5), "big": torch.randn(100_000)}

    def body(rank: int, group: Any) -> Any:
        if rank == 0:
            return send_state(group, [1], state, step=3)
        return receive_state(CorruptingGroup(group, nth=3), 0)  # length, header, then the packed bias+scale

    _, error = run_ranks(2, body)
    assert isinstance(error, StateTransferError) and "state['bias']: checksum" in str(error), error


def test_a_value_that_is_neither_a_tensor_nor_json_is_named_before_anything_is_sent() -> None:
    with pytest.raises(TypeError, match=r"state\['data'\]\[1\]: a set is neither a tensor nor JSON data"):
        flatten_state({"data": [1, {2, 3}]})
    with pytest.raises(TypeError, match=r"state: keys are str, int, float, bool or None, got tuple"):
        flatten_state({(1, 2): 3})
    with pytest.raises(TypeError, match="only dense tensors"):
        flatten_state({"sparse": torch.eye(3).to_sparse()})


def send_raw(group: Any, header: bytes, payload: list[torch.Tensor], ack: bool = False) -> None:
    """A hand-made stream: a header, ``payload`` (tensor bytes, then the trailer), then wait for the ack."""
    length = torch.tensor([len(header)], dtype=torch.int64)
    for tensor in (length, torch.frombuffer(bytearray(header), dtype=torch.uint8), *payload):
        group.send([tensor], 1, 0).wait()
    if ack:
        group.recv([torch.zeros(1, dtype=torch.int64)], 1, 0).wait()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"not json", "the state's header is not JSON"),
        (b'{"format": 2}', "expected a state header of format 1"),
        (b'{"format": 1, "step": -1, "chunk_bytes": 1, "small_bytes": 0, "tensors": []}', "the header's step is -1"),
        (b'{"format": 1, "step": 1, "chunk_bytes": 0, "small_bytes": 0, "tensors": []}', "chunk_bytes is 0"),
        (b'{"format": 1, "step": 1, "chunk_bytes": 9, "tensors": []}', "small_bytes is None"),
        (
            b'{"format": 1, "step": 1, "chunk_bytes": 9, "small_bytes": 0, "tensors": [{"dtype": "os", "shape": [1]}]}',
            "unknown tensor dtype 'os'",
        ),
        (
            b'{"format": 1, "step": 1, "chunk_bytes": 9, "small_bytes": 0, "tensors": [{"dtype": "float32", "shape": [-2]}]}',
            "malformed tensor spec",
        ),
        (
            b'{"format": 1, "step": 1, "chunk_bytes": 9, "small_bytes": 0, "tensors": [], "layout": {"mesh": [2]}}',
            "the header's layout is malformed",
        ),
    ],
)
def test_a_malformed_header_is_refused_before_any_allocation(header: bytes, message: str) -> None:
    def body(rank: int, group: Any) -> Any:
        if rank == 0:
            return send_raw(group, header, [])
        return receive_state(group, 0)

    _, error = run_ranks(2, body)
    assert isinstance(error, StateTransferError) and message in str(error), error


def test_a_skeleton_that_misplaces_tensors_is_refused() -> None:
    header = json.dumps(
        {
            "format": 1,
            "step": 1,
            "chunk_bytes": 64,
            "small_bytes": 0,
            "skeleton": {"list": [{"tensor": 0}, {"tensor": 0}]},
            "tensors": [{"dtype": "float32", "shape": [2]}],
        }
    ).encode()

    def body(rank: int, group: Any) -> Any:
        if rank == 0:
            return send_raw(group, header, [torch.zeros(2), torch.tensor([1, 0], dtype=torch.int64)], ack=True)
        return receive_state(group, 0)

    _, error = run_ranks(2, body)
    assert isinstance(error, StateTransferError) and "state[1]: the skeleton names tensor 0 of 1" in str(error), error
    with pytest.raises(StateTransferError, match="places 1 of the 2 tensors"):
        unflatten_state({"list": [{"tensor": 0}]}, [torch.zeros(1), torch.zeros(1)])


def test_run_interruptibly_returns_and_raises_what_its_task_did() -> None:
    assert run_interruptibly(lambda: 41 + 1, "t") == 42
    with pytest.raises(KeyError, match="missing"):
        run_interruptibly(lambda: {}["missing"], "t")


#: A rank connecting a transfer group to a sender that never publishes its address (it died first) is given up by
#: a restart, and then exits: gloo's constructor must not still be waiting in the store when the interpreter
#: exits (a thread coming back into Python then aborts the process). argv: the etcd endpoint, "abandon" or not.
_CONNECT_THEN_EXIT = """
import datetime, signal, sys, threading, time
import torch.distributed as dist
from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import parse_endpoints
from elastic_ft.etcd.group_store import group_store
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.inprocess.healing.transfer import run_interruptibly

store = group_store(EtcdStore(EtcdClient(parse_endpoints(sys.argv[1])), "/test/exit/"), "heal/group/1/")
abandon = (lambda: store.abandon("given up")) if sys.argv[2] == "abandon" else None

class Restart(BaseException):
    pass

def restart(*_):
    raise Restart()

signal.signal(signal.SIGALRM, restart)
signal.setitimer(signal.ITIMER_REAL, 1.0)
connect = lambda: dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
try:
    run_interruptibly(connect, "elastic_ft-heal-connect", abandon)
except Restart:
    pass
deadline = time.monotonic() + 2
while any(t.name == "elastic_ft-heal-connect" for t in threading.enumerate()) and time.monotonic() < deadline:
    time.sleep(0.01)
print("connecting:", any(t.name == "elastic_ft-heal-connect" for t in threading.enumerate()), flush=True)
"""


def _connect_then_exit(etcd: EtcdServer, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CONNECT_THEN_EXIT, etcd.endpoint, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_connect_given_up_by_a_restart_ends_before_the_process_exits(etcd: EtcdServer) -> None:
    done = _connect_then_exit(etcd, "abandon")
    assert "connecting: False" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    # Without it, the thread still waits in gloo's constructor when the process exits (which aborts it).
    kept = _connect_then_exit(etcd, "keep")
    assert "connecting: True" in kept.stdout, kept.stdout + kept.stderr


# ---- DTensors: sent as their local shard, with the layout they are a shard of ----


@pytest.fixture
def one_rank_world() -> Any:
    """A default process group of one rank (a HashStore: no socket), for DTensors on a one-rank mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def dtensor_state() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(3)
    return {
        "weight": distribute_tensor(torch.randn(6, 4), mesh, [Replicate(), Shard(0)]),
        "bias": distribute_tensor(torch.randn(6), mesh, [Replicate(), Replicate()]),
        "on_submesh": distribute_tensor(torch.randn(2, 2), mesh["shard"], [Shard(1)]),
        "step": torch.tensor(5.0),
    }


def test_a_dtensor_states_layout_is_read_from_its_mesh_and_placements(one_rank_world: None) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    from elastic_ft.inprocess.healing.layout import layout_of

    assert layout_of({"plain": torch.zeros(2), "n": 3}) is None
    state = dtensor_state()
    layout = layout_of(state)
    assert layout is not None and (layout.mesh, layout.split, layout.coordinate) == ((1, 1), (1,), (0, 0))
    replicated = {
        **state,
        "weight": distribute_tensor(torch.randn(6, 4), state["weight"].device_mesh, [Replicate()] * 2),
    }
    assert layout_of(replicated).digest != layout.digest  # another placement: another layout
    reshaped = {**state, "bias": distribute_tensor(torch.randn(7), state["bias"].device_mesh, [Replicate()] * 2)}
    assert layout_of(reshaped).digest != layout.digest
    assert layout_of(dict(reversed(list(state.items())))).digest != layout.digest  # the paths count, in order


def test_dtensors_on_meshes_of_different_roots_are_refused_by_name(one_rank_world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elastic_ft.inprocess.healing.layout import layout_of

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (1,))
    state = {
        "a": distribute_tensor(torch.randn(2), mesh, [Shard(0), Shard(0)]),
        "b": distribute_tensor(torch.randn(2), other, [Shard(0)]),
    }
    with pytest.raises(ValueError, match=r"state\['b'\]: a DTensor on a mesh of shape \(1,\).*one mesh"):
        layout_of(state)
    with pytest.raises(TypeError, match="one mesh"):
        send_state(None, [1], state, 1)  # refused before anything is sent


def test_a_dtensor_arrives_as_its_local_shard_with_the_senders_layout(one_rank_world: None) -> None:
    from elastic_ft.inprocess.healing.layout import layout_of

    state = dtensor_state()
    expected = {name: value.to_local() if hasattr(value, "to_local") else value for name, value in state.items()}

    def body(rank: int, group: Any) -> Any:
        return send_state(group, [1], state, 5) if rank == 0 else receive_state(group, 0)

    _, received = run_ranks(2, body)
    assert received.layout == layout_of(state) and received.step == 5
    assert all(type(value) is torch.Tensor for value in received.state.values())
    assert_same(expected, received.state)


def test_a_shard_that_is_not_the_one_needed_is_refused_naming_both() -> None:
    from elastic_ft.inprocess.exception import HealingError
    from elastic_ft.inprocess.healing.layout import check_shard
    from elastic_ft.inprocess.healing.plan import ShardLayout

    needed = ShardLayout((2, 2), (1,), (0, 0), "a" * 32)
    check_shard(ShardLayout((2, 2), (1,), (0, 1), "a" * 32), needed, (1, 2), "rank 1")  # its shard: accepted
    with pytest.raises(HealingError, match=r"rank 0 sent shard 0 of 2 of mesh \[2, 2\].*shard 1 of 2 .*is needed"):
        check_shard(ShardLayout((2, 2), (1,), (1, 0), "a" * 32), needed, (1, 2), "rank 0")
    with pytest.raises(HealingError, match=r"sent shard 1 of 3 of mesh \[1, 3\]"):
        check_shard(ShardLayout((1, 3), (1,), (0, 1), "a" * 32), needed, (1, 2), "rank 2")
    with pytest.raises(HealingError, match="received layout bbbbbbbb"):
        check_shard(ShardLayout((2, 2), (1,), (0, 1), "b" * 32), needed, (1, 2), "rank 1")
    with pytest.raises(HealingError, match="a state without DTensors"):
        check_shard(None, needed, (1, 2), "rank 1")
