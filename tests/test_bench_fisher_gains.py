"""bench/bench_fisher_gains.py on the tiny model: it reads the gains the artifact records
and turns them back into the matrices' curvature ratios."""

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_fisher_gains.py"


def test_the_report_recovers_each_matrix_curvature_from_its_gain(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_fisher_gains_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["bench_fisher_gains.py", "--power", "0.25", "--results-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = json.loads((tmp_path / "fisher-gains.json").read_text())
    assert result["matrices"] == 15  # 14 block matrices and the head
    # The head's G has rank one along its two label words: by far the sharpest matrix,
    # so at p > 0 its gain runs into the bound.
    assert result["capped"] == ["lm_head.weight"]
    fisher = result["fisher_vs_typical"]
    assert len(fisher) == 14 and "lm_head.weight" not in fisher
    kinds = result["by_kind"]
    assert kinds["k_proj"]["geomean"] < 0.1 < 1 < kinds["down_proj"]["geomean"]
    # Recomputing the gains from the ratios gives the bounds the artifact recorded.
    gains = [f**0.25 for f in fisher.values()]
    assert min(gains) >= result["gain_min"] * 0.999
    assert "| down_proj | 2 |" in (tmp_path / "fisher-gains.md").read_text()
