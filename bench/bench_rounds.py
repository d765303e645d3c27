#!/usr/bin/env python
"""Learning per round against peers per round: held-out accuracy after R rounds of N peers.

Every row runs `seedflood train`'s loop (`algorithm.trainer.train_local`: N simulated peers
per round, the daemons' estimator, step and ledger rules; basis artifacts computed at
their due epochs as a run's publisher would), for each N in --peers and each seed, and
scores the first --eval-examples held-out sentences at --eval-at rounds. The reference
row `adam` is one machine with first-order Adam on the same weights, prompts and batch
size (one step = one round; the same evaluation points). The diagnostic row `adam-core`
is the same Adam restricted to the zeroth-order rows' own subspace: per matrix
W = W0 + U C V^T with the run's basis (U, V: its rank r columns, computed at the base as
a run's publisher does) and Adam on the r x r core C, whose gradient is U^T (dL/dW) V. It
asks whether the subspace or the zeroth-order noise holds a row back.

Cheaper forward passes, stated in every row: `--train-only` restricts training to the
upper blocks, and the frozen blocks' hidden states are cached per example
(`algorithm/prefix_cache.py`), so a forward pass runs only the trained blocks.

    python bench/bench_rounds.py --peers 4,16,64 --seeds 3            # SmolLM2 on MR
    python bench/bench_rounds.py --model tiny-llama --task synthetic-sentiment ...
    python bench/bench_rounds.py --render                              # .md/.png from .json

The validation protocol (docs/LEARNING.md): choose on the fixed validation split, then
score the chosen row once on the test split:

    python bench/bench_rounds.py --eval-split validation --row a=...,lr:0.032 --row b=...
        --out NAME-val                         # every candidate, on validation
    python bench/bench_rounds.py --eval-split test --choose-from NAME-val --out NAME-test
        # per N the best zeroth-order row of NAME-val.json (mean accuracy at its last
        # evaluation) and the best Adam row, each run again and scored on test

Every run records `chosen_on` (the split its settings were chosen on) and `scored_on` (the
split its figures are on) with the digest of the sentences scored; the table gives the
standard error over seeds beside the sampling SE of one score, sqrt(p(1-p)/n).

Resumable: each finished (row, N, seed) run is written to bench/results/<out>.json at
once, and a rerun skips what is there (a session's background jobs die with it). A
zeroth-order run also resumes mid-way: its simulated peers log every round to a real
SQLite ledger (with the basis artifacts beside it) in bench/results/partial/, and the
evaluations done so far go to a JSON file next to it; a rerun of the same command replays
that ledger (base + ledger, as `seedflood train` resumes) and carries on from the next
round. The replayed model equals the uninterrupted one to float32 rounding (canonical
order instead of arrival order). Finished runs delete their partial files.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CACHE_DIR = Path(os.environ.get("SEEDFLOOD_BENCH_CACHE", "/tmp/seedflood-bench-cache"))
# Method rows: RunConfig overrides. "adam" is the first-order reference; "adam-core" is Adam
# on the zeroth-order rows' subspace (its rank, basis and basis settings are the row's).
FIRST_ORDER = ("adam", "adam-core")
ROWS: dict[str, dict[str, Any]] = {
    "adam": dict(method="adam", lr=3e-4),
    "random": dict(rank=32, directions=16, step_rule="round_mean", n_ref=4, lr=6.4e-2),
    "activation": dict(
        rank=32,
        directions=16,
        step_rule="round_mean",
        n_ref=4,
        lr=6.4e-2,
        basis="activation",
        basis_refresh=1,
    ),
}


LIST_KEYS = ("label_words", "label_names")  # row values that are lists, "|" between items


def parse_row(text: str) -> tuple[str, dict[str, Any]]:
    name, _, body = text.partition("=")
    spec: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition(":")
        if key in LIST_KEYS:  # label words: "label_words: terrible| great"
            spec[key] = value.split("|")
            continue
        if key == "template":  # "\n" typed in a shell stands for a newline
            spec[key] = value.replace("\\n", "\n")
            continue
        for cast in (int, float):
            try:
                spec[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            spec[key] = {"true": True, "false": False}.get(value, value)
    return name, spec


class Partial:
    """An unfinished zeroth-order run between sessions: its ledger (a real SQLite file,
    basis artifacts beside it, as `seedflood train` keeps them) and the evaluations and
    CPU time so far, under bench/results/partial/."""

    def __init__(self, args: argparse.Namespace, name: str, peers: int, seed: int, config):
        from seedflood_p2p.storage.ledger import Ledger

        self.path, self.state = self.paths(args, name, peers, seed)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.ledger = Ledger(self.path, config.run_id)
        self.ledger.claim(config, f"delete {self.path.name}* there to start this run again")
        saved = json.loads(self.state.read_text()) if self.state.exists() else {}
        self.curve = {int(r): tuple(v) for r, v in saved.get("curve", {}).items()}
        self.wall_s, self.cpu_s = saved.get("wall_s", 0.0), saved.get("cpu_s", 0.0)
        self.resumed_at: list[int] = saved.get("resumed_at", [])  # rounds it restarted at
        self._wall0, self._cpu0 = time.time(), time.process_time()

    @staticmethod
    def paths(args: argparse.Namespace, name: str, peers: int, seed: int) -> tuple[Path, Path]:
        # Appended, not with_suffix: a row name may hold a dot ("kfac-f0.25"), and
        # with_suffix would cut the name there, giving several runs one ledger.
        stem = f"{args.out}-{name}-N{peers}-seed{seed}"
        if getattr(args, "eval_split", "test") == "validation":  # evaluated on another split
            stem += "-validation"
        folder = args.results_dir / "partial"
        return folder / f"{stem}.sqlite", folder / f"{stem}.json"

    def resume(self, model: torch.nn.Module, engine) -> list[int]:
        """Load the ledger's artifacts into `engine` and replay the ledger into `model`;
        returns the artifacts' sizes."""
        from seedflood_p2p.algorithm.basis import load_schedule
        from seedflood_p2p.algorithm.replay import replay

        schedule = load_schedule(self.ledger)
        for first_epoch, sha in schedule.entries:
            engine.add_basis(first_epoch, schedule.artifacts[sha])
        if len(self.ledger):
            self.resumed_at.append(self.ledger.max_round() + 1)
            print(
                f"  resuming {self.path.name}: replaying {len(self.ledger)} messages "
                f"(rounds 0-{self.ledger.max_round()}), evaluations at {sorted(self.curve)}",
                flush=True,
            )
            # into the training engine: under momentum it keeps the velocity to go on from
            replay(model, self.config, self.ledger.messages(), schedule=schedule, engine=engine)
        return [schedule.artifacts[sha].size for _, sha in schedule.entries]

    def save(self, curve: dict[int, tuple[float, float]]) -> None:
        state = {
            "curve": {str(r): list(v) for r, v in sorted(curve.items())},
            "wall_s": self.wall_s + time.time() - self._wall0,
            "cpu_s": self.cpu_s + time.process_time() - self._cpu0,
            "resumed_at": self.resumed_at,
        }
        tmp = self.state.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state)

    @classmethod
    def discard(cls, args: argparse.Namespace, name: str, peers: int, seed: int) -> None:
        """Delete a finished run's partial files (its result is in <out>.json by now)."""
        path, state = cls.paths(args, name, peers, seed)
        for f in [state, *path.parent.glob(path.name + "*")]:
            if f.is_dir():
                shutil.rmtree(f)
            else:
                f.unlink(missing_ok=True)


def run_one(args: argparse.Namespace, name: str, spec: dict, peers: int, seed: int) -> dict:
    from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainable import find_trainable_matrices
    from seedflood_p2p.algorithm.trainer import evaluate_metrics, train_local
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.storage.artifacts import save_basis
    from seedflood_p2p.workload.data import load_task, split_sha256
    from seedflood_p2p.workload.models import load_model
    from seedflood_p2p.workload.tasks import task_spec

    torch.manual_seed(seed)
    model, tokenizer = load_model(args.model)
    model.to(args.device)
    spec = dict(spec)
    method = spec.pop("method", "zo")
    config = RunConfig(
        model=args.model,
        dataset=args.task,
        train_only=args.train_only,
        salt=f"bench-seed{seed}",
        **spec,
    )
    # The row's own prompt and label words (a run's `task_spec`), on the task's sentences
    task_settings, label_column = task_spec(config)
    task = load_task(
        args.task, text_column=config.text_column, label_column=label_column, spec=task_settings
    )
    if args.eval_split == "validation":  # the fixed split where settings are chosen
        check_validation(args, task)
        task.test = task.validation
    elif args.eval_split == "val":  # legacy: the sentences after the pool (moves with it)
        val = task.train[args.train_examples : args.train_examples + args.eval_examples]
        if not val:
            raise SystemExit(
                f"error: --eval-split val: {args.task} has {len(task.train)} training "
                f"sentences, none after the first {args.train_examples}; lower --train-examples"
            )
        task.test = val
    if args.train_examples:
        task.train = task.train[: args.train_examples]
    task.calibration = config.calibration  # load_run_task's rule; the rows share one task
    curve: dict[int, tuple[float, float]] = {}
    correct: dict[str, str] = {}  # each evaluation's "1"/"0" per sentence (paired SEs)

    eval_cpu = [0.0]  # CPU-s spent scoring, so a row's training CPU can be read apart

    def score(r: int, cache) -> tuple[float, float]:
        cpu = time.process_time()
        try:
            return _score(r, cache)
        finally:
            eval_cpu[0] += time.process_time() - cpu

    def _score(r: int, cache) -> tuple[float, float]:
        metrics = evaluate_metrics(
            model, tokenizer, task, config, args.eval_examples, cache, per_example=True
        )
        if "correct" in metrics:
            correct[str(r)] = metrics["correct"]
        return metrics["loss"], metrics.get("accuracy")

    wall0, cpu0 = time.time(), time.process_time()
    extra: dict[str, Any] = {}
    if method == "adam":
        matrices = find_trainable_matrices(model, only=config.train_only)
        cache = ExamplePrefixCache(model, matrices) if args.cache_prefix else None
        warm(args, cache, model, tokenizer, task, config)
        for p in model.parameters():
            p.requires_grad_(False)
        params = [m.weight for m in matrices]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=config.lr)
        first_order_steps(args, config, model, tokenizer, task, cache, curve, score, opt)
    elif method == "adam-core":
        extra = adam_core(args, config, model, tokenizer, task, curve, score)
    else:
        engine = make_estimator(model, config)
        cache = ExamplePrefixCache(model, engine.matrices) if args.cache_prefix else None
        partial = Partial(args, name, peers, seed, config)
        curve.update(partial.curve)
        sizes = partial.resume(model, engine)
        warm(args, cache, model, tokenizer, task, config)
        done = partial.ledger.max_round() + 1  # rounds already in the ledger
        if done in args.eval_at and done not in curve:  # stopped before that evaluation
            curve[done] = score(done, cache)
            partial.save(curve)

        def on_round(record) -> None:
            r = record.round + 1
            if r in args.eval_at:
                curve[r] = score(r, cache)
                partial.save(curve)
                print(
                    f"  {name} N={peers} seed={seed} round {r}: acc {curve[r][1]:.3f}", flush=True
                )

        def on_basis(epoch: int, artifact) -> None:
            save_basis(partial.ledger, epoch, artifact)
            sizes.append(artifact.size)

        train_local(
            engine,
            tokenizer,
            task,
            peers=peers,
            rounds=args.rounds,
            ledger=partial.ledger,
            on_round=on_round,
            on_basis=on_basis,
            prefix_cache=cache,
            peers_per_pass=args.peers_per_pass,
        )
        engine.close()
        partial.ledger.close()  # before main() deletes its files
        extra = {
            "artifacts": len(sizes),
            "artifact_bytes": sizes[0] if sizes else 0,
            "trainable_params": engine.num_parameters,
            # Replay equals the live model to float32 rounding (~1e-7 here), not bitwise, so
            # a resumed run is a fair sample of its row, not the uninterrupted trajectory.
            "resumed_at": partial.resumed_at,
        }
        wall0, cpu0 = wall0 - partial.wall_s, cpu0 - partial.cpu_s  # earlier sessions' share
    return {
        "row": name,
        "peers": peers,
        "seed": seed,
        "settings": {"method": method, **spec, "train_only": config.train_only},
        "curve": {str(r): {"loss": v[0], "accuracy": v[1]} for r, v in sorted(curve.items())},
        "wall_s": round(time.time() - wall0, 1),
        "cpu_s": round(time.process_time() - cpu0, 1),
        # this session's CPU outside scoring (cache warm-up included); a resumed run's
        # earlier sessions are not split, so it is absent there
        **(
            {}
            if extra.get("resumed_at")
            else {"train_cpu_s": round(time.process_time() - cpu0 - eval_cpu[0], 1)}
        ),
        "prefix_cache": bool(args.cache_prefix),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "eval_split": args.eval_split,
        "scored_on": SPLIT_NAMES[args.eval_split],
        "chosen_on": spec_chosen_on(args, name),
        **({"chosen_from": args.choose_from} if args.choose_from else {}),
        "eval_examples": min(args.eval_examples, len(task.test)),
        "scored_sha256": split_sha256(task.test[: args.eval_examples], args.eval_split),
        "peers_per_pass": args.peers_per_pass,
        **({"correct": correct} if correct else {}),
        **extra,
    }


def first_order_steps(args, config, model, tokenizer, task, cache, curve: dict, score, opt):
    """The first-order rows' loop: `opt` (zero_grad, step) on the peers' objective with
    autograd, one batch of 16 a step (the same batches for every first-order row, step for
    step), evaluated at --eval-at into `curve`."""
    from seedflood_p2p.algorithm.objective import differentiable_example_losses, on_model_device
    from seedflood_p2p.algorithm.trainer import batch_seed
    from seedflood_p2p.workload.batching import calibrated, make_batch, sample_batch

    peer = b"adam"
    for step in range(args.rounds + 1):
        if step in args.eval_at:
            curve[step] = score(step, cache)
        if step == args.rounds:
            break
        examples = sample_batch(task, batch_seed(config.run_key, peer, step), 16)
        rows = calibrated(task, examples)
        batch = on_model_device(model, make_batch(rows, tokenizer, task, config.max_length))
        ctx = cache.batch(rows, batch) if cache else _null()
        with ctx:  # the peers' objective, with autograd
            loss = differentiable_example_losses(model, batch, task.kind).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class CoreAdam:
    """Adam on the r x r cores of W = W0 + U C V^T, one per matrix (`bases`: [(U, V)]):
    after a backward pass, dL/dC = U^T (dL/dW) V (the full gradient, projected), one Adam
    step on the cores, and the weights written as W0 + U C V^T. The weights never leave
    W0 + span(U) x span(V), the subspace a zeroth-order row moves in."""

    def __init__(self, matrices: list, bases: list[tuple[torch.Tensor, torch.Tensor]], lr: float):
        self.matrices, self.bases = matrices, bases
        self.start = [m.as_2d().detach().clone() for m in matrices]
        self.cores = [
            torch.zeros(u.shape[1], v.shape[1], dtype=u.dtype, device=u.device, requires_grad=True)
            for u, v in bases
        ]
        self.opt = torch.optim.Adam(self.cores, lr=lr)
        for m in matrices:
            m.weight.requires_grad_(True)

    def zero_grad(self) -> None:
        for m in self.matrices:
            m.weight.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for m, (u, v), core in zip(self.matrices, self.bases, self.cores):
            core.grad = u.T @ m.weight.grad.view(m.shape) @ v
        self.opt.step()
        for m, (u, v), core, w0 in zip(self.matrices, self.bases, self.cores, self.start):
            m.as_2d().copy_(w0 + u @ core @ v.T)


def adam_core(args, config, model, tokenizer, task, curve: dict, score) -> dict:
    """The `adam-core` row: `CoreAdam` in the basis the zeroth-order rows use (their
    coordinates exactly: a message's direction is one column pair (u_a, v_b) of it, with
    the basis computed at the base as the run's publisher computes it), on the Adam row's
    batches, step for step."""
    from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
    from seedflood_p2p.algorithm.subcge import SubCGE, make_estimator
    from seedflood_p2p.algorithm.trainer import basis_due, make_basis

    engine = make_estimator(model, config)
    if not isinstance(engine, SubCGE):
        raise SystemExit("error: the adam-core row needs the subcge estimator (its basis)")
    if config.basis_refresh:
        raise SystemExit("error: the adam-core row holds one basis: set basis_refresh:0")
    cache = ExamplePrefixCache(model, engine.matrices) if args.cache_prefix else None
    warm(args, cache, model, tokenizer, task, config)
    if basis_due(config, 0) is not None and config.basis in ("activation", "kfac"):
        engine.add_basis(0, make_basis(engine, tokenizer, task, 0))
    for p in model.parameters():
        p.requires_grad_(False)
    adam = CoreAdam(engine.matrices, engine.basis(0), config.lr)
    first_order_steps(args, config, model, tokenizer, task, cache, curve, score, adam)
    engine.close()
    return {
        "trainable_params": sum(c.numel() for c in adam.cores),
        "core_norm": float(torch.sqrt(sum((c.detach() ** 2).sum() for c in adam.cores))),
    }


# What each --eval-split scores, as results files name it.
SPLIT_NAMES = {
    "test": "test",
    "validation": "validation",
    "val": "val (the training sentences after the pool; before the fixed validation split)",
}


def spec_chosen_on(args: argparse.Namespace, name: str) -> str:
    """The split a row's settings were chosen on: validation for a validation run (it is
    the choosing) and for a row --choose-from picked; else --chosen-on."""
    if args.eval_split in ("validation", "val") or args.choose_from:
        return "validation"
    return args.chosen_on


def check_validation(args: argparse.Namespace, task) -> None:
    """Refuse a validation run whose training pool would meet the validation sentences."""
    if not task.validation:
        raise SystemExit(f"error: --eval-split validation: {args.task} has no validation split")
    if not 0 < args.train_examples <= task.pool_limit:
        raise SystemExit(
            f"error: --eval-split validation: the pool of --train-examples "
            f"{args.train_examples or 'all'} would train on validation sentences; "
            f"{args.task}'s pools of up to {task.pool_limit} are disjoint from them"
        )


def task_label(task_name: str, examples: list) -> str:
    """A file-name-safe label for a task: a built-in's name, or a data file's stem and the
    digest of the examples read from it (the file may change under the same name)."""
    if "/" not in task_name and "\\" not in task_name and not Path(task_name).suffix:
        return task_name
    digest = hashlib.sha256("\0".join(e.text for e in examples).encode()).hexdigest()[:8]
    return f"{Path(task_name).stem}.{digest}"


def warm(args, cache, model, tokenizer, task, config) -> None:
    """Fill the prefix cache for every training and held-out example used, from a file
    when an earlier run wrote one (same model, trained blocks, examples, max_length)."""
    from seedflood_p2p.workload.batching import make_batch

    if cache is None or not cache.active:
        return
    held_out = args.eval_split  # test, validation, or val (the sentences after the pool)
    for split, examples in (("train", task.train), (held_out, task.test[: args.eval_examples])):
        name = f"{args.model}-{task_label(args.task, examples)}-{split}{len(examples)}"
        name += f"-first{cache.first}"
        # the prompt is part of every prefix state: rows with their own template get their own
        prompt = hashlib.sha256(task.template.encode()).hexdigest()[:8]
        # v2: computed one example at a time (prefix_cache.py); v1 files were batched
        path = CACHE_DIR / f"prefix-{name}-len{config.max_length}-t{prompt}-v2.pt"
        if path.exists():
            for example, states in zip(examples, torch.load(path, map_location=args.device)):
                cache.keep(example, states)
            continue
        started = time.time()
        with torch.no_grad():
            for i in range(0, len(examples), 32):
                chunk = examples[i : i + 32]
                batch = make_batch(chunk, tokenizer, task, config.max_length)
                cache.fill(chunk, batch)
                if i % 640 == 0:
                    print(
                        f"  prefix cache {split} {i}/{len(examples)} "
                        f"({time.time() - started:.0f} s)",
                        flush=True,
                    )
        CACHE_DIR.mkdir(exist_ok=True)
        torch.save([cache.hidden[id(e)][1] for e in examples], path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": []}


def render(path: Path, meta: dict, plot: str = "", plot_name: str = "") -> None:
    """<out>.md (every row) and a PNG: every row in <out>.png, or with `plot` ("ROW" or
    "ROW@N", comma-separated) only those, in that order, in `plot_name`.png."""
    data = load(path)
    runs = data["runs"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        key = (run["row"], run["peers"] if run["settings"]["method"] not in FIRST_ORDER else 1)
        groups.setdefault(key, []).append(run)
    eval_at = sorted({int(r) for run in runs for r in run["curve"]})
    commands = list(dict.fromkeys(run.get("command", meta.get("command")) for run in runs))
    n_scored = meta.get("eval_examples") or 1000
    digests = sorted({r["scored_sha256"][:16] for r in runs if r.get("scored_sha256")})
    lines = [
        f"# Accuracy against rounds: {meta.get('model')} on {meta.get('task')}",
        "",
        "Commands (each run records its own): "
        + "; ".join(f"`{c}`" for c in commands)
        + (
            f". Held-out: the first {meta.get('eval_examples')} test sentences"
            if meta.get("eval_split", "test") == "test"
            else f". Held-out: the fixed validation split ({meta.get('eval_examples')} "
            "sentences, carved from the training sentences, disjoint from the pool; used to "
            "choose settings)"
            if meta.get("eval_split") == "validation"
            else f". Held-out: validation, the {meta.get('eval_examples')} training sentences "
            f"after the first {meta.get('train_examples')} (used to choose settings)"
        )
        + (f" (sha256 of the sentences scored: {', '.join(digests)})" if digests else "")
        + (f"; device {meta['device']}" if meta.get("device", "cpu") != "cpu" else "")
        + "; each cell is the mean over seeds +- the standard error of that mean over "
        "seeds (sample std / sqrt(seeds)), and in brackets the sampling SE of one score "
        f"on the {n_scored:,} sentences, sqrt(p(1-p)/n), which more seeds on the same "
        "sentences do not shrink. Trained weights: "
        f"`{meta.get('train_only') or 'all matrices'}`"
        + (", frozen blocks cached per example (prefix cache)" if meta.get("cache_prefix") else "")
        + ". Adam: one machine, batch 16, one step per round.",
        "",
        "| row | N peers/round | chosen on | scored on | seeds | "
        + " | ".join(f"round {r}" for r in eval_at)
        + " | CPU-s/run (of it training) |",
        "|---|---:|---|---|---:|" + "---:|" * len(eval_at) + "---:|",
    ]
    for (row, peers), group in sorted(
        groups.items(), key=lambda kv: (kv[0][0] not in FIRST_ORDER, kv[0])
    ):
        cells = []
        for r in eval_at:
            accs = [g["curve"][str(r)]["accuracy"] for g in group if str(r) in g["curve"]]
            if not accs:
                cells.append("")
                continue
            mean = statistics.fmean(accs)
            se = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else float("nan")
            n = max(g.get("eval_examples") or n_scored for g in group)
            sampling = f" [{math.sqrt(mean * (1 - mean) / n):.3f}]"
            cells.append((f"{mean:.3f} +- {se:.3f}" if len(accs) > 1 else f"{mean:.3f}") + sampling)
        cpu = statistics.fmean(g["cpu_s"] for g in group)
        copied = {g["copied_from"] for g in group if g.get("copied_from")}  # a reference row
        name = f"{row} (from {', '.join(sorted(copied))}; CPU-s of its runs)" if copied else row
        train = [g["train_cpu_s"] for g in group if "train_cpu_s" in g]
        # training CPU apart from scoring, where every run recorded it
        cells.append(
            f"{cpu:.0f}" + (f" ({statistics.fmean(train):.0f})" if len(train) == len(group) else "")
        )
        chosen = "/".join(sorted({g.get("chosen_on", "unrecorded") for g in group}))
        scored = "/".join(sorted({g.get("scored_on") or legacy_split(g, meta) for g in group}))
        lines.append(
            f"| {name} | {peers} | {chosen} | {scored} | {len(group)} | " + " | ".join(cells) + " |"
        )
    lines += ["", "Row settings:", ""]
    for row in sorted({r["row"] for r in runs}):
        settings = next(r["settings"] for r in runs if r["row"] == row)
        lines.append(f"- `{row}`: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    art = [r for r in runs if r.get("artifacts")]
    if art:
        a = art[0]
        lines.append(
            f"\nBasis artifacts: {a['artifact_bytes']:,} bytes each, one per refresh "
            f"({a['artifacts']} in a {max(eval_at)}-round run); trainable parameters "
            f"{a['trainable_params']:,}."
        )
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = sorted(groups.items())
    if plot:
        wanted = [w.strip() for w in plot.split(",") if w.strip()]
        drawn = [
            (key, group)
            for w in wanted
            for key, group in drawn
            if w in (key[0], f"{key[0]}@{key[1]}")
        ]
    colors = plt.get_cmap("tab10" if len(drawn) <= 10 else "tab20").colors
    for index, ((row, peers), group) in enumerate(drawn):
        xs, ys, es = [], [], []
        for r in eval_at:
            accs = [g["curve"][str(r)]["accuracy"] for g in group if str(r) in g["curve"]]
            if accs:
                xs.append(r)
                ys.append(statistics.fmean(accs))
                es.append(statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else 0)
        settings = group[0]["settings"]
        adam = settings["method"] in FIRST_ORDER
        label = f"{row}, N={peers}"
        if adam:
            named = "" if row == "adam" else f", {row}"
            core = f", rank-{settings.get('rank', 0)} core" if settings["method"] != "adam" else ""
            label = f"Adam lr {settings['lr']:g} (1 machine{core}){named}"
        ax.errorbar(
            xs,
            ys,
            yerr=es,
            marker="o",
            capsize=3,
            label=label,
            linestyle="--" if adam else "-",
            color=colors[index % len(colors)],
        )
    ax.set_xlabel("round (Adam: step)")
    ax.set_ylabel(f"held-out accuracy ({meta.get('eval_examples')} sentences)")
    ax.set_title(f"{meta.get('model')} on {meta.get('task')}: accuracy against rounds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(
        path.with_name(f"{plot_name}.png") if plot_name else path.with_suffix(".png"), dpi=110
    )


def legacy_split(run: dict, meta: dict) -> str:
    """The split a run from before `scored_on` was recorded was scored on."""
    return SPLIT_NAMES.get(run.get("eval_split") or meta.get("eval_split", "test"), "test")


def chosen_rows(args: argparse.Namespace, peers: list[int]) -> list[tuple[str, dict, int]]:
    """--choose-from: per N the zeroth-order row with the highest mean accuracy at the
    last evaluation of the validation results file, and the best Adam row."""
    data = load(args.results_dir / f"{args.choose_from}.json")
    runs = [r for r in data["runs"] if r.get("scored_on") == "validation"]
    if not runs:
        raise SystemExit(
            f"error: --choose-from {args.choose_from}: no run scored on the validation split"
        )

    def best(candidates: list[dict]) -> tuple[str, dict] | None:
        groups: dict[str, list[dict]] = {}
        for r in candidates:
            groups.setdefault(r["row"], []).append(r)
        scores = {}
        for row, group in groups.items():
            last = max(int(k) for g in group for k in g["curve"])
            accs = [g["curve"][str(last)]["accuracy"] for g in group if str(last) in g["curve"]]
            scores[row] = statistics.fmean(accs)
        if not scores:
            return None
        row = max(scores, key=lambda k: scores[k])
        settings = dict(groups[row][0]["settings"])
        settings.pop("train_only", None)
        if settings.get("method") == "zo":
            settings.pop("method")
        print(
            f"chosen on validation: {row} ("
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(scores.items(), key=lambda kv: -kv[1]))
            + ")",
            flush=True,
        )
        return row, settings

    jobs = []
    adam = best([r for r in runs if r["settings"]["method"] == "adam"])
    if adam:
        jobs.append((*adam, peers[0]))
    for n in peers:
        zo = best(
            [r for r in runs if r["settings"]["method"] not in FIRST_ORDER and r["peers"] == n]
        )
        if zo:
            jobs.append((*zo, n))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="mr")
    parser.add_argument("--train-only", default="model.layers.2[89].*")
    parser.add_argument("--cache-prefix", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--peers", default="4,16,64")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="start at this seed (split seeds over processes)"
    )
    parser.add_argument(
        "--train-examples", type=int, default=2400, help="first N training sentences (0: all)"
    )
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--eval-at", default="0,10,20,30,40")
    parser.add_argument("--eval-examples", type=int, default=1000)
    parser.add_argument("--rows", default="adam,random,activation")
    parser.add_argument("--row", action="append", default=[], help="NAME=key:value,...")
    parser.add_argument("--out", default="rounds")
    parser.add_argument("--render", action="store_true")
    parser.add_argument(
        "--plot", default="", help="with --render: rows to draw, ROW or ROW@N, comma-separated"
    )
    parser.add_argument("--plot-name", default="", help="with --plot: the PNG's name (no .png)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the full model")
    parser.add_argument(
        "--eval-split",
        choices=["test", "validation", "val"],
        default="test",
        help="validation: score the task's fixed validation split (to choose settings; "
        "MR: 1,000 training sentences no pool of up to 8,605 meets); test: score a chosen "
        "row once; val (legacy): the --eval-examples training sentences after the first "
        "--train-examples",
    )
    parser.add_argument(
        "--chosen-on",
        default="unrecorded",
        help="with --eval-split test: the split the rows' settings were chosen on, as the "
        "results record it (a validation run records validation)",
    )
    parser.add_argument(
        "--choose-from",
        default="",
        help="with --eval-split test: a validation results file (its --out) to take the "
        "best row per N (and the best Adam row) from, instead of --rows/--row",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--peers-per-pass",
        type=int,
        default=1,
        help="simulated peers estimated in one pair of forward passes (stacked batches; "
        "each peer's scalars equal to float rounding): 64 on a GPU",
    )
    args = parser.parse_args()
    if args.eval_split == "val" and not args.train_examples:
        parser.error("--eval-split val needs --train-examples > 0 (the sentences after them)")
    if args.choose_from and args.eval_split != "test":
        parser.error("--choose-from picks rows to score on the test split: --eval-split test")
    args.eval_at = [int(x) for x in args.eval_at.split(",")]
    torch.set_num_threads(args.threads)
    rows = {name: ROWS[name] for name in args.rows.split(",") if name}
    rows.update(parse_row(r) for r in args.row)
    peer_counts = [int(x) for x in args.peers.split(",")]
    path = args.results_dir / f"{args.out}.json"
    meta = {
        "model": args.model,
        "task": args.task,
        "train_only": args.train_only,
        "cache_prefix": args.cache_prefix,
        "eval_examples": args.eval_examples,
        "train_examples": args.train_examples,
        "eval_split": args.eval_split,
        "scored_on": SPLIT_NAMES[args.eval_split],
        "chosen_on": spec_chosen_on(args, ""),
        "device": args.device,
        "command": "python bench/bench_rounds.py " + " ".join(sys.argv[1:]),
    }
    if args.render:
        if args.plot and not args.plot_name:
            parser.error("--plot needs --plot-name (the full plot keeps <out>.png)")
        render(path, load(path).get("meta", meta), args.plot, args.plot_name)
        return
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.choose_from:
        jobs = chosen_rows(args, peer_counts)
    else:
        jobs = [
            (name, spec, peers)
            for peers in peer_counts
            for name, spec in rows.items()
            # one first-order run per seed
            if spec.get("method") not in FIRST_ORDER or peers == peer_counts[0]
        ]
    meta.update(validation_digest(args))
    for seed in range(args.first_seed, args.seeds):
        for name, spec, peers in jobs:
            data = load(path)
            if any(
                r["row"] == name
                and r["seed"] == seed
                and (r["peers"] == peers or spec.get("method") in FIRST_ORDER)
                and (r.get("scored_on") or legacy_split(r, data.get("meta", {})))
                == meta["scored_on"]
                for r in data["runs"]
            ):
                continue
            print(f"{name} N={peers} seed={seed} ...", flush=True)
            run = run_one(args, name, spec, peers, seed)
            run["command"] = meta["command"]
            with open(path.with_suffix(".lock"), "w") as lock:  # several --peers processes
                fcntl.flock(lock, fcntl.LOCK_EX)
                data = load(path)
                data["meta"] = meta
                data["runs"].append(run)
                tmp = path.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(data, indent=1))
                os.replace(tmp, path)
            Partial.discard(args, name, peers, seed)
            render(path, meta)
            last = run["curve"][max(run["curve"], key=int)]
            print(f"{name} N={peers} seed={seed}: {last} ({run['cpu_s']} CPU-s)", flush=True)


def validation_digest(args: argparse.Namespace) -> dict:
    """The task's validation split, by size and digest, for the results' meta."""
    from seedflood_p2p.workload.data import load_task, split_sha256

    task = load_task(args.task)
    return {
        "validation_examples": len(task.validation),
        "validation_sha256": split_sha256(task.validation, "validation"),
        "test_examples": len(task.test),
    }


if __name__ == "__main__":
    main()
