"""Held-state digests on a peer (`protocol/held_state.py`): the digest of the rows our
weights hold, sent with each update we train, and the search for the rows a sender's
digest says it lacked (peer/state_rewind.py rebuilds that state for an audit).

Each row's 64-bit hash is a pure function of (peer, round), cached so a row is hashed
once while it is recent. Only the newest rounds are hashed again and again (appended rows,
the search window, a row frozen FROZEN_AFTER rounds after it was applied), so the cache
keeps the rows of the newest ROUNDS_CACHED rounds, and at most HASHES_KEPT rows in all (a
swarm of many peers): a run of hours meets rows without end, and a restart hashes every
frozen row of the history once. Rows of older rounds are hashed on demand, uncached:
digests and searches are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import islice

from seedflood_p2p.protocol.held_state import MASK, find_missing, row_hash
from seedflood_p2p.protocol.message import UpdateMessage

# Row hashes cached (~140 bytes each: at most about 18 MB). Rehashing a row costs ~1.2 us,
# so a state of more rows than this pays that per older row in each `missing` search.
HASHES_KEPT = 1 << 17
# Rounds whose rows are cached: every round a row is hashed in more than once (the search
# window, peer/state_rewind.py HELD_WINDOW + MAX_REWIND = 90 rounds; a row frozen 120 + lag
# rounds after it was applied, peer/applied_rows.py) and the digest's KEYS_WINDOW. Before,
# by count alone, a 6-peer run cached its last 131,072 rows: ~9 MiB more an hour of a
# soak's life, and a restarted peer hashed (and kept) every frozen row of the history.
ROUNDS_CACHED = 256
# Rounds whose keys a digest keeps to count a key once (`HeldDigests.of`), and the most
# appended rows older than that checked one by one (more: the list is summed again).
KEYS_WINDOW = 256
MAX_OLD_APPENDED = 64


class HeldDigests:
    """Held-state digests (`protocol/held_state.py`): of the rows our weights hold, kept up
    to date as rows are applied, and the search for the rows a sender's digest says it
    lacked. A recent row's hash is computed once (at most `kept` of them cached)."""

    def __init__(self, kept: int = HASHES_KEPT, rounds: int = ROUNDS_CACHED) -> None:
        self.kept = max(2, kept)
        self.rounds = max(1, rounds)
        # row_hash of recent rows met, by round (oldest rounds dropped whole)
        self._hashes: dict[int, dict[bytes, int]] = {}
        self._count = 0  # rows in `_hashes`
        self._floor = -1  # rows of rounds below this are hashed on demand, not cached
        self._top = -1  # the newest round met
        # (applied list, rows summed, keys of the newest rounds, digest, newest round)
        self._memo: tuple | None = None
        self._window_keys = 1024  # keys held after the last pruning

    def of(
        self,
        applied: list[UpdateMessage],
        base: int = 0,
        frozen: Callable[[tuple[bytes, int]], bool] | None = None,
    ) -> int:
        """The digest of the rows `applied` (one hash per (peer, round), so an
        equivocation's swap, three rows applied for one key, counts once), plus `base`, the
        hash sum of older rows held packed (peer/applied_rows.py), whose keys `frozen`
        tells (they are not counted again). Kept up to date from the rows appended since
        the last call; a list rebuilt (a ban took rows back, a restore, a freeze) is summed
        again.

        The keys already summed are kept only for the newest KEYS_WINDOW rounds (a run of
        hours appends rows without end): an appended row older than that (a late row, a
        swap of an old round: rare) is looked for in the list itself, and many of them at
        once sum the list again."""
        memo = self._memo
        if memo is None or memo[0] is not applied or memo[1] > len(applied):
            return (self._sum_all(applied, frozen) + base) & MASK
        _, start, keys, total, top = memo
        new = applied[start:]
        top = max([top, *(m.round for m in new)])
        floor = top - KEYS_WINDOW
        if sum(m.round < floor for m in new) > MAX_OLD_APPENDED:
            return (self._sum_all(applied, frozen) + base) & MASK
        for i, m in enumerate(new, start):
            key = (m.peer, m.round)
            if frozen is not None and frozen(key):
                continue
            if m.round >= floor:
                if key in keys:
                    continue
                keys.add(key)
            elif any(o.round == m.round and o.peer == m.peer for o in islice(applied, i)):
                continue
            total = (total + self._row_hash(key)) & MASK
        if len(keys) > 2 * self._window_keys:  # drop the keys below the window
            keys = {k for k in keys if k[1] >= floor}
            self._window_keys = max(len(keys), 1024)
        self._memo = (applied, len(applied), keys, total, top)
        return (total + base) & MASK

    def _sum_all(
        self, applied: list[UpdateMessage], frozen: Callable[[tuple[bytes, int]], bool] | None
    ) -> int:
        seen: set[tuple[bytes, int]] = set()
        total = 0
        for m in applied:
            key = (m.peer, m.round)
            if key not in seen and not (frozen is not None and frozen(key)):
                seen.add(key)
                total = (total + self._row_hash(key)) & MASK
        top = max((m.round for m in applied), default=-1)
        keys = {k for k in seen if k[1] >= top - KEYS_WINDOW}
        self._window_keys = max(len(keys), 1024)
        self._memo = (applied, len(applied), keys, total, top)
        return total

    def missing(
        self,
        state: list[UpdateMessage],
        held: int,
        peer: bytes,
        since: int,
        base: int = 0,
        older: frozenset[bytes] = frozenset(),
        arrived: Sequence[tuple[bytes, int]] = (),
    ) -> list[UpdateMessage] | None:
        """The updates of `state` that the sender of `peer`'s update lacked by its digest
        `held` ([]: none), or None if no honest pattern explains it
        (`held_state.find_missing`; rows of rounds before `since` are not searched). The
        state also holds packed rows older than `since` (`base`: their hash sum; `older`:
        their peers), none of them in `state`.

        `arrived`: rows of the state in the order they reached us, oldest first. When no
        pattern of `find_missing` fits, the rows that reached us last are tried: all those
        after some point, with or without one other row (`arrived_last`)."""
        hashes = {(m.peer, m.round): self._row_hash((m.peer, m.round)) for m in state}
        keys = find_missing(hashes, held, peer, since, base, older)
        if keys is None and arrived:
            keys = arrived_last(hashes, held, peer, since, base, arrived)
        if keys is None:
            return None
        lacked = set(keys)
        return [m for m in state if (m.peer, m.round) in lacked]

    def keys_held(self) -> int:
        """Keys the digest of the last list keeps to count a key once (its newest rounds)."""
        return len(self._memo[2]) if self._memo else 0

    def cached(self) -> int:
        """Row hashes held in the cache (at most `kept`, of the newest `rounds` rounds)."""
        return self._count

    def rounds_cached(self) -> int:
        """Rounds with a row hash in the cache (at most `rounds`)."""
        return len(self._hashes)

    def row_hash(self, key: tuple[bytes, int]) -> int:
        """`held_state.row_hash` of a row, cached while it is recent."""
        return self._row_hash(key)

    def _row_hash(self, key: tuple[bytes, int]) -> int:
        peer, round_ = key
        bucket = self._hashes.get(round_)
        h = None if bucket is None else bucket.get(peer)
        if h is not None:
            return h
        h = row_hash(peer, round_)
        if round_ > self._top:
            self._top = round_
            if round_ - self.rounds >= self._floor + max(1, self.rounds // 4):
                self._drop_below(round_ - self.rounds + 1)  # the window slid a quarter
        if round_ < self._floor or round_ <= self._top - self.rounds:
            return h  # an old row: hashed on demand
        if self._count >= self.kept:
            self._prune()
            if round_ < self._floor:
                return h
        self._hashes.setdefault(round_, {})[peer] = h
        self._count += 1
        return h

    def _drop_below(self, floor: int) -> None:
        """Forget the rows of rounds below `floor`, and cache none of them again."""
        self._floor = max(self._floor, floor)
        for r in [r for r in self._hashes if r < self._floor]:
            self._count -= len(self._hashes.pop(r))

    def _prune(self) -> None:
        """The count bound: drop the oldest rounds' hashes, to half of it or less (whole
        rounds, so a round is cached all or nothing); rows below the new floor are not
        cached again."""
        room, kept = self.kept // 2, 0
        rounds = sorted(self._hashes, reverse=True)
        floor = rounds[0] + 1
        for r in rounds:  # newest first, while whole rounds fit in half the bound
            if kept + len(self._hashes[r]) > room:
                break
            kept += len(self._hashes[r])
            floor = r
        self._drop_below(floor)


def arrived_last(
    hashes: Mapping[tuple[bytes, int], int],
    held: int,
    sender: bytes,
    since: int,
    base: int,
    arrived: Sequence[tuple[bytes, int]],
) -> list[tuple[bytes, int]] | None:
    """The rows a sender lacked if it trained before the rows that reached us last had
    reached it: every row of `hashes` (rounds >= `since`, not the sender's) after some
    point of `arrived` (our arrival order, oldest first), and perhaps one other row (one
    lost on the way). None if no such set explains the digest `held`.

    The pattern of slow established peers that nobody waits for (several of them, each
    lacking a tail of many rounds: `find_missing` searches each peer's newest two only),
    in O(rows): the sender trained at some moment, and what reached us after about that
    moment had not reached it. A guess from our arrivals, so only the auditor's own: a
    wrong one is a state tried for nothing, never a vote."""
    delta = (sum(hashes.values()) + base - held) & MASK
    if delta == 0:
        return []
    order = dict.fromkeys(k for k in arrived if k in hashes and k[0] != sender and k[1] >= since)
    singles = {hashes[k]: k for k in hashes if k[0] != sender and k[1] >= since}
    suffix: list[tuple[bytes, int]] = []
    taken: set[tuple[bytes, int]] = set()
    total = 0
    for key in reversed(order):
        suffix.append(key)
        taken.add(key)
        total = (total + hashes[key]) & MASK
        if total == delta:
            return suffix[::-1]
        other = singles.get((delta - total) & MASK)
        if other is not None and other not in taken:
            return [*suffix[::-1], other]
    return None
