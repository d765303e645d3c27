"""The rows a peer's weights hold (peer/applied_rows.py): the newest in full, the older
ones packed. Against a plain list of every row (what the peer held before), on random
histories with late rows, equivocation swaps and bans; then in `PeerAudits` on the tiny
model, past the freezing horizon: a ban takes frozen rows back, an audit still matches."""

import random

import numpy as np
import pytest
import torch

from peer.applied_rows import AppliedRows
from peer.held_digests import HeldDigests
from seedflood_p2p.protocol.held_state import row_hash, state_digest
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, quantize_scalars

PEERS = [f"peer-{i}".encode() for i in range(5)]


def _row(rng: random.Random, round_: int, peer: bytes, k: int = 2) -> UpdateMessage:
    return UpdateMessage(round_, peer, quantize_scalars([rng.gauss(0, 1) for _ in range(k)]))


def _digest(rows) -> int:
    return state_digest((m.peer, m.round) for m in rows)


def _same(a, b) -> bool:
    return sorted(a) == sorted(b)


@pytest.mark.parametrize("seed", range(6))
def test_packed_rows_hold_what_the_list_held(seed):
    """Each round: the rows of a settled round, sometimes a late row of an old round or an
    equivocation's swap (old copy negated, new copy) of a row long frozen, and now and then
    a ban (take back a peer's rows) or a case turned back (apply them again). After every
    step the rows held, the held-state digest and what a ban takes back are the list's."""
    rng = random.Random(seed)
    held = HeldDigests()
    rows = AppliedRows(held.row_hash, frozen_after=12)
    reference: list[UpdateMessage] = []
    banned: set[bytes] = set()
    waiting: list[UpdateMessage] = []
    copies: dict[tuple[bytes, int], UpdateMessage] = {}  # the copy each key holds now

    def counts(peer: bytes, round_: int) -> bool:
        return peer not in banned

    for now in range(120):
        new = [_row(rng, now, p) for p in PEERS if p not in banned and rng.random() < 0.9]
        if now > 30 and rng.random() < 0.3:  # a late row of an old round
            old = rng.randrange(now - 30)
            peer = rng.choice(PEERS)
            if (peer, old) not in copies and peer not in banned:
                new.append(_row(rng, old, peer))
        if now > 30 and rng.random() < 0.2 and copies:  # a swap of a (likely frozen) row
            key = rng.choice(sorted(copies))
            if key[0] not in banned and key[1] < now - 20:
                replacement = _row(rng, key[1], key[0])
                new += [copies[key].negated(), replacement]
        for m in new:
            if m.scalars != tuple(-s for s in copies.get((m.peer, m.round), m).scalars):
                copies[(m.peer, m.round)] = m
        rows.extend(new, now)
        reference += new
        rows.freeze(now)
        if now in (50, 90):  # a ban
            peer = {50: PEERS[0], 90: PEERS[1]}[now]
            banned.add(peer)
            drop = rows.take_back(counts, {peer})
            expected = [m for m in reference if m.peer == peer]
            assert _same(drop, expected)
            reference = [m for m in reference if m.peer != peer]
            waiting += drop
        if now == 70:  # the first case turned back: its rows applied again, as late rows
            peer = PEERS[0]
            banned.discard(peer)
            back = [m for m in waiting if m.peer == peer]
            waiting = [m for m in waiting if m.peer != peer]
            rows.extend(back, now)
            reference += back
        assert len(rows) == len(reference)
        assert _same(rows, reference)
        assert held.of(rows.recent, rows.frozen_total, rows.is_frozen) == _digest(reference)
    assert rows.frozen() > 0.8 * len(reference)  # most rows are packed by the end
    assert len(rows.recent) <= 13 * 3 * len(PEERS)  # the rows of the last 13 rounds at most


def test_a_ban_takes_back_frozen_rows_of_only_the_peers_named():
    rng = random.Random(1)
    held = HeldDigests()
    rows = AppliedRows(held.row_hash, frozen_after=5)
    for now in range(40):
        rows.extend([_row(rng, now, p) for p in PEERS[:3]], now)
        rows.freeze(now)
    assert rows.frozen() == 3 * 34 and rows.frozen_peers() == frozenset(PEERS[:3])
    # counts says no for everyone, but only the suspects' frozen rows are read
    drop = rows.take_back(lambda peer, round_: False, {PEERS[0]})
    assert {m.peer for m in drop if m.round < 34} == {PEERS[0]}
    assert not rows.recent and rows.frozen() == 2 * 34
    assert rows.frozen_peers() == frozenset(PEERS[1:3])


def test_rows_that_are_not_float16_are_kept_exactly():
    """Every applied scalar is float16-exact (the wire's); a row that is not (a test's, an
    old build's) widens its peer's packed rows instead of being rounded."""
    held = HeldDigests()
    rows = AppliedRows(held.row_hash, frozen_after=1)
    exact = UpdateMessage(0, PEERS[0], (0.5, -2.0))
    inexact = UpdateMessage(1, PEERS[0], (0.1, 1e-9))
    rows.extend([exact], 0)
    rows.extend([inexact], 1)
    rows.freeze(5)
    assert rows.frozen() == 2 and list(rows) == [exact, inexact]
    with pytest.raises(ValueError, match="scalars"):
        rows.extend([UpdateMessage(2, PEERS[0], (1.0,))], 2)
        rows.freeze(9)


def test_a_restore_packs_its_old_rows_at_once():
    rng = random.Random(2)
    held = HeldDigests()
    rows = AppliedRows(held.row_hash, frozen_after=10)
    restored = [_row(rng, t, p) for t in range(50) for p in PEERS]
    rows.reset(restored, 50)
    assert rows.frozen() == 40 * len(PEERS) and len(rows.recent) == 10 * len(PEERS)
    assert held.of(rows.recent, rows.frozen_total, rows.is_frozen) == _digest(restored)


def test_packed_rows_cost_a_fraction_of_the_messages():
    """What a row costs held (tracemalloc): a message of 16 scalars against its packed
    form. bench/bench_applied_rows.py measures it at scale."""
    import tracemalloc

    rng = np.random.default_rng(0)
    peers = [f"peer-{i:04d}".encode() for i in range(50)]

    def build(frozen_after):
        rows = AppliedRows(lambda key: row_hash(*key), frozen_after)  # no hash cache
        for t in range(100):
            batch = [UpdateMessage(t, p, quantize_scalars(rng.normal(size=16))) for p in peers]
            rows.extend(batch, t)
            rows.freeze(t + 1)
        return rows

    sizes = []
    for frozen_after in (10**9, 0):
        tracemalloc.start()
        rows = build(frozen_after)
        sizes.append(tracemalloc.get_traced_memory()[0] / len(rows))
        tracemalloc.stop()
        del rows
    listed, packed = sizes
    assert packed < listed / 4, sizes  # ~248 -> ~40 bytes


# -- in PeerAudits, past the freezing horizon ------------------------------------------


def _audits(tmp_path, lag=0):
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.core.extra_settings import AuditSettings
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    config = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=0.5, n_ref=4)
    model, tokenizer = load_model("tiny-llama")
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    settings = AuditSettings(enabled=True, lag=lag)
    audits = PeerAudits(settings, b"secret", b"peer-C", ledger, live, AuditIntake(ledger, 1))
    return audits, ledger, live, tokenizer, config


@pytest.mark.usefixtures("one_thread")
def test_a_ban_takes_back_a_peers_frozen_rows_from_the_weights(tmp_path):
    from peer.state_rewind import FROZEN_AFTER

    A, B, X = b"peer-A", b"peer-B", b"peer-X"
    audits, ledger, live, _, _ = _audits(tmp_path)
    base = {k: w.clone() for k, w in live.weights().items()}
    rounds = FROZEN_AFTER + 40
    rng = np.random.default_rng(3)
    history = [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1) * 0.1))
        for t in range(rounds)
        for p in (A, B, X)
    ]
    ledger.add(history)
    for t in range(1, rounds + 1):  # round t applies the rows of round t - 1 (lag 0)
        audits.round = t
        audits.apply([m for m in history if m.round == t - 1])
    assert audits.applied.frozen() >= 3 * 35 and len(audits.applied) == len(history)
    # X is banned: three auditors' mismatch records on one of its updates
    claim = history[2]
    assert claim.peer == X
    records = [AuditRecord(X, 0, a, (claim.scalars[0] + 1.0,), 1) for a in (A, B, b"peer-D")]
    ledger.add_audits(records)
    newly = audits.set_standing(audits.judge())
    assert newly == [X]
    assert {m.peer for m in audits.applied} == {A, B}
    assert sorted(m for m in audits.waiting if m.peer == X) == sorted(
        m for m in history if m.peer == X
    )
    assert audits.held_digest() == _digest(m for m in history if m.peer != X)
    # the weights: base + A's and B's rows only (a float32 sum in another order)
    held = {k: w.clone() for k, w in live.weights().items()}
    live.load_weights(base)
    live.apply([m for m in history if m.peer != X])
    for name, w in live.weights().items():
        assert torch.allclose(w, held[name], atol=1e-6), name
    ledger.close()


@pytest.mark.usefixtures("one_thread")
def test_an_honest_update_still_matches_with_old_rows_packed(tmp_path):
    """An audit long into a run: the state is mostly packed rows; the sender's held-state
    digest names exactly that state, so the first recomputation matches."""
    from peer.state_rewind import FROZEN_AFTER
    from seedflood_p2p.algorithm.trainer import zo_step
    from seedflood_p2p.protocol.message import Envelope
    from seedflood_p2p.protocol.update import encode_update
    from seedflood_p2p.workload.data import load_task

    A, B = b"peer-A", b"peer-B"
    audits, ledger, live, tokenizer, config = _audits(tmp_path)
    task = load_task("synthetic-sentiment")
    rounds = FROZEN_AFTER + 30
    rng = np.random.default_rng(4)
    history = [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1) * 0.05))
        for t in range(rounds)
        for p in (A, B)
    ]
    ledger.add(history)
    for t in range(1, rounds + 1):
        audits.round = t
        audits.on_accept([m for m in history if m.round == t - 1], 4)
        audits.apply([m for m in history if m.round == t - 1])
    assert audits.applied.frozen() >= 2 * 25  # the oldest rounds are packed
    # A trains round `rounds` on S_rounds (all rows of earlier rounds): what we hold
    claim, _ = zo_step(live.engine, tokenizer, task, A, rounds)
    held = _digest(history)
    assert audits.held_digest() == held
    data = encode_update(config.run_id, rounds, claim.scalars, held)
    ledger.add([claim], [Envelope(data, b"s", b"sig")])
    audits.on_accept([claim], 4)
    audits.due = {(A, rounds): "recheck"}
    ((record, mismatch),) = audits.audit(audits.ready(rounds + 6), live.engine, tokenizer, task)
    assert not mismatch and audits.counts["held_exact"] == 1
    assert audits.counts["late_state_retries"] == 0
    ledger.close()


def test_a_trusted_links_rows_count_in_the_digest_before_they_are_known():
    """A joiner trusting a link holds its rows in the weights before the ledger does:
    `hold_unseen(the link's held digest)` counts them in the held-state digest at once;
    `hold_seen(rows)` names them, a chunk at a time, when the history is in, the digest the
    same after every chunk (the peer publishes it meanwhile), and the account is then the
    one of a restore that held them all along: the same rows taken back by a ban."""
    rng = random.Random(3)
    link = [_row(rng, t, p) for t in range(20) for p in PEERS]
    after = [_row(rng, t, p) for t in range(20, 30) for p in PEERS]
    digests = HeldDigests()
    whole = AppliedRows(digests.row_hash, frozen_after=12)
    whole.reset(link + after, 30)
    trusting = AppliedRows(digests.row_hash, frozen_after=12)
    trusting.reset(after, 30)

    def digest(a: AppliedRows) -> int:
        return digests.of(a.recent, a.frozen_total, a.is_frozen)

    trusting.hold_unseen(_digest(link))
    assert digest(trusting) == digest(whole) == _digest(link + after)
    trusting.hold_seen(link[:40])
    assert digest(trusting) == digest(whole)
    trusting.hold_seen(link[40:])
    assert digest(trusting) == digest(whole)
    assert trusting.frozen() == whole.frozen() + 2 * len(PEERS)  # (rounds 18, 19: frozen here)
    banned = PEERS[1]

    def counts(peer, round_):
        return peer != banned

    assert _same(trusting.take_back(counts, [banned]), whole.take_back(counts, [banned]))
    assert digest(trusting) == digest(whole)
