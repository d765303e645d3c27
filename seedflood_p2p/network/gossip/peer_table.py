"""The training peers a flood node has heard of: each one's newest round and when it was
last heard alive (`PeerState`), indexed so that who is live, and which live peers are
behind a round, are answered without a pass over every peer.

A waiting round asks both at every tick (peer/rounds.py `Pacing`). A pass over 10,000
peers, filtered for bans and probation, took about 5 ms, so the tick grew to keep the
passes under 3% of the event loop and a round started up to 0.2 s late (issue 46). Here
a tick costs O(live rounds) plus the peers that really are behind.

The index is kept for one liveness timeout (a reader's setting, passed with each query;
another timeout rebuilds it once). Expiry is lazy: each live peer has one entry in a heap
of the times it was last heard; an entry that comes due is checked against the peer's
newest time and pushed again if it was heard since, so a peer costs one heap operation
per timeout, not one per update. Times are the reader's clock (time.monotonic) and never
go back.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class PeerState:
    round: int  # the newest round of its updates in our ledger
    last_seen: float  # when it was last heard alive (-inf: never, e.g. known by repair only)


class PeerTable:
    """Peer id -> PeerState, read like a dict; `heard` and `forget` are the only writers."""

    def __init__(self) -> None:
        self._states: dict[bytes, PeerState] = {}
        self._timeout: float | None = None  # the index below is for this timeout
        self._live: set[bytes] = set()
        self._live_at: dict[int, set[bytes]] = {}  # round -> the live peers at it
        self._due: list[tuple[float, bytes]] = []  # (last heard when pushed, peer): a heap

    # -- the dict a reader sees ----------------------------------------------------------
    def __getitem__(self, peer: bytes) -> PeerState:
        return self._states[peer]

    def get(self, peer: bytes, default: PeerState | None = None) -> PeerState | None:
        return self._states.get(peer, default)

    def __contains__(self, peer: object) -> bool:
        return peer in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._states)

    def items(self):
        return self._states.items()

    def values(self):
        return self._states.values()

    # -- writers ---------------------------------------------------------------------------
    def heard(self, peer: bytes, round_: int, now: float | None = None) -> PeerState:
        """An update of `peer` for `round_` entered our ledger; `now`: it also showed the
        peer alive then (None: it did not, e.g. old history by repair)."""
        state = self._states.get(peer)
        if state is None:
            state = self._states[peer] = PeerState(round_, -math.inf)
        live = peer in self._live
        if round_ > state.round:
            if live:
                self._move(peer, state.round, round_)
            state.round = round_
        if now is not None and now > state.last_seen:
            state.last_seen = now
            if not live and self._timeout is not None:
                self._enter(peer, state)
        return state

    def forget(self, peer: bytes) -> None:
        """`peer` leaves the table (its heap entry is dropped when it comes due)."""
        state = self._states.pop(peer, None)
        if state is not None and peer in self._live:
            self._leave(peer, state.round)

    # -- live peers ----------------------------------------------------------------------
    def live_count(self, now: float, timeout: float) -> int:
        """How many peers were heard within `timeout` s of `now`."""
        self._expire(now, timeout)
        return len(self._live)

    def is_live(self, peer: bytes, now: float, timeout: float) -> bool:
        self._expire(now, timeout)
        return peer in self._live

    def live(self, now: float, timeout: float) -> dict[bytes, PeerState]:
        """The peers heard within `timeout` s of `now` (O(live peers))."""
        self._expire(now, timeout)
        return {p: self._states[p] for p in self._live}

    def live_rounds(self, now: float, timeout: float) -> Iterator[tuple[int, set[bytes]]]:
        """(round, the live peers at it), lowest round first. Read it before the next
        write: the sets are the index's own."""
        self._expire(now, timeout)
        for round_ in sorted(self._live_at):
            yield round_, self._live_at[round_]

    # -- the index -----------------------------------------------------------------------
    def _expire(self, now: float, timeout: float) -> None:
        if timeout != self._timeout:
            self._rebuild(now, timeout)
        cutoff = now - timeout
        due = self._due
        while due and due[0][0] <= cutoff:
            _, peer = heapq.heappop(due)
            state = self._states.get(peer)
            if state is None or peer not in self._live:
                continue  # forgotten, or a stale entry
            if state.last_seen <= cutoff:
                self._leave(peer, state.round)
            else:  # heard since it was pushed: due again one timeout after that
                heapq.heappush(due, (state.last_seen, peer))

    def _rebuild(self, now: float, timeout: float) -> None:
        self._timeout = timeout
        self._live, self._live_at, self._due = set(), {}, []
        for peer, state in self._states.items():
            if now - state.last_seen < timeout:
                self._enter(peer, state)

    def _enter(self, peer: bytes, state: PeerState) -> None:
        self._live.add(peer)
        self._live_at.setdefault(state.round, set()).add(peer)
        heapq.heappush(self._due, (state.last_seen, peer))

    def _leave(self, peer: bytes, round_: int) -> None:
        self._live.discard(peer)
        peers = self._live_at[round_]
        peers.discard(peer)
        if not peers:
            del self._live_at[round_]

    def _move(self, peer: bytes, old: int, new: int) -> None:
        peers = self._live_at[old]
        peers.discard(peer)
        if not peers:
            del self._live_at[old]
        self._live_at.setdefault(new, set()).add(peer)
