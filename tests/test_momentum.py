"""Momentum from the ledger (algorithm/momentum.py): the state of round T is base minus each
row weighted by w(T - s) = 1 + b + ... + b^(T-s-1) in the fixed basis, however the rows
arrive; a replay rebuilds it and the velocity, so training resumes where it stopped."""

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.basis import KFAC_ARTIFACT_KIND, encode
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.momentum import MAX_LAG, Velocity
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.workload.models import load_model

BETA = 0.9
RANK = 4
ATOL = 2e-6  # live (a merge per round) against one weighted merge: float32 rounding


def _config(momentum: float = BETA, **kw) -> RunConfig:
    settings = dict(
        model="tiny-llama",
        rank=RANK,
        refresh_period=3,  # several epochs: momentum spans them (one basis)
        lr=1e-2,
        n_ref=2,
        directions=2,
        basis="kfac",
        momentum=momentum,
    )
    return RunConfig(**{**settings, **kw})


def _artifact(engine: SubCGE):
    """A K-FAC-kind artifact with both sides for every matrix (orthonormal columns)."""
    g = torch.Generator().manual_seed(7)
    u, v = {}, {}
    for matrix in engine.matrices:
        m, k = matrix.shape
        u[matrix.name] = torch.linalg.qr(torch.randn(m, RANK, generator=g))[0] * m**0.5
        v[matrix.name] = torch.linalg.qr(torch.randn(k, RANK, generator=g))[0] * k**0.5
    return encode(v, {"kind": KFAC_ARTIFACT_KIND}, u)


def _engine(config: RunConfig) -> SubCGE:
    model, _ = load_model("tiny-llama")
    engine = SubCGE(model, config)
    engine.add_basis(0, _artifact(engine))
    return engine


def _rounds(n_rounds: int, n_peers: int, k: int = 2, seed: int = 0) -> list[list[UpdateMessage]]:
    rng = np.random.default_rng(seed)
    return [
        [
            UpdateMessage(t, f"peer-{p}".encode(), quantize_scalars(rng.normal(size=k)))
            for p in range(n_peers)
        ]
        for t in range(n_rounds)
    ]


def _weights(engine: SubCGE) -> dict[str, torch.Tensor]:
    return {m.name: m.weight.detach().clone() for m in engine.matrices}


def _close(a: dict, b: dict, atol: float = ATOL) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0)


def _train_live(engine: SubCGE, rounds: list[list[UpdateMessage]]) -> None:
    live = LiveModel(engine)
    for messages in rounds:
        live.apply(messages)


def test_factors_are_the_geometric_sums_and_bitwise_repeatable():
    velocity = Velocity(BETA, (1, 1))
    for lag in (1, 2, 5, 40):
        weight, decay = velocity.factors(lag)
        assert weight == pytest.approx((1 - BETA**lag) / (1 - BETA), rel=1e-12)
        assert decay == pytest.approx(BETA ** (lag - 1), rel=1e-12)
    assert velocity.factors(1) == (1.0, 1.0)  # a row of the round just passed: no rounding
    # built by the same IEEE steps in any order of asking
    assert Velocity(BETA, (1, 1)).factors(40) == velocity.factors(40)
    assert velocity.factors(MAX_LAG + 10) == velocity.factors(MAX_LAG)


def test_live_rounds_equal_the_defining_sum_over_the_ledger():
    """Round by round (a merge each) = base - U (sum_i w(T - s_i) c_i) V^T, T = rounds."""
    config = _config()
    rounds = _rounds(7, 3)
    live = _engine(config)
    base = _weights(live)
    _train_live(live, rounds)
    # The definition, evaluated directly: each row's entries times w(T - s), merged once
    # (`merge_core` leaves the velocity alone; the same run, so the same directions).
    plain = _engine(config)
    T = len(rounds)
    for messages in rounds:
        weight = (1 - BETA ** (T - messages[0].round)) / (1 - BETA)
        epochs, index, value = plain.core_entries(messages, {messages[0].round: len(messages)})
        core = np.zeros((len(plain.matrices), RANK * RANK))
        np.add.at(core.reshape(-1), index.ravel(), value.ravel() * weight)
        plain.merge_core(int(epochs[0]), core, alpha=-1.0)
    expected = _weights(plain)
    _close(_weights(live), expected)
    # and momentum moved the model further than the plain rule would have
    assert any(not torch.equal(expected[n], base[n]) for n in base)


def test_momentum_zero_is_the_plain_rule_bit_for_bit():
    rounds = _rounds(5, 2)
    with_zero, plain = _engine(_config(momentum=0.0)), _engine(_config(momentum=0.0))
    assert with_zero.velocity is None
    _train_live(with_zero, rounds)
    replay(plain.model, plain.config, [m for r in rounds for m in r], schedule=plain.schedule)
    _close(_weights(with_zero), _weights(plain))


@pytest.mark.parametrize("step_rule", ["per_update", "round_mean"])
def test_a_late_row_lands_where_it_would_have_in_order(step_rule):
    """A row of round 2 arriving after round 5: w(T - 2) in the state, b^(T-3) in the
    velocity, so the state and the rounds after it are those of the in-order run (under
    round_mean the late row also re-scales its round's rows, at their weights too)."""
    config = _config(step_rule=step_rule)
    rounds = _rounds(8, 3)
    in_order = _engine(config)
    _train_live(in_order, rounds)
    late_row = rounds[2][1]
    held_back = [[m for m in r if m is not late_row] for r in rounds]
    late = _engine(config)
    live = LiveModel(late)
    for t, messages in enumerate(held_back):
        live.apply(messages if t != 5 else [*messages, late_row])
    _close(_weights(late), _weights(in_order))
    np.testing.assert_allclose(late.velocity.core, in_order.velocity.core, atol=1e-12)


def test_replay_is_bitwise_repeatable_and_equals_the_live_model():
    rounds = _rounds(9, 3)
    ledger = sorted((m for r in rounds for m in r), key=lambda m: (m.round, m.peer))
    live = _engine(_config())
    _train_live(live, rounds)
    first, second = _engine(_config()), _engine(_config())
    for engine in (first, second):
        replay(engine.model, engine.config, ledger, schedule=engine.schedule)
    for name, w in _weights(first).items():
        assert torch.equal(w, _weights(second)[name])
    _close(_weights(first), _weights(live))


def test_training_resumed_from_a_replay_goes_on_with_the_velocity():
    """Stop after round 4, replay the ledger into the training engine, train rounds 5-8:
    the same model as training 0-8 without a stop. A replay that left the velocity
    behind (a fresh engine) would lose momentum's carry and end elsewhere."""
    rounds = _rounds(9, 3)
    straight = _engine(_config())
    _train_live(straight, rounds)
    ledger = sorted((m for r in rounds[:5] for m in r), key=lambda m: (m.round, m.peer))

    resumed = _engine(_config())
    replay(resumed.model, resumed.config, ledger, engine=resumed)
    assert resumed.velocity.head == 5
    _train_live(resumed, rounds[5:])
    _close(_weights(resumed), _weights(straight))

    forgetful = _engine(_config())
    replay(forgetful.model, forgetful.config, ledger, schedule=forgetful.schedule)
    _train_live(forgetful, rounds[5:])
    gap = max(
        float((_weights(forgetful)[n] - w).abs().max()) for n, w in _weights(straight).items()
    )
    assert gap > 100 * ATOL


def test_momentum_needs_a_fixed_basis_and_stays_in_bounds():
    with pytest.raises(UserError, match="momentum needs a basis that never changes"):
        _config(basis="random")
    with pytest.raises(UserError, match="momentum needs a basis that never changes"):
        _config(basis_refresh=2)
    with pytest.raises(UserError, match=r"momentum must be a number in \[0, 0.99\]"):
        _config(momentum=1.0)
    with pytest.raises(UserError, match="momentum must be"):
        _config(momentum=float("nan"))
    assert _config().daemon_problem() is None  # the daemons run it (audits on)
    chained = _config(extra={"audit": False, "checkpoint_every": 10})
    assert "momentum with a checkpoint chain" in chained.daemon_problem()


def test_momentum_needs_u_sides_for_every_matrix():
    engine = SubCGE(load_model("tiny-llama")[0], _config())
    artifact = _artifact(engine)
    v_only = encode(artifact.v, {"kind": KFAC_ARTIFACT_KIND}, {})
    with pytest.raises(UserError, match="no U side for"):
        engine.add_basis(0, v_only)


def test_runs_without_momentum_keep_their_run_id():
    plain = RunConfig(basis="kfac")
    assert "momentum" not in plain.to_json()
    assert RunConfig(basis="kfac", momentum=0.5).run_id != plain.run_id
    assert RunConfig.from_json(_config().to_json()).momentum == BETA


def test_an_audits_rewind_gives_the_state_of_an_earlier_round_and_puts_ours_back():
    """Take back the rows of rounds >= 5 at head 8, rewind to 5: the state (and velocity)
    of a run that stopped after round 4; load_state puts the exact weights back."""
    rounds = _rounds(8, 3)
    short = _engine(_config())
    _train_live(short, rounds[:5])
    engine = _engine(_config())
    live = LiveModel(engine)
    for messages in rounds:
        live.apply(messages)
    ours, saved = _weights(engine), live.save_state()
    live.apply([m.negated() for r in rounds[5:] for m in r])
    live.rewind(5)
    assert engine.velocity.head == 5
    _close(_weights(engine), _weights(short), atol=1e-5)
    np.testing.assert_allclose(engine.velocity.core, short.velocity.core, atol=1e-9)
    live.load_state(saved)
    assert all(torch.equal(w, ours[n]) for n, w in _weights(engine).items())
    assert engine.velocity.head == 8


def test_a_round_without_rows_still_moves_the_model():
    engine = _engine(_config())
    live = LiveModel(engine)
    live.apply(_rounds(1, 2)[0])
    before = _weights(engine)
    live.advance(2)  # round 1 had no rows: the velocity carries on
    assert engine.velocity.head == 2
    assert any(not torch.equal(w, before[n]) for n, w in _weights(engine).items())


def test_a_checkpoint_carries_the_velocity_and_a_restart_goes_on_from_it(tmp_path):
    from seedflood_p2p.storage.ledger import Ledger

    config = _config()
    rounds = _rounds(9, 3)
    ledger = Ledger(tmp_path / "ledger.sqlite", config.run_id)
    ledger.claim(config, "")
    engine = _engine(config)
    live = LiveModel(engine, ledger)
    (tmp_path / "ckpt").mkdir()
    for t, messages in enumerate(rounds[:8]):
        ledger.add(messages)
        live.receive(messages)
        live.apply(live.take())
        if t == 5:
            meta = live.checkpoint(tmp_path / "ckpt", live.cut(), {"round": 6})
            assert meta["momentum_head"] == 6
    restarted = _engine(config)
    how = LiveModel(restarted, ledger).restore(
        LiveModel(restarted, ledger).cut(), tmp_path / "ckpt"
    )
    assert how.startswith("checkpoint of round 6 + 6 ledger messages"), how
    assert restarted.velocity.head == 8
    _close(_weights(restarted), _weights(engine), atol=1e-5)
    np.testing.assert_allclose(restarted.velocity.core, engine.velocity.core, atol=1e-9)
    for e in (engine, restarted):  # one more round on each: still together
        LiveModel(e).apply(rounds[8])
    _close(_weights(restarted), _weights(engine), atol=1e-5)
    ledger.close()


def test_a_trial_state_moves_to_its_round_even_without_rows_between():
    """Our state is of round 6, the last rows are of round 3: the state of round 4 is ours
    without the carry of rounds 4-5 (move_to rewinds it), and of round 8 ours carried on."""
    rounds = _rounds(4, 2)
    at4 = _engine(_config())
    LiveModel(at4).apply([m for r in rounds for m in r])  # rows of rounds 0-3: head 4
    engine = _engine(_config())
    live = LiveModel(engine)
    live.apply([m for r in rounds for m in r])
    live.advance(6)
    assert live.head == 6
    live.move_to(4)
    assert live.head == 4
    _close(_weights(engine), _weights(at4), atol=1e-5)
    at8 = _engine(_config())
    LiveModel(at8).apply([m for r in rounds for m in r])
    LiveModel(at8).advance(8)
    live.move_to(8)
    _close(_weights(engine), _weights(at8), atol=1e-5)


def test_a_restart_that_would_take_rows_back_under_momentum_replays_instead(tmp_path):
    """The checkpoint's velocity went on through the rows to take back: its state minus
    them is not the kept rows' state, so the restore replays the kept rows."""
    from seedflood_p2p.storage.ledger import Ledger

    config = _config()
    rounds = _rounds(6, 3)
    ledger = Ledger(tmp_path / "ledger.sqlite", config.run_id)
    ledger.claim(config, "")
    live = LiveModel(_engine(config), ledger)
    for messages in rounds:
        ledger.add(messages)
    live.restore(live.cut())
    live.checkpoint(tmp_path, live.cut(), {"round": 6})
    restarted = LiveModel(_engine(config), ledger)
    how = restarted.restore(restarted.cut(), tmp_path, keep=lambda m: m.round < 4)
    assert how == "replay of 12 ledger messages", how
    reference = LiveModel(_engine(config), ledger)
    reference.restore(reference.cut(), keep=lambda m: m.round < 4)
    assert all(
        torch.equal(w, _weights(reference.engine)[n]) for n, w in _weights(restarted.engine).items()
    )
    ledger.close()
