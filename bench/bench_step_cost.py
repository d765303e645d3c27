#!/usr/bin/env python
"""What one peer step and one evaluation cost on SmolLM2-135M / MR (CPU, one thread):
the full model against the top blocks only (`train_only`), with and without the peer's
frozen-prefix cache (algorithm/prefix_cache.py).

    python bench/bench_step_cost.py                  # ~10 CPU-min
    python bench/bench_step_cost.py --repeats 1      # a quick look

Rows, measured interleaved in one process (process CPU time, one torch thread; ratios are
side by side): a training step (`zo_step`, both forward passes) on examples never seen,
the same step on examples the cache holds (a repeat of the round), and scoring the first
`--eval-examples` test sentences the first and the second time. Writes
bench/results/step_cost.json and step_cost.md.
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
    ap.add_argument("--out", default="step_cost")
    args = ap.parse_args()
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
        f"--top '{args.top}' --repeats {args.repeats} --eval-examples {args.eval_examples}",
        "model": args.model,
        "task": args.task,
        "threads": 1,
        "calibration": "content-free",
        "rows": rows,
    }
    (RESULTS / f"{args.out}.json").write_text(json.dumps(meta, indent=1))
    base = {r["directions"]: r for r in rows if r["setup"].startswith("full")}
    lines = [
        f"# One peer step and one evaluation: CPU seconds ({args.model} on {args.task})",
        "",
        f"`{meta['command']}`; one torch thread, process CPU time, median of "
        f"{args.repeats} steps; batch 16 with the content-free row; upper blocks = "
        f"`{args.top}`. `new`: examples never seen; `seen`: the same round again (every "
        f"example cached); eval: the first {args.eval_examples} test sentences, first and "
        "second time. x: the full model's step on new examples over this row's.",
        "",
        "| setup | step, new | step, seen | eval first | eval again | x new | x seen |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        full = base[r["directions"]]["step_new_cpu_s"]
        lines.append(
            f"| {r['setup']} | {r['step_new_cpu_s']:.2f} | {r['step_seen_cpu_s']:.2f} | "
            f"{r['eval_first_cpu_s']:.1f} | {r['eval_again_cpu_s']:.1f} | "
            f"{full / r['step_new_cpu_s']:.1f} | {full / r['step_seen_cpu_s']:.1f} |"
        )
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
