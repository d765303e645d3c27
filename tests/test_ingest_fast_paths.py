"""The ingest fast paths (issue 46 item 1) compute exactly what the code before them did.

SubCGE's coordinates (`philox4x32_grid`, `message_coordinates` in chunks), its
coefficients in one pass (`step_coefficient_rows`) and its chunked `accumulate` are checked
bit for bit against the previous implementations, kept here as references; the incremental
quorum round (`RoundClaims`) against `quorum_round`. Speed is bench/bench_accumulate.py's.
"""

import os
import random
from collections import Counter

import numpy as np
import pytest

from seedflood_p2p.algorithm import subcge
from seedflood_p2p.algorithm.subcge import (
    SubCGE,
    message_coordinates,
    step_coefficient_rows,
    step_coefficients,
)
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.rng import derive_key, philox4x32, philox4x32_grid
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.protocol.update import RoundClaims, quorum_round
from seedflood_p2p.workload.models import load_model


def reference_coordinates(run_key, peers, rounds, num_layers, rank, directions=1):
    """message_coordinates as it was before the fast path: every counter built, one pass."""
    n, k = len(peers), directions
    keys = np.array(
        [derive_key("seedflood/message", run_key, p, t) for p, t in zip(peers, rounds)],
        dtype=np.uint64,
    ).reshape(n, 2)
    blocks = -(-3 * num_layers // 4)
    counters = np.zeros((n * k * blocks, 4), dtype=np.uint64)
    counters[:, 0] = np.tile(np.arange(blocks, dtype=np.uint64), n * k)
    counters[:, 1] = np.tile(np.repeat(np.arange(k, dtype=np.uint64), blocks), n)
    key0 = np.repeat(keys[:, 0], k * blocks)
    key1 = np.repeat(keys[:, 1], k * blocks)
    words = philox4x32(counters, (key0, key1)).reshape(n * k, blocks * 4)[:, : 3 * num_layers]
    words = words.reshape(n, k, num_layers, 3).astype(np.int64)
    sign = np.where(words[..., 2] & 1, 1.0, -1.0)
    return words[..., 0] % rank, words[..., 1] % rank, sign


def reference_accumulate(engine: SubCGE, messages, round_sizes=None) -> dict[int, np.ndarray]:
    """SubCGE.accumulate as it was: one core_entries pass, per-message coefficients."""
    L, r, k = len(engine.matrices), engine.config.rank, engine.config.directions
    a, b, sign = reference_coordinates(
        engine.run_key, [m.peer for m in messages], [m.round for m in messages], L, r, k
    )
    if round_sizes is None and engine.config.round_sized:
        round_sizes = Counter(m.round for m in messages)
    sizes = round_sizes or {}
    coef = np.stack([engine.coefficients(m, sizes.get(m.round, 1)) for m in messages])
    index = (np.arange(L) * r * r + a * r + b).reshape(len(messages), k * L)
    value = (sign * coef[:, :, None]).reshape(len(messages), k * L)
    epochs = np.array([engine.config.epoch_of(m.round) for m in messages])
    pending: dict[int, np.ndarray] = {}
    for epoch in np.unique(epochs):
        rows = epochs == epoch
        core = pending.setdefault(int(epoch), np.zeros((L, r * r)))
        np.add.at(core.reshape(-1), index[rows].ravel(), value[rows].ravel())
    return pending


def test_philox_grid_equals_philox_on_its_counters():
    rng = np.random.default_rng(3)
    for n, streams, blocks, rounds in [
        (1, 1, 1, 10),
        (5, 16, 158, 10),
        (3, 7, 13, 10),
        (2, 3, 4, 7),
    ]:
        keys = rng.integers(0, 1 << 32, (n, 2), dtype=np.uint64)
        counters = np.zeros((n * streams * blocks, 4), dtype=np.uint64)
        counters[:, 0] = np.tile(np.arange(blocks, dtype=np.uint64), n * streams)
        counters[:, 1] = np.tile(np.repeat(np.arange(streams, dtype=np.uint64), blocks), n)
        key = (np.repeat(keys[:, 0], streams * blocks), np.repeat(keys[:, 1], streams * blocks))
        expected = philox4x32(counters, key, rounds).reshape(n, streams, blocks, 4)
        got = philox4x32_grid(keys, streams, blocks, rounds)
        assert got.dtype == np.uint32 and np.array_equal(got, expected)


@pytest.mark.parametrize(
    "layers, rank, k, n",
    [
        (210, 8, 16, 40),
        (15, 4, 16, 300),
        (15, 4, 1, 500),
        (30, 6, 3, 90),
        (7, 5, 2, 17),
        (1, 1, 1, 3),
    ],
    ids=["smollm2-k16", "tiny-k16", "tiny-k1", "rank6-k3", "rank5", "one"],
)
def test_message_coordinates_equal_the_previous_implementation(layers, rank, k, n):
    rng = random.Random(layers * 1000 + rank * 10 + k)
    for case in range(3):  # runs, peers (38-byte ids and odd ones), rounds up to 2^62
        run_key = rng.randbytes(16)
        peers = [rng.randbytes(rng.choice([38, 38, 1, 64])) for _ in range(n)]
        rounds = [rng.choice([0, 1, 7, rng.randrange(1 << 20), (1 << 62) - 1]) for _ in range(n)]
        new = message_coordinates(run_key, peers, rounds, layers, rank, k)
        old = reference_coordinates(run_key, peers, rounds, layers, rank, k)
        for x, y in zip(new, old, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), case


def test_message_coordinates_chunk_size_does_not_matter(monkeypatch):
    run_key, peers = os.urandom(16), [os.urandom(38) for _ in range(23)]
    rounds = list(range(23))
    whole = message_coordinates(run_key, peers, rounds, 20, 8, 4)
    for chunk in (1, 100, 1 << 20):
        monkeypatch.setattr(subcge, "COORDINATE_CHUNK", chunk)
        parts = message_coordinates(run_key, peers, rounds, 20, 8, 4)
        assert all(np.array_equal(x, y) for x, y in zip(whole, parts, strict=True))


@pytest.mark.parametrize("normalize", ["unit", "none", "rms"])
@pytest.mark.parametrize("step_rule", ["per_update", "round_mean", "round_sqrt"])
def test_coefficient_rows_equal_per_message_coefficients(normalize, step_rule):
    rng = np.random.default_rng(11)
    for k in range(1, 17):
        config = RunConfig(
            model="tiny-llama",
            normalize=normalize,
            step_rule=step_rule,
            lr_schedule="cosine",
            total_rounds=500,
            clip=3.0,
            directions=k,
            batch_size=2 * k,
            n_ref=4,
        )
        n = 64
        g = rng.normal(scale=rng.choice([1e-3, 1.0, 50.0]), size=(n, k))
        g[0] = 0.0  # a zero row (rms 0) and a negative zero
        g[1, 0] = -0.0
        g = np.array([quantize_scalars(row) for row in g])
        rounds = [int(x) for x in rng.integers(0, 600, n)]
        sizes = {t: int(rng.integers(1, 9)) for t in rounds[: n // 2]}
        rows = step_coefficient_rows(g, rounds, config, sizes)
        for i in range(n):
            one = step_coefficients(tuple(g[i]), rounds[i], config, sizes.get(rounds[i], 1))
            assert np.array_equal(rows[i], one), (k, i)
            assert np.array_equal(np.signbit(rows[i]), np.signbit(one))


@pytest.mark.parametrize(
    "settings",
    [{}, {"directions": 16}, {"directions": 4, "step_rule": "round_sqrt", "normalize": "none"}],
    ids=["k1", "k16", "k4-round-sqrt"],
)
def test_chunked_accumulate_equals_one_pass(monkeypatch, settings):
    model, _ = load_model("tiny-llama")
    config = RunConfig(model="tiny-llama", rank=4, refresh_period=3, lr=1e-2, **settings)
    rng = np.random.default_rng(5)
    k = config.directions
    # rounds out of order, several epochs interleaved, repeated peers: canonical order kept
    messages = [
        UpdateMessage(int(t), f"p{int(p)}".encode(), quantize_scalars(rng.normal(size=k)))
        for t, p in zip(rng.integers(0, 12, 300), rng.integers(0, 40, 300))
    ]
    expected = reference_accumulate(SubCGE(model, config), messages)
    for chunk in (1, 97, 1 << 17):
        monkeypatch.setattr(subcge, "ACCUMULATE_CHUNK", chunk)
        engine = SubCGE(model, config)
        engine.accumulate(messages)
        assert sorted(engine._pending) == sorted(expected)
        for epoch, core in expected.items():
            assert np.array_equal(engine._pending[epoch], core), (chunk, epoch)
    sizes = {t: 7 for t in range(12)}  # the ledger's round sizes, given
    expected = reference_accumulate(SubCGE(model, config), messages, sizes)
    engine = SubCGE(model, config)
    engine.accumulate(messages, sizes)
    assert all(np.array_equal(engine._pending[e], c) for e, c in expected.items())


def test_round_claims_quorum_equals_sorting_all_claims():
    rng = random.Random(7)
    for quorum in (1, 2, 3):
        claims = RoundClaims({}, quorum)
        assert claims.quorum_round() == quorum_round([], quorum) == -1
        for step in range(3000):
            peer = bytes([rng.randrange(40)])
            op = rng.random()
            if op < 0.85:  # the usual change: a raise (or a new peer)
                claims[peer] = max(claims.get(peer, -1), rng.randrange(200)) + rng.randrange(3)
            elif op < 0.93:
                claims[peer] = rng.randrange(200)  # anything, lowered too
            elif op < 0.96 and claims:
                del claims[rng.choice(list(claims))]
            elif op < 0.98:
                claims.pop(peer, None)
            else:
                claims.update({peer: rng.randrange(50)})
            assert claims.quorum_round() == quorum_round(claims.values(), quorum), step
        assert dict(claims) == {p: claims[p] for p in claims}


def test_admission_reference_round_follows_claims(tmp_path):
    from seedflood_p2p.network.gossip.admission import Admission
    from seedflood_p2p.network.monitoring.metrics import NodeMetrics
    from seedflood_p2p.storage.ledger import Ledger

    ledger = Ledger(tmp_path / "l.sqlite", "00" * 8)
    admission = Admission(ledger, 1, b"me", NodeMetrics(), 10)
    assert isinstance(admission.claims, RoundClaims)
    rounds = {}
    rng = random.Random(1)
    for _ in range(500):
        peer, round_ = bytes([rng.randrange(30)]), rng.randrange(1000)
        admission.note_claim(peer, round_)
        rounds[peer] = max(rounds.get(peer, -1), round_)
        assert admission.reference_round() == max(-1, quorum_round(rounds.values()))
    ledger.close()


def test_live_count_is_counted_at_most_once_a_second(monkeypatch):
    from peer import audit_duty

    counted = []

    def peers_alive() -> int:
        counted.append(1)
        return 5

    clock = [100.0]
    monkeypatch.setattr(audit_duty.time, "monotonic", lambda: clock[0])
    daemon = audit_duty.DaemonAudits(None, None, None, peers_alive)
    assert daemon.live_count() == 5 and len(counted) == 1
    clock[0] += 0.5
    assert daemon.live_count() == 5 and len(counted) == 1
    clock[0] += audit_duty.LIVE_COUNT_SECONDS
    assert daemon.live_count() == 5 and len(counted) == 2
