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


def tiny_args(rounds: int, eval_at: str, eval_examples: int, out: str, results: Path) -> list:
    """bench_rounds.py's flags for one activation-basis row of 2 peers on the tiny model."""
    return [
        "--model", "tiny-llama", "--task", "synthetic-sentiment",
        "--train-only", "", "--no-cache-prefix",
        "--peers", "2", "--seeds", "1", "--rounds", str(rounds), "--eval-at", eval_at,
        "--eval-examples", str(eval_examples), "--rows", "",
        "--row", "act=rank:8,directions:4,step_rule:round_mean,n_ref:2,lr:0.05,"
        "basis:activation,basis_refresh:0",
        "--out", out, "--results-dir", str(results),
    ]  # fmt: skip


def run(bench, monkeypatch, results: Path) -> None:
    monkeypatch.setattr(
        sys, "argv", ["bench_rounds.py", *tiny_args(8, "0,4,8", 40, "resume", results)]
    )
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


def test_rows_whose_names_hold_a_dot_keep_separate_ledgers(tmp_path):
    """A row named "kfac-f0.25" once lost everything after its dot in the partial files'
    names, so its seeds (and "kfac-f0.125") shared one ledger and a second process was
    refused as "another run"."""
    bench = load_bench()
    args = bench.argparse.Namespace(results_dir=tmp_path, out="levers")
    paths = {
        bench.Partial.paths(args, name, 64, seed)
        for name in ("kfac-f0.25", "kfac-f0.125", "kfac-f0")
        for seed in (1, 2)
    }
    assert len(paths) == 6
    ledger, state = bench.Partial.paths(args, "kfac-f0.25", 64, 1)
    assert ledger.name == "levers-kfac-f0.25-N64-seed1.sqlite"
    assert state.name == "levers-kfac-f0.25-N64-seed1.json"


def test_the_benchmark_runs_without_the_daemons_settings_packages(tmp_path):
    """The lent GPU machines' image has torch and transformers but not pydantic (the
    daemons' settings); the benchmark and its resume must not need it."""
    import os
    import subprocess

    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\nsys.modules['pydantic'] = None\nsys.modules['pydantic_settings'] = None\n"
    )
    argv = [sys.executable, str(BENCH), *tiny_args(2, "2", 16, "nopydantic", tmp_path / "results")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), str(BENCH.parents[1])])}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads((tmp_path / "results" / "nopydantic.json").read_text())
    assert any(r["row"] == "act" for r in runs["runs"])
