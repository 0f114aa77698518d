"""What a node sees of the rendezvous: the board it always watches, and the whole state it follows only while
it monitors or closes a round."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.kv import KeyValue
from elastic_ft.etcd.view import PrefixView
from elastic_ft.rendezvous import model
from elastic_ft.untrusted import MalformedRecord, SkipLog


class BoardView:
    """The board (``rdzv/board``), watched: its current value, and the last one written, even one deleted in
    the same watch batch (a monitor that leaves writes one last board saying so just before its lease, and the
    board, go)."""

    def __init__(self, client: EtcdClient, key: str, skipped: SkipLog) -> None:
        self._key = key
        self._skipped = skipped
        #: The last board written (set by the watch, in order).
        self.last: model.Board | None = None
        self.view: PrefixView[model.Board | None, model.Board | None] = PrefixView(client, key, self._parse, _latest)

    def _parse(self, relative: str, raw: KeyValue) -> model.Board | None:
        if relative:
            return None  # another key that happens to start with the board's name
        try:
            board = model.Board.from_json(raw.value)
        except MalformedRecord as exc:
            self._skipped.skip(exc.at(self._key), "a malformed rendezvous board")
            return None
        self.last = board
        return board

    def snapshot(self) -> tuple[model.Board | None, int]:
        return self.view.snapshot()


def _latest(boards: Iterable[model.Board | None]) -> model.Board | None:
    """The board view's state: the board, or None when there is none (or it is malformed)."""
    return next((b for b in boards if b is not None), None)


class WholeState:
    """The whole rendezvous state: live while this node follows every key (it monitors, or closes a round),
    else read on demand with one range read (a timeout's message, a look without a monitor)."""

    def __init__(self, client: EtcdClient, prefix: str, board_view: PrefixView[Any, Any], skipped: SkipLog) -> None:
        self._client = client
        self._prefix = prefix
        self._board_view = board_view
        self._skipped = skipped
        self.live: PrefixView[model.Fact, model.RendezvousState] | None = None
        self._users = 0
        self._events_before = 0  # received by live views since stopped
        self._lock = threading.Lock()

    def follow(self) -> PrefixView[model.Fact, model.RendezvousState]:
        """Start (or share) the live view of every key; pair with :meth:`release`."""
        with self._lock:
            if self.live is None:
                self.live = PrefixView(self._client, self._prefix, model.parse_key, model.build_state)
            self._users += 1
            return self.live

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users <= 0 and self.live is not None:
                self._stop_live()

    def snapshot(self) -> tuple[model.RendezvousState, int]:
        """The whole state (a range read unless followed); warns once for each malformed key it left out."""
        live = self.live
        if live is not None:
            state, version = live.snapshot()
        else:
            kvs, revision = self._client.get_prefix(self._prefix)
            state, version = model.parse_state({kv.key[len(self._prefix) :]: kv for kv in kvs}), -revision
        for key, reason in state.malformed.items():
            self._skipped.skip(MalformedRecord(reason, f"{self._prefix}{key}"), "a malformed rendezvous key")
        return state, version

    def disconnected_for(self) -> float:
        live = self.live
        return max(self._board_view.disconnected_for(), live.disconnected_for() if live is not None else 0.0)

    @property
    def events_received(self) -> int:
        """Watch events every live view of this node received."""
        live = self.live
        return self._events_before + (live.events_received if live is not None else 0)

    def _stop_live(self) -> None:
        if self.live is not None:
            self.live.stop()
            self._events_before += self.live.events_received
            self.live, self._users = None, 0

    def stop(self) -> None:
        with self._lock:
            self._stop_live()
