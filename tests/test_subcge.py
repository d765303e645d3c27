"""SubCGE: aggregation equals the sum of rank-one contributions, perturbations leave
weights bitwise unchanged, the hooks perturb exactly like editing the weights."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from seedflood_p2p.algorithm.objective import example_losses
from seedflood_p2p.algorithm.subcge import NaiveSeedReplay, SubCGE, layer_basis
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.workload.models import load_model

# Aggregated vs one-by-one float64 reference: both are sums of the same terms in
# float32 weights, so they agree to a few float32 ulps of the update size.
AGGREGATE_ATOL = 1e-6


def _config(**kw) -> RunConfig:
    base = dict(model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=3, eps=1e-3)
    base.update(kw)
    return RunConfig(**base)


def _messages(n_rounds: int, n_peers: int, seed: int = 0, k: int = 1) -> list[UpdateMessage]:
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, f"peer-{p}".encode(), quantize_scalars(rng.normal(size=k)))
        for t in range(n_rounds)
        for p in range(n_peers)
    ]


def _inputs(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {m.name: m.weight.detach().clone() for m in engine.matrices}


@pytest.mark.parametrize(
    "settings", [{}, {"directions": 4, "train_norms": True}], ids=["k1", "k4-norms"]
)
def test_aggregate_equals_sum_of_rank_one_contributions(settings):
    model, _ = load_model("tiny-llama")
    config = _config(**settings)
    engine = SubCGE(model, config)
    if config.train_norms:
        assert any(m.kind == "norm" for m in engine.matrices)
    before = _snapshot(engine)
    messages = _messages(12, 3, k=config.directions)  # three epochs
    engine.accumulate(messages)
    engine.commit()
    for i, matrix in enumerate(engine.matrices):
        m, k = matrix.shape
        expected = before[matrix.name].double().reshape(m, k)
        for msg in messages:
            d = engine.direction(msg.peer, msg.round)
            uv = torch.from_numpy(layer_basis(config.run_key, d.epoch, i, m, k, config.rank))
            for j, coef in enumerate(engine.coefficients(msg)):
                u, v = uv[:m, d.a[j, i]].double(), uv[m:, d.b[j, i]].double()
                expected -= coef * d.sign[j, i] * torch.outer(u, v)
        got = matrix.weight.double().reshape(m, k)
        torch.testing.assert_close(got, expected, atol=AGGREGATE_ATOL, rtol=0)
        assert not torch.equal(matrix.weight, before[matrix.name])


@pytest.mark.slow
def test_thousand_perturbed_evaluations_leave_weights_bitwise_unchanged():
    model, _ = load_model("tiny-llama")
    engine = SubCGE(model, _config(directions=2, train_norms=True))
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    x = _inputs()
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}
    for i in range(500):  # 500 estimates = 1000 evaluations (+eps and -eps)
        d = engine.direction(b"peer", i)
        engine.estimate(lambda: example_losses(model, batch, "lm"), d, batch_size=2)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("variant", ["tiny-llama", "tiny-llama-tied", "gpt2"])
def test_hook_perturbation_equals_editing_the_weights(variant):
    if variant == "gpt2":  # Conv1D weights stored (in, out)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256)).eval()
    else:
        model, _ = load_model(variant)
    config = _config(include_embeddings=True)
    engine = SubCGE(model, config)
    x = _inputs()

    def loss() -> float:
        return model(input_ids=x, labels=x).loss.item()

    d = engine.direction(b"peer", 3)
    with engine.perturbed(d, 0.05):
        hooked = loss()
    before = _snapshot(engine)
    _edit_along(engine, d, 0, 0.05)
    edited = loss()
    for matrix in engine.matrices:
        matrix.weight.data.copy_(before[matrix.name])
    assert hooked == pytest.approx(edited, abs=1e-5)
    assert abs(hooked - loss()) > 1e-4  # the perturbation changes the loss at all


def _edit_along(engine: SubCGE, d, j: int, scale: float) -> None:
    """W += scale * Z_j, written into the weights (the reference the hooks must match)."""
    with torch.no_grad():
        for i, (u, v) in enumerate(engine.basis(d.epoch)):
            z = float(d.sign[j, i]) * torch.outer(u[:, d.a[j, i]], v[:, d.b[j, i]])
            engine.matrices[i].add_(z, alpha=scale)


@pytest.mark.parametrize("variant", ["tiny-llama", "gpt2"])
def test_one_forward_with_a_direction_per_example_equals_editing_per_example(variant):
    """k directions in one batched forward: example b sees exactly W + s * Z_rows[b]."""
    if variant == "gpt2":
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256)).eval()
    else:
        model, _ = load_model(variant)
    engine = SubCGE(model, _config(directions=4, batch_size=8, train_norms=True))
    assert any(m.kind == "norm" for m in engine.matrices)
    x = torch.randint(0, 256, (8, 10), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}
    d = engine.direction(b"peer", 7)
    with engine.perturbed(d, 0.05, batch_size=8):
        hooked = example_losses(model, batch, "lm")
    before = _snapshot(engine)
    for j in range(4):  # examples 2j, 2j + 1 belong to direction j
        _edit_along(engine, d, j, 0.05)
        edited = example_losses(model, batch, "lm")
        for matrix in engine.matrices:
            matrix.weight.data.copy_(before[matrix.name])
        torch.testing.assert_close(
            hooked[2 * j : 2 * j + 2], edited[2 * j : 2 * j + 2], atol=1e-5, rtol=0
        )
    assert (hooked - example_losses(model, batch, "lm")).abs().max() > 1e-4


def test_estimate_is_a_directional_derivative():
    model, _ = load_model("tiny-llama")
    engine = SubCGE(model, _config(eps=1e-3))
    x = _inputs()
    d = engine.direction(b"peer", 0)

    def loss() -> float:
        return model(input_ids=x, labels=x).loss.double().item()

    (g,), _ = engine.estimate(loss, d)
    # A central difference at another step (half of eps) agrees: g is the slope along Z.
    with engine.perturbed(d, 5e-4):
        plus = loss()
    with engine.perturbed(d, -5e-4):
        minus = loss()
    assert g == pytest.approx((plus - minus) / 1e-3, rel=0.02)
    assert abs(g) > 0.1


def test_accumulation_order_changes_result_only_within_tolerance():
    results = []
    for order in (1, -1):
        model, _ = load_model("tiny-llama")
        engine = SubCGE(model, _config())
        msgs = _messages(10, 4)[::order]
        for start in range(0, len(msgs), 7):  # arrival in uneven batches, committed as it goes
            engine.accumulate(msgs[start : start + 7])
            engine.commit()
        results.append(_snapshot(engine))
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], atol=AGGREGATE_ATOL, rtol=0)


def test_directions_are_deterministic_and_distinct():
    model, _ = load_model("tiny-llama")
    e1, e2 = SubCGE(model, _config()), SubCGE(model, _config(salt="other run"))
    d1, d1_again = e1.direction(b"a", 5), SubCGE(model, _config()).direction(b"a", 5)
    assert (d1.a == d1_again.a).all() and (d1.b == d1_again.b).all()
    assert (d1.sign == d1_again.sign).all()
    others = [e1.direction(b"b", 5), e1.direction(b"a", 6), e2.direction(b"a", 5)]
    for other in others:
        assert not ((other.a == d1.a).all() and (other.b == d1.b).all())


def test_rank_larger_than_a_layer_is_a_user_error():
    model, _ = load_model("tiny-llama")
    with pytest.raises(UserError, match=r"rank 100 is larger than weight .* choose a rank <= 32"):
        SubCGE(model, _config(rank=100))


def test_naive_baseline_is_exact_and_applies_full_size_directions():
    model, _ = load_model("tiny-llama")
    engine = NaiveSeedReplay(model, _config())
    before = _snapshot(engine)
    x = _inputs()
    (g,), _ = engine.estimate(
        lambda: model(input_ids=x, labels=x).loss.item(), engine.direction(b"p", 0)
    )
    assert g != 0.0
    for matrix in engine.matrices:
        assert torch.equal(matrix.weight, before[matrix.name])
    msgs = _messages(2, 2)
    engine.accumulate(msgs)
    engine.commit()
    for matrix in engine.matrices:
        delta = (matrix.weight - before[matrix.name]).abs()
        assert (delta > 0).float().mean() > 0.99  # dense update, unlike SubCGE's low rank


def test_shared_prefix_gives_bitwise_the_estimate_of_two_full_passes():
    """Training only the last block: the -eps pass reuses the untrained blocks' output."""
    model, _ = load_model("tiny-llama")
    config = _config(
        directions=2,
        batch_size=4,
        train_norms=True,
        train_only="model.layers.1.*,model.norm.weight",
    )
    engine = SubCGE(model, config)
    assert engine.prefix.active and engine.prefix.first == 1
    x = torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}
    calls = []
    handle = model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    d = engine.direction(b"peer", 1)
    shared = engine.estimate(lambda: example_losses(model, batch, "lm"), d, batch_size=4)
    assert len(calls) == 1  # block 0 ran for the +eps pass only
    engine.prefix.layers = None  # no sharing: two full passes
    full = engine.estimate(lambda: example_losses(model, batch, "lm"), d, batch_size=4)
    handle.remove()
    assert len(calls) == 3 and shared == full  # ... and twice without sharing
    assert all(isinstance(m, torch.nn.Module) for m in model.model.layers)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # blocks restored


def test_unit_normalize_bounds_every_message_to_an_honest_step():
    """normalize = "unit": every receiver scales a message's scalars to RMS 1, so a message
    claiming 1,000x an honest estimate moves the weights exactly as far as the honest one,
    in the same direction; sent scalars stay as estimated (audits recompute them)."""
    honest, inflated = (0.37, -1.25), (370.0, -1250.0)  # same direction, 1000x the size
    norms = {}
    for scalars in (honest, inflated):
        torch.manual_seed(0)
        model, _ = load_model("tiny-llama")
        engine = SubCGE(model, _config(directions=2, batch_size=16, normalize="unit"))
        before = _snapshot(engine)
        engine.accumulate([UpdateMessage(3, b"peer-x", quantize_scalars(scalars))])
        engine.commit()
        after = _snapshot(engine)
        norms[scalars] = torch.cat([(after[n] - before[n]).flatten() for n in before])
    step_honest, step_inflated = norms[honest], norms[inflated]
    assert step_honest.norm() > 0
    torch.testing.assert_close(step_inflated, step_honest, rtol=1e-3, atol=1e-9)
    # "none" applies the scalars as sent (up to clip): the inflated step is far larger
    engine_none = SubCGE(
        load_model("tiny-llama")[0], _config(directions=2, batch_size=16, normalize="none")
    )
    big = engine_none.coefficients(UpdateMessage(3, b"peer-x", quantize_scalars(inflated)))
    small = engine_none.coefficients(UpdateMessage(3, b"peer-x", quantize_scalars(honest)))
    assert np.abs(big).sum() > 50 * np.abs(small).sum()


def test_unit_normalize_is_odd_so_a_negated_update_takes_one_back():
    """Voiding and equivocation take an update back with its negated scalars: under "unit"
    the negated message's step must be exactly minus the original's."""
    engine = SubCGE(
        load_model("tiny-llama")[0], _config(directions=4, batch_size=16, normalize="unit")
    )
    scalars = quantize_scalars((0.5, -2.0, 0.0, 7.25))
    forward = engine.coefficients(UpdateMessage(9, b"p", scalars))
    backward = engine.coefficients(UpdateMessage(9, b"p", tuple(-x for x in scalars)))
    np.testing.assert_array_equal(backward, -forward)
    assert np.all(np.isfinite(forward)) and forward[2] == 0 and forward[3] > 0
    zero = engine.coefficients(UpdateMessage(9, b"p", (0.0, 0.0, 0.0, 0.0)))
    np.testing.assert_array_equal(zero, np.zeros(4))


def test_normalize_must_be_a_known_rule():
    with pytest.raises(UserError, match="normalize must be one of none, rms, unit"):
        _config(normalize="median")


def test_a_manifest_without_normalize_keeps_scalars_as_sent():
    """Manifests written before `normalize` existed meant "none"; the "unit" default must not
    change what their ledgers replay to."""
    import json

    body = json.loads(RunConfig().to_json())
    del body["normalize"]
    assert RunConfig.from_json(json.dumps(body)).normalize == "none"
    assert RunConfig.from_json(RunConfig().to_json()).normalize == "unit"


@pytest.mark.parametrize("directions", [1, 4])
def test_peers_stacked_in_one_pass_estimate_what_each_estimates_alone(directions):
    """zo_steps (simulated peers' batches in one pair of forward passes, a direction per
    example) sends each peer the scalars its own zo_step computes, to float rounding."""
    from seedflood_p2p.algorithm.trainer import zo_step, zo_steps
    from seedflood_p2p.workload.data import load_task

    torch.manual_seed(0)
    config = _config(dataset="synthetic-sentiment", batch_size=8, directions=directions)
    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    engine = SubCGE(model, config)
    peers = [b"p0", b"p1", b"p2"]
    stacked = zo_steps(engine, tokenizer, task, peers, 3)
    for peer, (message, loss) in zip(peers, stacked, strict=True):
        alone, alone_loss = zo_step(engine, tokenizer, task, peer, 3)
        assert message.peer == peer and message.round == 3
        assert len(message.scalars) == directions
        np.testing.assert_allclose(message.scalars, alone.scalars, rtol=2e-3, atol=1e-3)
        assert loss == pytest.approx(alone_loss, rel=1e-5)
    # not the same scalars for every peer: each example used its own peer's direction
    assert stacked[0][0].scalars != stacked[1][0].scalars
