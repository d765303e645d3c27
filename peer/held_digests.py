"""Held-state digests on a peer (`protocol/held_state.py`): the digest of the rows our
weights hold, sent with each update we train, and the search for the rows a sender's
digest says it lacked (peer/state_rewind.py rebuilds that state for an audit).

Each row's 64-bit hash is a pure function of (peer, round), cached so a row is hashed
once while it is recent. The cache is bounded (HASHES_KEPT rows): a run of hours meets
rows without end, and only the newest rounds are hashed again and again (appended rows,
the search window). When full, the oldest rounds' hashes are dropped and rows below them
are hashed on demand, uncached: digests and searches are the same either way.
"""

from __future__ import annotations

from seedflood_p2p.protocol.held_state import MASK, find_missing, row_hash
from seedflood_p2p.protocol.message import UpdateMessage

# Row hashes cached (~120 bytes each: about 16 MB). Rehashing a row costs ~1.2 us, so a
# state of more rows than this pays that per older row in each `missing` search.
HASHES_KEPT = 1 << 17


class HeldDigests:
    """Held-state digests (`protocol/held_state.py`): of the rows our weights hold, kept up
    to date as rows are applied, and the search for the rows a sender's digest says it
    lacked. A recent row's hash is computed once (at most `kept` of them cached)."""

    def __init__(self, kept: int = HASHES_KEPT) -> None:
        self.kept = max(2, kept)
        self._hashes: dict[tuple[bytes, int], int] = {}  # row_hash of recent rows met
        self._floor = -1  # rows of rounds below this are hashed on demand, not cached
        self._memo: tuple | None = None  # (applied list, rows summed, keys, digest)

    def of(self, applied: list[UpdateMessage]) -> int:
        """The digest of the rows `applied` (one hash per (peer, round), so an
        equivocation's swap, three rows applied for one key, counts once). Kept up to date
        from the rows appended since the last call; a list rebuilt (a ban took rows back, a
        restore) is summed again."""
        memo = self._memo
        if memo is not None and memo[0] is applied and memo[1] <= len(applied):
            _, start, keys, total = memo
        else:
            start, keys, total = 0, set(), 0
        for m in applied[start:]:
            key = (m.peer, m.round)
            if key not in keys:
                keys.add(key)
                total = (total + self._row_hash(key)) & MASK
        self._memo = (applied, len(applied), keys, total)
        return total

    def missing(
        self, state: list[UpdateMessage], held: int, peer: bytes, since: int
    ) -> list[UpdateMessage] | None:
        """The updates of `state` that the sender of `peer`'s update lacked by its digest
        `held` ([]: none), or None if no honest pattern explains it
        (`held_state.find_missing`; rows of rounds before `since` are not searched)."""
        hashes = {(m.peer, m.round): self._row_hash((m.peer, m.round)) for m in state}
        keys = find_missing(hashes, held, peer, since)
        if keys is None:
            return None
        lacked = set(keys)
        return [m for m in state if (m.peer, m.round) in lacked]

    def cached(self) -> int:
        """Row hashes held in the cache (at most `kept`)."""
        return len(self._hashes)

    def _row_hash(self, key: tuple[bytes, int]) -> int:
        h = self._hashes.get(key)
        if h is None:
            h = row_hash(*key)
            if key[1] >= self._floor:
                if len(self._hashes) >= self.kept:
                    self._prune()
                if key[1] >= self._floor:
                    self._hashes[key] = h
        return h

    def _prune(self) -> None:
        """Drop the oldest rounds' hashes, to half the bound or less (whole rounds, so a
        round is cached all or nothing); rows below the new floor are not cached again."""
        rounds = sorted({r for _, r in self._hashes}, reverse=True)
        room, kept = self.kept // 2, 0
        per_round: dict[int, int] = {}
        for _, r in self._hashes:
            per_round[r] = per_round.get(r, 0) + 1
        floor = rounds[0] + 1
        for r in rounds:  # newest first, while whole rounds fit in half the bound
            if kept + per_round[r] > room:
                break
            kept += per_round[r]
            floor = r
        self._floor = max(self._floor, floor)
        self._hashes = {k: h for k, h in self._hashes.items() if k[1] >= self._floor}
