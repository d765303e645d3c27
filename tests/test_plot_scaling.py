"""bench/plot_scaling.py, the scaling curve's summary: rows grouped by N from two machines'
results files, each N held against the Adam row of its own machine, the sampling SE of a
margin paired over sentences where both rows kept their marks, and N* the smallest N that
beats Adam. Small synthetic results files stand for bench_rounds.py's: no training."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plot_scaling  # noqa: E402

SENTENCES = 40


def _run(row: str, peers: int, seed: int, accuracy: float, marks: str | None) -> dict:
    run = {
        "row": row,
        "peers": peers,
        "seed": seed,
        "settings": {"method": "adam" if row.startswith("adam") else "zo"},
        "scored_on": "test",
        "curve": {
            "0": {"loss": 1.0, "accuracy": 0.5},
            "20": {"loss": 0.8, "accuracy": accuracy - 0.01},
            "40": {"loss": 0.7, "accuracy": accuracy},
        },
    }
    if marks is not None:
        run["correct"] = {"40": marks}
    return run


def _marks(count: int, shift: int) -> str:
    """`count` sentences right out of SENTENCES, starting at `shift` (wrapping)."""
    bits = ["0"] * SENTENCES
    for i in range(count):
        bits[(shift + i) % SENTENCES] = "1"
    return "".join(bits)


def _write(path: Path, runs: list[dict]) -> Path:
    path.write_text(json.dumps({"meta": {"eval_examples": SENTENCES}, "runs": runs}))
    return path


@pytest.fixture
def sources(tmp_path):
    cpu, gpu = [], []
    for seed in range(5):
        # CPU: N = 4 below Adam, N = 16 above; both keep marks (paired margins)
        cpu.append(_run("adam-a", 4, seed, 0.75, _marks(30, seed)))
        cpu.append(_run("zo-small", 4, seed, 0.70 + 0.001 * seed, _marks(28, seed)))
        cpu.append(_run("zo-mid", 16, seed, 0.80 + 0.001 * seed, _marks(32, seed)))
        # GPU: its own Adam row and N = 64, no marks (the unpaired bound)
        gpu.append(_run("adam-a", 1, seed, 0.76, None))
        gpu.append(_run("zo-big", 64, seed, 0.81, None))
    cpu.append(_run("zo-unfinished", 256, 0, 0.9, None))  # 1 seed: no claim, left out
    return (
        ("cpu", _write(tmp_path / "cpu.json", cpu)),
        ("gpu", _write(tmp_path / "gpu.json", gpu)),
    )


def test_rows_are_grouped_by_n_and_each_n_meets_its_own_machines_adam(sources):
    summary = plot_scaling.collect(sources)
    assert list(summary["zo"]) == [4, 16, 64]  # N = 256 has 1 seed: not a claim
    assert summary["device"] == {4: "cpu", 16: "cpu", 64: "gpu"}
    assert summary["zo"][16][40]["mean"] == pytest.approx(0.802)
    assert summary["zo"][16][40]["se_seeds"] == pytest.approx(
        statistics.stdev([0.80 + 0.001 * s for s in range(5)]) / math.sqrt(5)
    )
    m16 = plot_scaling.margin(summary, 16, 40)
    m64 = plot_scaling.margin(summary, 64, 40)
    assert m16["against"] == "Adam (cpu)" and m64["against"] == "Adam (gpu)"
    assert m16["margin"] == pytest.approx(0.802 - 0.75)
    assert m64["margin"] == pytest.approx(0.81 - 0.76)


def test_a_margin_is_paired_over_sentences_where_both_rows_kept_marks(sources):
    summary = plot_scaling.collect(sources)
    m16 = plot_scaling.margin(summary, 16, 40)
    assert m16["paired"]
    a = [statistics.fmean(int(_marks(32, s)[i]) for s in range(5)) for i in range(SENTENCES)]
    b = [statistics.fmean(int(_marks(30, s)[i]) for s in range(5)) for i in range(SENTENCES)]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    assert m16["se_sampling"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(SENTENCES))
    assert m16["se_combined"] == pytest.approx(math.hypot(m16["se_seeds"], m16["se_sampling"]))
    # no marks on the GPU: the unpaired bound, sqrt(2) times one score's sampling SE
    m64 = plot_scaling.margin(summary, 64, 40)
    assert not m64["paired"]
    assert m64["se_sampling"] == pytest.approx(math.sqrt(2 * 0.76 * 0.24 / SENTENCES))
    # marks kept at round 40 only (as the first runs that kept them): round 20 is unpaired
    assert not plot_scaling.margin(summary, 16, 20)["paired"]


def test_n_star_is_the_smallest_n_that_beats_adam_and_the_page_is_written(sources, tmp_path):
    summary = plot_scaling.collect(sources)
    summary["n_star"] = {str(r): plot_scaling.n_star(summary, r) for r in (20, 40)}
    star = summary["n_star"]["40"]
    assert (star["n_star"], star["below"]) == (16, 4)
    assert [m["n"] for m in star["margins"]] == [4, 16, 64]
    plot_scaling.render(summary, tmp_path / "scaling")
    md = (tmp_path / "scaling.md").read_text()
    assert "**N* = 16**" in md and "(N = 4 does not)" in md
    assert "(paired)" in md and "(unpaired bound)" in md
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "marks" not in json.loads((tmp_path / "scaling.json").read_text())


def test_compare_rows_pairs_two_rows_over_the_sentences_both_marked():
    import compare_rows  # bench/, beside plot_scaling

    a = [_run("lever", 4, s, 0.80 + 0.001 * s, _marks(32, s % 2)) for s in range(5)]
    b = [_run("plain", 4, s, 0.78 + 0.001 * s, _marks(31, s % 2)) for s in range(5)]
    rounds = compare_rows.compare(("a", a, SENTENCES), ("b", b, SENTENCES))
    assert [c["round"] for c in rounds] == [20, 40]
    at20, at40 = rounds
    assert at40["difference"] == pytest.approx(0.02)
    assert at40["paired"] and not at20["paired"]  # marks kept at round 40 only
    ma, mb = plot_scaling.marks(a, 40), plot_scaling.marks(b, 40)
    diffs = [x - y for x, y in zip(ma, mb, strict=True)]
    assert at40["se_sampling"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(SENTENCES))
    assert at20["se_sampling"] == pytest.approx(math.sqrt(2 * 0.772 * 0.228 / SENTENCES), rel=1e-3)
