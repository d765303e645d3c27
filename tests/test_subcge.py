"""SubCGE: aggregation equals the sum of rank-one contributions, perturbations leave
weights bitwise unchanged, the hooks perturb exactly like editing the weights."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from seedflood_p2p.algorithm.subcge import NaiveSeedReplay, SubCGE, layer_basis
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalar
from seedflood_p2p.workload.models import load_model

# Aggregated vs one-by-one float64 reference: both are sums of the same terms in
# float32 weights, so they agree to a few float32 ulps of the update size.
AGGREGATE_ATOL = 1e-6


def _config(**kw) -> RunConfig:
    base = dict(model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=3, eps=1e-3)
    base.update(kw)
    return RunConfig(**base)


def _messages(n_rounds: int, n_peers: int, seed: int = 0) -> list[UpdateMessage]:
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, f"peer-{p}".encode(), quantize_scalar(float(rng.normal())))
        for t in range(n_rounds)
        for p in range(n_peers)
    ]


def _inputs(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {m.name: m.weight.detach().clone() for m in engine.matrices}


def test_aggregate_equals_sum_of_rank_one_contributions():
    model, _ = load_model("tiny-llama")
    config = _config()
    engine = SubCGE(model, config)
    before = _snapshot(engine)
    messages = _messages(12, 3)  # three epochs
    engine.accumulate(messages)
    engine.commit()
    for i, matrix in enumerate(engine.matrices):
        m, k = matrix.shape
        expected = before[matrix.name].double()
        for msg in messages:
            d = engine.direction(msg.peer, msg.round)
            uv = torch.from_numpy(layer_basis(config.run_key, d.epoch, i, m, k, config.rank))
            u, v = uv[:m, d.a[i]].double(), uv[m:, d.b[i]].double()
            expected -= engine.coefficient(msg) * d.sign[i] * torch.outer(u, v)
        torch.testing.assert_close(matrix.weight.double(), expected, atol=AGGREGATE_ATOL, rtol=0)
        assert not torch.equal(matrix.weight, before[matrix.name])


def test_thousand_perturbed_evaluations_leave_weights_bitwise_unchanged():
    model, _ = load_model("tiny-llama")
    engine = SubCGE(model, _config())
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    x = _inputs()
    for i in range(500):  # 500 estimates = 1000 evaluations (+eps and -eps)
        d = engine.direction(b"peer", i)
        engine.estimate(lambda: model(input_ids=x, labels=x).loss.item(), d)
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
    with torch.no_grad():
        for i, (u, v) in enumerate(engine.basis(d.epoch)):
            z = float(d.sign[i]) * torch.outer(u[:, d.a[i]], v[:, d.b[i]])
            engine.matrices[i].weight.add_(0.05 * z)
    edited = loss()
    for matrix in engine.matrices:
        matrix.weight.data.copy_(before[matrix.name])
    assert hooked == pytest.approx(edited, abs=1e-5)
    assert abs(hooked - loss()) > 1e-4  # the perturbation changes the loss at all


def test_estimate_is_a_directional_derivative():
    model, _ = load_model("tiny-llama")
    engine = SubCGE(model, _config(eps=1e-3))
    x = _inputs()
    d = engine.direction(b"peer", 0)

    def loss() -> float:
        return model(input_ids=x, labels=x).loss.double().item()

    g, _ = engine.estimate(loss, d)
    with engine.perturbed(d, 1e-2):
        plus = loss()
    with engine.perturbed(d, -1e-2):
        minus = loss()
    assert g == pytest.approx((plus - minus) / 2e-2, rel=0.05)


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
    g, _ = engine.estimate(
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
