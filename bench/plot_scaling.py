#!/usr/bin/env python
"""Issue 47's scaling curve: a round's accuracy against the peers N in it, with Adam's step
as a line, and N* (the smallest measured N whose round beats Adam's step).

Reads the test-split results of bench/bench_rounds.py (each row chosen on the validation
split, 5 seeds): the CPU's `scaling-test.json` (N = 4 and 16, bench/scaling_rounds.sh) and
the GPU's `gpu/scaling-test-gpu.json` (N = 64, 256, 1,024 and its own Adam row, `bash
bench/gpu_rounds.sh scale`), and writes bench/results/scaling.md, .json and .png.

    python bench/plot_scaling.py

Error bars: the standard error over seeds. The test's own sampling error is reported
beside it: sqrt(p(1-p)/n) for one score. For a difference of two rows on the same
sentences it is paired where both rows kept per-sentence marks at that evaluation
(bench_rounds.py keeps them since the fifteenth CPU session: at the last evaluation, then
at every one): the SE over sentences of (row A's mean mark over seeds - row B's);
otherwise the unpaired bound, sqrt(2) times one score's. Each N is compared with the Adam
row run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SOURCES = (
    ("cpu", RESULTS / "scaling-test.json"),
    ("gpu", RESULTS / "gpu" / "scaling-test-gpu.json"),
)


def summarise(values: list[float], n_sentences: int) -> dict:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return {
        "mean": mean,
        "se_seeds": se,
        "se_sampling": math.sqrt(mean * (1 - mean) / n_sentences),
        "seeds": len(values),
    }


def marks(runs: list[dict], round_: int) -> list[float] | None:
    """Per sentence, the mean over seeds of its correct mark at `round_` (None: not kept)."""
    bits = [run.get("correct", {}).get(str(round_)) for run in runs]
    if not all(bits) or len({len(b) for b in bits}) != 1:
        return None
    return [statistics.fmean(int(b[i]) for b in bits) for i in range(len(bits[0]))]


def collect(sources=SOURCES, rounds=(20, 40)) -> dict:
    """{"zo": {N: {round: summary}}, "adam": {device: {round: summary}}, "rows": names,
    "device": {N: where it ran}, "marks": {"zo N" / "adam device": per-sentence marks}}."""
    zo: dict[int, dict] = {}
    adam: dict[str, dict] = {}
    rows: dict[str, str] = {}
    where: dict[int, str] = {}
    kept: dict[str, list[float]] = {}
    for device, path in sources:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        n_sentences = data["meta"]["eval_examples"]
        groups: dict[tuple, list[dict]] = {}
        for run in data["runs"]:
            if run.get("scored_on") != "test":
                continue
            adam_row = run["settings"]["method"] == "adam"
            key = ("adam", device) if adam_row else ("zo", run["peers"])
            groups.setdefault(key, []).append(run)
            rows[f"{key[0]} {key[1]}"] = f"{run['row']} ({device})"
        for (kind, key), runs in groups.items():
            if len(runs) < 5:
                continue  # a claim needs 5 seeds; unfinished rows are left out
            out = {
                r: summarise([run["curve"][str(r)]["accuracy"] for run in runs], n_sentences)
                for r in rounds
                if all(str(r) in run["curve"] for run in runs)
            }
            out[0] = summarise([run["curve"]["0"]["accuracy"] for run in runs], n_sentences)
            if kind == "zo" and key in zo:
                continue  # N measured on both: the first source (the CPU) is kept
            (zo if kind == "zo" else adam)[key] = out
            if kind == "zo":
                where[key] = device
            for r in rounds:
                if (per_sentence := marks(runs, r)) is not None:
                    kept[f"{kind} {key} @{r}"] = per_sentence
    return {
        "zo": dict(sorted(zo.items())),
        "adam": adam,
        "rows": rows,
        "device": where,
        "marks": kept,
    }


def margin(summary: dict, n: int, round_: int) -> dict | None:
    """Round `round_` of N peers minus Adam's step `round_` on the same machine."""
    device = summary["device"][n]
    ref_key = device if device in summary["adam"] else next(iter(summary["adam"]), None)
    curve, ref = summary["zo"][n], summary["adam"].get(ref_key, {})
    if round_ not in curve or round_ not in ref:
        return None
    a = summary["marks"].get(f"zo {n} @{round_}")
    b = summary["marks"].get(f"adam {ref_key} @{round_}")
    if a and b and len(a) == len(b):
        diffs = [x - y for x, y in zip(a, b, strict=True)]
        se_sampling, paired = statistics.stdev(diffs) / math.sqrt(len(diffs)), True
    else:
        se_sampling, paired = math.sqrt(2) * ref[round_]["se_sampling"], False
    se_seeds = math.hypot(curve[round_]["se_seeds"], ref[round_]["se_seeds"])
    return {
        "n": n,
        "against": f"Adam ({ref_key})",
        "margin": curve[round_]["mean"] - ref[round_]["mean"],
        "se_seeds": se_seeds,
        "se_sampling": se_sampling,
        "paired": paired,
        "se_combined": math.hypot(se_seeds, se_sampling),
    }


def n_star(summary: dict, round_: int) -> dict:
    """The smallest measured N whose round `round_` beats Adam's step, with every margin."""
    margins = [m for n in summary["zo"] if (m := margin(summary, n, round_))]
    beats = [m["n"] for m in margins if m["margin"] > 0]
    first = beats[0] if beats else None
    below = [m["n"] for m in margins if first is not None and m["n"] < first]
    return {"n_star": first, "below": max(below) if below else None, "margins": margins}


def fmt(s: dict) -> str:
    return f"{s['mean']:.3f} +- {s['se_seeds']:.3f} [{s['se_sampling']:.3f}]"


def render(summary: dict, out: Path) -> None:
    zo, adam = summary["zo"], summary["adam"]
    ref = adam.get("gpu") or adam.get("cpu")
    lines = [
        "# A round of N peers against an Adam step: two blocks of SmolLM2-135M on MR",
        "",
        "`python bench/plot_scaling.py` over the test rows of `bench/scaling_rounds.sh` (CPU)",
        "and `bash bench/gpu_rounds.sh scale` (one H200). Per N the step (lr under round_mean,",
        "n_ref 16, K-FAC basis fixed at the base, rank 32, k = 16) and Adam's lr were chosen",
        "on MR's fixed validation split (1 seed each), then scored once on the 1,000 test",
        "sentences with 5 seeds. Cells: mean +- SE over seeds [sampling SE of one score].",
        "",
        "| N peers a round | row (where run) | round 0 | round 20 | round 40 |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, curve in zo.items():
        lines.append(
            f"| {n} | {summary['rows'][f'zo {n}']} | {fmt(curve[0])} | "
            f"{fmt(curve[20]) if 20 in curve else '-'} | {fmt(curve[40]) if 40 in curve else '-'} |"
        )
    for device, curve in adam.items():
        lines.append(
            f"| Adam, 1 machine | {summary['rows'][f'adam {device}']} | {fmt(curve[0])} | "
            f"{fmt(curve[20])} | {fmt(curve[40])} |"
        )
    lines += [
        "",
        "Margins, round r of N peers minus Adam's step r on the same machine: +- the SE",
        "over seeds, then with the test's sampling SE of the difference (paired where both",
        "rows kept per-sentence marks, else the unpaired bound) as one combined SE.",
        "",
        "| round | N | against | margin | SE seeds | SE sampling | combined | margin / combined |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in (20, 40):
        for m in summary["n_star"][str(r)]["margins"]:
            kind = "paired" if m["paired"] else "unpaired bound"
            lines.append(
                f"| {r} | {m['n']} | {m['against']} | {m['margin']:+.3f} | {m['se_seeds']:.3f} "
                f"| {m['se_sampling']:.3f} ({kind}) | {m['se_combined']:.3f} "
                f"| {m['margin'] / m['se_combined']:+.1f} |"
            )
    lines.append("")
    for r in (20, 40):
        star = summary["n_star"][str(r)]
        if star["n_star"] is None:
            lines.append(f"- round {r}: no measured N beats Adam's step {r}.")
            continue
        lines.append(
            f"- round {r}: **N* = {star['n_star']}**, the smallest measured N whose mean beats "
            f"Adam's step {r}"
            + (
                f" (N = {star['below']} does not)."
                if star["below"]
                else " (none smaller measured)."
            )
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    kept = {k: v for k, v in summary.items() if k != "marks"}  # the marks stay in the runs
    out.with_suffix(".json").write_text(json.dumps(kept, indent=1, default=str) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r, color in ((20, "tab:orange"), (40, "tab:blue")):
        ns = [n for n in zo if r in zo[n]]
        ax.errorbar(
            ns,
            [zo[n][r]["mean"] for n in ns],
            yerr=[zo[n][r]["se_seeds"] for n in ns],
            marker="o",
            color=color,
            capsize=3,
            label=f"zeroth-order, round {r}",
        )
        if ref and r in ref:
            m, se = ref[r]["mean"], ref[r]["se_seeds"]
            ax.axhline(m, color=color, ls="--", lw=1, label=f"Adam, step {r}")
            ax.axhspan(m - se, m + se, color=color, alpha=0.12)
    if ref:
        ax.axhline(ref[0]["mean"], color="grey", ls=":", lw=1, label="round 0")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("peers per round N")
    ax.set_ylabel("test accuracy (1,000 MR sentences)")
    ax.set_title("Two blocks of SmolLM2-135M: a round of N peers vs an Adam step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling")
    args = parser.parse_args()
    summary = collect()
    if not summary["zo"]:
        raise SystemExit(
            "error: no finished test rows (5 seeds) in "
            + ", ".join(str(p) for _, p in SOURCES)
            + ": run bench/scaling_rounds.sh or gpu_rounds.sh scale"
        )
    summary["n_star"] = {str(r): n_star(summary, r) for r in (20, 40)}
    render(summary, args.out)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
