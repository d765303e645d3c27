#!/usr/bin/env python
"""Where the two-block rows level off, and whether the optimizer or the subspace sets it:
full Adam, Adam on the zeroth-order rows' rank-32 subspace (`adam-core`) and a round of N
zeroth-order peers, each to 120 steps on MR's fixed validation split.

    python bench/plot_plateau.py        # reads bench/results/{subspace,plateau}-val.json

Rows and runs: `bench/bench_rounds.py` (commands in each results file). Writes
bench/results/plateau.md and plateau.png: per row, accuracy at each evaluated step, the mean
over seeds +- its SE, and the sampling SE of one score in brackets.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SOURCES = ("subspace-val.json", "plateau-val.json")
# (row, N) -> label; the rows chosen on validation (best at round 40 of their sweeps)
ROWS = {
    ("adam-sentiment-lr1e-4", 1): "Adam lr 1e-4 (all 7.1 M weights of the two blocks)",
    ("adam-sentiment-lr3e-5", 1): "Adam lr 3e-5 (all weights)",
    ("adam-core-lr1e-5", 1): "Adam lr 1e-5 on the rank-32 K-FAC cores (14,336 coordinates)",
    ("sentiment-lr0.064", 16): "zeroth order, 16 peers a round, lr 0.064 (same cores)",
}


def collect() -> dict:
    out: dict = {}
    for name in SOURCES:
        path = RESULTS / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for run in data["runs"]:
            adam = run["settings"]["method"] in ("adam", "adam-core")
            key = (run["row"], 1 if adam else run["peers"])
            if key in ROWS:
                out.setdefault(key, []).append(run)
    return out


def summary(runs: list[dict]) -> dict[int, tuple[float, float, float, int]]:
    """step -> (mean, SE over seeds, sampling SE, seeds)."""
    steps = sorted({int(s) for run in runs for s in run["curve"]})
    out = {}
    for s in steps:
        accs = [run["curve"][str(s)]["accuracy"] for run in runs if str(s) in run["curve"]]
        mean = statistics.fmean(accs)
        se = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else float("nan")
        n = runs[0]["eval_examples"]
        out[s] = (mean, se, math.sqrt(mean * (1 - mean) / n), len(accs))
    return out


def main() -> None:
    groups = collect()
    table = {key: summary(runs) for key, runs in groups.items()}
    steps = sorted({s for rows in table.values() for s in rows})
    lines = [
        "# Where the two-block rows level off (SmolLM2-135M, MR, validation split)",
        "",
        "`python bench/plot_plateau.py` over `bench/results/subspace-val.json` and",
        "`plateau-val.json` (commands in each). Accuracy on MR's fixed validation split (1,000",
        "sentences, carved from the training sentences): mean over seeds +- SE over seeds",
        "(blank with one seed) [sampling SE of one score]. A step is one Adam step or one",
        "round of N zeroth-order peers; every row on the first 512 training sentences.",
        "",
        "| row | seeds | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|---:|" + "---:|" * len(steps),
    ]
    for key, label in ROWS.items():
        if key not in table:
            continue
        rows = table[key]
        cells = []
        for s in steps:
            if s not in rows:
                cells.append("")
                continue
            mean, se, sampling, _ = rows[s]
            err = "" if math.isnan(se) else f" +- {se:.3f}"
            cells.append(f"{mean:.3f}{err} [{sampling:.3f}]")
        seeds = max(v[3] for v in rows.values())
        lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    (RESULTS / "plateau.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for key, label in ROWS.items():
        if key not in table:
            continue
        xs = sorted(table[key])
        ys = [table[key][s][0] for s in xs]
        es = [0 if math.isnan(table[key][s][1]) else table[key][s][1] for s in xs]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label,
                    linestyle="-" if key[1] > 1 else "--")  # fmt: skip
    ax.set_xlabel("step (Adam) or round (zeroth order)")
    ax.set_ylabel("accuracy, MR validation (1,000 sentences)")
    ax.set_title("Two blocks of SmolLM2-135M level off near 0.82, whatever trains them")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "plateau.png", dpi=120)


if __name__ == "__main__":
    main()
