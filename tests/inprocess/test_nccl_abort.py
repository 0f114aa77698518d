"""AbortTorchDistributed on NCCL: a rank blocked on a peer that never joins is released by the abort.

Needs two CUDA devices; skipped elsewhere (the gloo path is covered by
test_process_groups.py and the Wrapper tests).
"""

from __future__ import annotations

import datetime
import multiprocessing
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic_ft.inprocess.abort import AbortTorchDistributed
from elastic_ft.inprocess.state import State
from tests.inprocess.job import free_port_pair

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)"
)


def _rank(rank: int, port: int, results: multiprocessing.Queue) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    tensor = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(tensor)  # both ranks: the communicator is up
    torch.cuda.synchronize()
    if rank == 1:
        store.set("rank1_done", "1")
        time.sleep(30)  # never joins the second all_reduce; the abort must not wait for this
        results.put((rank, "idle"))
        return
    store.wait(["rank1_done"])
    aborted_at: list[float] = []

    def abort_later() -> None:
        time.sleep(1.0)
        aborted_at.append(time.monotonic())
        AbortTorchDistributed()(State(rank=0, world_size=2))  # from a thread other than the main one

    threading.Thread(target=abort_later, daemon=True).start()
    outcome = "completed"
    try:
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
    except (RuntimeError, dist.DistBackendError) as error:  # the aborted communicator fails the pending work
        outcome = type(error).__name__
    results.put((rank, outcome, time.monotonic() - aborted_at[0] if aborted_at else None))


def test_abort_releases_a_rank_blocked_in_an_nccl_collective() -> None:
    port = free_port_pair()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        rank0 = results.get(timeout=120)
        while rank0[0] != 0:
            rank0 = results.get(timeout=120)
    finally:
        for process in processes:
            process.kill()
            process.join()
    _, outcome, released_after = rank0
    assert outcome != "completed", "the all_reduce with a missing peer cannot have completed"
    assert released_after is not None and released_after < 10.0, f"released {released_after} s after the abort"
