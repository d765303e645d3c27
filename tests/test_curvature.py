"""The diagonal curvature scale (`RunConfig.curvature`, algorithm/curvature.py): each round's
scale is the defined function of the earlier rounds' core updates, it scales both the
perturbation and the step, folding is repeatable, and what it cannot do is refused."""

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.basis import KFAC_ARTIFACT_KIND, encode
from seedflood_p2p.algorithm.curvature import Curvature, scale_of
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.workload.models import load_model

SETTINGS = dict(
    model="tiny-llama", rank=4, directions=4, batch_size=8, basis="kfac", basis_refresh=0
)


def _messages(rounds: range, peers: int = 3, seed: int = 0) -> list[UpdateMessage]:
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, f"peer-{p}".encode(), quantize_scalars(rng.normal(size=4)))
        for t in rounds
        for p in range(peers)
    ]


def _engine(curvature: float = 0.9) -> SubCGE:
    model, _ = load_model("tiny-llama")
    engine = SubCGE(model, RunConfig(**SETTINGS, curvature=curvature))
    g = torch.Generator().manual_seed(7)  # a K-FAC-kind artifact: both sides, orthonormal
    u, v = {}, {}
    for matrix in engine.matrices:
        m, k = matrix.shape
        u[matrix.name] = torch.linalg.qr(torch.randn(m, 4, generator=g))[0] * m**0.5
        v[matrix.name] = torch.linalg.qr(torch.randn(k, 4, generator=g))[0] * k**0.5
    engine.add_basis(0, encode(v, {"kind": KFAC_ARTIFACT_KIND}, u))
    return engine


def test_the_scale_is_v_plus_its_mean_to_the_minus_quarter_normalised_per_matrix():
    v = np.array([[0.0, 1.0, 4.0, 9.0], [0.0, 0.0, 0.0, 0.0]])
    s = scale_of(v)
    raw = (v[0] + v[0].mean()) ** -0.25
    assert np.allclose(s[0], raw / np.sqrt(np.mean(raw**2)))
    assert np.allclose(np.mean(s[0] ** 2), 1.0) and s[0][0] > s[0][3]  # small v: larger s
    assert np.array_equal(s[1], np.ones(4))  # no row moved it yet


def test_each_rounds_scale_comes_from_the_earlier_rounds_updates():
    c = Curvature(0.5, (1, 4))
    c.delta[:] = [1.0, 0.0, 0.0, 2.0]  # round 0's update
    c.advance(1)
    assert np.allclose(c.second, 0.5 * np.array([[1.0, 0.0, 0.0, 4.0]]))
    assert np.allclose(c.scale, scale_of(c.second)) and not c.delta.any()
    c.advance(3)  # round 1 had no rows, round 2 none either: v decays twice more
    assert np.allclose(c.second, 0.125 * np.array([[1.0, 0.0, 0.0, 4.0]]))
    with pytest.raises(ValueError, match="round order"):
        c.advance(2)


def test_rows_are_folded_with_their_rounds_scale_into_the_core_and_the_rounds_update():
    engine = _engine()
    plain = _engine(curvature=0.0)  # another run id: compare entries, not runs
    first = _messages(range(1))
    engine.accumulate(first)
    d0 = engine.curvature.delta.copy()
    _, index, value = engine.core_entries(first)
    expected = np.zeros_like(d0).reshape(-1)
    np.add.at(expected, index.ravel(), value.ravel())  # round 0: s = 1 everywhere
    assert np.array_equal(d0.reshape(-1), expected)
    second = _messages(range(1, 2), seed=1)
    engine.accumulate(second)
    assert np.allclose(engine.curvature.second, 0.1 * d0 * d0)
    _, index, value = engine.core_entries(second)
    scaled = np.zeros_like(expected)
    np.add.at(scaled, index.ravel(), (value * engine.curvature.scale.reshape(-1)[index]).ravel())
    assert np.array_equal(engine.curvature.delta.reshape(-1), scaled)
    assert np.allclose(engine._pending[0].reshape(-1), expected + scaled, rtol=1e-12, atol=0)
    assert plain.curvature is None


def test_the_perturbation_of_a_round_is_scaled_like_its_step():
    engine = _engine()
    engine.accumulate(_messages(range(3)))
    d = engine.direction(b"peer-x", 3)
    with engine.perturbed(d, 1.0, 8):
        p = engine.matrices[0].perturbation
        plain_scale = torch.from_numpy(d.sign[:, 0]).to(p.scale.dtype)
        r = engine.config.rank
        factor = engine.curvature.scale[0, d.a[:, 0] * r + d.b[:, 0]]
        per_direction = p.scale.reshape(4, -1)[:, 0]
        assert torch.allclose(per_direction, plain_scale * torch.from_numpy(factor).float())
        assert not np.allclose(factor, 1.0)  # three rounds of rows moved it
    assert engine.curvature.head == 3


def test_folding_round_by_round_or_all_at_once_gives_the_same_bits():
    messages = _messages(range(6))
    a, b = _engine(), _engine()
    for t in range(6):
        a.accumulate([m for m in messages if m.round == t])
    b.accumulate(messages)
    assert np.array_equal(a._pending[0], b._pending[0])
    assert np.array_equal(a.curvature.second, b.curvature.second)


def test_a_late_row_is_refused():
    engine = _engine()
    engine.accumulate(_messages(range(3)))
    with pytest.raises(ValueError, match="round order"):
        engine.accumulate(_messages(range(1, 2)))


def test_settings_and_daemons_refuse_what_is_not_built():
    with pytest.raises(UserError, match="curvature needs a basis that never changes"):
        RunConfig(model="tiny-llama", curvature=0.9)
    with pytest.raises(UserError, match="curvature with momentum is not built"):
        RunConfig(**SETTINGS, curvature=0.9, momentum=0.5)
    with pytest.raises(UserError, match=r"curvature must be a number in \[0, 0.99\]"):
        RunConfig(**SETTINGS, curvature=1.0)
    problem = RunConfig(**SETTINGS, curvature=0.9).daemon_problem()
    assert problem and "not linear in the ledger" in problem
    assert RunConfig(**SETTINGS).daemon_problem() is None
    assert "curvature" not in RunConfig().to_json()  # runs without it keep their id


def _weights(engine: SubCGE) -> dict[str, torch.Tensor]:
    return {m.name: m.weight.detach().clone() for m in engine.matrices}


def _train_live(engine: SubCGE, messages: list[UpdateMessage]) -> None:
    live = LiveModel(engine)
    for t in sorted({m.round for m in messages}):
        live.apply([m for m in messages if m.round == t])


def test_replay_is_bitwise_repeatable_and_equals_the_live_model():
    messages = _messages(range(8))  # canonical order: (round, peer)
    live = _engine()
    _train_live(live, messages)
    first, second = _engine(), _engine()
    for engine in (first, second):
        replay(engine.model, engine.config, messages, schedule=engine.schedule)
    for name, w in _weights(first).items():
        assert torch.equal(w, _weights(second)[name])
        torch.testing.assert_close(w, _weights(live)[name], atol=2e-6, rtol=0)


def test_training_resumed_from_a_replay_goes_on_with_the_scale():
    """Stop after round 4, replay the ledger into the training engine, go on with rounds
    5-7: the model of an uninterrupted run. The replay rebuilds v round by round; without
    it (a fresh scale) rounds 5-7 would step elsewhere."""
    messages = _messages(range(8))
    straight = _engine()
    _train_live(straight, messages)
    resumed = _engine()
    replay(resumed.model, resumed.config, [m for m in messages if m.round < 5], engine=resumed)
    assert resumed.curvature.head == 4
    _train_live(resumed, [m for m in messages if m.round >= 5])
    for name, w in _weights(straight).items():
        torch.testing.assert_close(_weights(resumed)[name], w, atol=2e-6, rtol=0)
    assert np.array_equal(resumed.curvature.second, straight.curvature.second)

    forgetful = _engine()
    replay(
        forgetful.model,
        forgetful.config,
        [m for m in messages if m.round < 5],
        schedule=forgetful.schedule,
    )
    forgetful.curvature = Curvature(0.9, straight.curvature.second.shape)
    forgetful.curvature.head = 5  # a fresh scale: s = 1 from round 5 on
    _train_live(forgetful, [m for m in messages if m.round >= 5])
    gap = max(
        float((_weights(forgetful)[n] - w).abs().max()) for n, w in _weights(straight).items()
    )
    assert gap > 1e-4
