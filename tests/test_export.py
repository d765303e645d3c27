"""`seedflood export`: the run's model as a Hugging Face directory that transformers loads,
with a model card, scoring what `seedflood eval` scores."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from seedflood.cli import main
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model, save_model, weights_sha256

ROOT = Path(__file__).resolve().parents[1]
NLI = ROOT / "examples" / "tasks" / "nli.csv"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _accuracy(capsys, argv: list[str]) -> float:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return float(re.search(r"accuracy (\d\.\d+)", out).group(1))


@pytest.mark.slow
def test_export_from_ledger_and_checkpoint_loads_in_transformers(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import evaluate_metrics
    from seedflood_p2p.workload.tasks import load_run_task

    # The organiser's own model directory and three-class CSV with string labels.
    base_dir = tmp_path / "my-model"
    save_model(*load_model("tiny-llama"), base_dir)
    run = ["--model", str(base_dir), "--dataset", str(NLI), "--task", "nli", "--max-length", "96"]
    out = tmp_path / "run"
    assert main(["train", *run, "--rounds", "6", "--eval-every", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    ledger_path = out / "ledger.sqlite"

    exported = tmp_path / "hf"
    assert main(["export", "--ledger", str(ledger_path), "--out", str(exported)]) == 0
    capsys.readouterr()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md"):
        assert (exported / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    with Ledger.open_existing(ledger_path) as ledger:
        config = ledger.config
        digest, rounds = ledger.digest(), ledger.max_round() + 1
    assert len(config.dataset_sha256) == 64
    task = load_run_task(config)
    metrics = evaluate_metrics(model, tokenizer, task, config, 1000)
    assert set(metrics) == {"loss", "accuracy", "macro_f1"}
    # `seedflood eval` of the exported directory scores the same.
    eval_acc = _accuracy(capsys, ["eval", *run, str(exported)])
    assert round(metrics["accuracy"], 4) == eval_acc
    card = (exported / "README.md").read_text()
    assert config.run_id in card and digest in card and f"| rounds | {rounds} |" in card
    assert f"accuracy: {metrics['accuracy']:.4f}" in card and "macro_f1" in card
    assert json.loads((exported / "seedflood_run.json").read_text())["task"] == "nli"

    # The same weights from a peer's data dir: its checkpoint, not a replay.
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    shutil.copy(ledger_path, peer_dir / "ledger.sqlite")
    scratch, _ = load_model(str(base_dir))
    with Ledger.open_existing(peer_dir / "ledger.sqlite") as ledger:
        replay(scratch, config, ledger.messages())
        live = LiveModel(make_estimator(scratch, config), ledger)
        live.checkpoint(peer_dir, live.cut(), {"round": rounds - 1})
    from_checkpoint = tmp_path / "hf2"
    assert main(["export", "--checkpoint", str(peer_dir), "--out", str(from_checkpoint)]) == 0
    capsys.readouterr()
    again = AutoModelForCausalLM.from_pretrained(from_checkpoint)
    assert weights_sha256(again) == weights_sha256(model)
    assert digest in (from_checkpoint / "README.md").read_text()


def test_export_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "no checkpoint.json" in err[-1]
