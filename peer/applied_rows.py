"""The rows our weights hold (peer/audit_duty.py `PeerAudits.applied`): the newest in
full, the older ones packed.

A peer holds every row it applied, for as long as it runs: a ban takes its peer's rows
back, however old, and an audit rebuilds a settled state from the rows it holds. As
`UpdateMessage`s that is ~180-300 bytes a row (a run of 1,000 peers x 10,000 rounds: GBs),
and every audit scanned them all. But an audit only moves the newest rows: it rebuilds a
state at most MAX_REWIND rounds back, and searches a sender's missing rows HELD_WINDOW
rounds further (peer/state_rewind.py). So a row applied more than `frozen_after` rounds
ago is packed ("frozen"): per peer, its round and its float16 scalars (2 bytes each; every
applied scalar is float16-exact, `protocol.message.quantize_scalars`), and the sum of the
frozen keys' row hashes for the held-state digest. A frozen row leaves only when its peer
stops counting (`take_back`); nothing else reads it but the digest.

An equivocation replaces a row by two more of the same key (the old copy negated, the
new one), in order applied; a key may so have several rows, frozen or not. The digest
counts a key once (`frozen_total`, `is_frozen`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from seedflood_p2p.protocol.held_state import MASK
from seedflood_p2p.protocol.message import UpdateMessage, pack_scalars, unpack_scalars

Key = tuple[bytes, int]  # (peer, round)


class _Packed:
    """One peer's frozen rows, sorted by round (a key's rows in the order applied):
    rounds, and `width` scalars a row as float16 bits (every applied scalar is float16-exact;
    a row that is not, e.g. a test's, widens the peer's rows to float64)."""

    __slots__ = ("rounds", "values", "width")

    def __init__(self, width: int) -> None:
        self.rounds = array("q")
        self.values = array("H")
        self.width = width

    def add(self, round_: int, scalars: tuple[float, ...]) -> None:
        if len(scalars) != self.width:
            raise ValueError(f"a row of {len(scalars)} scalars among rows of {self.width}")
        if self.values.typecode == "H":
            packed = pack_scalars(scalars)
            if unpack_scalars(packed) == scalars:
                values = array("H", np.frombuffer(packed, dtype="<u2").tolist())
            else:  # not float16: this peer's rows as float64 from now on
                self.values = array("d", (v for i in range(len(self)) for v in self._row(i)))
        if self.values.typecode == "d":
            values = array("d", scalars)
        i = bisect_right(self.rounds, round_)  # after the key's earlier rows
        w = self.width
        if i == len(self.rounds):
            self.rounds.append(round_)
            self.values.extend(values)
        else:  # a late row of an older round (rare): in place
            self.rounds.insert(i, round_)
            self.values[i * w : i * w] = values

    def _row(self, i: int) -> tuple[float, ...]:
        part = self.values[i * self.width : (i + 1) * self.width]
        return unpack_scalars(part.tobytes()) if part.typecode == "H" else tuple(part)

    def has(self, round_: int) -> bool:
        i = bisect_left(self.rounds, round_)
        return i < len(self.rounds) and self.rounds[i] == round_

    def rows(self, peer: bytes) -> Iterator[UpdateMessage]:
        for i, round_ in enumerate(self.rounds):
            yield UpdateMessage(round_, peer, self._row(i))

    def keep(self, keep: list[bool]) -> None:
        w = self.width
        self.rounds = array("q", (r for r, k in zip(self.rounds, keep, strict=True) if k))
        self.values = array(
            self.values.typecode,
            (v for i, k in enumerate(keep) if k for v in self.values[i * w : (i + 1) * w]),
        )

    def __len__(self) -> int:
        return len(self.rounds)


class AppliedRows:
    """The rows the weights hold, in the order applied: `recent` (those applied within
    `frozen_after` rounds, in full) after the frozen ones (packed per peer; iterated first,
    by peer and round). `row_hash(key)`: the held-state hash of a row (cached by the
    caller, `HeldDigests.row_hash`)."""

    def __init__(self, row_hash: Callable[[Key], int], frozen_after: int) -> None:
        self.row_hash = row_hash
        self.frozen_after = frozen_after
        self.recent: list[UpdateMessage] = []
        self._at: list[tuple[int, int]] = []  # (our round, len(recent) before) per extend
        self._frozen: dict[bytes, _Packed] = {}
        self._frozen_rows = 0
        self.frozen_total = 0  # sum of the frozen keys' row hashes (each key once), & MASK
        self._restoring = 0  # the round a restore (`reset`) holds its rows for

    # -- what it holds -----------------------------------------------------------------
    def __iter__(self) -> Iterator[UpdateMessage]:
        for peer, packed in self._frozen.items():
            yield from packed.rows(peer)
        yield from self.recent

    def __len__(self) -> int:
        return self._frozen_rows + len(self.recent)

    def frozen(self) -> int:
        """Rows held packed."""
        return self._frozen_rows

    def is_frozen(self, key: Key) -> bool:
        packed = self._frozen.get(key[0])
        return packed is not None and packed.has(key[1])

    def frozen_peers(self) -> frozenset[bytes]:
        """Peers with frozen rows (rows older than any audit searches)."""
        return frozenset(self._frozen)

    def frozen_rows(self, keys: Iterable[Key]) -> list[UpdateMessage]:
        """The frozen rows of `keys`, in the order applied per key."""
        out = []
        by_peer: dict[bytes, set[int]] = {}
        for peer, round_ in keys:
            by_peer.setdefault(peer, set()).add(round_)
        for peer, rounds in by_peer.items():
            packed = self._frozen.get(peer)
            if packed is not None:
                out += [m for m in packed.rows(peer) if m.round in rounds]
        return out

    # -- changes -----------------------------------------------------------------------
    def extend(self, rows: Iterable[UpdateMessage], our_round: int) -> None:
        """Rows applied now, while we train `our_round`."""
        rows = list(rows)
        if not rows:
            return
        if not self._at or self._at[-1][0] != our_round:
            self._at.append((our_round, len(self.recent)))
        self.recent.extend(rows)

    def reset(self, rows: Iterable[UpdateMessage], our_round: int) -> None:
        """Hold exactly `rows` (a restore, a late join): those of rounds older than
        `frozen_after` are frozen at once (restored rows have no arrival an audit reads).
        Streamed: `rows` may be a restart's whole ledger (`restored` row by row)."""
        self.recent, self._at, self._frozen = [], [], {}
        self._frozen_rows = self.frozen_total = 0
        self._restoring = our_round
        for m in rows:
            self.restored(m)

    def restored(self, m: UpdateMessage) -> None:
        """One more row of a restore (after `reset(..., our_round)`), in the order applied."""
        if m.round < self._restoring - self.frozen_after:
            self._freeze((m,))
        else:
            self.extend((m,), self._restoring)

    def freeze(self, our_round: int) -> int:
        """Pack the rows applied before round `our_round - frozen_after`; returns how many."""
        floor = our_round - self.frozen_after
        cut = 0
        while self._at and self._at[0][0] < floor:
            self._at.pop(0)
            cut = self._at[0][1] if self._at else len(self.recent)
        if not cut:
            return 0
        old, self.recent = self.recent[:cut], self.recent[cut:]
        self._at = [(r, i - cut) for r, i in self._at]
        self._freeze(old)
        return cut

    def hold_unseen(self, total: int) -> None:
        """The weights also hold rows this account cannot name yet: a trusted link's, whose
        held-state hash sum is `total` (its JSON's `held_digest`, peer/latejoin.py). They
        count in the digest from now on; `hold_seen` names them once the history is in."""
        self.frozen_total = (self.frozen_total + total) & MASK

    def hold_seen(self, rows: Iterable[UpdateMessage]) -> None:
        """Some rows of `hold_unseen`, now in the ledger: frozen like any old row. Their
        hashes move from the unseen total to theirs, so the digest is the same after each
        call (the rows of a trusted link may be named a chunk at a time while the peer
        trains and publishes its digest)."""
        for m in rows:
            packed = self._frozen.get(m.peer)
            if packed is None or not packed.has(m.round):  # (a key counts once)
                self.frozen_total = (self.frozen_total - self.row_hash((m.peer, m.round))) & MASK
            self._freeze((m,))

    def _freeze(self, rows: Iterable[UpdateMessage]) -> None:
        for m in rows:
            packed = self._frozen.get(m.peer)
            if packed is None:
                packed = self._frozen[m.peer] = _Packed(len(m.scalars))
            if not packed.has(m.round):
                self.frozen_total = (self.frozen_total + self.row_hash((m.peer, m.round))) & MASK
            packed.add(m.round, m.scalars)
            self._frozen_rows += 1

    def take_back(
        self, counts: Callable[[bytes, int], bool], suspects: Iterable[bytes] | None
    ) -> list[UpdateMessage]:
        """Remove and return the rows that no longer count (`counts(peer, round)`): of the
        recent rows, all; of the frozen ones, those of the peers in `suspects` (None: every
        peer; the caller names the peers whose standing can have dropped rows)."""
        drop = []
        peers = (
            list(self._frozen) if suspects is None else [p for p in suspects if p in self._frozen]
        )
        for peer in peers:
            packed = self._frozen[peer]
            keep = [counts(peer, r) for r in packed.rounds]
            if all(keep):
                continue
            rows = list(packed.rows(peer))
            gone = {m.round for m, k in zip(rows, keep, strict=True) if not k}
            for round_ in gone:
                self.frozen_total = (self.frozen_total - self.row_hash((peer, round_))) & MASK
            drop += [m for m, k in zip(rows, keep, strict=True) if not k]
            self._frozen_rows -= len(rows) - sum(keep)
            if any(keep):
                packed.keep(keep)
            else:
                del self._frozen[peer]
        flags = [counts(m.peer, m.round) for m in self.recent]
        if not all(flags):
            kept: list[UpdateMessage] = []
            at, marks = [], list(self._at)
            j = 0
            for i, (m, k) in enumerate(zip(self.recent, flags, strict=True)):
                while j < len(marks) and marks[j][1] <= i:  # re-index the extend marks
                    at.append((marks[j][0], len(kept)))
                    j += 1
                if k:
                    kept.append(m)
                else:
                    drop.append(m)
            at += [(r, len(kept)) for r, _ in marks[j:]]
            self.recent, self._at = kept, at
        return drop
