"""One-sided estimates sharing one unperturbed pass (`RunConfig.one_sided_passes`, FZOO's
arithmetic): each scalar is (L(+eps) - L(0)) / eps on its own group of the batch, in
1 + m forward passes; stacked peers get their own; the settings refuse what it cannot do."""

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.objective import example_losses
from seedflood_p2p.algorithm.subcge import Direction, SubCGE
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.workload.models import load_model


def _engine(**kw) -> tuple[SubCGE, torch.nn.Module]:
    model, _ = load_model("tiny-llama")
    settings = dict(model="tiny-llama", rank=4, directions=4, batch_size=8, eps=1e-3)
    settings.update(kw)
    return SubCGE(model, RunConfig(**settings)), model


def _batch(rows: int, seed: int = 3) -> dict:
    x = torch.randint(0, 256, (rows, 10), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


def _one(direction: Direction, j: int) -> Direction:
    keep = [j]
    return Direction(
        direction.peer,
        direction.round,
        direction.epoch,
        direction.a[keep],
        direction.b[keep],
        direction.sign[keep],
    )


@pytest.mark.parametrize("passes", [1, 2, 4])
def test_each_scalar_is_its_directions_one_sided_difference_on_its_group(passes):
    engine, model = _engine(one_sided_passes=passes)
    k, groups = 4, 4 // passes
    batch = _batch(8)
    d = engine.direction(b"peer", 2)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    g, base = engine.estimates(lambda: example_losses(model, batch, "lm"), d, batch_size=8)
    handle.remove()
    assert len(calls) == 1 + passes  # one unperturbed pass, then one per set
    assert g.shape == (k,) and base.shape == (8,)
    unperturbed = example_losses(model, batch, "lm").double()
    assert torch.equal(base, unperturbed)  # the loss reported is the unperturbed one
    share = 8 // groups
    for j in range(k):
        group = j % groups  # direction p * groups + j' is estimated on group j'
        rows = slice(group * share, (group + 1) * share)
        with engine.perturbed(_one(d, j), engine.config.eps, 8):
            plus = example_losses(model, batch, "lm").double()
        expected = ((plus[rows] - unperturbed[rows]) / engine.config.eps).mean()
        assert abs(float(g[j]) - float(expected)) < 1e-3 * max(1.0, abs(float(expected)))


def test_estimate_follows_the_run_setting_and_two_point_stays_the_default():
    two, model = _engine()
    one, same_model = _engine(one_sided_passes=4)  # every direction on the whole batch
    batch = _batch(8)
    d = two.direction(b"peer", 2)
    g2, _ = two.estimate(lambda: example_losses(model, batch, "lm"), d, batch_size=8)
    g1, _ = one.estimate(lambda: example_losses(same_model, batch, "lm"), d, batch_size=8)
    ref, _ = two.two_point(lambda: example_losses(model, batch, "lm"), d, batch_size=8)
    assert g2 == tuple(ref.tolist())
    assert g1 != g2


def test_stacked_peers_get_what_each_gets_alone():
    """`zo_steps` stacks peers' batches and directions: each peer's scalars equal its own
    estimate (float rounding of another batch composition aside)."""
    engine, model = _engine(one_sided_passes=2)
    batches = [_batch(8, seed=s) for s in (3, 4)]
    peers = [b"peer-a", b"peer-b"]
    own = [engine.direction(p, 5) for p in peers]
    alone = [
        engine.estimates(lambda b=b: example_losses(model, b, "lm"), d, batch_size=8)[0]
        for b, d in zip(batches, own)
    ]
    stacked_batch = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    stacked = Direction(
        b"",
        5,
        own[0].epoch,
        np.concatenate([d.a for d in own]),
        np.concatenate([d.b for d in own]),
        np.concatenate([d.sign for d in own]),
    )
    together, _ = engine.estimates(
        lambda: example_losses(model, stacked_batch, "lm"), stacked, batch_size=16
    )
    assert torch.allclose(together, torch.cat(alone), rtol=1e-3, atol=1e-3)


def test_weights_are_bitwise_unchanged():
    engine, model = _engine(one_sided_passes=4)
    before = {m.name: m.weight.detach().clone() for m in engine.matrices}
    d = engine.direction(b"peer", 1)
    engine.estimates(lambda: example_losses(model, _batch(8), "lm"), d, batch_size=8)
    assert all(torch.equal(before[m.name], m.weight) for m in engine.matrices)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(directions=4, one_sided_passes=3), "must divide directions 4"),
        (dict(directions=4, batch_size=5, one_sided_passes=2), "multiple of directions"),
        (dict(directions=1, one_sided_passes=1, estimator="naive"), "needs the subcge"),
        (dict(directions=4, one_sided_passes=17), "one_sided_passes must be 0..16"),
        (
            dict(directions=4, one_sided_passes=2, calibration="content-free"),
            "calibration is not built",
        ),
    ],
)
def test_settings_it_cannot_run_are_refused_in_one_line(settings, words):
    with pytest.raises(UserError, match=words):
        RunConfig(model="tiny-llama", **settings)


def test_a_batch_of_the_groups_not_the_directions_is_allowed_and_run_ids_keep():
    # k = 16 in 4 passes: 4 groups, so a batch of 4 (one example a direction, as k = 16
    # two-point on 16 examples) is valid
    RunConfig(directions=16, batch_size=4, one_sided_passes=4)
    assert "one_sided_passes" not in RunConfig().to_json()  # default runs keep their id
    assert RunConfig(one_sided_passes=0).run_id == RunConfig().run_id
