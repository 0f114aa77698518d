"""The termination barrier's result: what every rank's next rank assignment starts from (pure: a value and its
checked codec).

The last rank to arrive at an iteration's termination barrier publishes it
(``coordination.iteration``); every rank decodes it, and the pure growth
of the world (``inprocess.restart.growth``) starts from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from elastic_ft.coordination.fault_records import FaultHistory
from elastic_ft.untrusted import MalformedRecord, is_count, json_object

#: Joiners one restart admits: far beyond any respawn budget.
JOINED_MAX = 4096


@dataclass(frozen=True)
class TerminationResult:
    """The termination barrier's result: what every rank's next rank assignment starts from.

    ``world_size``: the iteration's world size; ``terminated``: its ranks
    that left; ``joined``: initial ranks of the processes admitted into the
    next iteration, which take ranks ``world_size, world_size + 1, ...`` in
    this order before the rank assignment renumbers everyone; ``history``:
    the job's faults so far as the give-up rule counts them
    (:func:`~elastic_ft.coordination.fault_records.next_history`).
    """

    world_size: int
    terminated: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    history: FaultHistory = FaultHistory()  # noqa: RUF009 - frozen: one shared instance is safe

    def to_json(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "terminated": self.terminated,
                "joined": self.joined,
                "history": self.history.to_dict(),
            }
        )

    @classmethod
    def from_json(cls, payload: str | bytes | None, world_size: int | None) -> TerminationResult:
        """Decode a payload read from the store (untrusted).

        Raises:
            MalformedRecord: the payload is not a termination result of a world
                of ``world_size`` ranks (``None``: of any size, for a joiner).
        """
        record = json_object(payload or b"")
        terminated = record.get("terminated") if record else None
        joined = record.get("joined") if record else None
        size = record.get("world_size") if record else None
        history = FaultHistory.from_dict(record.get("history", {"repeats": 0, "stalled": 0})) if record else None
        if (
            record is None
            or not is_count(size)
            or size < 1
            or (world_size is not None and size != world_size)
            or not isinstance(terminated, list)
            or not all(is_count(r) and r < size for r in terminated)
            or not isinstance(joined, list)
            or len(joined) > JOINED_MAX
            or len(set(joined)) != len(joined)
            or not all(is_count(r) for r in joined)
            or history is None
        ):
            raise MalformedRecord(
                f"malformed termination result {payload!r:.200} for a world of {world_size or 'any number of'} "
                'ranks; expected {"world_size": N, "terminated": [ranks below N], "joined": [distinct initial ranks], '
                '"history": {"signature": text or null, "repeats": n, "stalled": n}}'
            )
        return cls(size, tuple(sorted(set(terminated))), tuple(joined), history)
