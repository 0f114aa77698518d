"""The history checks find what they are meant to find (a check that cannot fail is no check)."""

from __future__ import annotations

from elastic_ft.testing.history import FAILED, OK, UNKNOWN, Operation, check_appends, check_cas_chain, check_counter


def op(kind: str, argument: object, start: float, end: float, outcome: str = OK, result: object = None) -> Operation:
    return Operation(0, kind, argument, start, end, outcome, result)


def test_counter() -> None:
    adds = [op("add", None, 0, 1, result=1), op("add", None, 0, 1, result=2), op("add", None, 0, 1, UNKNOWN)]
    assert check_counter(adds, 2) == []
    assert check_counter(adds, 3) == []  # the unknown one committed
    assert "applied twice" in check_counter(adds, 4)[0]
    assert "lost" in check_counter(adds, 1)[0]
    assert any("same count" in p for p in check_counter([op("add", None, 0, 1, result=1)] * 2, 2))


def test_appends() -> None:
    appends = [op("append", "a", 0, 1), op("append", "b", 0, 1, UNKNOWN), op("append", "c", 0, 1, FAILED)]
    assert check_appends(appends, "a,") == []
    assert check_appends(appends, "a,b,") == []
    assert "present 2 times" in check_appends(appends, "a,a,")[0]
    assert "missing" in check_appends(appends, "b,")[0]
    assert "never appended" in check_appends(appends, "a,x,")[0]
    assert "reported failed" in check_appends(appends, "a,c,")[0]


def test_cas_chain() -> None:
    good = [
        op("compare_set", 0, 0, 1, result=(1, True)),
        op("compare_set", 1, 2, 3, result=(2, True)),
        op("compare_set", 1, 2.5, 3.5, result=(2, False)),  # saw 2, written during its call
    ]
    assert check_cas_chain(good, 2) == []
    assert "two swaps" in check_cas_chain([*good, op("compare_set", 1, 4, 5, result=(2, True))], 2)[0]
    assert any("register is 3" in p for p in check_cas_chain(good, 3))
    reordered = [op("compare_set", 0, 2, 3, result=(1, True)), op("compare_set", 1, 0, 1, result=(2, True))]
    assert any("finished before" in p for p in check_cas_chain(reordered, 2))
    stale = [*good, op("compare_set", 0, 4, 5, result=(1, False))]  # 1 was overwritten at 3, before it began
    assert any("overwritten before" in p for p in check_cas_chain(stale, 2))
    early = [*good, op("compare_set", 0, 0.1, 0.2, result=(2, False))]  # 2 was written from 2 on
    assert any("before any swap began" in p for p in check_cas_chain(early, 2))
