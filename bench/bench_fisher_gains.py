"""How far apart the matrices' K-FAC curvatures are: what `basis_fisher_power` scales by.

Computes the K-FAC basis of a model's base weights with `--power` p (what a run's
publisher would ship), reads the per-matrix gains the artifact records, and reports
F_m / F_typical = gain^(1/p) (uncapped matrices) by matrix kind and by layer, with the
gains at p and the number the gain bound capped.

    python bench/bench_fisher_gains.py --model smollm2-135m --task mr --power 0.125

writes bench/results/<out>.json and .md (~4 CPU-minutes for SmolLM2's full model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(gains: dict[str, float], power: float) -> dict:
    """F_m / F_typical per matrix from its gain at `power`, grouped by the last two parts
    of its name (e.g. "mlp.down_proj") and by layer index."""
    fisher = {name: g ** (1 / power) for name, g in gains.items() if g > 0}
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_layer: dict[str, list[float]] = defaultdict(list)
    for name, f in fisher.items():
        parts = name.split(".")
        by_kind[parts[-2]].append(f)
        layer = next((p for p in parts if p.isdigit()), "-")
        by_layer[layer].append(f)

    def stats(values: list[float]) -> dict:
        return {"matrices": len(values), "geomean": geometric_mean(values),
                "min": min(values), "max": max(values)}  # fmt: skip

    return {
        "fisher_vs_typical": fisher,
        "by_kind": {k: stats(v) for k, v in sorted(by_kind.items())},
        "by_layer": {
            k: stats(v) for k, v in sorted(by_layer.items(), key=lambda kv: (len(kv[0]), kv[0]))
        },
        "gain_min": min(gains.values()),
        "gain_max": max(gains.values()),
    }


def main() -> None:
    from seedflood_p2p.algorithm.basis import MAX_GAIN, _gain
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import make_basis
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--task", default="synthetic-sentiment")
    parser.add_argument("--train-only", default="", help="as bench_rounds (default: all)")
    parser.add_argument("--train-examples", type=int, default=2400)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--power", type=float, default=0.125)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="fisher-gains")
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.power == 0:
        parser.error("--power must be nonzero (at 0 every gain is 1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_model(args.model)
    task = load_task(args.task)
    task.train = task.train[: args.train_examples]
    config = RunConfig(model=args.model, dataset=args.task, train_only=args.train_only,
                       rank=args.rank, directions=16, basis="kfac",
                       basis_fisher_power=args.power)  # fmt: skip
    engine = make_estimator(model, config)
    artifact = make_basis(engine, tokenizer, task, 0)
    gains = json.loads(artifact.meta["fisher_gains"])
    # A matrix whose directions sit at the gain bound was capped: its gain is not its
    # (F_m / F_typical)^p, so it is counted, not converted back.
    capped = [
        name
        for name, u in artifact.u.items()
        if _gain(u) * _gain(artifact.v[name]) > 0.99 * MAX_GAIN
    ]
    result = summarize({n: g for n, g in gains.items() if n not in capped}, args.power)
    result.update(
        model=args.model, task=args.task, rank=args.rank, power=args.power,
        matrices=len(gains), capped=capped, artifact_bytes=artifact.size,
        command="python " + " ".join(sys.argv), seconds=time.time() - t0,
    )  # fmt: skip
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# K-FAC curvature across matrices: {args.model}, {args.task}",
        "",
        f"`{result['command']}` ({result['seconds']:.0f} s). F_m / F_typical: the K-FAC Fisher "
        "along a +-1-length direction of each matrix against the geometric mean over the "
        f"matrices; the gain at basis_fisher_power {args.power:g} is its {args.power:g}th power "
        f"(range {result['gain_min']:.3g}-{result['gain_max']:.3g}; "
        f"{len(capped)} of {len(gains)} capped by the gain bound).",
        "",
        "Capped (their F is above what the bound lets a gain show): "
        + (", ".join(f"`{n}`" for n in capped) or "none")
        + ".",
        "",
        "| matrices | count | F / F_typical, geometric mean | min | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for group in ("by_kind", "by_layer"):
        for key, s in result[group].items():
            label = key if group == "by_kind" else f"layer {key}"
            lines.append(
                f"| {label} | {s['matrices']} | {s['geomean']:.3g} | {s['min']:.3g} | "
                f"{s['max']:.3g} |"
            )
    (out / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
