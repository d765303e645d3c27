#!/usr/bin/env python
"""Learning benchmark: held-out MR accuracy of SmolLM2-135M against forward passes and CPU time.

What it measures. Each row (a training method) is run for several seeds from the same
base weights; at checkpoints given in forward passes of a batch of 16 it scores the full
1,000-sentence movie-review test split (accuracy and label-word cross-entropy), and it
records the training CPU-seconds spent to get there (evaluation excluded). Rows:

* zeroth-order (ZO) rows: `RunConfig` overrides (the ROWS table below, or `--row` on the
  command line). Every round each of `--peers` simulated peers runs `zo_step`, then the
  round's messages are applied (`accumulate` + `commit`), as `seedflood train` does. One
  `zo_step` counts as `engine.forwards_per_step` forward passes (2 when the estimator
  does not say).
* `adam`: a first-order reference on the same prompt, label words and training data:
  Adam on the weights SubCGE trains (`--adam-params matrices`) or on the 1-D norm
  weights (`--adam-params norms`). One step (forward + backward) counts as 3
  forward-pass equivalents.

    python bench/bench_learning.py                      # adam + subcge-today, 3 seeds
    python bench/bench_learning.py --jobs 2 --resume    # 2 worker processes; keep finished runs
    python bench/bench_learning.py --row r8=rank=8,refresh_period=20,lr=3e-4
    python bench/bench_learning.py --render             # rewrite .md/.png from the .json

Writes bench/results/<out>.json (every curve, per seed and mean; settings; machine
state), <out>.md (mean +- standard error over seeds) and <out>.png (accuracy against
forward passes and against CPU-seconds); `--out` is `learning` by default, or any path
stem. The files are rewritten after every finished run, so an interrupted benchmark keeps
what finished and `--resume` skips it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from seedflood_p2p.algorithm.objective import label_word_logits
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.algorithm.trainable import find_trainable_matrices
from seedflood_p2p.algorithm.trainer import batch_seed, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.workload.batching import Batcher, sample_batch
from seedflood_p2p.workload.data import Example, Task, load_task
from seedflood_p2p.workload.models import load_model

MODEL = "smollm2-135m"
TASK = "mr"
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
EVAL_BATCH = 32  # held-out sentences per evaluation batch (sorted by length)
DEFAULT_FORWARDS_PER_STEP = 2  # a two-point estimate, when the estimator does not say
ADAM_FORWARDS_PER_STEP = 3  # one forward + one backward counted as 3 forward passes
THRESHOLDS = (0.70, 0.75)  # "forward passes to first reach this accuracy"
PEER_IDS = [f"local-{i}".encode() for i in range(1024)]  # as `seedflood train` names them

# Methods. A spec with method "adam" is the first-order reference (its lr, params and
# steps default to --adam-lr, --adam-params, --adam-steps); any other spec is a set of
# RunConfig overrides on RunConfig(model=MODEL, dataset=TASK). More with --row.
ROWS: dict[str, dict[str, Any]] = {
    "adam": dict(method="adam"),
    "subcge-today": dict(rank=32, refresh_period=20, lr=3e-4),  # the demo's default
    "subcge-r8": dict(rank=8, refresh_period=20, lr=3e-4),
    "naive-today": dict(estimator="naive", lr=3e-4),
    # k = 16: one direction per example, all in the same two forward passes.
    "k16-matrices": dict(rank=32, refresh_period=20, lr=1e-3, directions=16),
    # k = 16 on the norm scale vectors only (35k weights, the densest gradient energy).
    "k16-norms": dict(
        rank=32, refresh_period=20, lr=1e-3, directions=16, train_norms=True, train_only="*norm*"
    ),
}
DEFAULT_ROWS = "adam,subcge-today,k16-norms,k16-matrices"


# ----------------------------------------------------------------------------- helpers


def log(text: str) -> None:
    """One progress line on stderr."""
    print(f"[bench_learning {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Clock:
    """Accumulates wall time and this process's CPU time over the `with` blocks it times."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def __enter__(self) -> Clock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def mean_and_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample std / sqrt(n)); no error for a single value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, statistics.stdev(values) / math.sqrt(len(values))


def load_averages() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info(threads: int) -> dict[str, Any]:
    """What the timings depend on: cores, threads, load, versions, the code's commit."""
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_start": load_averages(),
        "git": git_state(),
    }


def git_state() -> str:
    """HEAD's short hash, with '+dirty' if seedflood_p2p/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "seedflood_p2p"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


# ------------------------------------------------------------------------- row specs


def parse_value(text: str) -> Any:
    """A --row value: JSON (numbers, true/false, null, quoted strings), else the raw text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_row(text: str) -> tuple[str, dict[str, Any]]:
    """`name=key=value,key=value` -> (name, {key: value}). Values may not contain commas."""
    name, sep, rest = text.partition("=")
    if not name or not sep:
        raise SystemExit(f"--row {text!r}: expected name=key=value,key=value")
    spec: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise SystemExit(f"--row {text!r}: {item!r} is not key=value")
        spec[key.strip()] = parse_value(value.strip())
    return name.strip(), spec


def is_adam(spec: dict[str, Any]) -> bool:
    return spec.get("method") == "adam"


def zo_config(spec: dict[str, Any], seed: int) -> RunConfig:
    """The RunConfig of a ZO row for one seed: the salt changes directions and data."""
    return RunConfig(model=MODEL, dataset=TASK, **spec).replace(salt=f"bench-seed{seed}")


def resolve_adam(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """An Adam spec with every setting filled in (row values win over the flags)."""
    full = {
        "method": "adam",
        "params": args.adam_params,
        "lr": args.adam_lr,
        "steps": args.adam_steps,
        "batch_size": 16,
        "max_length": RunConfig().max_length,
        **spec,
    }
    unknown = set(full) - {"method", "params", "lr", "steps", "batch_size", "max_length"}
    if unknown:
        raise SystemExit(f"Adam row: unknown settings {sorted(unknown)}")
    if full["params"] not in ("matrices", "norms"):
        raise SystemExit(f"Adam row: params must be 'matrices' or 'norms', not {full['params']!r}")
    return full


def check_zo_spec(name: str, spec: dict[str, Any]) -> None:
    """Fail before any training if a ZO row's overrides are not valid RunConfig settings."""
    if {"model", "dataset"} & set(spec):
        raise SystemExit(f"row {name}: the model and dataset are fixed ({MODEL}, {TASK})")
    try:
        zo_config(spec, 0)
    except Exception as exc:  # TypeError for unknown fields, UserError for bad values
        raise SystemExit(f"row {name}: not a valid RunConfig: {exc}") from None


def resolve_rows(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The rows to run, name -> full spec: --rows from the table, plus every --row."""
    table = dict(ROWS)
    extra = [parse_row(text) for text in args.row]
    table.update(extra)
    names = [n for n in args.rows.split(",") if n] + [n for n, _ in extra]
    rows: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(names):
        if name not in table:
            raise SystemExit(f"unknown row {name!r}: choose from {', '.join(table)} or use --row")
        spec = table[name]
        if is_adam(spec):
            rows[name] = resolve_adam(spec, args)
        else:
            check_zo_spec(name, spec)
            rows[name] = dict(spec)
    return rows


def run_key(spec: dict[str, Any], settings: dict[str, Any]) -> str:
    """What a finished run must match to be reused by --resume."""
    relevant = {k: settings[k] for k in ("eval_at", "test_examples")}
    if not is_adam(spec):
        relevant.update(budget=settings["budget"], peers=settings["peers"])
    return json.dumps({"spec": spec, **relevant}, sort_keys=True)


# ------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: torch.nn.Module, batcher: Batcher, examples: list[Example]) -> dict:
    """Loss and accuracy on `examples`, in batches of EVAL_BATCH sorted by length (like
    bench_engine.evaluate_examples: right padding leaves the scored positions alone)."""
    clock = Clock()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].text))
    correct, total_loss = 0, 0.0
    with clock:
        for start in range(0, len(order), EVAL_BATCH):
            batch = batcher([examples[i] for i in order[start : start + EVAL_BATCH]])
            logits = label_word_logits(model, batch)
            total_loss += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
    return {
        "accuracy": correct / len(examples),
        "loss": total_loss / len(examples),
        "cpu_seconds": clock.cpu,
        "wall_seconds": clock.wall,
    }


def checkpoint_steps(eval_at: list[int], forwards_per_step: int, steps: int) -> set[int]:
    """Steps after which to evaluate: the first step reaching each checkpoint, and the last."""
    at = {math.ceil(c / forwards_per_step) for c in eval_at if c > 0}
    return {s for s in at if s <= steps} | {steps}


# --------------------------------------------------------------------- one worker's state


class Workbench:
    """One process's model, tokenizer, task and base weights (restored after every run)."""

    def __init__(self, threads: int, test_examples: int) -> None:
        torch.set_num_threads(threads)
        self.model, self.tokenizer = load_model(MODEL)
        self.task: Task = load_task(TASK)
        self.test = self.task.test[:test_examples]
        self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._zero_shot: dict[int, dict] = {}

    @torch.no_grad()
    def restore(self) -> None:
        self.model.load_state_dict(self.base)

    def evaluate(self, max_length: int) -> dict:
        return evaluate(self.model, Batcher(self.task, self.tokenizer, max_length), self.test)

    def zero_shot(self, max_length: int) -> dict:
        """The base model's score (the same for every run: computed once per process)."""
        if max_length not in self._zero_shot:
            self._zero_shot[max_length] = self.evaluate(max_length)
        return self._zero_shot[max_length]


class Curve:
    """A run's checkpoints: evaluates, records and reports progress."""

    def __init__(self, bench: Workbench, label: str, max_length: int, budget: int) -> None:
        self.bench, self.label, self.max_length, self.budget = bench, label, max_length, budget
        self.points: list[dict] = []
        self.eval_cpu = 0.0
        self.started = time.perf_counter()
        self.last_report = self.started

    def checkpoint(self, step: int, forwards: int, train: Clock) -> None:
        ev = (
            self.bench.zero_shot(self.max_length)
            if step == 0
            else self.bench.evaluate(self.max_length)
        )
        if step:
            self.eval_cpu += ev["cpu_seconds"]
        self.points.append(
            {
                "step": step,
                "forwards": forwards,
                "accuracy": ev["accuracy"],
                "loss": ev["loss"],
                "train_cpu_seconds": train.cpu,
                "train_wall_seconds": train.wall,
            }
        )
        self.report(forwards, f"accuracy {ev['accuracy']:.3f} loss {ev['loss']:.4f}", train)

    def heartbeat(self, forwards: int, train_loss: float, train: Clock, every: float) -> None:
        """A progress line between checkpoints, at most every `every` seconds."""
        if time.perf_counter() - self.last_report >= every:
            accuracy = self.points[-1]["accuracy"] if self.points else float("nan")
            self.report(forwards, f"train loss {train_loss:.4f} (accuracy {accuracy:.3f})", train)

    def report(self, forwards: int, what: str, train: Clock) -> None:
        self.last_report = time.perf_counter()
        elapsed = (self.last_report - self.started) / 60
        log(
            f"{self.label}: forwards {forwards}/{self.budget}  {what}  train "
            f"{train.cpu:.0f} CPU-s  elapsed {elapsed:.1f} min"
        )


# ---------------------------------------------------------------------------- ZO rows


def forwards_per_step(engine: object) -> int:
    """Forward passes one zo_step costs: the estimator's own figure, else a two-point 2."""
    value = getattr(engine, "forwards_per_step", DEFAULT_FORWARDS_PER_STEP)
    return int(value() if callable(value) else value)


def run_zo(bench: Workbench, name: str, spec: dict, seed: int, settings: dict) -> dict:
    """One ZO run: rounds of `peers` zo_steps then accumulate + commit, to the budget."""
    cfg = zo_config(spec, seed)
    engine = make_estimator(bench.model, cfg)
    per_step = forwards_per_step(engine)
    peers = PEER_IDS[: settings["peers"]]
    per_round = per_step * len(peers)
    rounds = settings["budget"] // per_round
    at = checkpoint_steps(settings["eval_at"], per_round, rounds)
    curve = Curve(bench, f"{name} seed {seed}", cfg.max_length, rounds * per_round)
    train, losses, status = Clock(), [], "ok"
    curve.checkpoint(0, 0, train)
    try:
        for round_ in range(rounds):
            with train:
                messages, round_losses = [], []
                for peer in peers:
                    message, loss = zo_step(engine, bench.tokenizer, bench.task, peer, round_)
                    messages.append(message)
                    round_losses.append(loss)
                engine.accumulate(messages)
                engine.commit()
            losses.append(statistics.fmean(round_losses))
            done = (round_ + 1) * per_round
            if round_ + 1 in at:
                curve.checkpoint(round_ + 1, done, train)
            else:
                curve.heartbeat(done, losses[-1], train, settings["log_every"])
    except FloatingPointError as exc:
        status = f"diverged: {exc}"
        log(f"{name} seed {seed}: {status}")
    finally:
        engine.close()
        bench.restore()
    return {
        "config": asdict(cfg),
        "forwards_per_step": per_step,
        "forwards_per_round": per_round,
        "forward_unit": "forward pass",
        "steps_run": len(losses),
        "forwards_run": len(losses) * per_round,
        "status": status,
        "curve": curve.points,
        "train_losses": losses,
        "train_cpu_seconds": train.cpu,
        "train_wall_seconds": train.wall,
        "eval_cpu_seconds": curve.eval_cpu,
    }


# ----------------------------------------------------------------------- the Adam row

# label_word_logits runs under torch.no_grad; Adam needs the same objective with autograd.
_label_word_logits_with_grad = inspect.unwrap(label_word_logits)


def adam_parameters(model: torch.nn.Module, which: str) -> list[torch.nn.Parameter]:
    """'matrices': the 2-D weights SubCGE trains; 'norms': the 1-D norm weights."""
    if which == "matrices":
        return [m.weight for m in find_trainable_matrices(model)]
    return [p for n, p in model.named_parameters() if p.dim() == 1 and "norm" in n]


def adam_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy over the label words at the prompt's end, with gradients."""
    logits = _label_word_logits_with_grad(model, batch)
    loss = F.cross_entropy(logits, batch["labels"])
    if not loss.requires_grad:
        raise RuntimeError("label_word_logits no longer passes gradients: update adam_loss")
    return loss


def run_adam(bench: Workbench, name: str, spec: dict, seed: int, settings: dict) -> dict:
    """One first-order run: `steps` Adam steps on batches drawn like a ZO peer's."""
    cfg = RunConfig(
        model=MODEL, dataset=TASK, batch_size=spec["batch_size"], max_length=spec["max_length"]
    ).replace(salt=f"bench-seed{seed}")
    params = adam_parameters(bench.model, spec["params"])
    batcher = Batcher(bench.task, bench.tokenizer, cfg.max_length)
    steps = spec["steps"]
    at = checkpoint_steps(settings["eval_at"], ADAM_FORWARDS_PER_STEP, steps)
    curve = Curve(bench, f"{name} seed {seed}", cfg.max_length, steps * ADAM_FORWARDS_PER_STEP)
    train, losses, status = Clock(), [], "ok"
    curve.checkpoint(0, 0, train)
    try:
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=spec["lr"])
        for step in range(steps):
            with train:
                seed_ = batch_seed(cfg.run_key, PEER_IDS[0], step)
                batch = batcher(sample_batch(bench.task, seed_, cfg.batch_size))
                loss = adam_loss(bench.model, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]):
                status = f"diverged: non-finite loss at step {step}"
                break
            done = (step + 1) * ADAM_FORWARDS_PER_STEP
            if step + 1 in at:
                curve.checkpoint(step + 1, done, train)
            else:
                curve.heartbeat(done, losses[-1], train, settings["log_every"])
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        bench.restore()
    return {
        "config": {**spec, "trained_parameters": sum(p.numel() for p in params)},
        "forwards_per_step": ADAM_FORWARDS_PER_STEP,
        "forward_unit": "forward-pass equivalent (one Adam step = forward + backward = 3)",
        "steps_run": len(losses),
        "forwards_run": len(losses) * ADAM_FORWARDS_PER_STEP,
        "status": status,
        "curve": curve.points,
        "train_losses": losses,
        "train_cpu_seconds": train.cpu,
        "train_wall_seconds": train.wall,
        "eval_cpu_seconds": curve.eval_cpu,
    }


# ------------------------------------------------------------------- running the runs

_BENCH: Workbench | None = None  # this process's Workbench (one per worker)
_INIT_ERROR = ""  # why it could not be built (a failing pool initializer would respawn forever)


def init_worker(threads: int, test_examples: int) -> None:
    """Load the model once per process (the pool initializer, or the main process)."""
    global _BENCH, _INIT_ERROR
    try:
        _BENCH = Workbench(threads, test_examples)
    except Exception:
        _INIT_ERROR = traceback.format_exc()


def run_one(job: dict) -> dict:
    """One (row, seed) run in this process; errors come back as a record, not a crash."""
    name, spec, seed, settings = job["row"], job["spec"], job["seed"], job["settings"]
    load_start, started = load_averages(), time.perf_counter()
    record = {"row": name, "seed": seed, "key": run_key(spec, settings), "pid": os.getpid()}
    if _BENCH is None:
        return {**record, "error": f"loading the model failed:\n{_INIT_ERROR}"}
    try:
        run = (run_adam if is_adam(spec) else run_zo)(_BENCH, name, spec, seed, settings)
    except Exception:
        _BENCH.restore()
        return {**record, "error": traceback.format_exc()}
    return {
        **record,
        **run,
        "wall_seconds": time.perf_counter() - started,
        "load_average_start": load_start,
        "load_average_end": load_averages(),
    }


def run_all(jobs: list[dict], workers: int, threads: int, test_examples: int) -> Iterator[dict]:
    """Run the jobs in this process (workers = 1) or in a spawn pool; yield each as it ends."""
    if not jobs:
        return
    if workers <= 1:
        if _BENCH is None and not _INIT_ERROR:
            init_worker(threads, test_examples)
        for job in jobs:
            yield run_one(job)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(
        min(workers, len(jobs)), initializer=init_worker, initargs=(threads, test_examples)
    ) as pool:
        yield from pool.imap_unordered(run_one, jobs, chunksize=1)


# ------------------------------------------------------------------------- summaries


def first_reaching(curve: list[dict], threshold: float) -> int | None:
    """Forward passes at the first checkpoint with accuracy >= threshold."""
    return next((p["forwards"] for p in curve if p["accuracy"] >= threshold), None)


def summarise_row(runs: list[dict]) -> dict:
    """Mean +- standard error over seeds at each checkpoint, at the end, and costs."""
    by_forwards: dict[int, list[dict]] = {}
    for run in runs:
        for point in run["curve"]:
            by_forwards.setdefault(point["forwards"], []).append(point)
    checkpoints = []
    for forwards in sorted(by_forwards):
        points = by_forwards[forwards]
        acc, acc_se = mean_and_se([p["accuracy"] for p in points])
        loss, loss_se = mean_and_se([p["loss"] for p in points])
        cpu, cpu_se = mean_and_se([p["train_cpu_seconds"] for p in points])
        checkpoints.append(
            {
                "forwards": forwards,
                "step": points[0]["step"],
                "seeds": len(points),
                "accuracy_mean": acc,
                "accuracy_se": acc_se,
                "loss_mean": loss,
                "loss_se": loss_se,
                "train_cpu_seconds_mean": cpu,
                "train_cpu_seconds_se": cpu_se,
            }
        )
    finals = [run["curve"][-1] for run in runs]
    final_acc, final_acc_se = mean_and_se([p["accuracy"] for p in finals])
    final_loss, final_loss_se = mean_and_se([p["loss"] for p in finals])
    reach = {}
    for threshold in THRESHOLDS:
        hits = [f for f in (first_reaching(r["curve"], threshold) for r in runs) if f is not None]
        reach[f"{threshold:.2f}"] = {
            "seeds_reached": len(hits),
            "seeds": len(runs),
            "forwards_mean": statistics.fmean(hits) if hits else None,
            "forwards_per_seed": [first_reaching(r["curve"], threshold) for r in runs],
        }
    trained = [r for r in runs if r["forwards_run"] > 0]
    return {
        "seeds": sorted(r["seed"] for r in runs),
        "forward_unit": runs[0]["forward_unit"],
        "statuses": [r["status"] for r in runs],
        "checkpoints": checkpoints,
        "final": {
            "forwards_mean": statistics.fmean(p["forwards"] for p in finals),
            "accuracy_mean": final_acc,
            "accuracy_se": final_acc_se,
            "loss_mean": final_loss,
            "loss_se": final_loss_se,
        },
        "reach": reach,
        "cpu_seconds_per_forward": statistics.fmean(
            r["train_cpu_seconds"] / r["forwards_run"] for r in trained
        )
        if trained
        else None,
        "wall_seconds_per_forward": statistics.fmean(
            r["train_wall_seconds"] / r["forwards_run"] for r in trained
        )
        if trained
        else None,
    }


def summarise(results: dict) -> dict[str, dict]:
    """Per-row summaries, rows in the order they were specified."""
    grouped: dict[str, list[dict]] = {}
    for run in sorted(results["runs"], key=lambda r: r["seed"]):
        grouped.setdefault(run["row"], []).append(run)
    order = list(results["rows"]) + [r for r in grouped if r not in results["rows"]]
    return {name: summarise_row(grouped[name]) for name in order if name in grouped}


# --------------------------------------------------------------------------- output


def _pm(mean: float, se: float | None, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def _reach_text(reach: dict) -> str:
    if not reach["seeds_reached"]:
        return "not reached"
    text = f"{reach['forwards_mean']:.0f}"
    if reach["seeds_reached"] < reach["seeds"]:
        text += f" ({reach['seeds_reached']}/{reach['seeds']} seeds)"
    return text


def _settings_text(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k != "method") or "defaults"


def write_markdown(results: dict, path: Path) -> None:
    """Per-row tables of mean +- standard error over seeds, and a summary table."""
    s, m = results["settings"], results["machine"]
    n = s["test_examples"]
    lines = [
        "# Learning benchmark: SmolLM2-135M on MR, held-out accuracy vs forward passes",
        "",
        f"Generated by `{results['command']}` on {m['date']} (code {m['git']}); "
        f"{results['wall_minutes']:.1f} min wall. {m['nproc']} cores ({m['cpu_model']}), "
        f"{m['torch_threads']} torch thread(s) per process, {s['jobs']} worker process(es); "
        f"load average (1/5/15 min) at start {m['load_average_start']}, at end "
        f"{m.get('load_average_end')}.",
        "",
        f"Held-out set: the first {n} MR test sentences, scored in batches of {EVAL_BATCH} "
        "sorted by length: accuracy is the argmax over the label words ` terrible` / ` great` "
        "after `{sentence}\\nIt was`, loss the cross-entropy over those two words. One "
        f"accuracy on {n} sentences has a standard error of sqrt(p(1-p)/{n}): "
        f"{math.sqrt(0.25 / n):.3f} at p = 0.5, {math.sqrt(0.75 * 0.25 / n):.3f} at p = 0.75. "
        "Below, ± is the standard error of the mean over seeds (sample std / sqrt(seeds)), "
        "which includes that sampling error of each seed's score.",
        "",
        "Cost: ZO rows count forward passes of a training batch (`engine.forwards_per_step` "
        f"per `zo_step`, {DEFAULT_FORWARDS_PER_STEP} if the estimator does not say; a round "
        f"of {s['peers']} simulated peer(s) runs that many zo_steps), budget {s['budget']}. "
        f"The Adam row counts each step (forward + backward) as {ADAM_FORWARDS_PER_STEP} "
        "forward-pass equivalents. CPU-s: this process's CPU time spent training (evaluation "
        "excluded). Seeds change the ZO directions and the training batches "
        "(`salt=bench-seed<N>`).",
        "",
        "## Summary",
        "",
        "| row | settings | seeds | forwards | final accuracy | final loss | "
        + " | ".join(f"forwards to {t:.2f}" for t in THRESHOLDS)
        + " | CPU-s per forward |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(THRESHOLDS) + "---:|",
    ]
    for name, row in results["summary"].items():
        f = row["final"]
        per_forward = row["cpu_seconds_per_forward"]
        cost = "-" if per_forward is None else f"{per_forward:.2f}"
        reach = " | ".join(_reach_text(row["reach"][f"{t:.2f}"]) for t in THRESHOLDS)
        lines.append(
            f"| {name} | {_settings_text(results['rows'].get(name, {}))} | "
            f"{len(row['seeds'])} | {f['forwards_mean']:.0f} | "
            f"{_pm(f['accuracy_mean'], f['accuracy_se'])} | "
            f"{_pm(f['loss_mean'], f['loss_se'], 4)} | {reach} | {cost} |"
        )
    for name, row in results["summary"].items():
        statuses = sorted(set(row["statuses"]))
        lines += [
            "",
            f"## {name}",
            "",
            f"Settings: {_settings_text(results['rows'].get(name, {}))}. Unit: "
            f"{row['forward_unit']}. Seeds {row['seeds']}; status: {'; '.join(statuses)}.",
            "",
            "| forwards | step | seeds | accuracy | loss | train CPU-s |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        last = len(row["checkpoints"]) - 1
        for i, c in enumerate(row["checkpoints"]):
            tag = " (end)" if i == last else ""
            lines.append(
                f"| {c['forwards']}{tag} | {c['step']} | {c['seeds']} | "
                f"{_pm(c['accuracy_mean'], c['accuracy_se'])} | "
                f"{_pm(c['loss_mean'], c['loss_se'], 4)} | "
                f"{c['train_cpu_seconds_mean']:.0f} |"
            )
        reach = ", ".join(f"{t:.2f}: {_reach_text(row['reach'][f'{t:.2f}'])}" for t in THRESHOLDS)
        wall = row["wall_seconds_per_forward"]
        lines += [
            "",
            "Forward passes at the first checkpoint reaching accuracy (mean over the seeds "
            f"that did): {reach}. "
            + (
                f"CPU-s per forward: {row['cpu_seconds_per_forward']:.2f} (wall {wall:.2f})."
                if wall is not None
                else ""
            ),
        ]
    if results.get("failed"):
        lines += ["", "## Failed runs", ""]
        lines += [  # the exception's last line; the JSON has the whole traceback
            f"- {f['row']} seed {f['seed']}: `{f['error'].strip().splitlines()[-1]}`"
            for f in results["failed"]
        ]
    lines += ["", f"![learning curves]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def plot(results: dict, path: Path) -> None:
    """Accuracy against forward passes (left) and training CPU-seconds (right): the mean
    over seeds with a band of +- one standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for i, (name, row) in enumerate(results["summary"].items()):
        cps = row["checkpoints"]
        ys = [c["accuracy_mean"] for c in cps]
        se = [c["accuracy_se"] or 0.0 for c in cps]
        label = f"{name} ({len(row['seeds'])} seed{'s' if len(row['seeds']) > 1 else ''})"
        for ax, key in zip(axes, ("forwards", "train_cpu_seconds_mean")):
            xs = [c[key] for c in cps]
            ax.plot(xs, ys, "o-", color=f"C{i}", ms=3, label=label)
            ax.fill_between(
                xs,
                [y - e for y, e in zip(ys, se)],
                [y + e for y, e in zip(ys, se)],
                color=f"C{i}",
                alpha=0.2,
                lw=0,
            )
    n = results["settings"]["test_examples"]
    axes[0].set_xlabel("forward passes of a batch of 16 (Adam: 3 per step)")
    threads = results["machine"]["torch_threads"]
    axes[1].set_xlabel(f"training CPU-seconds ({threads} torch thread{'s' * (threads > 1)})")
    axes[0].set_ylabel(f"held-out accuracy ({n} MR test sentences)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M on MR: mean over seeds, band = ± standard error")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(results: dict, stem: Path, started: float | None) -> None:
    """Summaries, then <stem>.json (atomically), .md and .png. `started`: the perf_counter
    at this invocation's start (None when only re-rendering: times are left as they are)."""
    if started is not None:
        results["machine"]["load_average_end"] = load_averages()
        elapsed = (time.perf_counter() - started) / 60
        results["wall_minutes"] = results.get("previous_wall_minutes", 0.0) + elapsed
    results["summary"] = summarise(results)
    tmp = stem.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, stem.with_suffix(".json"))
    if results["summary"]:
        write_markdown(results, stem.with_suffix(".md"))
        plot(results, stem.with_suffix(".png"))


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, from {list(ROWS)}")
    p.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE,...",
        help="define a row (RunConfig overrides; method=adam for Adam) and run it; repeatable",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per row (0 .. N-1)")
    p.add_argument("--budget", type=int, default=1000, help="forward passes per ZO run")
    p.add_argument("--eval-at", default="0,100,250,500,1000", help="checkpoints, forward passes")
    p.add_argument("--test-examples", type=int, default=1000, help="held-out sentences")
    p.add_argument("--peers", type=int, default=1, help="simulated peers per ZO round")
    p.add_argument("--adam-params", choices=("matrices", "norms"), default="matrices")
    p.add_argument("--adam-lr", type=float, default=1e-5)
    p.add_argument("--adam-steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (each loads the model)")
    p.add_argument("--out", default="learning", help="stem in bench/results/, or a path stem")
    p.add_argument("--resume", action="store_true", help="keep finished runs of <out>.json")
    p.add_argument("--render", action="store_true", help="only rewrite .md/.png from .json")
    p.add_argument("--log-every", type=float, default=60.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.budget < 0 or not 1 <= args.peers <= len(PEER_IDS):
        p.error(f"need --seeds >= 1, --budget >= 0, 1 <= --peers <= {len(PEER_IDS)}")
    return args


def output_stem(out: str) -> Path:
    """`learning` -> bench/results/learning; anything with a '/' is a path stem."""
    stem = Path(out) if "/" in out else RESULTS / out
    stem.parent.mkdir(parents=True, exist_ok=True)
    return stem


def previous_runs(stem: Path, jobs: list[dict]) -> dict:
    """The JSON of an earlier run, checked against the jobs it is to skip."""
    path = stem.with_suffix(".json")
    if not path.is_file():
        log(f"--resume: no {path} yet, starting afresh")
        return {}
    old = json.loads(path.read_text())
    wanted = {(j["row"], j["seed"]): run_key(j["spec"], j["settings"]) for j in jobs}
    for run in old.get("runs", []):
        key = wanted.get((run["row"], run["seed"]))
        if key is not None and key != run["key"]:
            raise SystemExit(
                f"{path}: run {run['row']} seed {run['seed']} used other settings "
                f"({run['key']}); use another --out, or drop --resume to start afresh"
            )
    return old


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stem = output_stem(args.out)
    started = time.perf_counter()
    if args.render:
        save(json.loads(stem.with_suffix(".json").read_text()), stem, None)
        return
    torch.set_num_threads(args.threads)
    rows = resolve_rows(args)
    test_size = len(load_task(TASK).test)
    if not 1 <= args.test_examples <= test_size:
        raise SystemExit(f"--test-examples must be in 1..{test_size}")
    eval_at = sorted({int(x) for x in args.eval_at.split(",") if x.strip()})
    settings = {
        "budget": args.budget,
        "eval_at": eval_at,
        "test_examples": args.test_examples,
        "peers": args.peers,
        "seeds": args.seeds,
        "jobs": args.jobs,
        "threads": args.threads,
        "log_every": args.log_every,
        "model": MODEL,
        "task": TASK,
        "adam_forwards_per_step": ADAM_FORWARDS_PER_STEP,
    }
    jobs = [
        {"row": name, "seed": seed, "spec": spec, "settings": settings}
        for name, spec in rows.items()
        for seed in range(args.seeds)
    ]
    old = previous_runs(stem, jobs) if args.resume else {}
    done = {(r["row"], r["seed"]) for r in old.get("runs", [])}
    machine = machine_info(args.threads)
    results = {
        "benchmark": "learning",
        "command": "python bench/bench_learning.py " + shlex.join(sys.argv[1:] or []),
        "settings": settings,
        "machine": machine,
        "sessions": old.get("sessions", []) + [machine],  # one per invocation (--resume)
        "rows": {**old.get("rows", {}), **rows},
        "runs": old.get("runs", []),
        "failed": [],
        "previous_wall_minutes": old.get("wall_minutes", 0.0),
    }
    pending = [j for j in jobs if (j["row"], j["seed"]) not in done]
    log(
        f"{len(pending)} run(s) to do ({len(jobs) - len(pending)} already in "
        f"{stem.with_suffix('.json')}), {args.jobs} job(s), {args.threads} thread(s) each"
    )
    for run in run_all(pending, args.jobs, args.threads, args.test_examples):
        if "error" in run:
            log(f"{run['row']} seed {run['seed']} FAILED:\n{run['error']}")
            results["failed"].append(run)
        else:
            results["runs"].append(run)
            final = run["curve"][-1]
            log(
                f"{run['row']} seed {run['seed']} done: accuracy {final['accuracy']:.3f} after "
                f"{final['forwards']} forwards, {run['train_cpu_seconds']:.0f} train CPU-s, "
                f"{run['wall_seconds'] / 60:.1f} min"
            )
        save(results, stem, started)
    save(results, stem, started)
    log(f"wrote {stem.with_suffix('.json')}, .md, .png")
    if results["failed"]:
        raise SystemExit(f"{len(results['failed'])} run(s) failed: see the log above")


if __name__ == "__main__":
    main()
