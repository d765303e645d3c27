#!/usr/bin/env python
"""Honest audit mismatch: how far an honest recomputed update is from the claim.

Peers train in lockstep (every round's updates merged before the next round, as
`seedflood train` does). For sampled updates (p, t), claimed on W_t (base + rounds < t),
the scalars are recomputed (`audit.recompute`, the sender's own step) on:

    same state      W_t again (1 thread against the sender's 2: is it bitwise equal?)
    rolled back     W_t - (updates of rounds t-2, t-1) + (the same): W_t up to rounding
    behind 1 / 2    W_{t-1} / W_{t-2}: the auditor lacks the last 1 / 2 rounds
    ahead 1 / 2     W_{t+1} / W_{t+2}: the auditor audits 1 / 2 rounds after the claim
    demo            sender and auditor each lack an independent random half of the other
                    peers' updates of rounds t-2 and t-1 (the daemon's max_staleness = 2:
                    a round starts once every live peer published round t - 3)

and reports |claimed - recomputed| (absolute, relative to max(|c|, |r|), and relative to
the run's median |claimed|). It then scores candidate rules (`audit.AuditRule`) on the
same samples: honest false-positive rate per scenario, and the detection rate of the
three cheats (sign flip, x3, a random honest-looking scalar drawn from the run's claims)
when the auditor is in the same scenario.

    python bench/bench_audit_mismatch.py --model tiny-llama            # ~1-2 CPU-min
    python bench/bench_audit_mismatch.py --model smollm2-135m --peers 4 --rounds 9 \\
        --samples-per-round 2 --start 3                                # ~15-20 CPU-min
Writes bench/results/audit_mismatch-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from seedflood_p2p.algorithm.audit_rules import recompute, relative_error
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.algorithm.trainer import zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditRule
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

OUT = Path(__file__).parent / "results"
SCENARIOS = ("same state", "rolled back", "behind 1", "behind 2", "ahead 1", "ahead 2", "demo")
RULES = [
    AuditRule(relative=r, absolute=a)
    for r in (0.05, 0.1, 0.2, 0.3, 0.5)
    for a in (0.0, 0.01, 0.05, 0.2)
]


def snapshot(engine) -> list[torch.Tensor]:
    return [m.weight.detach().clone() for m in engine.matrices]


@torch.no_grad()
def restore(engine, saved: list[torch.Tensor]) -> None:
    for m, w in zip(engine.matrices, saved):
        m.weight.copy_(w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--dataset", default="")
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--start", type=int, default=3, help="first round sampled")
    p.add_argument("--samples-per-round", type=int, default=0, help="0: every peer")
    p.add_argument("--lr", type=float, default=0.0, help="0: demo's 3e-4 (SmolLM2), 2e-3 tiny")
    p.add_argument("--rank", type=int, default=0, help="0: demo's 32 (SmolLM2), 8 tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    smol = args.model.startswith("smollm2")
    config = RunConfig(
        model=args.model,
        dataset=args.dataset or ("mr" if smol else "synthetic-sentiment"),
        rank=args.rank or (32 if smol else 8),
        refresh_period=20,
        lr=args.lr or (3e-4 if smol else 2e-3),
        n_ref=args.peers,
    )
    sender_threads = max(2, torch.get_num_threads())
    model, tokenizer = load_model(config.model)
    task = load_task(config.dataset)
    engine = SubCGE(model, config, basis_cache=args.rounds // config.refresh_period + 3)
    live = LiveModel(engine)
    peers = [f"audit-{i}".encode() for i in range(args.peers)]
    rng = random.Random(args.seed)
    history: list[list[UpdateMessage]] = []  # per round, the messages applied
    claims: dict[tuple[int, bytes], tuple[float, ...]] = {}
    samples: list[dict] = []
    started = time.process_time()
    estimates = 0

    def estimate(message: UpdateMessage, threads: int | None = None) -> tuple[float, ...]:
        nonlocal estimates
        estimates += 1
        if threads is None:
            return recompute(engine, tokenizer, task, message)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return recompute(engine, tokenizer, task, message)
        finally:
            torch.set_num_threads(before)

    def record(scenario: str, key: tuple[int, bytes], recomputed: tuple[float, ...]) -> None:
        c = claims[key]
        samples.append(
            {
                "scenario": scenario,
                "round": key[0],
                "peer": key[1].decode(),
                "claimed": list(c),
                "recomputed": list(recomputed),
            }
        )

    for t in range(args.rounds):
        torch.set_num_threads(sender_threads)
        messages = []
        for peer in peers:
            message, _ = zo_step(engine, tokenizer, task, peer, t)
            estimates += 1
            messages.append(message)
            claims[(t, peer)] = message.scalars
        sampled = peers if not args.samples_per_round else rng.sample(peers, args.samples_per_round)
        if t >= args.start:
            saved = snapshot(engine)
            for peer in sampled:
                key = (t, peer)
                message = UpdateMessage(t, peer, claims[key])
                record("same state", key, estimate(message, threads=1))
                # W_t rebuilt as W_t - (rounds t-2, t-1) + (rounds t-2, t-1): equal up to
                # float32 rounding, as a re-checker rolling its live model back would hold
                recent_all = [m for r in history[t - 2 :] for m in r]
                live.apply([m.negated() for m in recent_all])
                live.apply(recent_all)
                record("rolled back", key, estimate(message))
                restore(engine, saved)
                for lag in (1, 2):  # auditor lacks rounds t-lag .. t-1
                    live.apply([m.negated() for r in history[t - lag :] for m in r])
                    record(f"behind {lag}", key, estimate(message))
                    restore(engine, saved)
                # demo: sender and auditor each lack a random half of others' last 2 rounds
                recent = [m for r in history[t - 2 :] for m in r if m.peer != peer]
                views = []
                for _ in range(2):
                    missing = [m for m in recent if rng.random() < 0.5]
                    live.apply([m.negated() for m in missing])
                    views.append(estimate(message))
                    restore(engine, saved)
                claims_demo = views[0]
                samples.append(
                    {
                        "scenario": "demo",
                        "round": t,
                        "peer": peer.decode(),
                        "claimed": list(claims_demo),
                        "recomputed": list(views[1]),
                    }
                )
            for lag in (1, 2):  # claims of round t - lag, recomputed now (W_t)
                for peer in sampled:
                    key = (t - lag, peer)
                    if key[0] >= args.start:
                        record(f"ahead {lag}", key, estimate(UpdateMessage(*key, claims[key])))
        live.apply(messages)
        history.append(messages)
        print(
            f"round {t}: {len(samples)} samples, {time.process_time() - started:.0f} CPU-s",
            flush=True,
        )
    cpu = time.process_time() - started
    result = summarize(samples, claims, rng)
    result.update(
        {
            "config": json.loads(config.to_json()),
            "peers": args.peers,
            "rounds": args.rounds,
            "start": args.start,
            "estimates": estimates,
            "cpu_seconds": cpu,
            "cpu_seconds_per_estimate": cpu / max(1, estimates),
            "samples": samples,
        }
    )
    name = f"audit_mismatch-{args.model}"
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    (OUT / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = np.asarray(values)
    return {
        "n": len(values),
        "p50": float(np.percentile(v, 50)),
        "p90": float(np.percentile(v, 90)),
        "p99": float(np.percentile(v, 99)),
        "max": float(v.max()),
        "exact": float(np.mean(v == 0)),
    }


def summarize(samples: list[dict], claims: dict, rng: random.Random) -> dict:
    all_claims = np.asarray([c for v in claims.values() for c in v])
    scale = float(np.median(np.abs(all_claims)))
    dist = {}
    for s in SCENARIOS:
        rows = [x for x in samples if x["scenario"] == s]
        diffs = [float(np.max(np.abs(np.subtract(x["claimed"], x["recomputed"])))) for x in rows]
        rels = [relative_error(x["claimed"], x["recomputed"]) for x in rows]
        dist[s] = {
            "absolute": percentiles(diffs),
            "relative": percentiles(rels),
            "over_median_claim": percentiles([d / scale for d in diffs]),
        }
    pool = [tuple(v) for v in claims.values()]
    rules = []
    for rule in RULES:
        row = {
            "relative": rule.relative,
            "absolute": rule.absolute,
            "false_positive": {},
            "detect": {},
        }
        for s in SCENARIOS:
            rows = [x for x in samples if x["scenario"] == s]
            if not rows:
                continue
            row["false_positive"][s] = float(
                np.mean([rule.mismatches(x["claimed"], x["recomputed"]) for x in rows])
            )
            cheats = {
                "sign flip": lambda c: tuple(-v for v in c),
                "x3": lambda c: tuple(3 * v for v in c),
                "random": lambda c: rng.choice(pool),
            }
            row["detect"][s] = {
                kind: float(
                    np.mean([rule.mismatches(f(x["claimed"]), x["recomputed"]) for x in rows])
                )
                for kind, f in cheats.items()
            }
        rules.append(row)
    return {"median_abs_claim": scale, "distribution": dist, "rules": rules}


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Honest audit mismatch: {c['model']} on {c['dataset']}",
        "",
        f"{result['peers']} peers in lockstep, {result['rounds']} rounds (sampled from round "
        f"{result['start']}), rank {c['rank']}, T {c['refresh_period']}, lr {c['lr']}, "
        f"n_ref {c['n_ref']}, k {c['directions']}, normalize {c['normalize']}. "
        f"{result['estimates']} estimates in {result['cpu_seconds']:.0f} CPU-s "
        f"({result['cpu_seconds_per_estimate']:.2f} CPU-s each). Median |claimed scalar| "
        f"{result['median_abs_claim']:.4g}. Produced by `bench/bench_audit_mismatch.py`.",
        "",
        "## |claimed - recomputed| of honest updates",
        "",
        "relative = |c - r| / max(|c|, |r|); exact = share of bitwise-equal float16 scalars.",
        "",
        "| scenario | n | abs p50 | abs p90 | abs p99 | abs max | rel p50 | rel p90 | rel p99 "
        "| rel max | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, d in result["distribution"].items():
        a, r = d["absolute"], d["relative"]
        if not a:
            continue
        lines.append(
            f"| {s} | {a['n']} | {a['p50']:.3g} | {a['p90']:.3g} | {a['p99']:.3g} | "
            f"{a['max']:.3g} | {r['p50']:.3g} | {r['p90']:.3g} | {r['p99']:.3g} | "
            f"{r['max']:.3g} | {a['exact']:.2f} |"
        )
    lines += [
        "",
        "## Candidate rules: mismatch iff |c - r| > max(absolute, relative * max(|c|, |r|))",
        "",
        "false+ = share of honest samples called a mismatch (worst scenario, and demo); "
        "detect = share of cheats caught by ONE audit in the demo scenario.",
        "",
        "| relative | absolute | false+ worst | false+ demo | detect sign flip | detect x3 "
        "| detect random |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rules"]:
        fp = row["false_positive"]
        det = row["detect"].get("demo", {})
        lines.append(
            f"| {row['relative']} | {row['absolute']} | {max(fp.values()):.4f} | "
            f"{fp.get('demo', float('nan')):.4f} | {det.get('sign flip', float('nan')):.3f} | "
            f"{det.get('x3', float('nan')):.3f} | {det.get('random', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
