"""A cut: which (peer, round) rows a checkpoint or a chain link holds, as each peer's round
ranges ({peer hex: [[first, last], ...]}), so that a cut of ten million gap-free rows is a
few thousand integers. No torch here: a child process that checks a ledger against a cut
(`storage/ledger.py`, `digest_within_file`) imports only this and the ledger."""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def encode_cut(rows: Iterable[tuple[bytes, int]]) -> dict[str, list[list[int]]]:
    """(peer, round) rows as {peer hex: [[first, last], ...]}: a peer that published
    every round from 0 to 10,000 is one range, so the cut stays small."""
    encoder = CutEncoder()
    for peer, round_ in sorted(set(rows), key=lambda row: (row[1], row[0])):
        encoder.add(peer, round_)
    return encoder.encoded()


class CutEncoder:
    """`encode_cut`, fed rows in canonical order (each peer's rounds ascending) one at a
    time: memory of the ranges, not of the rows (a checkpoint of 10M rows at stop)."""

    def __init__(self) -> None:
        self._ranges: dict[bytes, list[list[int]]] = {}

    def add(self, peer: bytes, round_: int) -> None:
        ranges = self._ranges.setdefault(peer, [])
        if ranges and round_ <= ranges[-1][1]:
            raise ValueError(f"rounds of {peer.hex()[-8:]} out of order: {round_}")
        if ranges and ranges[-1][1] == round_ - 1:
            ranges[-1][1] = round_
        else:
            ranges.append([round_, round_])

    def encoded(self) -> dict[str, list[list[int]]]:
        return {peer.hex(): ranges for peer, ranges in sorted(self._ranges.items())}

    def copy(self) -> CutEncoder:
        other = CutEncoder()
        other._ranges = {peer: [list(r) for r in ranges] for peer, ranges in self._ranges.items()}
        return other


class CutRanges:
    """The (peer, round) rows of an `encode_cut` value, kept as its ranges: `in` and `len`
    as a set of the rows would give, in memory of the ranges (a peer's 10,000 rounds are
    two ints, not 10,000 tuples: a restart at 10M rows would otherwise build a set of
    10M tuples, ~1 GB, to ask which rows its checkpoint covers)."""

    def __init__(self, cut: dict[str, list[list[int]]]) -> None:
        if not isinstance(cut, dict):
            raise ValueError("ledger_cut is not a table")
        self._firsts: dict[bytes, list[int]] = {}
        self._lasts: dict[bytes, list[int]] = {}
        self._rows = 0
        for peer_hex, ranges in cut.items():
            peer = bytes.fromhex(peer_hex)
            firsts, lasts = self._firsts.setdefault(peer, []), self._lasts.setdefault(peer, [])
            for first, last in ranges:
                if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last):
                    raise ValueError(f"bad round range {first}..{last}")
                if lasts and first <= lasts[-1]:
                    raise ValueError(f"round ranges of {peer_hex[-8:]} overlap or are unsorted")
                firsts.append(first)
                lasts.append(last)
                self._rows += last - first + 1

    @property
    def peers(self) -> frozenset[bytes]:
        """The peers with at least one row in the cut."""
        return frozenset(peer for peer, firsts in self._firsts.items() if firsts)

    def __contains__(self, row: tuple[bytes, int]) -> bool:
        peer, round_ = row
        firsts = self._firsts.get(peer)
        if not firsts:
            return False
        i = bisect.bisect_right(firsts, round_) - 1
        return i >= 0 and round_ <= self._lasts[peer][i]

    def __len__(self) -> int:
        return self._rows

    def last_round(self) -> int:
        """The newest round any range reaches (-1: no rows)."""
        return max((lasts[-1] for lasts in self._lasts.values() if lasts), default=-1)


def cut_contains(cut: dict[str, list[list[int]]]) -> CutRanges:
    """The (peer, round) rows of an `encode_cut` value; ValueError if it is malformed."""
    return CutRanges(cut)
