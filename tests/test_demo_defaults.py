"""The demo's fast setting follows the model, not the data set, and its figures name their
split and say when they end below their start (issue 47)."""

from __future__ import annotations

import argparse

from seedflood_p2p.apps import demo
from seedflood_p2p.core.flags import run_config_from_args


def demo_config(*argv: str):
    """The run the demo would start for these flags (cmd_demo's steps, without daemons)."""
    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)  # `seedflood demo`'s flags
    args = parser.parse_args(list(argv))
    defaults = demo.demo_defaults(args)
    config = run_config_from_args(args, defaults=defaults)
    fitted = demo.fit_to_data(args, config, defaults)
    return run_config_from_args(args, defaults=fitted) if fitted != defaults else config


def write_csv(path, rows: int, labels: bool = True):
    lines = ["text,label" if labels else "text"]
    lines += [f"review number {i} was {'fine' if i % 2 else 'dull'}" for i in range(rows)]
    if labels:
        lines = lines[:1] + [f"{line},{i % 2}" for i, line in enumerate(lines[1:])]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_organisers_csv_gets_the_default_models_fast_setting(tmp_path):
    data = write_csv(tmp_path / "reviews.csv", 2000)  # 1,800 train, 180 of them validation
    config = demo_config("--dataset", str(data))
    assert (config.model, config.train_only, config.train_examples) == (
        "smollm2-135m",
        "model.layers.2[89].*",
        512,
    )
    assert config.basis == "kfac"
    # one text, two labels: the demo's validation-chosen prompt, uncalibrated
    assert (config.template, list(config.label_words), config.calibration) == (
        demo.DEMO_PROMPT["template"],
        demo.DEMO_PROMPT["label_words"],
        "",
    )


def test_the_demo_prompt_is_for_one_text_with_two_labels(tmp_path):
    assert demo_config().template == "Review: {text}\nSentiment:"  # the built-in default (mr)
    three = tmp_path / "three.csv"
    three.write_text("text,label\n" + "".join(f"row {i},{i % 3}\n" for i in range(300)))
    config = demo_config("--dataset", str(three))  # a third label: the run's own prompt
    assert (config.template, list(config.label_words)) == ("", [])
    assert config.calibration == "content-free"
    nli = demo_config("--task", "nli", "--dataset", str(three))  # a preset names its prompt
    assert (nli.template, list(nli.label_words)) == ("", [])
    own = demo_config("--label-words", " bad", " good")  # the user's words: not ours
    assert own.template == "" and list(own.label_words) == [" bad", " good"]
    kept = demo_config("--calibration", "content-free")  # a given setting stays
    assert kept.template == demo.DEMO_PROMPT["template"] and kept.calibration == "content-free"


def test_a_small_data_set_trains_on_what_it_has_outside_its_validation(tmp_path):
    data = write_csv(tmp_path / "small.csv", 300)  # 270 train: 27 validation, pool 243
    assert demo_config("--dataset", str(data)).train_examples == 243
    assert demo_config("--dataset", str(data), "--train-examples", "100").train_examples == 100
    text = write_csv(tmp_path / "text.csv", 300, labels=False)  # plain text: no label prior
    config = demo_config("--dataset", str(text))
    assert config.calibration == "" and config.train_only == "model.layers.2[89].*"
    assert demo_config("--model", "tiny-llama", "--dataset", str(data)).train_only == ""


def progress(**over):
    base = dict(
        elapsed=75, round=40, rounds=100, loss=0.6, accuracy=0.64, eval_round=25,
        eval_examples=200, start_accuracy=0.65, below_start=False, alive=4, messages=160,
        rate=2.0, bytes_out=7000,
    )  # fmt: skip
    return {**base, **over}


def test_the_progress_line_names_the_split_and_says_below_start(capsys):
    demo._print_progress(progress(), 4)
    line = capsys.readouterr().out
    assert "accuracy 0.640 on test[:200] (after 25)" in line and "BELOW" not in line
    demo._print_progress(progress(below_start=True), 4)
    assert "BELOW its start 0.650" in capsys.readouterr().out


def test_below_start_compares_the_latest_figure_with_the_first():
    start = {"rounds_done": 0, "eval_accuracy": 0.65, "eval_loss": 0.64}
    assert demo.below_start(start, {"rounds_done": 50, "eval_accuracy": 0.64, "eval_loss": 0.6})
    assert not demo.below_start(start, {"rounds_done": 50, "eval_accuracy": 0.70})
    assert not demo.below_start(start, start)  # one evaluation: nothing to compare
    assert demo.below_start(
        {"rounds_done": 0, "eval_loss": 2.0}, {"rounds_done": 9, "eval_loss": 2.1}
    )


def summary(evals):
    final = {"round": 50, "accepted": {"gossip": 1, "repair": 0}, "dropped": {}}
    return {
        "finals": {"peer0": final},
        "ledger_digests": {"peer0": "ab" * 32},
        "max_live_deviation": {"peer0": 1e-6},
        "final_eval": {
            "eval_examples": 1000,
            "calibration": "content-free",
            "split": "test",
            "loss": 0.58,
            "accuracy": 0.71,
        },
        "ledgers_identical": True,
        "replay_sha256": "cd" * 32,
        "plot": "demo.png",
        "evals": evals,
    }


def test_the_summary_names_each_figures_split_and_a_fall_below_start(capsys):
    evals = [
        {"rounds_done": 0, "eval_loss": 0.64, "eval_accuracy": 0.65, "eval_examples": 200},
        {"rounds_done": 50, "eval_loss": 0.66, "eval_accuracy": 0.62, "eval_examples": 200},
    ]
    demo.print_summary(summary(evals), evals)
    out = capsys.readouterr().out
    assert "held-out (test[:200]) loss 0.6400 -> 0.6600, accuracy 0.650 -> 0.620" in out
    assert "BELOW START: the held-out accuracy ended worse than it began" in out
    assert "replayed model on 1000 held-out examples (test[:1000], scored once)" in out
    evals[1]["eval_accuracy"] = 0.70
    demo.print_summary(summary(evals), evals)
    assert "BELOW START" not in capsys.readouterr().out
