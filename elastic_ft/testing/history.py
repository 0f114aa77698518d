"""Recorded histories of store operations, and checks that nothing was lost or applied twice.

Concurrent clients record each operation with its real-time interval and
outcome: ``ok`` with a result, ``unknown`` (the client could not learn
whether it committed) or ``failed`` (it certainly did not). As in etcd's
robustness tests, the checks read the final state together with the
history:

* :func:`check_counter`: a counter incremented by ``add(key, 1)`` ends
  between the acknowledged adds and those plus the unknown ones, and every
  acknowledged result is distinct (no two adds saw the same count);
* :func:`check_appends`: every acknowledged append of a unique token is in
  the final value exactly once, an unknown one at most once, nothing else;
* :func:`check_cas_chain`: clients increment a register with
  ``compare_set(v, v + 1)``, each value tagged with its writer so that a
  swap can tell its own success from another's; successful swaps form one chain 0 -> 1 -> ...,
  each value produced once, in an order consistent with real time, and each
  failed swap returned a value the register could hold during that call --
  a linearizability check specialised to this workload, which keeps it
  linear in the history's length.

Each check returns a list of violations (empty when the history is fine).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from typing import Any

OK, UNKNOWN, FAILED = "ok", "unknown", "failed"


@dataclasses.dataclass(frozen=True)
class Operation:
    client: int
    kind: str  # add, append, compare_set
    argument: Any
    start: float
    end: float
    outcome: str  # OK, UNKNOWN or FAILED
    result: Any = None


class History:
    """A thread-safe log of operations (``time.monotonic()`` intervals)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.operations: list[Operation] = []

    def record(self, client: int, kind: str, argument: Any, start: float, outcome: str, result: Any = None) -> None:
        operation = Operation(client, kind, argument, start, time.monotonic(), outcome, result)
        with self._lock:
            self.operations.append(operation)

    def of_kind(self, kind: str) -> list[Operation]:
        with self._lock:
            return [op for op in self.operations if op.kind == kind]

    def counts(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter((op.kind, op.outcome) for op in self.operations)


def check_counter(operations: list[Operation], final: int) -> list[str]:
    acknowledged = [op for op in operations if op.outcome == OK]
    unknown = sum(op.outcome == UNKNOWN for op in operations)
    problems = []
    if not len(acknowledged) <= final <= len(acknowledged) + unknown:
        problems.append(
            f"counter is {final} after {len(acknowledged)} acknowledged and {unknown} unknown add(1): "
            + ("an add was lost" if final < len(acknowledged) else "an add was applied twice")
        )
    seen = Counter(op.result for op in acknowledged)
    problems += [f"{n} adds returned the same count {value}" for value, n in seen.items() if n > 1]
    problems += [f"an add returned {op.result}, beyond the final {final}" for op in acknowledged if op.result > final]
    return problems


def check_appends(operations: list[Operation], final: str, separator: str = ",") -> list[str]:
    present = Counter(token for token in final.split(separator) if token)
    problems = []
    appended = {op.argument: op for op in operations}
    for token, n in present.items():
        if token not in appended:
            problems.append(f"{token!r} is in the value but was never appended")
        elif n > 1:
            problems.append(f"{token!r} appended once, present {n} times")
    for token, op in appended.items():
        if op.outcome == OK and token not in present:
            problems.append(f"acknowledged append {token!r} is missing")
        if op.outcome == FAILED and token in present:
            problems.append(f"append {token!r} reported failed but is present")
    return problems


def check_cas_chain(operations: list[Operation], final: int) -> list[str]:
    """``argument`` is the expected value v (the swap writes v + 1); ``result`` is (value returned, swapped)."""
    problems = []
    produced: dict[int, Operation] = {}  # value -> the swap that wrote it
    for op in operations:
        if op.outcome == OK and op.result[1]:
            if op.result[0] != op.argument + 1:
                problems.append(f"a swap from {op.argument} reported success with {op.result[0]}")
            if op.argument + 1 in produced:
                problems.append(f"value {op.argument + 1} written by two swaps from {op.argument}")
            produced[op.argument + 1] = op
    unknown = sum(op.outcome == UNKNOWN for op in operations)
    if not len(produced) <= final <= len(produced) + unknown:
        problems.append(f"register is {final} after {len(produced)} acknowledged and {unknown} unknown swaps")
    for value in produced:
        if value > final:
            problems.append(f"swap to {value} acknowledged, but the register ended at {final}")
    # Real-time order: a swap that finished before another started wrote a smaller value.
    ordered = sorted(produced.items())
    latest_start = float("-inf")
    for value, op in ordered:
        if op.end < latest_start:
            problems.append(f"swap to {value} finished before a swap to a smaller value started")
        latest_start = max(latest_start, op.start)
    for op in operations:
        if op.outcome != OK or op.result[1]:
            continue
        value = op.result[0]  # a failed swap saw ``value``: it must have held during [start, end]
        writer, overwriter = produced.get(value), produced.get(value + 1)
        if value == op.argument:
            problems.append(f"a swap from {value} failed although it returned the expected value")
        elif value > final or (value > 0 and writer is None and value > len(produced) + unknown):
            problems.append(f"a failed swap returned {value}, never written")
        elif writer is not None and writer.start > op.end:
            problems.append(f"a failed swap returned {value} before any swap began writing it")
        elif overwriter is not None and overwriter.end < op.start:
            problems.append(f"a failed swap returned {value}, overwritten before that call began")
    return problems
