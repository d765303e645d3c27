"""The held-state digest (protocol/held_state.py): a sender's 8 bytes name the rows it held,
and `find_missing` names the rows it lacked for each way an honest sender falls behind."""

import random

import msgpack

from seedflood_p2p.protocol.framing import PROTOCOL_VERSION, Rejected, run_tag
from seedflood_p2p.protocol.held_state import (
    find_missing,
    row_hash,
    state_digest,
)
from seedflood_p2p.protocol.message import pack_scalars
from seedflood_p2p.protocol.update import (
    MAX_UPDATE_BYTES,
    decode_held,
    decode_update,
    encode_update,
)

A, B, C, D, S = (f"peer-{c}".encode() for c in "ABCDS")


def _state(peers: dict[bytes, range]) -> dict[tuple[bytes, int], int]:
    return {(p, r): row_hash(p, r) for p, rounds in peers.items() for r in rounds}


def _held(state, lacked) -> int:
    return state_digest(k for k in state if k not in set(lacked))


def test_the_digest_is_of_a_set_and_tells_rows_apart():
    keys = [(A, 1), (B, 1), (A, 2)]
    assert state_digest(keys) == state_digest(reversed(keys)) == state_digest(keys + keys[:1])
    assert state_digest(keys) != state_digest(keys[:2])
    assert row_hash(A, 1) != row_hash(A, 2) != row_hash(B, 1)
    assert 0 <= state_digest(keys) < 2**64


def test_a_sender_that_held_the_settled_state_lacks_nothing():
    state = _state({A: range(10), B: range(10), S: range(10)})
    assert find_missing(state, state_digest(state), S) == []


def test_a_sleepers_late_rounds_are_found():
    """tests/test_audit_sleep.py: the others trained rounds 10-35 while d slept after its
    round 6, so each of their updates lacked d's rows 7 .. t - lag - 1 (12 and more)."""
    state = _state({A: range(19), B: range(19), D: range(19), S: range(19)})
    lacked = [(D, r) for r in range(7, 19)]
    assert sorted(find_missing(state, _held(state, lacked), S)) == lacked


def test_a_newcomers_rows_a_lossy_sender_never_saw_are_found():
    """tests/test_round_mean_daemon.py: c trained round 11 without any of the late joiner
    d's rows (rounds 8-10), or without only d's first row."""
    state = _state({A: range(11), B: range(11), D: range(8, 11), S: range(11)})
    assert sorted(find_missing(state, _held(state, [(D, 8), (D, 9), (D, 10)]), S)) == [
        (D, 8),
        (D, 9),
        (D, 10),
    ]
    assert find_missing(state, _held(state, [(D, 8)]), S) == [(D, 8)]


def test_lost_rows_and_two_peers_behind_are_found():
    state = _state({A: range(20), B: range(20), C: range(20), S: range(20)})
    for lacked in (
        [(B, 12)],  # one row lost on the way
        [(A, 5), (C, 17)],  # two lost rows
        [(A, 18), (A, 19), (B, 19)],  # two stragglers' newest rows
        [(A, 3), (B, 16), (B, 17), (B, 18), (B, 19)],  # a hole and a straggler
    ):
        assert sorted(find_missing(state, _held(state, lacked), S)) == sorted(lacked)


def test_many_peers_each_behind_by_their_last_rounds_are_found():
    peers = [f"p{i}".encode() for i in range(12)]
    state = _state({**{p: range(30) for p in peers}, S: range(30)})
    lacked = [(peers[1], 29), (peers[4], 28), (peers[4], 29), (peers[7], 29), (peers[9], 29)]
    assert sorted(find_missing(state, _held(state, lacked), S)) == sorted(lacked)


def test_what_no_honest_pattern_explains_is_not_found():
    state = _state({A: range(20), B: range(20), C: range(20), S: range(20)})
    three = [(A, 2), (B, 11), (C, 6)]  # three lost rows: still searched
    assert sorted(find_missing(state, _held(state, three), S)) == sorted(three)
    scattered = [(A, 2), (A, 9), (B, 4), (B, 11), (C, 6), (C, 15)]  # holes everywhere
    assert find_missing(state, _held(state, scattered), S) is None
    assert find_missing(state, random.Random(1).getrandbits(64), S) is None
    # the sender always held its own rows; rows before `since` are never searched
    assert find_missing(state, _held(state, [(S, 19)]), S) is None
    assert find_missing(state, _held(state, [(A, 2)]), S, since=5) is None


def test_the_search_stays_bounded_with_many_peers():
    """32 of 64 peers each lacking its newest row: more choices than MAX_SUMS partial sums
    a half hold, so this digest is reported as not found (the search stops there)."""
    peers = [f"p{i}".encode() for i in range(64)]
    state = _state({p: range(40) for p in peers})
    lacked = [(p, 39) for p in peers[::2]]  # 32 peers behind by one round
    assert find_missing(state, _held(state, lacked), S) is None


def test_the_held_digest_travels_in_the_update():
    run = "ab" * 32
    scalars = tuple(0.5 for _ in range(16))
    held = 2**64 - 1
    data = encode_update(run, 7, scalars, held)
    assert len(data) <= MAX_UPDATE_BYTES  # 16 scalars and the largest digest still fit
    assert decode_update(data, run, A, 16).scalars == scalars
    assert decode_held(data) == held
    assert decode_held(encode_update(run, 7, scalars)) is None  # optional
    assert decode_held(None) is None and decode_held(b"\xc1") is None
    good = [PROTOCOL_VERSION, run_tag(run), 7, pack_scalars((0.5,))]
    for bad in (-1, 1.5, b"12345678", None, True):
        payload = msgpack.packb([*good, bad], use_bin_type=True)
        try:
            decode_update(payload, run, A)
        except Rejected as exc:
            assert exc.reason == "malformed", bad
        else:
            raise AssertionError(f"held {bad!r} was accepted")


def _arrivals(keys: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """Rows in the order an auditor heard them: by round, then by peer."""
    return sorted(keys, key=lambda k: (k[1], k[0]))


def test_several_slow_peers_nobody_waited_for_are_found_by_our_arrival_order():
    """Issue 45: 8 freshly established keys, slow and not waited for (they start as
    laggards), each lacking a tail of 3-6 rounds when a founder trained: more than the
    newest two a peer that `find_missing` searches. What reached the auditor last (their
    late rounds) is what the founder lacked."""
    from peer.held_digests import HeldDigests, arrived_last
    from seedflood_p2p.protocol.message import UpdateMessage

    keys = [f"key{i}".encode() for i in range(8)]
    honest = {A: range(30), B: range(30), S: range(30)}
    state = _state({**honest, **{k: range(8, 14 + i % 4) for i, k in enumerate(keys)}})
    arrived = _arrivals([k for k in state if k[0] in (A, B, S)])
    # the slow keys' rows reached us later, all of them after the honest rows of round 29
    late = _arrivals([k for k in state if k[0] in keys])
    arrived += late
    held_at = 20  # the founder had heard the keys' first 20 rows
    lacked = late[held_at:]
    digest = _held(state, lacked)
    assert find_missing(state, digest, S) is None  # beyond the per-peer patterns
    assert sorted(arrived_last(state, digest, S, 0, 0, arrived)) == sorted(lacked)
    # ... with one more row lost on the way (an honest row of round 11)
    digest = _held(state, [*lacked, (B, 11)])
    assert sorted(arrived_last(state, digest, S, 0, 0, arrived)) == sorted([*lacked, (B, 11)])
    # the daemon's search: find_missing first, then our arrivals
    messages = [UpdateMessage(r, p, (0.5,)) for p, r in state]
    found = HeldDigests().missing(messages, _held(state, lacked), S, 0, arrived=arrived)
    assert sorted((m.peer, m.round) for m in found) == sorted(lacked)
    assert HeldDigests().missing(messages, _held(state, lacked), S, 0) is None


def test_the_arrival_pattern_does_not_explain_scattered_rows():
    """Rows lacked out of our arrival order (and more than one besides the suffix) are not
    found: the pattern is a suffix and at most one other row, O(rows)."""
    from peer.held_digests import arrived_last

    state = _state({A: range(20), B: range(20), C: range(20), S: range(20)})
    arrived = _arrivals(list(state))
    scattered = [(A, 2), (B, 11), (C, 6)]
    assert arrived_last(state, _held(state, scattered), S, 0, 0, arrived) is None
    assert arrived_last(state, state_digest(state), S, 0, 0, arrived) == []
    # rows of rounds before `since`, and the sender's own, are never among the lacked
    assert arrived_last(state, _held(state, [(S, 19)]), S, 0, 0, arrived) is None
    suffix = [k for k in arrived if k[0] != S][-6:]  # rounds 18 and 19 of A, B, C
    assert sorted(arrived_last(state, _held(state, suffix), S, 18, 0, arrived)) == sorted(suffix)
    assert arrived_last(state, _held(state, suffix), S, 19, 0, arrived) is None
