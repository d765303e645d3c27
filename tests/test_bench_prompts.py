"""bench/bench_prompts.py scores several label-word pairs from one forward pass per template;
each pair's figures must equal a run's own evaluation (`trainer.evaluate_metrics`) of a task
with that pair alone, calibrated and not."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from seedflood_p2p.algorithm.trainer import evaluate_metrics
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_prompts.py"
PAIRS = [(" terrible", " great"), (" bad", " good"), (" awful", " excellent"), ("bad", "good")]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_prompts_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("order", ["length", "run"])
def test_one_pass_scores_every_pair_as_a_run_scores_it_alone(tmp_path, monkeypatch, order):
    bench = _bench()
    monkeypatch.setattr(bench, "CACHE_DIR", tmp_path)
    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    examples = task.validation[:37]  # not a multiple of the batch size
    config = RunConfig(batch_size=8, max_length=48)
    template = "Review: {text}\nThe movie was"
    groups = bench.pair_groups(tokenizer, PAIRS)
    assert [len(g["pairs"]) for g in groups] == [3, 1]  # " x" pairs share the space token
    calls = []
    real = bench.pass_logits
    monkeypatch.setattr(bench, "pass_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows, timing = bench.score_template(
        model, tokenizer, task, examples, template, PAIRS, config, order, ["test"]
    )
    assert timing["passes"] == len(calls) == 2  # one per prefix group, not one per pair
    assert len(rows) == len(PAIRS) * 2
    for row in rows:
        alone = replace(
            task,
            template=template,
            label_words=tuple(row["label_words"]),
            calibration=row["calibration"],
            test=examples,
        )
        run_config = replace(config, calibration=row["calibration"])
        metrics = evaluate_metrics(model, tokenizer, alone, run_config, len(examples))
        assert row["accuracy"] == metrics["accuracy"]
        assert row["macro_f1"] == metrics["macro_f1"]
        assert row["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)
        assert row["n"] == len(examples)
    # Calibration moves the figures (the content-free row is really subtracted).
    first = [r for r in rows if r["label_words"] == list(PAIRS[0])]
    assert first[0]["loss"] != first[1]["loss"]
    # A second call reads the cached logits: no forward pass.
    again, _ = bench.score_template(
        model, tokenizer, task, examples, template, PAIRS, config, order, ["test"]
    )
    assert len(calls) == 2 and again == rows


def test_calibrate_is_the_runs_subtraction():
    from seedflood_p2p.algorithm.objective import calibrate

    logits = torch.arange(12.0).view(6, 2)
    out = calibrate(logits, 3)
    expected = [logits[0] - logits[2], logits[1] - logits[2], logits[3] - logits[5]]
    expected.append(logits[4] - logits[5])
    assert torch.equal(out, torch.stack(expected))
    assert calibrate(logits, 0) is logits
