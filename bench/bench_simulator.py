"""Simulator benchmark: SeedFlood versus gossip baselines, and SubCGE versus naive replay.

1. Training (tiny-llama on synthetic-sentiment, IID shards): ring and 2-D torus
   with 64 and 256 peers; SeedFlood (SubCGE), DZSGD, DSGD and centralized
   ZO-SGD for the same rounds, at per-hop delay 0 (a GossipSub flood takes
   milliseconds, a round seconds); for 64 peers on the torus also delay 1
   (one round per hop) and a 4x larger zeroth-order learning rate. Accuracy,
   loss, consensus distance and bytes per run.
2. Apply time: one round's `accumulate` + `commit` of n messages (n = 16 ...
   1024) with SubCGE and with naive replay, on tiny-llama and, when it can be
   loaded, SmolLM2-135M (naive replay only for a few messages there: one
   full-size Gaussian per message takes seconds).

Writes bench/results/sim_*.json, sim_results.md and sim_*.png.

    python bench/bench_simulator.py            # the full benchmark (~15-25 min on 2 cores)
    python bench/bench_simulator.py --quick    # a smoke run (~1 min)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.sim.config import SimConfig
from seedflood_p2p.sim.methods import FLOAT32_BYTES
from seedflood_p2p.sim.report import markdown_table, plot_runs
from seedflood_p2p.sim.simulator import simulate

RESULTS = Path(__file__).resolve().parent / "results"
ZO_LR = 2e-3  # SeedFlood, DZSGD and centralized (per round: the average moves by lr * g)
FO_LR = 3e-3  # DSGD: stable for tiny-llama on this task (0.01 oscillates)
REFERENCE_MODELS = {"SmolLM2-135M": 134.5e6, "OPT-125m": 125.2e6}


# ----------------------------------------------------------------------------- training


def training_jobs(quick: bool) -> list[tuple[str, SimConfig]]:
    """(name, config) of every training run, largest first (so two workers end together)."""
    sizes = {16: 6, 32: 6} if quick else {64: 30, 256: 16}  # peers -> rounds
    jobs = []
    for peers, rounds in sizes.items():
        common = dict(
            peers=peers,
            rounds=rounds,
            eval_every=max(rounds // 5, 1),
            eval_examples=200,
            eval_peers=4,
            fo_lr=FO_LR,
            run=RunConfig(lr=ZO_LR, n_ref=peers, batch_size=16),
        )
        jobs.append(("centralized", SimConfig(method="centralized", delay=0, **common)))
        for topology in ("ring", "torus"):
            for method in ("seedflood", "dzsgd", "dsgd"):
                jobs.append(
                    ("main", SimConfig(method=method, topology=topology, **common, delay=0))
                )
            if peers == min(sizes) and topology == "torus":  # one round per hop
                for method in ("seedflood", "dzsgd"):
                    config = SimConfig(method=method, topology=topology, delay=1, **common)
                    jobs.append(("delay1", config))
        if peers == min(sizes):  # a larger learning rate for both zeroth-order methods
            for method in ("seedflood", "dzsgd"):
                run = common["run"].replace(lr=4 * ZO_LR)
                config = SimConfig(
                    method=method, topology="torus", delay=0, **{**common, "run": run}
                )
                jobs.append(("lr", config))
    return sorted(jobs, key=lambda job: -job[1].peers * job[1].rounds)


def job_file(group: str, config: SimConfig) -> str:
    return (
        f"sim_{config.topology}_n{config.peers}_{config.method}_delay{config.delay}"
        f"_lr{config.run.lr:g}.json"
    )


def _run_one(job: tuple[str, SimConfig]) -> dict:
    group, config = job
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = simulate(config)
    result["bench_group"] = group
    print(
        f"  done {config.topology} n={config.peers} delay={config.delay} lr={config.run.lr:g} "
        f"{config.method}: loss {result['evals'][0]['loss']:.4f} -> {result['final']['loss']:.4f}"
        f", accuracy {result['final']['accuracy']:.3f}, {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return result


def run_training(jobs: list[tuple[str, SimConfig]], workers: int) -> list[dict]:
    if workers <= 1:
        return [_run_one(job) for job in jobs]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(_run_one, jobs, chunksize=1)


def _config_of(result: dict) -> SimConfig:
    body = dict(result["config"])
    body["run"] = RunConfig.from_json(json.dumps(body["run"]))
    return SimConfig(**body)


def label(result: dict) -> str:
    c = result["config"]
    return f"{c['method']} (n={c['peers']}, delay {c['delay']}, lr {c['run']['lr']:g})"


# --------------------------------------------------------------------------- apply time


def _messages(n: int, round_: int) -> list[UpdateMessage]:
    rng = np.random.default_rng(round_)
    return [
        UpdateMessage(round_, f"sim-{i}".encode(), quantize_scalars(float(rng.normal())))
        for i in range(n)
    ]


def time_apply(model, model_name: str, estimator: str, n: int, repeats: int) -> dict:
    """Seconds of accumulate + commit of n messages (one round), and its parts."""
    from seedflood_p2p.algorithm.subcge import make_estimator

    config = RunConfig(model=model_name, lr=1e-9, n_ref=n, estimator=estimator)
    engine = make_estimator(model, config)
    accumulate, commit = [], []
    for r in range(repeats + 1):
        messages = _messages(n, r)
        t0 = time.perf_counter()
        engine.accumulate(messages)
        t1 = time.perf_counter()
        engine.commit()
        t2 = time.perf_counter()
        if r:  # the first round also builds the epoch's bases: leave it out
            accumulate.append(t1 - t0)
            commit.append(t2 - t1)
    engine.close()
    total = [a + c for a, c in zip(accumulate, commit)]
    return {
        "model": model_name,
        "estimator": estimator,
        "messages": n,
        "parameters": engine.num_parameters,
        # Best of `repeats`: the machine is shared, the minimum is the least disturbed.
        "seconds": min(total),
        "accumulate_seconds": accumulate[total.index(min(total))],
        "commit_seconds": commit[total.index(min(total))],
        "median_seconds": statistics.median(total),
        "repeats": repeats,
    }


def run_apply_bench(quick: bool) -> list[dict]:
    from seedflood_p2p.workload.models import load_model

    torch.set_num_threads(1)
    counts = [16, 64] if quick else [16, 64, 256, 1024]
    rows = []
    model, _ = load_model("tiny-llama")
    for n in counts:
        rows.append(time_apply(model, "tiny-llama", "subcge", n, repeats=15))
        rows.append(time_apply(model, "tiny-llama", "naive", n, repeats=5 if n < 1024 else 2))
        print(
            f"  apply tiny-llama n={n}: subcge {rows[-2]['seconds'] * 1e3:.2f} ms, "
            f"naive {rows[-1]['seconds'] * 1e3:.1f} ms",
            flush=True,
        )
    if quick:
        return rows
    try:
        model, _ = load_model("smollm2-135m")
    except Exception as exc:  # not cached and no network: skip, and say so
        print(f"  SmolLM2-135M not available ({exc}); skipping it", flush=True)
        return rows
    for n in counts:
        rows.append(time_apply(model, "smollm2-135m", "subcge", n, repeats=2))
        print(f"  apply smollm2 n={n}: subcge {rows[-1]['seconds']:.2f} s", flush=True)
    for n in (1, 4):
        rows.append(time_apply(model, "smollm2-135m", "naive", n, repeats=1))
        print(f"  apply smollm2 n={n}: naive {rows[-1]['seconds']:.2f} s", flush=True)
    return rows


def plot_apply(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in dict.fromkeys(r["model"] for r in rows):
        for estimator, style in (("subcge", "-o"), ("naive", "--s")):
            pts = [r for r in rows if r["model"] == model and r["estimator"] == estimator]
            if pts:
                ax.plot(
                    [r["messages"] for r in pts],
                    [r["seconds"] * 1e3 for r in pts],
                    style,
                    label=f"{estimator} ({model}, {pts[0]['parameters'] / 1e6:.2f}M params)",
                )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="messages applied in one round (n)",
        ylabel="accumulate + commit (ms)",
        title="Applying one round of n messages",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ report


def _find(results: list[dict], method: str, like: dict) -> dict | None:
    """The run of `method` with the same topology, peers, delay and learning rate as `like`."""
    keys = ("topology", "peers", "delay")
    for r in results:
        c = r["config"]
        if (
            c["method"] == method
            and all(c[k] == like[k] for k in keys)
            and c["run"]["lr"] == like["run"]["lr"]
        ):
            return r
    return None


def claims(results: list[dict], apply_rows: list[dict]) -> list[str]:
    lines = []
    for r in results:
        c = r["config"]
        if c["method"] != "seedflood":
            continue
        dz, ds = _find(results, "dzsgd", c), _find(results, "dsgd", c)
        central = next(
            (
                x
                for x in results
                if x["method"] == "centralized"
                and x["config"]["peers"] == c["peers"]
                and x["config"]["run"]["lr"] == c["run"]["lr"]
            ),
            None,
        )
        where = f"{c['topology']}, n={c['peers']}, delay {c['delay']}, lr {c['run']['lr']:g}"
        sf = r["final"]
        if dz:
            better = sf["accuracy"] > dz["final"]["accuracy"]
            lower = sf["loss"] < dz["final"]["loss"]
            verdict = {
                (True, True): "holds",
                (False, False): "does NOT hold",
            }.get((better, lower), "mixed (accuracy and loss disagree)")
            lines.append(
                f"- SeedFlood vs DZSGD after {sf['round']} rounds ({where}): accuracy "
                f"{sf['accuracy']:.3f} vs {dz['final']['accuracy']:.3f}, loss {sf['loss']:.4f} vs "
                f"{dz['final']['loss']:.4f}, consensus distance "
                f"{sf['consensus']['mean_to_average']:.2e} vs "
                f"{dz['final']['consensus']['mean_to_average']:.2e}: **{verdict}**"
            )
        if central:
            lines.append(
                f"  - centralized ZO-SGD (same samples) at that point: accuracy "
                f"{central['final']['accuracy']:.3f}, loss {central['final']['loss']:.4f}"
            )
        if dz and ds:
            sf_bytes, dz_bytes, ds_bytes = (x["bytes"]["total"] for x in (r, dz, ds))
            lines.append(
                f"- Bytes ({where}): SeedFlood {sf_bytes / 1e6:.2f} MB, DZSGD "
                f"{dz_bytes / 1e6:.1f} MB ({dz_bytes / sf_bytes:.0f}x), "
                f"DSGD {ds_bytes / 1e6:.1f} MB ({ds_bytes / sf_bytes:.0f}x)"
            )
    for model in dict.fromkeys(r["model"] for r in apply_rows):
        for estimator in ("subcge", "naive"):
            pts = [r for r in apply_rows if r["model"] == model and r["estimator"] == estimator]
            if len(pts) >= 2:
                lo, hi = pts[0], pts[-1]
                growth = hi["seconds"] / lo["seconds"]
                more = hi["messages"] / lo["messages"]
                lines.append(
                    f"- Apply time, {estimator} on {model}: n={lo['messages']} "
                    f"{lo['seconds'] * 1e3:.2f} ms -> n={hi['messages']} "
                    f"{hi['seconds'] * 1e3:.2f} ms ({growth:.1f}x for {more:.0f}x the messages)"
                )
    return lines


def bytes_extrapolation(results: list[dict]) -> str:
    """Gossip bytes scale with the model size, SeedFlood's do not: the same runs at real sizes."""
    out = [
        "| run | SeedFlood total | DZSGD / DSGD total at this model size | "
        + " | ".join(f"gossip at {m} size (ratio)" for m in REFERENCE_MODELS)
        + " |",
        "|---|---|---|" + "---|" * len(REFERENCE_MODELS),
    ]
    for r in results:
        c = r["config"]
        if c["method"] != "seedflood":
            continue
        dz = _find(results, "dzsgd", c)
        if not dz:
            continue
        sf = r["bytes"]["total"]
        per_param = dz["bytes"]["total"] / dz["trainable_parameters"]
        cells = []
        for size in REFERENCE_MODELS.values():
            gossip = per_param * size
            cells.append(f"{gossip / 1e9:.0f} GB ({gossip / sf:.1e}x)")
        out.append(
            f"| {c['topology']} n={c['peers']} delay {c['delay']} lr {c['run']['lr']:g}, "
            f"{r['final']['round']} rounds | "
            f"{sf / 1e6:.2f} MB | {dz['bytes']['total'] / 1e6:.0f} MB | " + " | ".join(cells) + " |"
        )
    return "\n".join(out) + "\n"


def apply_table(rows: list[dict]) -> str:
    out = [
        "| model | estimator | messages n | accumulate + commit | accumulate | commit |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['estimator']} | {r['messages']} | {r['seconds'] * 1e3:.2f} ms | "
            f"{r['accumulate_seconds'] * 1e3:.2f} ms | {r['commit_seconds'] * 1e3:.2f} ms |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--skip-apply", action="store_true", help="reuse the apply timings already in --out"
    )
    parser.add_argument(
        "--skip-training", action="store_true", help="reuse the training runs already in --out"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    apply_path = args.out / "sim_apply_time.json"
    if args.skip_apply:  # reuse the last measurement, if any, for the report
        apply_rows = json.loads(apply_path.read_text()) if apply_path.exists() else []
    else:
        print("apply time (accumulate + commit of one round):", flush=True)
        apply_rows = run_apply_bench(args.quick)
        apply_path.write_text(json.dumps(apply_rows, indent=1))
    if apply_rows:
        plot_apply(apply_rows, args.out / "sim_apply_time.png")

    if args.skip_training:  # reuse the last runs, if any, for the report
        results = [
            json.loads(p.read_text()) for p in sorted(args.out.glob("sim_*_delay*_lr*.json"))
        ]
    else:
        jobs = training_jobs(args.quick)
        print(f"training: {len(jobs)} runs on {args.workers} workers", flush=True)
        results = run_training(jobs, args.workers)
        for result in results:
            path = args.out / job_file(result["bench_group"], _config_of(result))
            path.write_text(json.dumps(result, indent=1))
    if results:
        results.sort(
            key=lambda r: (
                r["config"]["peers"],
                r["config"]["topology"],
                r["config"]["delay"],
                r["config"]["run"]["lr"],
                r["method"],
            )
        )
        central = [r for r in results if r["bench_group"] == "centralized"]
        title = "tiny-llama, synthetic-sentiment"
        for topology in ("ring", "torus"):
            for group, suffix in (("main", "delay0"), ("delay1", "delay1")):
                runs = [
                    r
                    for r in results
                    if r["bench_group"] == group and r["config"]["topology"] == topology
                ]
                if runs:
                    plot_runs(
                        runs + central,  # centralized does not depend on the topology
                        args.out / f"sim_{topology}_{suffix}.png",
                        f"{topology}, per-hop delay {suffix[-1]} round(s): {title}",
                        label=label,
                    )
        sweep = [r for r in results if r["bench_group"] == "lr"]
        if sweep:
            sweep += [
                r
                for r in results
                if r["bench_group"] == "main"
                and r["config"]["topology"] == "torus"
                and r["config"]["peers"] == sweep[0]["config"]["peers"]
                and r["method"] in ("seedflood", "dzsgd")
            ]
            plot_runs(sweep, args.out / "sim_lr.png", f"torus, learning rates: {title}", label)

    elapsed = time.perf_counter() - started
    worker_minutes = sum(r["timing"]["total_seconds"] for r in results) / 60
    reused = ", reusing the training runs already written" if args.skip_training else ""
    if args.skip_apply:
        reused += ", reusing the apply timings already written"
    report = [
        "# Simulator benchmark",
        "",
        f"Generated by `python bench/bench_simulator.py{' --quick' if args.quick else ''}` "
        f"({elapsed / 60:.1f} min for this invocation{reused}) with torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, one torch thread per process. Training: "
        f"{len(results)} runs, {worker_minutes:.0f} min of run time in total, on "
        f"{args.workers} worker processes. The machine (2 cores) was shared with other "
        "jobs (load average 6-13 during the training runs): times are indicative.",
        "",
        f"Settings: tiny-llama ({results[0]['trainable_parameters'] if results else '?'} trainable "
        f"parameters), synthetic-sentiment, IID shards, batch 16, SubCGE rank 8, refresh 20, "
        f"ZO lr {ZO_LR} (n_ref = n for SeedFlood and centralized, 1 for DZSGD's local steps), "
        f"DSGD lr {FO_LR}; accuracy and loss are the mean over 4 evenly spaced peers' own "
        "models on 200 held-out examples. 'reference' is the model the peers converge to "
        "(SeedFlood: every message sent so far; gossip: the average model). Consensus: "
        "L2 distance of peers' trainable weights from their average. Bytes: SeedFlood counts "
        "len(encode_update) + 156 bytes GossipSub overhead per hop, gossip counts "
        f"{FLOAT32_BYTES}-byte floats of the trainable weights per neighbour per round.",
        "",
    ]
    if results:
        report += [
            "## Training",
            "",
            markdown_table(results),
            "",
            "Plots: sim_ring_delay0.png, sim_torus_delay0.png, sim_ring_delay1.png, "
            "sim_torus_delay1.png, sim_lr.png, sim_apply_time.png.",
            "",
        ]
        report += [
            "## Bytes at real model sizes (gossip bytes scale with d)",
            "",
            bytes_extrapolation(results),
            "",
        ]
    if apply_rows:
        report += ["## Apply time per round", "", apply_table(apply_rows), ""]
    report += ["## Claims", "", *claims(results, apply_rows), ""]
    (args.out / "sim_results.md").write_text("\n".join(report))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
