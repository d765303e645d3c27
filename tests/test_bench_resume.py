"""The learning benchmark resumes a run stopped mid-way from its ledger (issue 26: a run
longer than one session picks up where the last one stopped)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_rounds.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_rounds_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Stopped(Exception):
    """Stands in for the session ending (the process killed) after an evaluation."""


def run(bench, monkeypatch, results: Path) -> None:
    argv = [
        "bench_rounds.py",
        "--model", "tiny-llama", "--task", "synthetic-sentiment",
        "--train-only", "", "--no-cache-prefix",
        "--peers", "2", "--seeds", "1", "--rounds", "8", "--eval-at", "0,4,8",
        "--eval-examples", "40", "--rows", "",
        "--row", "act=rank:8,directions:4,step_rule:round_mean,n_ref:2,lr:0.05,"
        "basis:activation,basis_refresh:0",
        "--out", "resume", "--results-dir", str(results),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()


def test_a_stopped_run_resumes_from_its_ledger(tmp_path, monkeypatch):
    bench = load_bench()
    save = bench.Partial.save

    def save_then_stop(self, curve):
        save(self, curve)
        if 4 in curve:
            raise Stopped

    monkeypatch.setattr(bench.Partial, "save", save_then_stop)
    with pytest.raises(Stopped):
        run(bench, monkeypatch, tmp_path)
    assert not (tmp_path / "resume.json").exists()  # nothing finished yet
    partial = tmp_path / "partial"
    state = json.loads((partial / "resume-act-N2-seed0.json").read_text())
    assert sorted(state["curve"]) == ["0", "4"]
    artifacts = list((partial / "resume-act-N2-seed0.sqlite.artifacts").iterdir())
    assert len(artifacts) == 1  # the activation basis, kept beside the ledger
    artifact_bytes = artifacts[0].stat().st_size

    monkeypatch.setattr(bench.Partial, "save", save)
    run(bench, monkeypatch, tmp_path)  # the next session: same command
    (result,) = json.loads((tmp_path / "resume.json").read_text())["runs"]
    assert result["resumed_at"] == [4]  # replayed rounds 0-3, trained 4-7 only
    assert sorted(result["curve"], key=int) == ["0", "4", "8"]
    for r in ("0", "4"):  # the evaluations before the stop are kept as they were
        assert result["curve"][r] == dict(zip(("loss", "accuracy"), state["curve"][r]))
    assert result["artifacts"] == 1 and result["artifact_bytes"] == artifact_bytes
    assert not any(partial.iterdir())  # a finished run leaves no partial files
