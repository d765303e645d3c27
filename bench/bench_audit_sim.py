#!/usr/bin/env python
"""Cheaters caught by audits, in the simulator (`sim/audit_sim.py`), tiny model.

Experiments (pick with --experiment; each writes bench/results/audit_sim-<name>.json/.md,
and the curves as .png):

    seven      4 honest peers + 3 cheaters (sign flip, random, x3), audits on and off,
               against the 4 honest peers alone: rounds until each is banned, held-out loss
    fractions  10 peers, 1 / 2 / 3 cheaters (10% / 20% / 30%), audits on and off, and
               honest-only with lag 0 and lag 3 (the learning cost of the settled state)
    flip       10 peers, 3 of them sign-flippers (the cheat that hurts most), audits on and
               off, against the 10 honest peers alone
    honest     honest peers only, every update audited (rate 1): false accusations over
               many audited updates (target 0)

    python bench/bench_audit_sim.py --experiment seven
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.sim.audit_sim import CheatConfig, simulate_cheaters, summary_row

OUT = Path(__file__).parent / "results"


LR = 2e-3  # the simulator's tiny-model runs (bench/results/sim_results.md)


def run_config(peers: int, batch_size: int) -> RunConfig:
    return RunConfig(
        model="tiny-llama",
        dataset="synthetic-sentiment",
        lr=LR,
        n_ref=peers,
        batch_size=batch_size,
        max_length=32,
    )


def experiments(name: str, rounds: int, batch_size: int) -> list[tuple[str, CheatConfig]]:
    on = AuditSettings(enabled=True)
    if name == "seven":
        return [
            ("4 honest", CheatConfig(peers=4, rounds=rounds, run=run_config(4, batch_size))),
            *[
                (
                    f"4 honest + 3 cheaters, audits {'on' if audits else 'off'}",
                    CheatConfig(
                        peers=7,
                        cheaters=3,
                        rounds=rounds,
                        audits=audits,
                        settings=on,
                        run=run_config(7, batch_size),
                    ),
                )
                for audits in (True, False)
            ],
        ]
    if name == "fractions":
        peers = 10
        runs = [
            (
                f"{peers} honest, lag {lag}",
                CheatConfig(
                    peers=peers,
                    rounds=rounds,
                    settings=AuditSettings(enabled=True, lag=lag),
                    run=run_config(peers, batch_size),
                ),
            )
            for lag in (0, 3)
        ]
        for cheaters in (1, 2, 3):
            for audits in (True, False):
                runs.append(
                    (
                        f"{cheaters}/{peers} cheaters, audits {'on' if audits else 'off'}",
                        CheatConfig(
                            peers=peers,
                            cheaters=cheaters,
                            rounds=rounds,
                            audits=audits,
                            run=run_config(peers, batch_size),
                        ),
                    )
                )
        return runs
    if name == "flip":
        peers = 10
        return [
            (
                f"{peers} honest",
                CheatConfig(peers=peers, rounds=rounds, run=run_config(peers, batch_size)),
            ),
            *[
                (
                    f"3/{peers} sign-flippers, audits {'on' if audits else 'off'}",
                    CheatConfig(
                        peers=peers,
                        cheaters=3,
                        kinds=("sign-flip",),
                        rounds=rounds,
                        audits=audits,
                        run=run_config(peers, batch_size),
                    ),
                )
                for audits in (True, False)
            ],
        ]
    if name == "honest":
        peers = 16
        return [
            (
                "16 honest, every update audited",
                CheatConfig(
                    peers=peers,
                    rounds=rounds,
                    settings=AuditSettings(enabled=True, cpu_share=float(peers - 1)),
                    eval_every=32,
                    eval_examples=16,
                    run=run_config(peers, batch_size),
                ),
            )
        ]
    raise SystemExit(f"unknown experiment {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--experiment", default="seven", choices=("seven", "fractions", "flip", "honest")
    )
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--render-only", action="store_true", help="rewrite .md and .png from the .json")
    args = p.parse_args()
    name = f"audit_sim-{args.experiment}"
    if args.render_only:
        results = json.loads((OUT / f"{name}.json").read_text())
        (OUT / f"{name}.md").write_text(markdown(results, args))
        plot(results, OUT / f"{name}.png", args.experiment)
        return
    results = []
    for label, config in experiments(args.experiment, args.rounds, args.batch_size):
        print(f"{label}: running", flush=True)
        result = simulate_cheaters(config, progress=lambda _, record: print(record, flush=True))
        result["label"] = label
        results.append(result)
        row = summary_row(result)
        print(f"{label}: {row} ({result['seconds']:.0f} s)", flush=True)
        OUT.mkdir(exist_ok=True)
        (OUT / f"{name}.json").write_text(json.dumps(results, indent=1))
        (OUT / f"{name}.md").write_text(markdown(results, args))
        plot(results, OUT / f"{name}.png", args.experiment)


def markdown(results: list[dict], args) -> str:
    first = results[0]["config"]["run"]
    lines = [
        f"# Audits in the simulator: {args.experiment}",
        "",
        f"`python bench/bench_audit_sim.py --experiment {args.experiment} --rounds "
        f"{args.rounds} --batch-size {args.batch_size}`: {first['model']} on "
        f"{first['dataset']}, lr {first['lr']}, rank {first['rank']}, T "
        f"{first['refresh_period']}, n_ref = peers, lockstep (delay 0). Cheaters cheat every "
        "round from round 0; kinds in order sign-flip, random, scale3. Audit settings: "
        f"{results[-1]['config']['settings']}.",
        "",
        "| run | peers | cheaters | audits | lag | held-out loss (start -> end) | accuracy "
        "| banned (false) | rounds to ban | audit rate | P(audited) per update | honest "
        "updates audited | honest mismatches | audit CPU / training |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        row = summary_row(r)
        acc = row["final_accuracy"]
        lines.append(
            f"| {r['label']} | {row['peers']} | {row['cheaters']} | "
            f"{'on' if row['audits'] else 'off'} | {row['lag']} | "
            f"{r['evals'][0]['loss']:.4f} -> {row['final_loss']:.4f} | "
            f"{'-' if acc is None else f'{acc:.3f}'} | {row['banned']} ({row['false_bans']}) | "
            f"{_bans(row['rounds_to_ban'])} | {r['audit_rate']:.4f} | "
            f"{r['p_audited_per_update']:.3f} | {row['honest_audited']} | "
            f"{row['honest_mismatches']} | {row['audit_cpu_share']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _bans(rounds: dict) -> str:
    return ", ".join(f"{k}: {'-' if v is None else v}" for k, v in rounds.items()) or "-"


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if all(len(r["evals"]) < 2 for r in results):
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        x = [e["round"] for e in r["evals"]]
        style = "-" if r["config"]["audits"] or not r["config"]["cheaters"] else "--"
        ax.plot(x, [e["loss"] for e in r["evals"]], style, marker="o", ms=3, label=r["label"])
        for why in r["banned"].values():
            ax.axvline(why["round"] + 1, color="grey", alpha=0.2)
    ax.set(xlabel="round", ylabel="held-out loss", title=f"audits in the simulator: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
