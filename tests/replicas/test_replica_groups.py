"""A fault stays in its replica group: real torchrun processes, gloo, etcd, TorchFT's names.

``examples/torchft_ddp.py`` (DDP, AdamW, a DataLoader over a DistributedSampler) runs as 2 or 4 replica
groups, one torchrun each; one group's worker raises or is SIGKILLed, its torchrun restarts it, and it heals
from a live group and joins again. The other groups' processes train through it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.testing.etcd_cluster import EtcdCluster
from tests.replicas.job import ProcessRecord, ReplicatedJob, await_full_quorum, replay_committed_steps, run_replicated

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 400
FAULT_STEP = 40


def assert_same_as_the_replay(job: ReplicatedJob, out: Path, groups: int, steps: int) -> None:
    """Every process that finished ends with the model one process reaches by replaying the committed steps
    (each with the batches of the groups in its quorum), within 1e-6 relative: no step was lost, none was
    committed by some groups and not others, and a group that came back healed to the state it had to. The
    replay sums the gradients in another order than the all-reduce: 1e-7 apart, kept so by the example's smooth
    model; a group's batch missing from the last step alone moves the end by 1.4e-4."""
    expected = replay_committed_steps(out, groups, steps)
    for record in job.records:
        for mine, theirs in zip(record.weights, expected, strict=True):
            gap = math.dist(mine, theirs)
            assert gap <= 1e-6 * math.hypot(*theirs), f"replica {record.replica}: {gap}\n{job.describe()}"


def fault_step(out: Path) -> int:
    """The step the injected fault struck at: ``FAULT_STEP``, or later if a group was still starting then."""
    return int(json.loads((out / "record.fault.json").read_text())["step"])


def attempts(out: Path, record: ProcessRecord) -> list[tuple[int, int]]:
    """Each step one process took, as (count before it, count after it), from its step log: a group that joined
    late starts at the step it healed to, so its first attempt may be the one that failed."""
    lines = (out / f"record.{record.replica}.{record.pid}.steps.jsonl").read_text().splitlines()[1:]
    return [(entry["before"], entry["after"]) for entry in map(json.loads, lines)]


def assert_the_fault_stayed_in_its_group(job: ReplicatedJob, out: Path, groups: int, faulty: int) -> None:
    why = job.describe()
    assert job.codes == [0] * groups, why
    struck = fault_step(out)
    assert struck >= FAULT_STEP, struck
    for replica in range(groups):
        records = job.of(replica)
        assert records, f"replica {replica} left no record\n{why}"
        assert all(record.commits[-1][0] == STEPS for record in records), why
        if replica != faulty:
            # One process trained from before the fault to the end: never restarted.
            (record,) = records
            steps = [step for step, _, _ in record.commits]
            assert steps[0] <= struck < steps[-1], why
            # Loose: the benchmark (benchmarks/replica_groups.py) carries the numbers.
            assert record.longest_pause() < 3.0, f"longest pause {record.longest_pause():.2f} s\n{why}"
    (back,) = job.of(faulty)  # the replacement process; the first one died
    # It joined the others again: steps committed in a quorum of every group.
    assert any(participants == groups for _, _, participants in back.commits), why
    # Every group ends with the same model: no step was committed by some and not others.
    reference = job.records[0].weights
    for record in job.records[1:]:
        for mine, theirs in zip(record.weights, reference, strict=True):
            assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7) for a, b in zip(mine, theirs, strict=True)), why


@pytest.mark.parametrize(
    ("groups", "faulty", "kind", "launcher"),
    [(2, 1, "sigkill", "torchrun"), (4, 2, "raise", "torchrun"), (3, 1, "sigkill_in_vote", "etcdft")],
)
def test_a_fault_in_one_replica_group_leaves_the_others_training(
    etcd: EtcdServer, tmp_path: Path, reap_pids: list[int], groups: int, faulty: int, kind: str, launcher: str
) -> None:
    """``launcher``: a ``torchrun --standalone`` per group, as TorchFT's README runs them, or a ``torchrun`` per
    group with the etcdft rendezvous."""
    settings: dict[str, Any] = {
        "steps": STEPS,
        "step_sleep": 0.05,
        "fault": {"replica": faulty, "step": FAULT_STEP, "kind": kind},
    }
    job = run_replicated(etcd.endpoint, groups, tmp_path, settings, reap_pids, launcher=launcher)
    assert_the_fault_stayed_in_its_group(job, tmp_path, groups, faulty)
    assert_same_as_the_replay(job, tmp_path, groups, STEPS)


def test_a_group_whose_step_fails_without_dying_comes_back_at_the_next_quorum(
    etcd: EtcdServer, tmp_path: Path, reap_pids: list[int]
) -> None:
    """Group 1's cross-replica connections are cut mid-step (a network fault): that step's all-reduce fails in
    both groups, neither commits it, and both meet in the next quorum with the same processes; no step is
    committed by one and not the other."""
    settings = {"steps": 120, "step_sleep": 0.05, "fault": {"replica": 1, "step": 40, "kind": "cut"}}
    job = run_replicated(etcd.endpoint, 2, tmp_path, settings, reap_pids)
    why = job.describe()
    assert job.codes == [0, 0], why
    records = [job.of(replica) for replica in range(2)]
    assert all(len(found) == 1 for found in records), why  # no process restarted
    (first,), (second,) = records
    ahead, joined = ([s for s, _, _ in r.commits] for r in sorted((first, second), key=lambda r: r.steps[0][0]))
    assert joined == ahead[ahead.index(joined[0]) :], why  # the same commits since both were in
    struck = fault_step(tmp_path)
    for record in (first, second):
        # The struck step failed in both groups (the count stayed) and was tried again, and then committed.
        tries = [after for before, after in attempts(tmp_path, record) if before == struck]
        assert len(tries) >= 2 and tries[0] == struck and tries[-1] == struck + 1, f"{tries}\n{why}"
    assert "left quorum" not in why and first.commits[-1][0] == 120, why
    assert_same_as_the_replay(job, tmp_path, 2, 120)


def test_replica_groups_train_through_an_etcd_frozen_for_30_s(tmp_path: Path, reap_pids: list[int]) -> None:
    """No single point of failure: in an unchanged quorum a step asks etcd nothing, and the records etcd may
    drop meanwhile (their leases expire while it is frozen) are published again once it is back."""
    frozen: list[float] = []
    with EtcdCluster(members=1) as cluster:

        def freeze() -> None:
            await_full_quorum(tmp_path, 2)  # etcd away before a group is up is a bounded wait of its start
            time.sleep(2)
            frozen.append(time.time())
            cluster.pause_member(0)
            time.sleep(30)
            cluster.resume_member(0)
            frozen.append(time.time())

        settings = {"steps": 1000, "step_sleep": 0.05}
        job = run_replicated(cluster.endpoint, 2, tmp_path, settings, reap_pids, meanwhile=freeze)
    why = job.describe()
    assert job.codes == [0, 0], why
    for replica in range(2):
        (record,) = job.of(replica)
        during = [step for step, at, _ in record.commits if frozen[0] < at < frozen[1]]
        # It trained on while etcd answered nothing.
        assert len(during) > 100, f"{len(during)} steps during the freeze\n{why}"
        assert record.longest_pause(after=frozen[0]) < 3.0, why
    assert_same_as_the_replay(job, tmp_path, 2, 1000)
