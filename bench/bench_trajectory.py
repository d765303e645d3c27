#!/usr/bin/env python
"""Would a step along the run's own trajectory pay? An oracle line search, measured.

A "history direction" (one of a message's k directions along the sum of the updates the
ledger already holds) is a pure function of the ledger, so it could be built. Before
building it, this asks what it could buy at best: train two blocks of SmolLM2 with
`seedflood train`'s estimator (the row given), and every 10 rounds move the weights along
D = W_now - W_then (then = the base, 10 or 5 rounds ago) by alpha in {-0.5 .. 4}, score
the loss on 256 training sentences (the last of the pool: the oracle's line search), and
the held-out accuracy at the best alpha. A real history direction would estimate that
line search from a few two-point scalars a round, so it gets at most this.

    python bench/bench_trajectory.py --peers 4          # ~10 CPU-minutes
    python bench/bench_trajectory.py --render           # the table from the JSON

Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ALPHAS = (-0.5, 0.0, 0.5, 1.0, 2.0, 4.0)
WINDOWS = (("since the base", None), ("last 10 rounds", 10), ("last 5 rounds", 5))
ROW = (
    "rank:32,directions:16,step_rule:round_mean,n_ref:16,lr:0.064,basis:kfac,basis_refresh:0,"
    "calibration:content-free"
)


def measure(args: argparse.Namespace) -> list[dict]:
    import bench_rounds as rounds_bench  # a sibling script: its folder is on sys.path

    from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import evaluate, train_local
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model("smollm2-135m")
    task = load_task("mr")
    task.train = task.train[:2400]
    _, settings = rounds_bench.parse_row("row=" + args.row)
    config = RunConfig(
        model="smollm2-135m",
        dataset="mr",
        train_only="model.layers.2[89].*",
        salt=f"bench-seed{args.seed}",  # bench_rounds' run key: the same trajectory
        **settings,
    )
    task.calibration = config.calibration
    engine = make_estimator(model, config)
    cache = ExamplePrefixCache(model, engine.matrices)
    warm_args = argparse.Namespace(eval_split="test", model="smollm2-135m", task="mr",
                                   eval_examples=1000)  # fmt: skip
    rounds_bench.warm(warm_args, cache, model, tokenizer, task, config)
    weights = [m.weight for m in engine.matrices]
    history = {0: [w.detach().clone() for w in weights]}
    probe = copy.copy(task)
    probe.test = task.train[-256:]  # evaluate() scores task.test: the line search's data
    rows: list[dict] = []

    def moved(alpha: float, delta: list[torch.Tensor], now: list[torch.Tensor], on, n: int):
        with torch.no_grad():
            for w, d, x in zip(weights, delta, now, strict=True):
                w.copy_(x + alpha * d)
        return evaluate(model, tokenizer, on, config, n, cache)

    def on_round(record) -> None:
        r = record.round + 1
        history[r] = [w.detach().clone() for w in weights]
        if r > 11:  # keep the base and the last 10 rounds: all the windows need
            history.pop(r - 11, None)
        if r % 10:
            return
        now = history[r]
        row: dict = {"round": r, "now": evaluate(model, tokenizer, task, config, 1000, cache)}
        for name, back in WINDOWS:
            delta = [x - y for x, y in zip(now, history[0 if back is None else r - back])]
            losses = {a: moved(a, delta, now, probe, 256)[0] for a in ALPHAS}
            best = min(ALPHAS, key=losses.get)
            row[name] = {"train_loss": losses, "best_alpha": best,
                         "test_at_best": moved(best, delta, now, task, 1000)}  # fmt: skip
        with torch.no_grad():
            for w, x in zip(weights, now, strict=True):
                w.copy_(x)
        rows.append(row)
        print(f"round {r}: now {row['now'][1]:.3f}, at the best alpha: "
              + ", ".join(f"{n} {row[n]['test_at_best'][1]:.3f}" for n, _ in WINDOWS),
              flush=True)  # fmt: skip

    started = time.process_time()
    train_local(engine, tokenizer, task, peers=args.peers, rounds=args.rounds,
                on_round=on_round, prefix_cache=cache)  # fmt: skip
    print(f"{time.process_time() - started:.0f} CPU-s")
    return rows


def render(data: dict) -> str:
    lines = [
        f"# An oracle line search along the trajectory: two blocks, N = {data['peers']}, "
        f"seed {data['seed']}",
        "",
        f"Command: `{data['command']}`. Row: `{data['row']}`.",
        "Each cell: held-out accuracy (1,000 test sentences) with the weights moved to "
        "W_now + alpha x (W_now - W_then), alpha in "
        f"{list(ALPHAS)} picked by the loss on 256 training sentences; in brackets alpha and "
        "the training-loss change it bought.",
        "",
        "| round | as trained | " + " | ".join(n for n, _ in WINDOWS) + " |",
        "|---:|---:|" + "---:|" * len(WINDOWS),
    ]
    for row in data["rows"]:
        cells = []
        for name, _ in WINDOWS:
            cell = row[name]
            losses = {float(a): v for a, v in cell["train_loss"].items()}
            gain = losses[float(cell["best_alpha"])] - losses[0.0]
            cells.append(f"{cell['test_at_best'][1]:.3f} ({cell['best_alpha']:g}, {gain:+.4f})")
        lines.append(f"| {row['round']} | {row['now'][1]:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--row", default=ROW, help="bench_rounds' key:value settings")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--render", action="store_true", help="only rewrite the .md")
    parser.add_argument("--out", default="trajectory-n4")
    args = parser.parse_args()
    path = ROOT / "bench" / "results" / f"{args.out}.json"
    if args.render:
        data = json.loads(path.read_text())
    else:
        data = {"peers": args.peers, "seed": args.seed, "row": args.row,
                "command": "python " + " ".join(sys.argv), "rows": measure(args)}  # fmt: skip
        path.write_text(json.dumps(data, indent=1))
    path.with_suffix(".md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
