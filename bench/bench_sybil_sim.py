#!/usr/bin/env python
"""Many identities against probation, in the simulator (`sim/audit_sim.py`), tiny model.

4 honest peers (the run's founders) and 20 fresh identities of one attacker, every run
against the 4 honest peers alone (same seed):

    flip        20 identities negating their scalars from round 0
    late-flip   20 identities honest through probation, negating from round `--turn`
    random      20 identities sending others' recent scalars (honest-looking, pointing nowhere)
    honest      20 new identities that train honestly (they should simply help)
    flip+accuse the flippers also accuse an honest peer every round (all 20 vote)

each with probation off (today: audits at the production rate, every identity counts until
banned) and on (only established peers' matches make an update count). Writes
bench/results/sybil.json and sybil.md.

    python bench/bench_sybil_sim.py --rounds 40 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.sim.audit_sim import CheatConfig, simulate_cheaters

OUT = Path(__file__).parent / "results"
HONEST, SYBILS = 4, 20
ATTACKS = {
    "flip": {"kinds": ("sign-flip",)},
    "late-flip": {"kinds": ("late-flip",)},
    "random": {"kinds": ("random",)},
    "honest": {"kinds": ("honest",)},
    "flip+accuse": {"kinds": ("sign-flip",), "accuse": True},
}


def run_config(batch_size: int, seed: int) -> RunConfig:
    # n_ref 4: the run creator expects its 4 peers; each update is a step of lr / 4. The
    # seed goes into the run's salt: minibatches and directions come from (run, peer, round)
    return RunConfig(
        salt="seedflood" if seed == 0 else f"seedflood-{seed}",
        model="tiny-llama",
        dataset="synthetic-sentiment",
        lr=8e-3,
        n_ref=HONEST,
        batch_size=batch_size,
        max_length=32,
    )


def configs(args) -> list[tuple[str, str, bool, CheatConfig]]:
    # the simulator is lockstep (lag 0); cpu_share 0.1 is the production audit rate
    settings = AuditSettings(enabled=True, cpu_share=0.10, lag=0, quorum=3)
    common = dict(
        rounds=args.rounds,
        settings=settings,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        turn=args.turn,
        share=args.share,
        vouches=args.vouches,
    )
    out = []
    for seed in args.seeds:
        common["run"] = run_config(args.batch_size, seed)
        out.append(("honest only", "-", False, CheatConfig(peers=HONEST, seed=seed, **common)))
        for attack in args.attacks:
            for probation in (False, True):
                config = CheatConfig(
                    peers=HONEST + SYBILS,
                    cheaters=SYBILS,
                    probation=probation,
                    seed=seed,
                    **ATTACKS[attack],
                    **common,
                )
                out.append((attack, "on" if probation else "off", probation, config))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-examples", type=int, default=200)
    p.add_argument("--turn", type=int, default=15)
    p.add_argument("--share", type=float, default=0.25)
    p.add_argument("--vouches", type=int, default=3)
    p.add_argument("--name", default="sybil")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args()
    path = OUT / f"{args.name}.json"
    if args.render_only:
        rows = json.loads(path.read_text())
    else:
        rows = []
        for attack, probation, _, config in configs(args):
            started = time.perf_counter()
            result = simulate_cheaters(config)
            row = summarise(attack, probation, config, result)
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "evals"}), flush=True)
            OUT.mkdir(exist_ok=True)
            path.write_text(json.dumps(rows, indent=1))
            (OUT / f"{args.name}.md").write_text(markdown(rows, args))
    (OUT / f"{args.name}.md").write_text(markdown(rows, args))


def summarise(attack: str, probation: str, config: CheatConfig, result: dict) -> dict:
    sybils = sorted(result["cheaters"])
    bans = [result["banned"][s]["round"] + 1 for s in sybils if s in result["banned"]]
    est = result["established_round"]
    return {
        "attack": attack,
        "probation": probation,
        "seed": config.seed,
        "peers": config.peers,
        "final_loss": result["final"]["loss"],
        "final_accuracy": result["final"]["accuracy"],
        "evals": [(e["round"], e["loss"], e["accuracy"]) for e in result["evals"]],
        "sybil_updates_sent": result.get("sybil_updates_sent", 0),
        "sybil_updates_counted": result.get("sybil_updates_counted", 0),
        "sybil_updates_counted_at_end": result.get("sybil_updates_counted_at_end", 0),
        "sybils_banned": len(bans),
        "rounds_to_ban": [min(bans), max(bans)] if bans else None,
        "honest_banned": len(result["false_bans"]),
        "established": len(result.get("established_at_end", [])),
        "rounds_to_established": [min(est.values()) + 1, max(est.values()) + 1] if est else None,
        "first_counted": (
            [
                min(result["first_counted_round"].values()),
                max(result["first_counted_round"].values()),
            ]
            if result.get("first_counted_round")
            else None
        ),
        "probation_audits": result["counts"]["probation_audits"],
        "probation_backlog": result["counts"]["probation_backlog"],
        "audit_cpu_share": result["audit_cpu_share"],
        # honest peers' work: their audits against their own training steps
        "honest_audit_per_training": result["counts"]["audit_estimates"]
        / max(1, HONEST * config.rounds),
    }


def markdown(rows: list[dict], args) -> str:
    base = {r["seed"]: r for r in rows if r["attack"] == "honest only"}
    lines = [
        "# Many identities against probation (simulator)",
        "",
        f"`python bench/bench_sybil_sim.py --rounds {args.rounds} --seeds "
        f"{' '.join(map(str, args.seeds))}`: tiny-llama on synthetic-sentiment, lr 8e-3, "
        f"n_ref {HONEST}, batch {args.batch_size}, lockstep (lag 0), audits at cpu_share 0.1, "
        f"quorum 3; probation: the {HONEST} honest peers are founders, vouches "
        f"{args.vouches}, share {args.share} (probation audits per honest peer per round); "
        f"late-flip turns at round {args.turn}. Held-out loss on {args.eval_examples} "
        "examples; delta against the honest-only run of the same seed.",
        "",
        "| attack (20 ids) | probation | seed | held-out loss (delta) | accuracy | sybil updates "
        "counted ever / at end / sent | sybils banned (rounds) | honest banned | established "
        "(rounds) | first counted round | probation audits / backlog | honest audit CPU / "
        "training |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = base.get(r["seed"])
        delta = "" if ref is None or r is ref else f" ({r['final_loss'] - ref['final_loss']:+.4f})"
        acc = r["final_accuracy"]
        lines.append(
            f"| {r['attack']} | {r['probation']} | {r['seed']} | {r['final_loss']:.4f}{delta} | "
            f"{'-' if acc is None else f'{acc:.3f}'} | {r['sybil_updates_counted']} / "
            f"{r['sybil_updates_counted_at_end']} / {r['sybil_updates_sent']} | "
            f"{r['sybils_banned']} ({_range(r['rounds_to_ban'])}) | {r['honest_banned']} | "
            f"{r['established']} ({_range(r['rounds_to_established'])}) | "
            f"{_range(r['first_counted'])} | {r['probation_audits']} / {r['probation_backlog']} | "
            f"{r['honest_audit_per_training']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _range(pair) -> str:
    if not pair:
        return "-"
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}-{pair[1]}"


if __name__ == "__main__":
    main()
