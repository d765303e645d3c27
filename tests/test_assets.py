"""Run assets travel with the run: an organiser's own model directory and three-class CSV
(string labels, two text fields) reach volunteers that have neither, by digest, from
peers; a volunteer with a doctored copy is refused at join; the trained model exports."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import msgpack
import pytest

from seedflood.cli import main
from seedflood_p2p.apps.localnet import start_bootstrap, start_peer
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.transfer.assets import (
    ASSET_CHUNK_BYTES,
    allowed_name,
    decode_listing,
    encode_listing,
    make_listing,
)
from seedflood_p2p.workload.models import load_model, save_model

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 4
FLAGS = [
    "--until-round",
    str(ROUNDS),
    "--min-peers",
    "2",
    "--startup-wait",
    "120",
    "--round-deadline",
    "5",
    "--linger",
    "2",
    "--connect-retries",
    "20",
]


def test_only_data_files_travel(tmp_path):
    model = tmp_path / "m"
    save_model(*load_model("tiny-llama"), model)
    (model / "modeling_evil.py").write_text("import os")
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    names = [name for name, _, _, _ in make_listing("model", model)]
    assert "model.safetensors" in names and "config.json" in names
    assert not any(n.endswith((".py", ".bin")) for n in names)
    for bad in ("../x.json", ".hidden.json", "a/b.json", "x.py", "x.bin", "x" * 200 + ".json"):
        assert not allowed_name("model", bad)
    assert allowed_name("dataset", "nli.csv") and not allowed_name("dataset", "nli.py")
    assert allowed_name("basis", "a" * 64 + ".safetensors")
    assert not allowed_name("basis", "basis.json") and not allowed_name("basis", "b.bin")
    basis = tmp_path / ("a" * 64 + ".safetensors")
    basis.write_bytes(b"\0" * 10)
    one = make_listing("basis", basis)
    assert decode_listing("basis", encode_listing(one)) == one
    two = [*one, ("b" * 64 + ".safetensors", 10, b"\0" * 32, [b"\0" * 32])]
    assert decode_listing("basis", encode_listing(two)) is None  # one file, the artifact
    listing = make_listing("model", model)
    assert decode_listing("model", encode_listing(listing)) == listing
    forged = [("../../etc/passwd.json", 10, b"\0" * 32, [b"\0" * 32])]
    assert decode_listing("model", encode_listing(forged)) is None
    lying = [("config.json", 3 * ASSET_CHUNK_BYTES, b"\0" * 32, [b"\0" * 32])]
    assert decode_listing("model", encode_listing(lying)) is None  # chunk count wrong
    assert decode_listing("model", msgpack.packb({"x": 1})) is None


def _write_nli(path: Path, doctor: bool = False) -> Path:
    rows = [
        (f"{p} plays the piano.", f"{p} {h}", label)
        for p in ("Anna", "Ben", "Chloe", "David", "Emma", "Farid")
        for h, label in (
            ("plays music", "entailment"),
            ("is tired", "neutral"),
            ("plays nothing", "contradiction"),
        )
    ]
    if doctor:
        rows[0] = (rows[0][0], rows[0][1], "contradiction")
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["premise", "hypothesis", "label"])
        w.writerows(rows)
    return path


@pytest.mark.slow
def test_volunteers_fetch_the_organisers_model_and_data(tmp_path, capsys):
    organiser = tmp_path / "organiser"
    organiser.mkdir()
    model_dir = organiser / "my-model"
    save_model(*load_model("tiny-llama"), model_dir)
    data = _write_nli(organiser / "nli.csv")
    run = RunConfig(
        model=str(model_dir),
        dataset=str(data),
        task="nli",
        max_length=96,
        rank=4,
        refresh_period=5,
        lr=8e-3,
        n_ref=2,
        batch_size=8,
    )
    work = tmp_path / "work"
    work.mkdir()
    procs = []
    try:
        boot, address = start_bootstrap(work, run)
        procs.append(boot)
        peers = {name: start_peer(work, name, address, FLAGS) for name in ("a", "b")}
        procs += peers.values()
        doctored = _write_nli(tmp_path / "copy.csv", doctor=True)
        cheat = start_peer(work, "c", address, [*FLAGS, "--dataset-file", str(doctored)])
        procs.append(cheat)
        assert cheat.wait_exit() == 2
        line = [x for x in cheat.tail(50).splitlines() if "error" in x][-1]
        assert f"dataset '{doctored}'" in line and "differs from the organiser's" in line
        for name, proc in peers.items():
            assert proc.wait_exit(600) == 0, proc.tail()
            fetched = [e for e in proc.events() if "fetched the run's" in e.get("message", "")]
            assert len(fetched) == 2, proc.tail()
            assert list((work / name / "assets").glob("dataset-*/nli.csv"))
            assert list((work / name / "assets").glob("model-*/model.safetensors"))
            assert not list((work / name / "assets").glob("*/*.part"))
    finally:
        for p in procs:
            p.stop()
    exported = tmp_path / "hf"
    ledger = work / "a" / "ledger.sqlite"
    argv = ["export", "--ledger", str(ledger), "--out", str(exported), "--base", str(model_dir)]
    assert main([*argv, "--dataset-file", str(data)]) == 0
    card = (exported / "README.md").read_text()
    accuracy = float(re.search(r"accuracy: (\d\.\d+)", card).group(1))
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported).num_parameters() > 0
    capsys.readouterr()
    flags = ["--model", str(model_dir), "--dataset", str(data), "--task", "nli"]
    assert main(["eval", *flags, "--max-length", "96", "--batch-size", "8", str(exported)]) == 0
    assert f"accuracy {accuracy:.4f}" in capsys.readouterr().out


def test_download_uses_several_sources_drops_a_bad_one_and_resumes(tmp_path, monkeypatch):
    import asyncio
    import json

    from seedflood_p2p.network.transfer import assets

    data = tmp_path / "big.jsonl"
    with open(data, "w") as fh:
        for i in range(60000):
            fh.write(json.dumps({"text": f"row {i} " + "x" * 40, "label": i % 2}) + "\n")
    listing = make_listing("dataset", data)
    size, chunks = listing[0][1], listing[0][3]
    assert len(chunks) >= 3
    served: dict[str, list[int]] = {"good": [], "bad": [], "slow": []}

    async def fake_call(p2p, peer, name, request, timeout, **kw):
        _, kind, file, index = msgpack.unpackb(request)
        served[peer].append(index)
        start = index * ASSET_CHUNK_BYTES
        with open(data, "rb") as f:
            f.seek(start)
            block = f.read(ASSET_CHUNK_BYTES)
        await asyncio.sleep(0.01)
        return b"\0" + block[1:] if peer == "bad" else block

    monkeypatch.setattr(assets, "call_bytes", fake_call)
    folder = tmp_path / "got"
    run = assets._download(None, "r", "dataset", listing, ["bad", "good", "slow"], folder, 5)
    asyncio.run(run)
    assert (folder / "big.jsonl").read_bytes() == data.read_bytes()
    assert len(served["bad"]) == 1  # its one bad chunk, then never asked again
    assert served["good"] and served["slow"]  # the chunks spread over the good sources

    # Resume: a partial file with all but the last chunk right fetches only that one.
    (folder / "big.jsonl").rename(folder / "big.jsonl.part")
    with open(folder / "big.jsonl.part", "r+b") as f:
        f.seek((len(chunks) - 1) * ASSET_CHUNK_BYTES)
        f.write(b"\0\0\0")
    served = {"good": [], "bad": [], "slow": []}
    asyncio.run(assets._download(None, "r", "dataset", listing, ["good"], folder, 5))
    assert served["good"] == [len(chunks) - 1]
    assert (folder / "big.jsonl").read_bytes() == data.read_bytes() and size == data.stat().st_size
