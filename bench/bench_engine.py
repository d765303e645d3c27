#!/usr/bin/env python
"""Engine benchmark: SubCGE versus naive seed replay on SmolLM2-135M (CPU).

    python bench/bench_engine.py            # the full benchmark (about 30-40 min of CPU)
    python bench/bench_engine.py --quick    # a smoke run of every part (a few minutes)
    python bench/bench_engine.py --full     # also measure naive replay at n = 256 and 1024

Writes bench/results/engine.json, engine.md, engine_apply.png and engine_learning.png
(`--quick` writes engine-quick.* so it never overwrites a full run).

Parts, each one function below:
1. bench_apply:    cost of applying one round of n messages (SubCGE warm/cold vs naive).
2. bench_step:     one SubCGE step (zo_step, two perturbed forwards) over one plain forward.
3. bench_memory:   peak RSS increase of a training step over an inference forward
                   (separate child processes, see child_memory).
4. bench_learning: MR accuracy, zero-shot versus a fixed budget of SubCGE and naive steps,
                   after a short learning-rate / rank / refresh-period sweep.

Every timing records wall time and process CPU time. The machine this was written on
is shared (other jobs keep the load average well above its 2 cores), so wall times
are inflated by waiting for a core; with one torch thread, CPU time is close to what
the same work takes on an idle core. Both are reported; ratios are measured side by
side, interleaved, in the same process.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from seedflood_p2p.algorithm.objective import batch_loss, label_word_logits
from seedflood_p2p.algorithm.subcge import NaiveSeedReplay, SubCGE, make_estimator
from seedflood_p2p.algorithm.trainer import batch_seed, train_local, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.workload.batching import Batcher, make_batch, sample_batch
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

MODEL = "smollm2-135m"
TASK = "mr"
RESULTS = Path(__file__).resolve().parent / "results"
GAIN = 0.05  # "a real accuracy gain": +5 points on 500 examples (> 2 standard errors)

# What each mode runs. The learning-rate grid comes from an exploration on this
# machine (40 rounds, batch 16, r=8, T=20: lr 1e-5 and 3e-5 barely moved, 1e-4 and
# 3e-4 both reached 0.64 validation accuracy from 0.45, 1e-3 was unstable; batch 8
# learned slower per round and was no better per CPU second). A 15-round sweep
# picked lr 3e-4, which then drifted back to zero-shot accuracy by round 60: the
# sweep runs 30 rounds, with a checkpoint every 15.
PLANS = {
    "quick": dict(
        apply_sizes=[1, 16, 64],
        naive_measured=[1, 2],
        apply_repeats=2,
        step_repeats=2,
        memory_repeats=1,
        report_examples=64,
        val_examples=32,
        sweep_rounds=2,
        subcge_lrs=[1e-5],
        subcge_shapes=[(8, 10)],
        naive_lrs=[1e-5],
        final_rounds=3,
        checkpoint_every=3,
    ),
    "default": dict(
        apply_sizes=[1, 16, 64, 256, 1024],
        naive_measured=[1, 16, 64],
        apply_repeats=5,
        step_repeats=7,
        memory_repeats=2,
        report_examples=500,
        val_examples=200,
        sweep_rounds=30,
        subcge_lrs=[1e-4, 3e-4],
        subcge_shapes=[(8, 20), (8, 10), (8, 50), (32, 20)],
        naive_lrs=[1e-4, 3e-4],
        final_rounds=60,
        checkpoint_every=15,
    ),
}


# ----------------------------------------------------------------------------- helpers


class Timer:
    """Wall time (perf_counter) and CPU time of this process (process_time)."""

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def median(values) -> float:
    return float(statistics.median(values))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def restore(model, saved: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.copy_(saved[name])


def config(**changes) -> RunConfig:
    """The default RunConfig on SmolLM2 / MR, with `changes`."""
    return RunConfig(model=MODEL, dataset=TASK, **changes)


def messages(n: int, round_: int, seed: int = 0) -> list[UpdateMessage]:
    """n messages of one round from distinct peers, with projected gradients of size ~5."""
    rng = np.random.default_rng(seed + round_)
    return [
        UpdateMessage(
            round_, f"peer-{i:05d}".encode(), quantize_scalars(5.0 * rng.standard_normal())
        )
        for i in range(n)
    ]


def machine_state() -> dict:
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "time": time.strftime("%H:%M:%S")}


def log(text: str) -> None:
    print(f"[bench_engine {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- 1. apply cost


def bench_apply(model, plan: dict) -> dict:
    """Cost of applying one round of n messages: SubCGE (warm and cold) versus naive replay.

    Cold: the round belongs to an epoch whose bases are not cached, so the time includes
    generating them. Warm: the epoch's bases are already cached (every round of an epoch
    but its first). Naive replay regenerates a full-size Gaussian per message: measured
    directly for `naive_measured`, extrapolated linearly (through the origin) beyond.
    """
    cfg = config()
    saved = snapshot(model)
    result: dict = {"rank": cfg.rank, "refresh_period": cfg.refresh_period, "rows": []}

    engine = SubCGE(model, cfg)
    basis_times = []
    fresh_epoch = iter(range(1000, 10**6))
    engine.accumulate(messages(4, next(fresh_epoch) * cfg.refresh_period))  # untimed warm-up
    engine.commit()
    rows = {}
    for n in plan["apply_sizes"]:
        warm, cold, acc, com = [], [], [], []
        for _ in range(plan["apply_repeats"]):
            epoch = next(fresh_epoch)
            msgs = messages(n, epoch * cfg.refresh_period)
            with Timer() as t:
                engine.accumulate(msgs)
                engine.commit()
            cold.append(t)
            msgs = messages(n, epoch * cfg.refresh_period + 1)  # same epoch: bases cached
            with Timer() as t_acc:
                engine.accumulate(msgs)
            with Timer() as t_com:
                engine.commit()
            warm.append((t_acc.wall + t_com.wall, t_acc.cpu + t_com.cpu))
            acc.append(t_acc)
            com.append(t_com)
        with Timer() as t:
            engine.basis(next(fresh_epoch))
        basis_times.append(t)
        rows[n] = {
            "n": n,
            "subcge_warm_s": median(w for w, _ in warm),
            "subcge_warm_cpu_s": median(c for _, c in warm),
            "subcge_cold_s": median(t.wall for t in cold),
            "subcge_cold_cpu_s": median(t.cpu for t in cold),
            "subcge_accumulate_s": median(t.wall for t in acc),
            "subcge_commit_s": median(t.wall for t in com),
        }
        log(
            f"apply n={n}: SubCGE warm {rows[n]['subcge_warm_s']:.3f} s, "
            f"cold {rows[n]['subcge_cold_s']:.3f} s"
        )
    engine.close()
    result["basis_generation_s"] = median(t.wall for t in basis_times)
    result["basis_generation_cpu_s"] = median(t.cpu for t in basis_times)

    naive = NaiveSeedReplay(model, cfg)
    measured = {}
    for n in plan["naive_measured"]:
        msgs = messages(n, 7)
        with Timer() as t:
            naive.accumulate(msgs)
            naive.commit()
        measured[n] = t
        log(f"apply n={n}: naive {t.wall:.1f} s ({t.wall / n:.2f} s per message)")
    naive.close()
    ns = np.array(list(measured), dtype=float)
    per_message = float(ns @ [measured[n].wall for n in measured] / (ns @ ns))
    per_message_cpu = float(ns @ [measured[n].cpu for n in measured] / (ns @ ns))
    result["naive_seconds_per_message"] = per_message
    result["naive_cpu_seconds_per_message"] = per_message_cpu

    for n in plan["apply_sizes"]:
        row = rows[n]
        if n in measured:
            row.update(
                naive_s=measured[n].wall, naive_cpu_s=measured[n].cpu, naive_extrapolated=False
            )
        else:
            row.update(
                naive_s=per_message * n, naive_cpu_s=per_message_cpu * n, naive_extrapolated=True
            )
        row["naive_over_subcge_warm"] = row["naive_s"] / row["subcge_warm_s"]
        row["naive_over_subcge_cold"] = row["naive_s"] / row["subcge_cold_s"]
        row["naive_over_subcge_warm_cpu"] = row["naive_cpu_s"] / row["subcge_warm_cpu_s"]
        result["rows"].append(row)

    first, last = rows[min(rows)], rows[max(rows)]
    result["subcge_largest_over_n1_warm"] = last["subcge_warm_s"] / first["subcge_warm_s"]
    result["subcge_largest_over_n1_cold"] = last["subcge_cold_s"] / first["subcge_cold_s"]
    result["subcge_largest_over_n1_warm_cpu"] = (
        last["subcge_warm_cpu_s"] / first["subcge_warm_cpu_s"]
    )
    if 256 in rows:
        result["naive_over_subcge_at_256_warm"] = rows[256]["naive_over_subcge_warm"]
        result["naive_over_subcge_at_256_cold"] = rows[256]["naive_over_subcge_cold"]
    restore(model, saved)
    return result


# ----------------------------------------------------------- 2. step versus forward


def bench_step(model, tokenizer, task, plan: dict) -> dict:
    """zo_step (two perturbed forwards on its batch) over one plain forward of that batch.

    Both build the batch from the examples (tokenizing is ~1% of a forward). The order
    alternates each repeat (F Z, Z F, ...); one untimed warm-up of each comes first.
    """
    cfg = config()
    engine = SubCGE(model, cfg)
    peer = b"bench-step"

    def forward(round_: int) -> int:
        examples = sample_batch(task, batch_seed(cfg.run_key, peer, round_), cfg.batch_size)
        batch = make_batch(examples, tokenizer, task, cfg.max_length)
        batch_loss(model, batch, task.kind)
        return int(batch["input_ids"].shape[1])

    forward(0)
    zo_step(engine, tokenizer, task, peer, 0)
    fwd, zo, widths = [], [], []
    for round_ in range(1, plan["step_repeats"] + 1):
        for which in "fz" if round_ % 2 else "zf":
            with Timer() as t:
                if which == "f":
                    widths.append(forward(round_))
                else:
                    zo_step(engine, tokenizer, task, peer, round_)
            (fwd if which == "f" else zo).append(t)
    engine.close()
    result = {
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "padded_widths": widths,
        "repeats": len(fwd),
        "forward_s": median(t.wall for t in fwd),
        "forward_cpu_s": median(t.cpu for t in fwd),
        "zo_step_s": median(t.wall for t in zo),
        "zo_step_cpu_s": median(t.cpu for t in zo),
        "ratio_of_medians": median(t.wall for t in zo) / median(t.wall for t in fwd),
        "ratio_of_medians_cpu": median(t.cpu for t in zo) / median(t.cpu for t in fwd),
        "median_pair_ratio": median(z.wall / f.wall for z, f in zip(zo, fwd)),
        "median_pair_ratio_cpu": median(z.cpu / f.cpu for z, f in zip(zo, fwd)),
    }
    log(
        f"step: forward {result['forward_cpu_s']:.2f} s cpu, zo_step "
        f"{result['zo_step_cpu_s']:.2f} s cpu, ratio {result['ratio_of_medians_cpu']:.2f} "
        f"(wall {result['ratio_of_medians']:.2f})"
    )
    return result


# ---------------------------------------------------------------------- 3. memory


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def child_memory(mode: str, threads: int) -> None:
    """In a fresh process: load, then run one `mode` and print the RSS figures as JSON.

    The baseline is the resident set after loading the model and data, reading every
    weight once (safetensors loads them memory-mapped, so untouched pages would
    otherwise be counted in the first operation's peak), gc and malloc_trim. The peak
    is the kernel's high-water mark VmHWM, reset just before the operation by writing
    5 to /proc/self/clear_refs, so the loading peak does not hide it. Falls back to
    ru_maxrss (which then includes the loading peak) if the reset is not allowed.
    """
    torch.set_num_threads(threads)
    model, tokenizer = load_model(MODEL)
    task = load_task(TASK)
    cfg = config(estimator="naive" if mode == "naive_step" else "subcge")
    engine = make_estimator(model, cfg) if mode != "forward" else None
    peer = b"bench-memory"
    with torch.no_grad():  # page in weights that loading left memory-mapped
        for tensor in list(model.parameters()) + list(model.buffers()):
            float(tensor.float().sum())
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    baseline = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    with Timer() as t:
        if mode == "forward":
            examples = sample_batch(task, batch_seed(cfg.run_key, peer, 0), cfg.batch_size)
            batch_loss(model, make_batch(examples, tokenizer, task, cfg.max_length), task.kind)
        else:
            zo_step(engine, tokenizer, task, peer, 0)
    import resource

    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "mode": mode,
                "baseline_kib": baseline,
                "peak_kib": peak,
                "increase_kib": peak - baseline,
                "hwm_reset": reset,
                "seconds": t.wall,
            }
        )
    )


def bench_memory(plan: dict, threads: int) -> dict:
    """Peak RSS increase of one training step over one inference forward (child processes)."""
    modes = ["forward", "subcge_step", "naive_step"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(plan["memory_repeats"]):
        for mode in modes:
            if mode == "naive_step" and rep > 0:  # context only: one child is enough
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--child-memory", mode, "--threads", str(threads)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(
                f"memory {mode}: +{runs[mode][-1]['increase_kib'] / 1024:.0f} MiB over "
                f"{runs[mode][-1]['baseline_kib'] / 1024:.0f} MiB"
            )
    summary = {}
    for mode in modes:
        summary[mode] = {
            "baseline_mib": median(r["baseline_kib"] for r in runs[mode]) / 1024,
            "peak_mib": median(r["peak_kib"] for r in runs[mode]) / 1024,
            "increase_mib": median(r["increase_kib"] for r in runs[mode]) / 1024,
            "hwm_reset": all(r["hwm_reset"] for r in runs[mode]),
        }
    fwd = summary["forward"]
    for mode in ("subcge_step", "naive_step"):
        summary[mode]["increase_over_forward"] = summary[mode]["increase_mib"] / fwd["increase_mib"]
        summary[mode]["peak_over_forward"] = summary[mode]["peak_mib"] / fwd["peak_mib"]
    return {"runs": runs, "summary": summary}


# --------------------------------------------------------------------- 4. learning


@torch.no_grad()
def evaluate_examples(model, tokenizer, task, examples, max_length: int) -> dict:
    """Loss and accuracy on `examples`, batched by length (less padding than
    trainer.evaluate; right padding does not change the scored positions)."""
    batcher = Batcher(task, tokenizer, max_length)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].text))
    correct = [0] * len(examples)
    total_loss = 0.0
    with Timer() as t:
        for start in range(0, len(order), 32):
            index = order[start : start + 32]
            chunk = [examples[i] for i in index]
            batch = batcher(chunk)
            logits = label_word_logits(model, batch)
            total_loss += float(
                torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
            )
            for i, ok in zip(index, (logits.argmax(-1) == batch["labels"]).tolist()):
                correct[i] = int(ok)
    return {
        "loss": total_loss / len(examples),
        "accuracy": sum(correct) / len(examples),
        "correct": correct,
        "seconds": t.wall,
        "cpu_seconds": t.cpu,
    }


class _ResumeAt:
    """Stands in for a Ledger so that train_local starts at `round_` (stores nothing).

    train_local always starts at round 0 without a ledger; this lets the final run
    continue the best sweep run instead of repeating its first rounds.
    """

    def __init__(self, round_: int) -> None:
        self.round_ = round_

    def max_round(self) -> int:
        return self.round_ - 1

    def add(self, messages) -> None:
        pass


def train_and_evaluate(
    model, tokenizer, task, cfg: RunConfig, val: list, start: int, rounds: int, every: int
) -> dict:
    """Train rounds [start, rounds) of `cfg` on the model as it is (train_local, 1 peer),
    evaluating `val` every `every` rounds and at the end. Training time excludes those
    evaluations. A non-finite projected gradient ends the run as "diverged"."""
    engine = make_estimator(model, cfg)
    curve, train_losses = [], []
    eval_cpu = [0.0]

    def on_round(record) -> None:
        train_losses.append(record.train_loss)
        done = record.round + 1
        if done % every == 0 or done == rounds:
            ev = evaluate_examples(model, tokenizer, task, val, cfg.max_length)
            eval_cpu[0] += ev["cpu_seconds"]
            curve.append({"round": done, "val_loss": ev["loss"], "val_accuracy": ev["accuracy"]})
            log(
                f"  {cfg.estimator} r={cfg.rank} T={cfg.refresh_period} lr={cfg.lr:g} "
                f"round {done}: val acc {ev['accuracy']:.3f} loss {ev['loss']:.3f}"
            )

    status, records = "ok", []
    with Timer() as t:
        try:
            records = train_local(
                engine,
                tokenizer,
                task,
                peers=1,
                rounds=rounds,
                on_round=on_round,
                ledger=_ResumeAt(start) if start else None,
            )
        except FloatingPointError as exc:
            status = f"diverged: {exc}"
    engine.close()
    return {
        "estimator": cfg.estimator,
        "rank": cfg.rank,
        "refresh_period": cfg.refresh_period,
        "lr": cfg.lr,
        "eps": cfg.eps,
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "rounds": rounds,
        "status": status,
        "train_seconds": sum(r.seconds for r in records),
        "train_cpu_seconds": t.cpu - eval_cpu[0],
        "rounds_run": len(records),
        "train_losses": train_losses,
        "curve": curve,
    }


def _summarise(run: dict) -> dict:
    done = max(1, run["rounds_run"])
    ok = run["status"] == "ok" and run["curve"]
    run["seconds_per_round"] = run["train_seconds"] / done
    run["cpu_seconds_per_round"] = run["train_cpu_seconds"] / done
    run["final_val_loss"] = run["curve"][-1]["val_loss"] if ok else float("inf")
    run["final_val_accuracy"] = run["curve"][-1]["val_accuracy"] if ok else 0.0
    return run


def bench_learning(model, tokenizer, task, plan: dict) -> dict:
    """Zero-shot MR accuracy versus a fixed budget of SubCGE and naive steps.

    Held-out sets: the first `report_examples` test sentences for the reported
    accuracies; the next `val_examples` (validation) for choosing settings and for the
    learning curves. Sweep: `sweep_rounds` rounds per setting from the base weights;
    SubCGE's lr at the first (rank, T), then the other (rank, T) at the best lr; the
    naive estimator's lrs. The best setting (lowest validation loss: after a short
    budget it separates settings better than accuracy on a few hundred sentences) of
    each estimator is then continued to `final_rounds`, so both get the same budget.
    """
    saved = snapshot(model)
    base = config()
    report = task.test[: plan["report_examples"]]
    val = task.test[plan["report_examples"] : plan["report_examples"] + plan["val_examples"]]
    zero_report = evaluate_examples(model, tokenizer, task, report, base.max_length)
    zero_val = evaluate_examples(model, tokenizer, task, val, base.max_length)
    log(f"zero-shot: report acc {zero_report['accuracy']:.3f}, val acc {zero_val['accuracy']:.3f}")
    S, N, every = plan["sweep_rounds"], plan["final_rounds"], plan["checkpoint_every"]
    best: dict[str, tuple[dict, dict]] = {}  # estimator -> (run, weights after it)

    def sweep_run(cfg: RunConfig) -> dict:
        restore(model, saved)
        run = _summarise(train_and_evaluate(model, tokenizer, task, cfg, val, 0, S, every))
        run["config"] = cfg
        current = best.get(cfg.estimator)
        if current is None or run["final_val_loss"] < current[0]["final_val_loss"]:
            best[cfg.estimator] = (run, snapshot(model))
        return run

    r0, t0 = plan["subcge_shapes"][0]
    sweep = [sweep_run(config(rank=r0, refresh_period=t0, lr=lr)) for lr in plan["subcge_lrs"]]
    best_lr = best["subcge"][0]["lr"]
    sweep += [
        sweep_run(config(rank=r, refresh_period=t, lr=best_lr))
        for r, t in plan["subcge_shapes"][1:]
    ]
    naive_sweep = [sweep_run(config(estimator="naive", lr=lr)) for lr in plan["naive_lrs"]]

    finals = {}
    for name in ("subcge", "naive"):
        first, weights = best[name]
        cfg = first.pop("config")
        restore(model, weights)
        rest = train_and_evaluate(model, tokenizer, task, cfg, val, S, N, every)
        final = dict(first)
        final.update(
            rounds=N,
            status=rest["status"],
            train_seconds=first["train_seconds"] + rest["train_seconds"],
            train_cpu_seconds=first["train_cpu_seconds"] + rest["train_cpu_seconds"],
            rounds_run=first["rounds_run"] + rest["rounds_run"],
            train_losses=first["train_losses"] + rest["train_losses"],
            curve=first["curve"] + rest["curve"],
        )
        _summarise(final)
        ev = evaluate_examples(model, tokenizer, task, report, cfg.max_length)
        final["report_accuracy"] = ev["accuracy"]
        final["report_loss"] = ev["loss"]
        final["report_gain"] = ev["accuracy"] - zero_report["accuracy"]
        # Paired with zero-shot on the same sentences.
        final["flips_vs_zero_shot"] = {
            "now_right": sum(a > b for a, b in zip(ev["correct"], zero_report["correct"])),
            "now_wrong": sum(a < b for a, b in zip(ev["correct"], zero_report["correct"])),
        }
        finals[name] = final
        log(
            f"final {name}: report acc {ev['accuracy']:.3f} (zero-shot "
            f"{zero_report['accuracy']:.3f}) after {N} rounds, "
            f"{final['cpu_seconds_per_round']:.1f} CPU s/round"
        )
    for run in sweep + naive_sweep:
        run.pop("config", None)
    restore(model, saved)
    return {
        "report_examples": len(report),
        "val_examples": len(val),
        "zero_shot": {
            "report_accuracy": zero_report["accuracy"],
            "report_loss": zero_report["loss"],
            "val_accuracy": zero_val["accuracy"],
            "val_loss": zero_val["loss"],
            "report_eval_seconds": zero_report["seconds"],
            "report_eval_cpu_seconds": zero_report["cpu_seconds"],
        },
        "sweep_rounds": S,
        "subcge_sweep": sweep,
        "naive_sweep": naive_sweep,
        "final": finals,
        "gain_threshold": GAIN,
    }


def sustained_gain_round(curve: list[dict], zero: float, gain: float = GAIN) -> int | None:
    """First checkpoint from which validation accuracy stays >= zero-shot + gain."""
    first = None
    for c in curve:
        if c["val_accuracy"] - zero >= gain:
            first = c["round"] if first is None else first
        else:
            first = None
    return first


# ------------------------------------------------------------------------- output


def plot_apply(apply: dict, params: int, path: Path) -> None:
    """Apply time against n, log-log: wall time (left) and CPU time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = apply["rows"]
    n = [r["n"] for r in rows]
    meas = [r for r in rows if not r["naive_extrapolated"]]
    extra = meas[-1:] + [r for r in rows if r["naive_extrapolated"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharex=True)
    for ax, cpu in zip(axes, (False, True)):
        key = "_cpu_s" if cpu else "_s"
        ax.plot(n, [r["subcge_warm" + key] for r in rows], "o-", label="SubCGE, bases cached")
        ax.plot(n, [r["subcge_cold" + key] for r in rows], "s--", label="SubCGE, new epoch")
        ax.plot(
            [r["n"] for r in meas],
            [r["naive" + key] for r in meas],
            "^-",
            color="C3",
            label="naive seed replay (measured)",
        )
        if len(extra) > 1:
            ax.plot(
                [r["n"] for r in extra],
                [r["naive" + key] for r in extra],
                "^:",
                color="C3",
                mfc="none",
                label="naive seed replay (extrapolated)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("messages applied in one round (n)")
        ax.set_ylabel(f"{'CPU' if cpu else 'wall'} time to apply one round (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M ({params / 1e6:.1f}M trainable), rank {apply['rank']}, "
        "1 CPU thread; wall time includes waiting on a shared machine"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_learning(learning: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    zero = learning["zero_shot"]["val_accuracy"]
    for name, res in learning["final"].items():
        xs = [0] + [c["round"] for c in res["curve"]]
        ys = [zero] + [c["val_accuracy"] for c in res["curve"]]
        ax.plot(
            xs,
            ys,
            "o-",
            label=f"{name} (r={res['rank']}, T={res['refresh_period']}, lr={res['lr']:g})"
            if name == "subcge"
            else f"{name} (lr={res['lr']:g})",
        )
    ax.axhline(zero, color="gray", ls=":", label="zero-shot")
    ax.set_xlabel(f"round (1 peer, batch {learning['final']['subcge']['batch_size']})")
    ax.set_ylabel(f"validation accuracy ({learning['val_examples']} MR sentences)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.2f}"
    return f"{x:.4f}"


def write_markdown(res: dict, path: Path) -> None:
    env = res["environment"]
    flags = (" --quick" if res["mode"] == "quick" else "") + (" --full" if res["full"] else "")
    lines = [
        "# Engine benchmark: SubCGE vs naive seed replay (SmolLM2-135M, CPU)",
        "",
        f"Generated by `python bench/bench_engine.py{flags}` on {env['date']}, total "
        f"{res['total_minutes']:.1f} min wall. torch {env['torch']}, {env['cpus']} CPUs "
        f"({env['cpu_model']}), "
        f"{env['threads']} torch thread(s). Load average (1 min) at start / end: "
        f"{env['load_start']['loadavg_1m']} / {env['load_end']['loadavg_1m']}. The machine "
        "is shared with other jobs: where wall time exceeds CPU time (process CPU seconds, "
        "one thread), the process was waiting for a core; CPU time is close to what the work "
        "costs on an idle core. Ratios are measured side by side in the same run. Model: "
        f"{env['trainable_params'] / 1e6:.1f}M parameters in {env['trainable_matrices']} "
        "trainable matrices (embeddings, tied with the LM head, excluded: the default).",
        "",
    ]
    if "apply" in res:
        a = res["apply"]
        lines += [
            "## 1. Applying one round of n messages",
            "",
            f"Default settings (rank {a['rank']}, T = {a['refresh_period']}). SubCGE = "
            "`accumulate(msgs)` + `commit()`. *Warm*: the epoch's bases are cached (all rounds "
            "of an epoch but the first); *cold*: the round opens a new epoch, so the time "
            f"includes generating its bases ({_fmt(a['basis_generation_s'])} s wall, "
            f"{_fmt(a['basis_generation_cpu_s'])} s CPU on their own). Naive = "
            "`NaiveSeedReplay.accumulate` + `commit`: one full-size Gaussian per message, "
            f"{_fmt(a['naive_seconds_per_message'])} s wall "
            f"({_fmt(a['naive_cpu_seconds_per_message'])} s CPU) per message; rows marked "
            "*extrapolated* are that per-message cost "
            "(least squares through the origin over the measured n) times n. Median of "
            f"{res['plan']['apply_repeats']} repeats for SubCGE, one run for naive.",
            "",
            "| n | SubCGE warm, s (CPU s) | SubCGE cold, s (CPU s) | naive, s (CPU s) | "
            "naive / SubCGE warm | naive / SubCGE cold |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in a["rows"]:
            tag = " *extrapolated*" if r["naive_extrapolated"] else ""
            lines.append(
                f"| {r['n']} | {_fmt(r['subcge_warm_s'])} ({_fmt(r['subcge_warm_cpu_s'])}) | "
                f"{_fmt(r['subcge_cold_s'])} ({_fmt(r['subcge_cold_cpu_s'])}) | "
                f"{_fmt(r['naive_s'])} ({_fmt(r['naive_cpu_s'])}){tag} | "
                f"{_fmt(r['naive_over_subcge_warm'])}x | {_fmt(r['naive_over_subcge_cold'])}x |"
            )
        nmax = a["rows"][-1]["n"]
        ok1 = a["subcge_largest_over_n1_warm"] <= 1.5 and a["subcge_largest_over_n1_cold"] <= 1.5
        lines += [
            "",
            f"- Target: SubCGE at n = {nmax} within 1.5x of n = 1: warm "
            f"{a['subcge_largest_over_n1_warm']:.2f}x "
            f"(CPU {a['subcge_largest_over_n1_warm_cpu']:.2f}x), cold "
            f"{a['subcge_largest_over_n1_cold']:.2f}x: **{'met' if ok1 else 'NOT met'}**.",
        ]
        if "naive_over_subcge_at_256_warm" in a:
            ok2 = a["naive_over_subcge_at_256_cold"] >= 100
            ext = next(r for r in a["rows"] if r["n"] == 256)["naive_extrapolated"]
            lines.append(
                f"- Target: naive over SubCGE at n = 256 at least 100x: "
                f"{a['naive_over_subcge_at_256_warm']:.0f}x warm, "
                f"{a['naive_over_subcge_at_256_cold']:.0f}x cold"
                f"{' (naive extrapolated)' if ext else ''}: **{'met' if ok2 else 'NOT met'}**."
            )
        lines += [
            "- Breakdown (warm, median): accumulate / commit, s: "
            + ", ".join(
                f"n={r['n']}: {_fmt(r['subcge_accumulate_s'])} / {_fmt(r['subcge_commit_s'])}"
                for r in a["rows"]
            ),
            "",
            "![apply time](engine_apply.png)",
            "",
        ]
    if "step" in res:
        s = res["step"]
        lines += [
            "## 2. One SubCGE step over one forward pass",
            "",
            f"Batch {s['batch_size']} MR prompts, max_length {s['max_length']} (padded widths "
            f"{s['padded_widths']}); `zo_step` (batch building, two perturbed forwards with "
            "the rank-one hooks) versus `batch_loss` on the same batch (one plain forward); "
            f"{s['repeats']} interleaved pairs after a warm-up, order alternating.",
            "",
            "| | forward | zo_step | ratio of medians | median of pair ratios |",
            "|---|---:|---:|---:|---:|",
            f"| CPU s | {_fmt(s['forward_cpu_s'])} | {_fmt(s['zo_step_cpu_s'])} | "
            f"{s['ratio_of_medians_cpu']:.2f}x | {s['median_pair_ratio_cpu']:.2f}x |",
            f"| wall s | {_fmt(s['forward_s'])} | {_fmt(s['zo_step_s'])} | "
            f"{s['ratio_of_medians']:.2f}x | {s['median_pair_ratio']:.2f}x |",
            "",
            f"- Target at most 2.3x: **{'met' if s['ratio_of_medians_cpu'] <= 2.3 else 'NOT met'}**"
            f" on CPU time ({s['ratio_of_medians_cpu']:.2f}x); wall {s['ratio_of_medians']:.2f}x.",
            "",
        ]
    if "memory" in res:
        m = res["memory"]["summary"]
        lines += [
            "## 3. Peak memory: training step vs inference forward",
            "",
            "Method: each figure comes from a fresh child process that loads the model and "
            "the task (and builds the estimator for a step), runs `gc.collect()` and "
            "`malloc_trim(0)`, reads its resident set VmRSS (the baseline), resets the "
            "kernel's peak-RSS mark (`echo 5 > /proc/self/clear_refs`), runs one operation "
            "(one forward of a batch of 16, or one `zo_step` on the same batch) and reads the "
            "peak VmHWM. Increase = peak - baseline. Median over "
            f"{res['plan']['memory_repeats']} children per mode, run interleaved. The naive "
            "step (one child) is shown for context: it restores the weights from a full copy.",
            "",
            "| operation | baseline MiB | peak MiB | increase MiB | increase / forward's | "
            "peak / forward's |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for mode in ("forward", "subcge_step", "naive_step"):
            x = m[mode]
            lines.append(
                f"| {mode} | {x['baseline_mib']:.0f} | {x['peak_mib']:.0f} | "
                f"{x['increase_mib']:.0f} | {x.get('increase_over_forward', 1.0):.2f}x | "
                f"{x.get('peak_over_forward', 1.0):.2f}x |"
            )
        ratio = m["subcge_step"]["increase_over_forward"]
        lines += [
            "",
            f"- Target at most 1.2x (increase over the loaded model): "
            f"**{'met' if ratio <= 1.2 else 'NOT met'}** ({ratio:.2f}x; total peak "
            f"{m['subcge_step']['peak_over_forward']:.2f}x).",
            "",
        ]
    if "learning" in res:
        lr_ = res["learning"]
        z = lr_["zero_shot"]
        lines += [
            "## 4. Learning on MR (SmolLM2-135M, 1 peer)",
            "",
            f"Prompt `{{sentence}}\\nIt was` scored by ` terrible` vs ` great` (argmax, no "
            f"calibration). Reported accuracy: the first {lr_['report_examples']} test "
            f"sentences; settings were chosen, and learning curves drawn, on the next "
            f"{lr_['val_examples']} (validation). `train_local(..., peers=1)`, eps 1e-3, "
            f"batch 16, max_length 64, constant lr. Sweep: {lr_['sweep_rounds']} rounds per "
            "setting from the base weights; SubCGE's lr at the first (rank, T), then the other "
            "(rank, T) at the best lr; the naive estimator's lrs. The best setting of each "
            "(lowest validation loss) is then continued to the full budget, so both "
            "estimators get the same number of rounds.",
            "",
            f"Zero-shot: {z['report_accuracy']:.3f} accuracy (loss {z['report_loss']:.3f}) on the "
            f"report set, {z['val_accuracy']:.3f} on validation.",
            "",
            "Sweep (validation at each checkpoint of the short budget, rounds "
            f"{', '.join(str(c['round']) for c in lr_['subcge_sweep'][0]['curve'])}):",
            "",
            "| estimator | rank | T | lr | val acc by checkpoint | val loss by checkpoint | "
            "CPU s / round | status |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in lr_["subcge_sweep"] + lr_["naive_sweep"]:
            rank = r["rank"] if r["estimator"] == "subcge" else "-"
            period = r["refresh_period"] if r["estimator"] == "subcge" else "-"
            accs = " → ".join(f"{c['val_accuracy']:.3f}" for c in r["curve"])
            losses = " → ".join(f"{c['val_loss']:.3f}" for c in r["curve"])
            lines.append(
                f"| {r['estimator']} | {rank} | {period} | {r['lr']:g} | {accs} | {losses} | "
                f"{r['cpu_seconds_per_round']:.1f} | {r['status'][:40]} |"
            )
        lines += [
            "",
            f"Final: the best of each, continued to {lr_['final']['subcge']['rounds']} rounds "
            "(its sweep rounds included).",
            "",
            "| estimator | settings | report acc | gain over zero-shot | now right / now "
            "wrong | train s (CPU s) | s / round (CPU) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for name, f in lr_["final"].items():
            settings = (
                f"r={f['rank']}, T={f['refresh_period']}, lr={f['lr']:g}"
                if name == "subcge"
                else f"lr={f['lr']:g}"
            )
            fl = f["flips_vs_zero_shot"]
            lines.append(
                f"| {name} | {settings} | {f['report_accuracy']:.3f} | {f['report_gain']:+.3f} | "
                f"{fl['now_right']} / {fl['now_wrong']} | {f['train_seconds']:.0f} "
                f"({f['train_cpu_seconds']:.0f}) | {f['seconds_per_round']:.1f} "
                f"({f['cpu_seconds_per_round']:.1f}) |"
            )
        lines += ["", "Validation curves (accuracy / loss at each checkpoint):", ""]
        for name, f in lr_["final"].items():
            lines.append(
                f"- {name}: "
                + ", ".join(
                    f"round {c['round']}: {c['val_accuracy']:.3f} / {c['val_loss']:.3f}"
                    for c in f["curve"]
                )
            )
        for name, first in lr_["sustained_gain_round"].items():
            lines.append(
                f"- {name}: first checkpoint from which validation accuracy stays at least "
                f"{lr_['gain_threshold']:.2f} above zero-shot: "
                f"{('round ' + str(first)) if first else 'none within the budget'}."
            )
        lines += [
            "",
            "![learning curves](engine_learning.png)",
            "",
        ]
    if res.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    path.write_text("\n".join(lines))


def render(res: dict, stem: str) -> None:
    """Add derived figures to `res`; write <stem>.json, <stem>.md and the plots."""
    if "learning" in res:
        learning = res["learning"]
        learning.pop("subcge_first_checkpoint_with_gain", None)  # older name, not sustained
        learning["sustained_gain_round"] = {
            name: sustained_gain_round(f["curve"], learning["zero_shot"]["val_accuracy"])
            for name, f in learning["final"].items()
        }
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=1))
    if "apply" in res:
        plot_apply(
            res["apply"], res["environment"]["trainable_params"], RESULTS / f"{stem}_apply.png"
        )
    if "learning" in res:
        plot_learning(res["learning"], RESULTS / f"{stem}_learning.png")
    write_markdown(res, RESULTS / f"{stem}.md")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run of every part")
    parser.add_argument(
        "--full",
        action="store_true",
        help="measure naive replay at every n too (n = 1024 alone: ~10 min of CPU)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine, 2 threads "
        "made forwards 2-7x slower and erratic)",
    )
    parser.add_argument(
        "--parts",
        default="apply,step,memory,learning",
        help="comma-separated subset of apply,step,memory,learning",
    )
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md and plots from the .json"
    )
    parser.add_argument("--child-memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        child_memory(args.child_memory, args.threads)
        return
    if args.render:
        stem = "engine-quick" if args.quick else "engine"
        res = json.loads((RESULTS / f"{stem}.json").read_text())
        render(res, stem)
        return

    torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "default"
    plan = dict(PLANS[mode])
    if args.full:
        plan["naive_measured"] = list(plan["apply_sizes"])
    parts = args.parts.split(",")
    stem = "engine-quick" if args.quick else "engine"
    RESULTS.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    load_start = machine_state()
    model, tokenizer = load_model(MODEL)
    task = load_task(TASK)
    engine = SubCGE(model, config())
    trainable = (engine.num_parameters, len(engine.matrices))
    engine.close()
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    res: dict = {
        "mode": mode,
        "full": args.full,
        "plan": plan,
        "environment": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model,
            "threads": torch.get_num_threads(),
            "load_start": load_start,
            "trainable_params": trainable[0],
            "trainable_matrices": trainable[1],
            "default_config": asdict(config()),
        },
        "notes": [],
    }

    def save() -> None:
        res["environment"]["load_end"] = machine_state()
        res["total_minutes"] = (time.perf_counter() - t_start) / 60
        render(res, stem)

    if "apply" in parts:
        res["apply"] = bench_apply(model, plan)
        save()
    if "step" in parts:
        res["step"] = bench_step(model, tokenizer, task, plan)
        save()
    if "memory" in parts:
        res["memory"] = bench_memory(plan, args.threads)
        save()
    if "learning" in parts:
        res["learning"] = bench_learning(model, tokenizer, task, plan)
        save()
    save()
    log(f"done in {res['total_minutes']:.1f} min: {RESULTS / (stem + '.md')}")


if __name__ == "__main__":
    main()
