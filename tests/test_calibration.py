"""Content-free calibration (RunConfig.calibration): a classification's label logits read
relative to the template filled with "N/A", scored under the same direction, so the label
prior leaves every estimate; off by default and part of the run id when on."""

import dataclasses

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.objective import example_losses, label_word_logits
from seedflood_p2p.algorithm.subcge import Direction, SubCGE
from seedflood_p2p.algorithm.trainer import batch_seed, evaluate_metrics, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.workload.batching import calibrated, make_batch, sample_batch
from seedflood_p2p.workload.data import Example, load_task
from seedflood_p2p.workload.models import load_model
from seedflood_p2p.workload.tasks import load_run_task


def _na() -> Example:
    """The content-free prompt as an ordinary example (scored without calibration)."""
    return Example("N/A", label=0)


def _calibrated_task():
    return dataclasses.replace(load_task("synthetic-sentiment"), calibration="content-free")


def test_calibrated_rows_close_each_group_with_the_one_content_free_prompt():
    task = _calibrated_task()
    examples = task.train[:8]
    rows = calibrated(task, examples, groups=4)
    assert len(rows) == 12
    assert [r.content_free for r in rows] == [False, False, True] * 4
    assert all(rows[i] is task.content_free for i in (2, 5, 8, 11))  # one object: cacheable
    assert [r for r in rows if not r.content_free] == examples
    assert task.content_free.text == "N/A"
    assert calibrated(load_task("synthetic-sentiment"), examples, 4) == examples  # off: as is
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        calibrated(task, examples, groups=3)


def test_content_free_prompt_fills_every_template_field():
    task = dataclasses.replace(
        load_task("synthetic-sentiment"),
        template="{premise}\nQuestion: {hypothesis}?\nAnswer:",
        calibration="content-free",
    )
    assert task.content_free.values() == {"premise": "N/A", "hypothesis": "N/A"}


def test_batch_labels_only_the_real_rows_and_refuses_a_broken_layout():
    _, tokenizer = load_model("tiny-llama")
    task = _calibrated_task()
    examples = task.train[:4]
    batch = make_batch(calibrated(task, examples, 2), tokenizer, task, 64)
    assert batch["input_ids"].shape[0] == 6
    assert batch["calibration_group"] == 3
    assert batch["labels"].tolist() == [e.label for e in examples]
    with pytest.raises(ValueError, match="close equal groups"):
        make_batch([task.content_free, *examples], tokenizer, task, 64)


def test_label_logits_are_read_relative_to_the_content_free_prompt():
    model, tokenizer = load_model("tiny-llama")
    task = _calibrated_task()
    plain = load_task("synthetic-sentiment")
    examples = task.train[:4]
    raw = label_word_logits(model, make_batch(examples, tokenizer, plain, 64))
    content_free = label_word_logits(model, make_batch([_na()], tokenizer, plain, 64))
    got = label_word_logits(model, make_batch(calibrated(task, examples), tokenizer, task, 64))
    assert torch.allclose(got, raw - content_free, atol=1e-5)
    assert not torch.allclose(got, raw, atol=1e-3)  # the tiny model has a label prior


def test_each_group_reads_its_content_free_row_under_its_own_direction():
    """zo_step's scalar j equals a two-point estimate on (example j, content-free row) with
    direction j alone on both rows; reading the content-free row unperturbed would not."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    config = RunConfig(model="tiny-llama", rank=4, directions=4, batch_size=4, eps=1e-2,
                       calibration="content-free")  # fmt: skip
    task = _calibrated_task()
    engine = SubCGE(model, config)
    peer = b"peer-a"
    message, _ = zo_step(engine, tokenizer, task, peer, 0)
    examples = sample_batch(task, batch_seed(config.run_key, peer, 0), config.batch_size)
    full = engine.direction(peer, 0)
    expected, unperturbed_reference = [], []
    for j, example in enumerate(examples):
        one = Direction(peer, 0, full.epoch, full.a[j : j + 1], full.b[j : j + 1],
                        full.sign[j : j + 1])  # fmt: skip
        batch = make_batch(calibrated(task, [example]), tokenizer, task, config.max_length)
        g, _ = engine.two_point(lambda b=batch: example_losses(model, b, "classification"), one)
        expected.append(float(g[0]))
        # the same example with its content-free logits taken from the unperturbed model
        alone = make_batch([example], tokenizer, task, config.max_length)
        cf = label_word_logits(model, make_batch([_na()], tokenizer, task, config.max_length))

        def fixed_reference(b=alone, c=cf, y=example.label):
            logits = label_word_logits(model, b) - c
            return torch.nn.functional.cross_entropy(logits, torch.tensor([y]))

        g2, _ = engine.two_point(fixed_reference, one)
        unperturbed_reference.append(float(g2[0]))
    sent = np.array(message.scalars, dtype=np.float64)
    assert np.allclose(sent, expected, rtol=2e-2, atol=2e-3)  # float16 on the wire
    assert not np.allclose(sent, unperturbed_reference, rtol=2e-2, atol=2e-3)


def test_evaluation_counts_real_sentences_and_removes_the_prior():
    model, tokenizer = load_model("tiny-llama")
    config = RunConfig(model="tiny-llama")
    plain = load_task("synthetic-sentiment")
    task = _calibrated_task()
    raw = evaluate_metrics(model, tokenizer, plain, config, max_examples=40)
    cal = evaluate_metrics(model, tokenizer, task, config, max_examples=40)
    assert raw["loss"] != pytest.approx(cal["loss"])
    # every one of the 40 sentences is scored once: accuracy is a multiple of 1/40
    assert (cal["accuracy"] * 40) == pytest.approx(round(cal["accuracy"] * 40))


def test_calibration_is_a_run_setting_checked_at_start():
    assert "calibration" not in RunConfig().to_json()
    assert RunConfig(calibration="content-free").run_id != RunConfig().run_id
    with pytest.raises(UserError, match="calibration must be 'content-free' or empty"):
        RunConfig(calibration="prior")
    with pytest.raises(UserError, match="calibration needs a classification task"):
        RunConfig(kind="lm", calibration="content-free")
    task = load_run_task(RunConfig(calibration="content-free"))
    assert task.calibration == "content-free"
    assert load_run_task(RunConfig()).calibration == ""


def test_calibrated_training_learns_and_replays_from_the_ledger(tmp_path):
    """16 simulated peers, 20 rounds: the calibrated held-out loss falls, and the ledger's
    replay (which never scores a prompt) gives the live model."""
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import train_local
    from seedflood_p2p.storage.ledger import Ledger

    torch.manual_seed(0)
    config = RunConfig(model="tiny-llama", rank=32, directions=16, lr=6.4e-2, n_ref=4,
                       step_rule="round_mean", calibration="content-free")  # fmt: skip
    model, tokenizer = load_model(config.model)
    task = load_run_task(config)
    before = evaluate_metrics(model, tokenizer, task, config, 200)
    ledger = Ledger(tmp_path / "ledger.sqlite", config.run_id)
    ledger.claim(config, "")
    engine = make_estimator(model, config)
    train_local(engine, tokenizer, task, peers=16, rounds=20, ledger=ledger)
    after = evaluate_metrics(model, tokenizer, task, config, 200)
    # measured: loss 0.696 -> 0.643, accuracy 0.48 -> 0.765
    assert after["loss"] < before["loss"] - 0.02, (before, after)
    assert after["accuracy"] > before["accuracy"] + 0.1, (before, after)
    fresh, _ = load_model(config.model)
    replay(fresh, ledger.config, ledger.messages())
    ledger.close()
    live = dict(model.named_parameters())
    for name, weight in fresh.named_parameters():
        assert torch.allclose(weight, live[name], atol=1e-5), name


def test_model_card_of_a_calibrated_run_says_how_to_read_its_logits():
    from seedflood_p2p.apps.export import model_card

    card = model_card(RunConfig(calibration="content-free"), {}, {"accuracy": 0.7})
    assert "| calibration | content-free" in card
    assert 'every\nfield "N/A"' in card
    assert "calibration" not in model_card(RunConfig(), {}, {"accuracy": 0.7})
