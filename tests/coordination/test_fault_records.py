"""The Wrapper's fault and heartbeat records: round trips, and total parsers for what etcd hands back."""

from __future__ import annotations

import pytest

from elastic_ft.coordination.fault_records import (
    MESSAGE_LIMIT,
    PEER_LOST,
    TRACEBACK_LIMIT,
    FaultGroup,
    FaultHistory,
    Heartbeat,
    Interruption,
    encode_heartbeat,
    encode_interruption,
    fault_kind,
    fault_signature,
    give_up,
    group_faults,
    next_history,
    parse_heartbeat,
    parse_heartbeat_record,
    parse_interruption,
    parse_interruptions,
    restart_cause,
)


def test_an_interruption_round_trips_with_its_message_cut() -> None:
    line = encode_interruption(3, "RuntimeError", "x" * 2000, 1795450000.5)
    assert line.endswith("\n")
    assert parse_interruption(line) == Interruption(3, "RuntimeError", "x" * MESSAGE_LIMIT, 1795450000.5)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"kind": "x"}',
        '{"rank": 1}',
        '{"rank": -1, "kind": "x"}',
        '{"rank": true, "kind": "x"}',
        '{"rank": 1.5, "kind": "x"}',
        '{"rank": 1e400, "kind": "x"}',
        '{"rank": 1, "kind": 5}',
        '{"rank": 1, "kind": "x", "message": ["m"]}',
        '{"rank": 1, "kind": "x", "time": "now"}',
        '{"rank": 1, "kind": "x", "time": NaN}',
        '{"rank": 1, "kind": "x", "time": 1e400}',
    ],
)
def test_a_malformed_interruption_is_none(line: str) -> None:
    assert parse_interruption(line) is None


def test_interruptions_keep_the_good_lines_and_name_the_bad() -> None:
    text = encode_interruption(0, "a", "", 1.0) + "garbage\n\n" + encode_interruption(2, "b", "m", 2.0)
    records, malformed = parse_interruptions(text)
    assert [(r.rank, r.kind) for r in records] == [(0, "a"), (2, "b")]
    assert malformed == ["garbage"]


def test_a_heartbeat_round_trips() -> None:
    assert parse_heartbeat(encode_heartbeat(10.0, 9.5)) == (10.0, 9.5)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{}",
        '{"t": 1}',
        '{"t": 1, "active": "1"}',
        '{"t": 1, "active": Infinity}',
        '{"t": NaN, "active": 1}',
        '{"t": true, "active": 1}',
        "[1, 2]",
    ],
)
def test_a_malformed_or_forged_heartbeat_is_none(text: str) -> None:
    # An infinite "last active" would make every peer look busy forever and disable hang detection.
    assert parse_heartbeat(text) is None


def test_a_heartbeat_says_whether_the_rank_waits_for_others_and_whether_it_is_a_reserve() -> None:
    assert parse_heartbeat_record(encode_heartbeat(10.0, 9.5)) == Heartbeat(10.0, 9.5, None, False)
    assert parse_heartbeat_record(encode_heartbeat(10.0, 9.5, True, True)) == Heartbeat(10.0, 9.5, True, True)
    for forged in ('{"t": 1, "active": 1, "waiting": "yes"}', '{"t": 1, "active": 1, "reserve": 1}'):
        assert parse_heartbeat_record(forged) is None


def test_a_heartbeat_says_when_the_next_is_due_and_a_forged_promise_is_refused() -> None:
    assert parse_heartbeat_record(encode_heartbeat(10.0, 9.5, due_at=10.25)) == Heartbeat(10.0, 9.5, due_at=10.25)
    for forged in (
        '{"t": 1, "active": 1, "due": "soon"}',
        '{"t": 1, "active": 1, "due": Infinity}',
        '{"t": 1, "active": 1, "due": true}',
    ):
        assert parse_heartbeat_record(forged) is None


def test_a_heartbeat_says_whether_it_promises_a_stall_notice() -> None:
    promising = encode_heartbeat(10.0, 9.99, due_at=11.0, notice=True)
    assert parse_heartbeat_record(promising) == Heartbeat(10.0, 9.99, due_at=11.0, notice=True)
    assert parse_heartbeat_record(encode_heartbeat(10.0, 9.5, due_at=11.0)).notice is False
    for forged in ('{"t": 1, "active": 1, "notice": 1}', '{"t": 1, "active": 1, "notice": "yes"}'):
        assert parse_heartbeat_record(forged) is None


def test_an_exception_records_its_step_origin_and_traceback() -> None:
    line = encode_interruption(
        1, "KeyError", "KeyError('x')", 5.0, step=7, origin="/job/train.py:42 in train", traceback="t" * 10_000
    )
    record = parse_interruption(line)
    assert record is not None and (record.step, record.origin) == (7, "/job/train.py:42 in train")
    assert record.traceback == "t" * TRACEBACK_LIMIT  # its end: the innermost frames and the error
    for forged in ('"step": -1', '"step": true', '"step": 1.5', '"origin": 3', '"traceback": ["t"]'):
        assert parse_interruption(f'{{"rank": 1, "kind": "x", {forged}}}') is None


def test_a_fault_seen_twice_keeps_its_traceback_in_the_report() -> None:
    with_traceback = Interruption(1, "KeyError", "KeyError('x')", 2.0, 3, "f.py:1 in g", "Traceback ...")
    plain = Interruption(1, "KeyError", "KeyError('x') with more text", 1.0)
    (group,) = group_faults([plain, with_traceback])
    assert group.traceback == "Traceback ..." and group.time == 1.0 and "more text" in group.message


def exception(rank: int, step: int, origin: str = "/job/train.py:42 in train", at: float = 1.0) -> Interruption:
    return Interruption(rank, "KeyError", "KeyError('x')", at, step, origin, "Traceback ...")


def test_the_same_exception_at_the_same_step_without_progress_counts_up() -> None:
    history = next_history(FaultHistory(), [exception(1, 5)], progressed=True)
    assert history == FaultHistory("KeyError raised at /job/train.py:42 in train, step 5", 1, 0)
    history = next_history(history, [exception(1, 5)], progressed=False)
    history = next_history(history, [exception(1, 5)], progressed=False)
    assert (history.repeats, history.stalled) == (3, 2)
    verdict = give_up(history, 3, None)
    assert verdict is not None and verdict.fatal and "the same fault ended 3 iterations in a row" in verdict.reason
    assert give_up(history, 4, None) is None and give_up(history, None, None) is None


def test_progress_or_another_fault_starts_the_count_again() -> None:
    history = FaultHistory(fault_signature(exception(1, 5)), 2, 2)
    assert next_history(history, [exception(1, 5)], progressed=True).repeats == 1  # steps in between
    assert next_history(history, [exception(1, 6)], progressed=False).repeats == 1  # another step
    assert next_history(history, [exception(1, 5, origin="/job/train.py:43 in train")], False).repeats == 1
    # A dead process has no origin: no exception repeats, but the iteration still made no progress.
    died = Interruption(2, "terminated", "process 12 died", 1.0)
    assert next_history(history, [died], progressed=False) == FaultHistory(None, 0, 3)


def test_the_cause_is_the_earliest_exception_and_consequences_do_not_count() -> None:
    later = exception(2, 5, origin="/job/other.py:9 in f", at=2.0)
    history = next_history(FaultHistory(), [later, exception(1, 5, at=1.0)], progressed=False)
    assert history.signature is not None and "train.py:42" in history.signature
    previous = FaultHistory("x", 2, 4)
    lost = Interruption(0, PEER_LOST, "Connection reset by peer", 1.0, 5, "f.py:1 in g")
    admit = Interruption(0, "admit_joiners", "initial rank(s) [6] ready", 1.0)
    assert next_history(previous, [lost, admit], progressed=False) == previous
    # A joiner's admission after steps ends the run: a rank that fails to join again and again (its link to
    # the peers still down) does not make the others give up while they train in between.
    assert next_history(previous, [admit], progressed=True) == FaultHistory("x", 0, 0)


def test_an_exception_beside_a_lost_rank_repeats_no_fault() -> None:
    # A host cut off from its peers but not from etcd is lost, comes back, and is lost again at the same step;
    # its transfer's error each time is the loss's consequence, not a bug: nothing counts up to the fatal rule.
    history = FaultHistory()
    for _ in range(5):
        node_died = Interruption(4, "node_died", "node n2 died again", 2.0)
        history = next_history(history, [exception(4, 92, at=1.0), node_died], progressed=False)
    assert (history.signature, history.repeats, history.stalled) == (None, 0, 5)
    assert give_up(history, 3, None) is None
    # A hang beside it (no origin either) likewise; exceptions alone still name their cause.
    hang = Interruption(3, "hang", "rank 3 made no progress", 1.5)
    assert next_history(FaultHistory(), [exception(1, 5), hang], progressed=False).signature is None
    assert next_history(FaultHistory(), [exception(1, 5), exception(2, 5)], progressed=False).repeats == 1


def test_an_error_raised_from_a_broken_connection_is_a_lost_peer() -> None:
    class TransferFailed(Exception):
        pass

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    try:
        raise TransferFailed("the state transfer from rank 0 to [4] failed") from gloo
    except TransferFailed as error:
        assert fault_kind(error) == PEER_LOST
    assert fault_kind(TransferFailed("the header is not JSON")) == "TransferFailed"
    assert fault_kind(ValueError("Connection closed by peer")) == "ValueError"  # not a connection's error
    looped = RuntimeError("bad value")
    looped.__cause__ = looped  # a cycle ends the walk
    assert fault_kind(looped) == "RuntimeError"


def test_restarts_without_progress_give_up_without_being_fatal() -> None:
    history = FaultHistory(None, 0, 10)
    verdict = give_up(history, 3, 10)
    assert verdict is not None and not verdict.fatal  # no progress: a process restart may still help
    assert "10 iterations in a row ended on a fault without progress" in verdict.reason
    assert give_up(history, 3, None) is None


@pytest.mark.parametrize(
    "record",
    [
        None,
        [],
        {"repeats": 1},
        {"signature": 3, "repeats": 1, "stalled": 0},
        {"signature": None, "repeats": -1, "stalled": 0},
        {"signature": None, "repeats": True, "stalled": 0},
        {"signature": "x" * 5000, "repeats": 0, "stalled": 0},
    ],
)
def test_a_forged_fault_history_is_refused(record: object) -> None:
    assert FaultHistory.from_dict(record) is None


def test_the_restart_cause_is_the_first_exception_that_is_not_a_broken_connection() -> None:
    lost = FaultGroup("peer_lost", "Connection closed by peer", (0, 2), 1.0, "Traceback: gloo")
    raised = FaultGroup("ValueError", "bad batch", (1,), 1.1, "Traceback: ValueError")
    hang = FaultGroup("hang", "rank 3 made no progress", (3,), 0.9)
    assert restart_cause([lost, raised, hang]) == raised
    assert restart_cause([hang, lost]) is None  # a hang and its consequences: no exception to show
    assert restart_cause([]) is None
