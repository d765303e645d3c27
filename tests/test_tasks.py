"""A run's task as run settings: presets, templates with named fields, any number of string
labels, completion data, the dataset digest in the manifest, and bad input as one line."""

from __future__ import annotations

import csv
import json
import random
import re
import types
from pathlib import Path

import pytest

from seedflood.cli import build_parser, main
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import run_config_from_args
from seedflood_p2p.workload.batching import make_batch
from seedflood_p2p.workload.data import MAX_LINE_BYTES, Example, examples_sha256, load_task
from seedflood_p2p.workload.models import load_model
from seedflood_p2p.workload.tasks import PRESETS, load_run_task, run_sources, task_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "tasks"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    assert not any("Traceback" in line for line in err)
    return err[-1]


def _three_class_csv(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["premise", "hypothesis", "label"])
        w.writerows(rows)
    return path


NLI_ROWS = [
    (f"{p} plays the piano.", f"{p} {h}", label)
    for p in ("Anna", "Ben", "Chloe", "David", "Emma")
    for h, label in (
        ("plays music", "entailment"),
        ("is tired", "neutral"),
        ("plays nothing", "contradiction"),
    )
]


# ---------------------------------------------------------------- settings, run id


def test_default_settings_keep_their_run_id():
    # The run id of the default settings before the task settings existed.
    assert RunConfig().run_id == "386a14a517907ac3458f33e6fe06df1a807b4a94ada46527782bf1c0d61a78b2"
    assert "template" not in RunConfig().to_json()
    other = RunConfig(template="{text}\nIn short, it was")
    assert other.run_id != RunConfig().run_id
    assert RunConfig.from_json(other.to_json()) == other
    words = RunConfig(label_words=[" bad", " okay", " good"])
    assert RunConfig.from_json(words.to_json()).run_id == words.run_id != RunConfig().run_id


def test_flags_and_toml_give_the_same_task_settings(tmp_path):
    flags = [
        "train",
        "--template",
        "{premise}\nQuestion: {hypothesis}?",
        "--label-words",
        " Yes",
        " Maybe",
        " No",
        "--label-names",
        "entailment",
        "neutral",
        "contradiction",
        "--kind",
        "classification",
    ]
    a = run_config_from_args(build_parser(["train"]).parse_args(flags))
    toml = tmp_path / "run.toml"
    toml.write_text(
        'template = "{premise}\\nQuestion: {hypothesis}?"\n'
        'label_words = [" Yes", " Maybe", " No"]\n'
        'label_names = ["entailment", "neutral", "contradiction"]\n'
        'kind = "classification"\n'
    )
    b = run_config_from_args(build_parser(["train"]).parse_args(["train", "--config", str(toml)]))
    assert a == b and a.label_words == [" Yes", " Maybe", " No"]
    for command in ("bootstrap", "demo"):
        args = build_parser([command]).parse_args([command, *flags[1:]])
        assert args.label_words == [" Yes", " Maybe", " No"] and args.template == flags[2]


def test_mismatched_label_words_and_names_are_refused():
    with pytest.raises(UserError, match="label_words has 2 values and label_names 3"):
        RunConfig(label_words=[" a", " b"], label_names=["x", "y", "z"])
    with pytest.raises(UserError, match="kind must be one of"):
        RunConfig(kind="regression")


# ------------------------------------------------------------------------- data


def test_three_string_labels_and_two_fields(tmp_path):
    path = _three_class_csv(tmp_path / "nli.csv", NLI_ROWS)
    config = RunConfig(dataset=str(path), task="nli")
    task = load_run_task(config)
    assert task.kind == "classification" and task.num_labels == 3
    assert len(task.train) + len(task.test) == 15
    examples = task.train + task.test
    assert {e.label for e in examples} == {0, 1, 2}
    byhyp = {dict(e.fields)["hypothesis"]: e.label for e in examples}
    assert byhyp["Anna plays music"] == 0 and byhyp["Anna plays nothing"] == 2
    model, tokenizer = load_model("tiny-llama")
    batch = make_batch(task.train[:4], tokenizer, task, 128)
    assert batch["label_word_ids"].shape == (3,)
    prompt = tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0] == 1])
    first = task.train[0]
    assert prompt.startswith(dict(first.fields)["premise"] + "\nQuestion: ")


def test_long_fields_are_cut_longest_first_template_kept():
    _, tokenizer = load_model("tiny-llama")
    task = load_task(str(EXAMPLES / "nli.csv"), spec=task_spec(RunConfig(task="nli"))[0])
    long = Example("x", 0, (("premise", "p" * 300), ("hypothesis", "short hypothesis")))
    batch = make_batch([long], tokenizer, task, 80)
    text = tokenizer.decode(batch["input_ids"][0])
    assert len(batch["input_ids"][0]) <= 80
    assert "short hypothesis" in text and text.endswith("Answer: ")  # the common prefix " "


def test_every_preset_loads_its_example_file():
    _, tokenizer = load_model("tiny-llama")
    for name, preset in PRESETS.items():
        task = load_run_task(RunConfig(task=name, dataset=str(EXAMPLES / preset.example)))
        assert task.kind == preset.kind, name
        batch = make_batch(task.train[:2], tokenizer, task, 128)
        assert batch["input_ids"].shape[0] == 2


def test_completion_loss_is_on_the_answer_only():
    _, tokenizer = load_model("tiny-llama")
    task = load_run_task(RunConfig(task="completion", dataset=str(EXAMPLES / "completion.jsonl")))
    example = task.train[0]
    batch = make_batch([example], tokenizer, task, 64)
    labels = batch["labels"][0]
    scored = labels[labels != -100].tolist()
    answer = tokenizer(example.target, add_special_tokens=False)["input_ids"]
    assert scored == answer + [tokenizer.eos_token_id]


@pytest.mark.slow
def test_completion_held_out_loss_falls_on_tiny_llama():
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import evaluate_metrics, train_local

    config = RunConfig(task="completion", dataset=str(EXAMPLES / "completion.jsonl"), max_length=32)
    model, tokenizer = load_model(config.model)
    task = load_run_task(config)
    before = evaluate_metrics(model, tokenizer, task, config, 100)
    engine = make_estimator(model, config)
    train_local(engine, tokenizer, task, peers=1, rounds=80)
    engine.close()
    after = evaluate_metrics(model, tokenizer, task, config, 100)
    assert set(after) == {"loss", "perplexity"}
    assert after["loss"] < before["loss"] - 0.2, (before, after)
    assert after["perplexity"] < before["perplexity"]


def test_macro_f1():
    from seedflood_p2p.algorithm.trainer import macro_f1

    assert macro_f1([0, 1, 2], [0, 1, 2], 3) == 1.0
    # label 0: tp 1 fp 1 fn 0 -> 2/3; label 1: tp 0 fn 1 -> 0; label 2 absent
    assert macro_f1([0, 0], [0, 1], 3) == pytest.approx((2 / 3 + 0) / 2)


# ---------------------------------------------------------------- dataset digest


def test_dataset_digest_is_of_the_parsed_rows(tmp_path):
    rows = NLI_ROWS
    a = load_run_task(
        RunConfig(task="nli", dataset=str(_three_class_csv(tmp_path / "a.csv", rows)))
    )
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(
        "\ufeff"
        + "".join(
            json.dumps({"label": lab, "hypothesis": h, "premise": p, "unused": 1}) + "\n"
            for p, h, lab in shuffled
        ),
        encoding="utf-8",
    )
    b = load_run_task(RunConfig(task="nli", dataset=str(jsonl)))
    assert examples_sha256(a) == examples_sha256(b)
    doctored = rows[:]
    doctored[3] = (doctored[3][0], doctored[3][1], "contradiction")
    c = load_run_task(
        RunConfig(task="nli", dataset=str(_three_class_csv(tmp_path / "c.csv", doctored)))
    )
    assert examples_sha256(c) != examples_sha256(a)


def test_joiner_refuses_a_doctored_dataset_and_never_opens_manifest_paths(tmp_path):
    from bootstrap.node import BootstrapSettings, resolve_manifest
    from peer.join import Joiner
    from peer.settings import PeerSettings

    original = _three_class_csv(tmp_path / "organiser.csv", NLI_ROWS)
    config = resolve_manifest(
        BootstrapSettings(data_dir=tmp_path / "boot"), RunConfig(task="nli", dataset=str(original))
    )
    assert len(config.dataset_sha256) == 64 and len(config.base_sha256) == 64
    # A manifest from the network naming a path: refused without the peer's own copy.
    with pytest.raises(UserError, match="never opens a path named by a manifest"):
        run_sources(config)
    for name in ("./data.csv", "~/x.jsonl", "/etc/passwd"):
        with pytest.raises(UserError, match="--dataset-file"):
            run_sources(config.replace(dataset=name))
    with pytest.raises(UserError, match="--model-dir"):
        run_sources(config.replace(model="/opt/models/x"))
    assert run_sources(RunConfig()) == ("tiny-llama", "synthetic-sentiment")

    copy = tmp_path / "volunteer.csv"
    copy.write_bytes(original.read_bytes())
    peer = types.SimpleNamespace(s=PeerSettings(dataset_file=copy), asset_paths={})
    _, _, task = Joiner.load_model(peer, config)
    assert task.num_labels == 3
    doctored = NLI_ROWS[:]
    doctored[0] = (doctored[0][0], doctored[0][1], "neutral")
    _three_class_csv(copy, doctored)
    with pytest.raises(UserError) as err:
        Joiner.load_model(peer, config)
    line = str(err.value)
    assert "\n" not in line and f"dataset '{copy}'" in line and "differs" in line


# ------------------------------------------------------------------- bad input


def test_unknown_template_field(capsys, tmp_path):
    path = _three_class_csv(tmp_path / "d.csv", NLI_ROWS)
    line = _error_line(
        capsys,
        ["eval", "--dataset", str(path), "--task", "nli", "--template", "{premise} {question}"],
    )
    assert "no column 'question'" in line and "premise, hypothesis, label" in line
    line = _error_line(capsys, ["eval", "--dataset", str(path), "--template", "{premise} {0}"])
    assert "not a plain column name" in line
    line = _error_line(capsys, ["eval", "--dataset", str(path), "--template", "{premise"])
    assert "template" in line and "not valid" in line


def test_labels_outside_the_list(capsys, tmp_path):
    rows = NLI_ROWS + [("Anna plays the piano.", "Anna sings", "maybe")]
    path = _three_class_csv(tmp_path / "d.csv", rows)
    line = _error_line(capsys, ["eval", "--dataset", str(path), "--task", "nli"])
    assert "label 'maybe' is not one of the run's labels" in line and "d.csv, line 17" in line
    line = _error_line(
        capsys,
        ["eval", "--dataset", str(path), "--template", "{premise} {hypothesis}"],
    )
    assert "label 'entailment' is not one of 0..1" in line and "--label-names" in line
    jsonl = tmp_path / "n.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"t{i}", "label": 5}) + "\n" for i in range(4)))
    line = _error_line(capsys, ["eval", "--dataset", str(jsonl)])
    assert "label 5 is not one of 0..1" in line


def test_empty_files(capsys, tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert "is empty" in _error_line(capsys, ["eval", "--dataset", str(empty)])
    blank = tmp_path / "b.jsonl"
    blank.write_text("\n\n  \n")
    assert "has no rows" in _error_line(capsys, ["eval", "--dataset", str(blank)])
    header = tmp_path / "h.csv"
    header.write_text("premise,hypothesis,label\n")
    line = _error_line(capsys, ["eval", "--dataset", str(header), "--task", "nli"])
    assert "has no rows" in line


def test_a_2gb_line_is_refused_without_reading_it(capsys, tmp_path):
    import resource

    for name, head in (("big.jsonl", b'{"text": "'), ("big.csv", b'text,label\n"')):
        path = tmp_path / name
        with open(path, "wb") as fh:
            fh.write(head)
            fh.truncate(2 << 30)  # sparse: 2 GiB of one line, no disk used
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        line = _error_line(capsys, ["eval", "--dataset", str(path)])
        assert f"longer than {MAX_LINE_BYTES >> 20} MiB" in line and name in line
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown_kib < 200 * 1024  # far from 2 GiB


def test_unknown_preset_and_builtin_with_three_labels(capsys):
    assert "unknown task preset 'sst9'" in _error_line(capsys, ["eval", "--task", "sst9"])
    line = _error_line(capsys, ["eval", "--label-words", " a", " b", " c"])
    assert "built-in task 'synthetic-sentiment'" in line


def test_completion_and_lm_report_loss_and_perplexity(capsys, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": f"what is {i} plus one", "reply": f" {i + 1}"}) + "\n"
            for i in range(30)
        )
    )
    argv = ["eval", "--dataset", str(path), "--kind", "completion", "--label-column", "reply"]
    assert main([*argv, "--template", "Q: {question}?\nA:"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"3 held-out examples  loss \d+\.\d+  perplexity \d+\.\d+$", out.strip())
    assert "accuracy" not in out
    assert main(["eval", "--dataset", str(EXAMPLES / "lm.jsonl"), "--task", "lm"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_train_examples_keeps_the_first_n_and_is_part_of_the_run():
    from seedflood_p2p.algorithm.trainer import batch_seed
    from seedflood_p2p.workload.batching import sample_batch

    full = load_run_task(RunConfig())
    config = RunConfig(train_examples=40)
    task = load_run_task(config)
    assert task.train == full.train[:40] and task.test == full.test
    assert config.run_id != RunConfig().run_id  # the set trained on is the run's
    assert "train_examples" not in RunConfig().to_json()  # old run ids unchanged
    drawn = {
        id(e) for r in range(50) for e in sample_batch(task, batch_seed(config.run_key, b"p", r), 8)
    }
    assert drawn <= {id(e) for e in task.train} and len(drawn) > 30
    # the digest a joiner checks is of what it trains on, the same on every machine
    assert examples_sha256(task) == examples_sha256(load_run_task(config))
    assert examples_sha256(task) != examples_sha256(full)
    with pytest.raises(UserError, match="has 2000 training examples; lower --train-examples"):
        load_run_task(RunConfig(train_examples=2001))
    with pytest.raises(UserError, match="train_examples must be 0"):
        RunConfig(train_examples=-1)
