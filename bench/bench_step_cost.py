#!/usr/bin/env python
"""What one peer step and one evaluation cost on SmolLM2-135M / MR (CPU, one thread):
the full model against the top blocks only (`train_only`), with and without the peer's
frozen-prefix cache (algorithm/prefix_cache.py).

    python bench/bench_step_cost.py                  # ~10 CPU-min
    python bench/bench_step_cost.py --repeats 1      # a quick look
    python bench/bench_step_cost.py --estimators     # two-point against one-sided passes

Rows, measured interleaved in one process (process CPU time, one torch thread; ratios are
side by side): a training step (`zo_step`, both forward passes) on examples never seen,
the same step on examples the cache holds (a repeat of the round), and scoring the first
`--eval-examples` test sentences the first and the second time. Writes
bench/results/step_cost.json and step_cost.md.

`--estimators`: the lever rows of bench/fzoo_rounds.sh instead (the upper blocks, k = 16,
cached, uncalibrated): the two-point step against one-sided estimates sharing one
unperturbed pass (`one_sided_passes` m, batch 16 / 8 / 4), so estimates per CPU-second are
read side by side; writes step_cost-estimators.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.algorithm.trainer import evaluate_metrics, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.workload.models import load_model
from seedflood_p2p.workload.tasks import load_run_task

RESULTS = Path(__file__).resolve().parent / "results"


def cpu(fn, *args) -> float:
    """Process CPU seconds of fn(*args)."""
    started = time.process_time()
    fn(*args)
    return time.process_time() - started


def setups(args) -> list[tuple[str, RunConfig, bool]]:
    if args.estimators:
        common = dict(model=args.model, dataset=args.task, rank=32, directions=16)
        return [
            (name, RunConfig(**common, train_only=args.top, **settings), True)
            for name, settings in (
                ("two-point, batch 16", {}),
                ("one-sided m=1, batch 16", dict(one_sided_passes=1)),
                ("one-sided m=2, batch 8", dict(one_sided_passes=2, batch_size=8)),
                ("one-sided m=4, batch 4", dict(one_sided_passes=4, batch_size=4)),
                ("one-sided m=4, batch 16", dict(one_sided_passes=4)),
            )
        ]
    common = dict(model=args.model, dataset=args.task, rank=32, calibration="content-free")
    out = []
    for k in (1, 16):
        out.append((f"full model, k={k}", RunConfig(**common, directions=k), False))
        two = RunConfig(**common, directions=k, train_only=args.top)
        out.append((f"upper blocks, k={k}, no cache", two, False))
        out.append((f"upper blocks, k={k}, cache", two, True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="mr")
    ap.add_argument("--top", default="model.layers.2[89].*", help="the upper blocks' globs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--estimators", action="store_true", help="the one-sided lever's rows")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.out = args.out or ("step_cost-estimators" if args.estimators else "step_cost")
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    rows = []
    for name, config, cached in setups(args):
        task = load_run_task(config)
        engine = make_estimator(model, config)
        cache = ExamplePrefixCache(model, engine.matrices) if cached else None
        peer = b"bench-peer"
        new, seen = [], []
        for r in range(args.repeats):
            step = (zo_step, engine, tokenizer, task, peer, r, cache)
            new.append(cpu(*step))
            seen.append(cpu(*step))  # the same batch: every example cached now
        scoring = (evaluate_metrics, model, tokenizer, task, config, args.eval_examples, cache)
        first, second = cpu(*scoring), cpu(*scoring)
        engine.close()
        row = {
            "setup": name,
            "directions": config.directions,
            "batch_size": config.batch_size,
            "one_sided_passes": config.one_sided_passes,
            "examples_per_estimate": config.batch_size
            * max(1, config.one_sided_passes)
            // config.directions,
            "train_only": config.train_only,
            "cache": cached,
            "step_new_cpu_s": statistics.median(new),
            "step_seen_cpu_s": statistics.median(seen),
            "eval_first_cpu_s": first,
            "eval_again_cpu_s": second,
            "cache_mb": round(cache.nbytes / 2**20, 1) if cache else 0.0,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(args, rows)


def write(args, rows: list[dict]) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "command": f"python bench/bench_step_cost.py --model {args.model} --task {args.task} "
        f"--top '{args.top}' --repeats {args.repeats} --eval-examples {args.eval_examples}"
        + (" --estimators" if args.estimators else ""),
        "model": args.model,
        "task": args.task,
        "threads": 1,
        "calibration": "" if args.estimators else "content-free",
        "rows": rows,
    }
    (RESULTS / f"{args.out}.json").write_text(json.dumps(meta, indent=1))
    # x: the first row of each k (the full model's step; with --estimators the two-point one)
    base = {}
    for r in rows:
        base.setdefault(r["directions"], r)
    first = base[rows[0]["directions"]]["setup"]
    batch = "batch 16, uncalibrated" if args.estimators else "batch 16 with the content-free row"
    lines = [
        f"# One peer step and one evaluation: CPU seconds ({args.model} on {args.task})",
        "",
        f"`{meta['command']}`; one torch thread, process CPU time, median of "
        f"{args.repeats} steps; {batch} unless the row says; upper blocks = "
        f"`{args.top}`. `new`: examples never seen; `seen`: the same round again (every "
        f"example cached); eval: the first {args.eval_examples} test sentences, first and "
        f"second time. x: the step of `{first}` (the first row of its k) over this row's; "
        "estimates/CPU-s: k over the step's CPU on cached examples.",
        "",
        "| setup | examples / estimate | step, new | step, seen | eval first | eval again "
        "| x new | x seen | estimates / CPU-s, seen |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = base[r["directions"]]
        lines.append(
            f"| {r['setup']} | {r.get('examples_per_estimate', '')} | "
            f"{r['step_new_cpu_s']:.2f} | {r['step_seen_cpu_s']:.2f} | "
            f"{r['eval_first_cpu_s']:.1f} | {r['eval_again_cpu_s']:.1f} | "
            f"{ref['step_new_cpu_s'] / r['step_new_cpu_s']:.2f} | "
            f"{ref['step_seen_cpu_s'] / r['step_seen_cpu_s']:.2f} | "
            f"{r['directions'] / r['step_seen_cpu_s']:.1f} |"
        )
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
