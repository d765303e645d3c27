"""The held-state digest: which ledger rows a sender's model held when it trained a round.

An audit recomputes a sender's update on the state it trained on. That state is the
settled state S_t (the counted rows of rounds < t - lag) minus whatever had not reached
the sender yet: a sleeper's late rounds, a newcomer's first rows, a row lost on the way.
An auditor used to guess which rows those were from the order rows reached it; a wrong
guess accused an honest peer (tests/test_audit_sleep.py, tests/test_round_mean_daemon.py).

So a sender now says which state it held, in 8 bytes of its update: the sum (mod 2^64)
of one 64-bit hash per (peer, round) its model held. A sum, not a hash of a list, so an
auditor can test "S_t without these rows" by subtracting their hashes, with no model
pass: `find_missing` searches the ways an honest sender falls behind (one peer's newest
rounds from some round on, its first rows, single lost rows, two or three of those at
once, the last rounds of several peers) and names the rows to leave out; the auditor
recomputes on that state first. A mismatch there still tries the settled state and the
guessed ones (peer/audit_duty.py), so a false digest, even one sent to some peers only,
gains a sender nothing: a wrong scalar is wrong on every state tried, a right one is
matched where it was before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping

MASK = (1 << 64) - 1
Key = tuple[bytes, int]  # (peer, round)
MAX_SUMS = 20_000  # partial sums kept a half while combining many peers' last rounds
MAX_TRIPLE_OPTIONS = 800  # three options at once are searched up to this many options
LAST_ROUNDS = 2  # ... of which each peer may lack its newest 0 .. LAST_ROUNDS rows


def row_hash(peer: bytes, round_: int) -> int:
    """The 64-bit hash of one ledger row (peer, round) in a held-state digest."""
    body = round_.to_bytes(8, "little") + peer
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def state_digest(keys: Iterable[Key]) -> int:
    """The digest of a state holding the rows `keys` (a set: repeats count once)."""
    return sum(row_hash(p, r) for p, r in set(keys)) & MASK


def find_missing(
    hashes: Mapping[Key, int],
    held: int,
    sender: bytes,
    since: int = 0,
    base: int = 0,
    older: Collection[bytes] = (),
) -> list[Key] | None:
    """The rows of a state (`hashes`: its rows and their `row_hash`) that a sender whose
    digest is `held` lacked: [] if it held them all, None if no honest pattern explains
    the digest. Only rows of rounds >= `since` are candidates, never the sender's own.

    Patterns, cheapest first: one option of one peer (its rows from some round on, its
    first one or two rows, or one row), two options, three (while there are at most
    MAX_TRIPLE_OPTIONS options), then each of many peers lacking its newest
    0 .. LAST_ROUNDS rows (at most MAX_SUMS partial sums a half).

    The state may also hold rows older than `since` that `hashes` leaves out (a peer keeps
    old rows packed, peer/applied_rows.py): `base` is their hash sum, `older` their peers
    (whose first rows are then not among `hashes`)."""
    total = (sum(hashes.values()) + base) & MASK
    delta = (total - held) & MASK  # the hash sum of the rows the sender lacked
    if delta == 0:
        return []
    rows: dict[bytes, list[Key]] = {}
    for key in sorted(hashes, key=lambda k: k[1]):
        if key[0] != sender:
            rows.setdefault(key[0], []).append(key)
    options: dict[int, tuple[Key, ...]] = {}
    for peer_rows in rows.values():
        recent = [k for k in peer_rows if k[1] >= since]
        drops = [tuple(recent[i:]) for i in range(len(recent))]  # from some round on
        newcomer = recent and recent[0] == peer_rows[0] and peer_rows[0][0] not in older
        if newcomer:  # its first rows
            drops += [tuple(peer_rows[:j]) for j in (1, 2) if j < len(peer_rows)]
        drops += [(k,) for k in recent]  # one lost row
        for drop in drops:
            options.setdefault(sum(hashes[k] for k in drop) & MASK, drop)
    if delta in options:
        return list(options[delta])
    for s, drop in options.items():  # two options at once
        other = options.get((delta - s) & MASK)
        if other is not None and not set(drop) & set(other):
            return list(drop + other)
    if len(options) <= MAX_TRIPLE_OPTIONS:  # three (a lossy peer's holes), O(options^2)
        items = list(options.items())
        for i, (s1, d1) in enumerate(items):
            for s2, d2 in items[i + 1 :]:
                d3 = options.get((delta - s1 - s2) & MASK)
                if d3 is not None and len(set(d1) | set(d2) | set(d3)) == len(d1 + d2 + d3):
                    return list(d1 + d2 + d3)
    return _newest_of_many(rows, hashes, delta, since)


def _newest_of_many(
    rows: Mapping[bytes, list[Key]], hashes: Mapping[Key, int], delta: int, since: int
) -> list[Key] | None:
    """Each peer lacking its newest 0 .. LAST_ROUNDS recent rows (a sender that trained
    before several peers' last rounds reached it): the peers split in two halves, each
    half's partial sums (at most MAX_SUMS), and a sum of one half that the other
    completes (3^9 < MAX_SUMS sums a half: 18 peers searched in full)."""
    tails_of = []
    for peer_rows in rows.values():
        recent = [k for k in peer_rows if k[1] >= since][-LAST_ROUNDS:]
        tails_of.append([tuple(recent[len(recent) - j :]) for j in range(1, len(recent) + 1)])
    half = len(tails_of) // 2
    first, second = _sums(tails_of[:half], hashes), _sums(tails_of[half:], hashes)
    for s, drop in first.items():
        other = second.get((delta - s) & MASK)
        if other is not None and drop + other:
            return list(drop + other)
    return None


def _sums(tails_of: list[list[tuple[Key, ...]]], hashes: Mapping[Key, int]) -> dict:
    """{hash sum: rows} over every choice of one tail (or none) per peer, at most MAX_SUMS."""
    sums: dict[int, tuple[Key, ...]] = {0: ()}
    for tails in tails_of:
        grown = dict(sums)
        for s, drop in sums.items():
            for tail in tails:
                if len(grown) >= MAX_SUMS:
                    return grown
                grown.setdefault((s + sum(hashes[k] for k in tail)) & MASK, drop + tail)
        sums = grown
    return sums
