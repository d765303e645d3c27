"""How far one identity can push the model, with the scalars applied as sent (`normalize =
"none"`, bounded by `clip` only) or scaled to one honest step by every receiver (`"unit"`).

    python bench/bench_normalize.py [--seeds 8] [--rounds 200]

In one process (the estimator, step and apply of `seedflood train`), 4 honest tiny-model
peers train on synthetic sentiment for ROUNDS rounds; in the `attacker` rows a fifth
identity takes part in every round (one update per round, which is what the admission
rules allow an identity that audits have not caught yet): it estimates on its own
direction like an honest peer and then sends the opposite sign at the largest size the
run accepts (`clip`), i.e. gradient ascent at full strength. Recorded per seed: the
held-out loss and accuracy on all 400 test examples after the last round; per row, the
mean +- standard error over seeds, and the attacker's paired effect (same seed, same
honest peers). Writes bench/results/normalize.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.algorithm.trainer import evaluate, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(model="tiny-llama", rank=4, refresh_period=5, batch_size=8, n_ref=4)
ROWS = {  # name: (normalize, lr); "unit" steps are ~1/2.3 of "none" steps at equal lr
    "none lr 2e-3": ("none", 2e-3),
    "none lr 4e-3": ("none", 4e-3),
    "unit lr 8e-3": ("unit", 8e-3),
    "unit lr 1.6e-2": ("unit", 1.6e-2),
}
HONEST = [f"honest-{i}".encode() for i in range(4)]
ATTACKER = b"attacker"


def train(normalize: str, lr: float, seed: int, rounds: int, attacker: bool) -> dict:
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = RunConfig(**BASE, normalize=normalize, lr=lr, salt=f"normalize-bench-{seed}")
    engine = make_estimator(model, config)
    live = LiveModel(engine)
    for round_ in range(rounds):
        messages = [zo_step(engine, tokenizer, task, peer, round_)[0] for peer in HONEST]
        if attacker:  # ascent along its own direction, as large as the run accepts
            honest_estimate, _ = zo_step(engine, tokenizer, task, ATTACKER, round_)
            g = honest_estimate.scalars
            hostile = tuple(-math.copysign(config.clip, x) for x in g)
            messages.append(UpdateMessage(round_, ATTACKER, quantize_scalars(hostile)))
        live.apply(messages)
    loss, accuracy = evaluate(model, tokenizer, task, config, len(task.test))
    engine.close()
    return {"loss": loss, "accuracy": accuracy, "finite": math.isfinite(loss)}


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0] if values else float("nan")), float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--name", default="normalize")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started, load_start = time.time(), os.getloadavg()
    runs = []
    for name, (normalize, lr) in ROWS.items():
        for attacker in (False, True):
            for seed in range(args.seeds):
                t0 = time.time()
                r = train(normalize, lr, seed, args.rounds, attacker)
                r.update(row=name, attacker=attacker, seed=seed, seconds=round(time.time() - t0))
                runs.append(r)
                print(json.dumps(r), flush=True)
    summary = []
    for name in ROWS:
        row = {"row": name}
        for attacker in (False, True):
            mine = sorted(
                (r for r in runs if r["row"] == name and r["attacker"] == attacker),
                key=lambda r: r["seed"],
            )
            key = "attacker" if attacker else "honest"
            row[key + "_loss"] = mean_se([r["loss"] for r in mine])
            row[key + "_accuracy"] = mean_se([r["accuracy"] for r in mine])
        pairs = [
            (a["loss"] - h["loss"])
            for h in runs
            for a in runs
            if h["row"] == a["row"] == name
            and not h["attacker"]
            and a["attacker"]
            and h["seed"] == a["seed"]
        ]
        row["attacker_effect_on_loss"] = mean_se(pairs)
        summary.append(row)
    result = {
        "command": "python bench/bench_normalize.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.time() - started),
        "seeds": args.seeds,
        "rounds": args.rounds,
        "base": BASE,
        "runs": runs,
        "summary": summary,
    }
    out = ROOT / "bench" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


def _pm(pair: tuple[float, float], digits: int = 4) -> str:
    mean, se = pair
    if math.isnan(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} +- {se:.{digits}f}"


def markdown(result: dict) -> str:
    lines = [
        "# One identity's push: scalars as sent vs scaled by every receiver",
        "",
        f"`{result['command']}`, {result['date']}, {result['machine']}; load average "
        f"{'/'.join(f'{x:.2f}' for x in result['loadavg_start'])} at start; "
        f"{result['wall_s']} s in all.",
        "",
        f"4 honest tiny-model peers, synthetic sentiment, {result['rounds']} rounds "
        f"(settings {result['base']}); `attacker`: a fifth identity in every round that "
        "sends minus the sign of its own honest estimate at the largest accepted size "
        "(`clip` = 100). Held-out loss and accuracy on all 400 test examples after the last "
        f"round, mean +- SE over {result['seeds']} seeds; the attacker's effect is the "
        "paired difference (same seed, same honest peers).",
        "",
        "| row | honest loss | honest accuracy | with attacker: loss | with attacker: "
        "accuracy | attacker's effect on loss |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        lines.append(
            f"| {row['row']} | {_pm(row['honest_loss'])} | {_pm(row['honest_accuracy'], 3)} | "
            f"{_pm(row['attacker_loss'])} | {_pm(row['attacker_accuracy'], 3)} | "
            f"{_pm(row['attacker_effect_on_loss'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
