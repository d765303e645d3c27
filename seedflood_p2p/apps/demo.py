"""`seedflood demo`: a real multi-peer run on this machine, watched live, summarised in a plot.

A bootstrap node and N peer daemons start as separate processes, each with its
own go-libp2p daemon on 127.0.0.1. The demo follows their JSON logs and status
pages, prints a progress line every few seconds, stops the peers when the
round or time budget is spent (SIGTERM: each finishes its round and writes a
checkpoint), then checks consensus: identical ledgers on every peer, one
canonical replay, and how far each live model is from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from seedflood_p2p.apps.localnet import NodeProcess, start_bootstrap, start_peer
from seedflood_p2p.core.config import OMITTED_WHEN_DEFAULT, RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import (
    add_flags,
    add_run_flags,
    read_toml,
    run_config_from_args,
    settings_of,
    settings_values,
)

log = logging.getLogger("seedflood.demo")

# The demo's built-in default: see docs/DEMO.md ("Why this default") for the measurements.
DEMO_DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "dataset": "mr",
    "rank": 32,
    # the label prior out of the loss: ahead at round 20 by 3.7 SE, +0.030 at 40 (1.6 SE),
    # one more row per batch (docs/LEARNING.md, "Calibration"); --calibration "" turns it off
    "calibration": "content-free",
    # K-FAC directions, 16 scalars a message, a round of 4 moving a quarter of a full step
    # (docs/LEARNING.md, "How far rounds go"): the bootstrap node computes the basis once
    "basis": "kfac",
    "directions": 16,
    "step_rule": "round_mean",
    "n_ref": 16,
    "lr": 0.064,
}
# A model's own fast setting, on any data set (a built-in one or an organiser's CSV):
# SmolLM2's top 2 of 30 blocks train, on the first 512 training examples, so after the
# first minutes every example's frozen-prefix output is in each peer's cache and a step
# runs 2 blocks, not 30 (docs/DEMO.md). It follows the model, not the data set (issue 47:
# `--dataset reviews.csv` once fell back to the whole model and took ~20 s a round, not
# ~2.5). A data set with fewer training examples trains on all it has outside its
# validation split (fit_to_data). Another --model trains all of itself unless told.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"train_only": "model.layers.2[89].*", "train_examples": 512},
}
DEFAULT_MODEL_DEFAULTS = MODEL_DEFAULTS[DEMO_DEFAULTS["model"]]
# The demo's prompt, for one text with two labels (negative, positive), chosen on the
# validation split (docs/LEARNING.md, "Prompt and label words"): 3rd of 160 prompts
# zero-shot at 0.770 against the best's 0.774 (0.3 SE apart), and of the top three the
# one that names no movie, so it reads an organiser's product reviews as well. Read
# uncalibrated: calibration costs it 0.16 at round 0 (bench/results/prompt-val.md). The
# step stays 0.064: at the demo's length (240 rounds, 4 peers) it led 0.032 and 0.016 on
# validation, 0.814 against 0.807 and 0.804 (bench/results/prompt-demo-val.md, one seed).
DEMO_PROMPT: dict[str, Any] = {
    "template": "Review: {text}\nSentiment:",
    "label_words": [" negative", " positive"],
    "calibration": "",
}
# Settings that say what the task looks like: any of them given, the demo's prompt is out.
PROMPT_SHAPE = ("task", "kind", "template", "label_words", "label_names")


def fits_demo_prompt(task: Any) -> bool:
    """Whether a loaded task is one text with two labels (what DEMO_PROMPT reads)."""
    labels = {e.label for e in task.train[:2000]}
    return task.kind == "classification" and labels <= {0, 1}


@dataclass(frozen=True)
class DemoSettings:
    """How the demo runs (the run's own settings are RunConfig's, with DEMO_DEFAULTS)."""

    peers: int = 4
    rounds: int = 2000
    minutes: float = field(default=10.0, metadata={"help": "training time budget"})
    eval_every: int = field(default=25, metadata={"help": "peer0 scores the model"})
    eval_examples: int = field(default=200, metadata={"help": "test sentences per eval"})
    final_eval_examples: int = field(
        default=1000, metadata={"help": "the replayed model scored at the end; 0: skip"}
    )
    round_interval: float = 0.0
    work_dir: Path | None = field(default=None, metadata={"help": "runs/demo-TIMESTAMP if unset"})
    # Where each peer computes (the peers' --device); the final replay and its score run on
    # the CPU, as anyone's check would.
    device: str = field(default="cpu", metadata={"help": "cpu, or cuda: the peers' device"})

    def __post_init__(self) -> None:
        if self.peers < 1 or self.rounds < 1 or not self.minutes > 0:
            raise UserError("--peers and --rounds must be >= 1 and --minutes > 0")


DEMO_FIELDS = settings_of(DemoSettings)


def own_copies(config: RunConfig) -> list[str]:
    """Peer flags naming this machine's model directory and data file, when the run names
    them by local path (a peer never opens a path a manifest names)."""
    from seedflood_p2p.workload.data import BUILTIN_TASKS
    from seedflood_p2p.workload.models import BUILTIN_MODELS
    from seedflood_p2p.workload.tasks import is_local_path

    flags = []
    if is_local_path(config.model, BUILTIN_MODELS):
        flags += ["--model-dir", str(Path(config.model).expanduser().resolve())]
    if is_local_path(config.dataset, BUILTIN_TASKS):
        flags += ["--dataset-file", str(Path(config.dataset).expanduser().resolve())]
    return flags


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, {**DEMO_DEFAULTS, **DEFAULT_MODEL_DEFAULTS, **DEMO_PROMPT})
    add_flags(parser, DEMO_FIELDS, "demo settings")


def _given(args: argparse.Namespace, table: dict[str, Any], name: str) -> Any:
    """A run setting as the flags, the environment or the file give it; None if none does."""
    flag = getattr(args, name, None)
    if flag is not None:
        return flag
    return os.environ.get(f"SEEDFLOOD_{name.upper()}") or table.get(name)


def demo_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """DEMO_DEFAULTS, the chosen model's own fast setting (MODEL_DEFAULTS) whatever the
    data set, when the flags, the environment and the file choose that model, and the
    demo's prompt (DEMO_PROMPT) when nothing sets the task's shape."""
    table = read_toml(args)
    model = _given(args, table, "model") or DEMO_DEFAULTS["model"]
    defaults = {**DEMO_DEFAULTS, **MODEL_DEFAULTS.get(model, {})}
    if not any(_given(args, table, name) for name in PROMPT_SHAPE):
        defaults.update(DEMO_PROMPT)
    return defaults


def fit_to_data(args: argparse.Namespace, config: RunConfig, defaults: dict) -> dict[str, Any]:
    """`defaults` fitted to the run's data set, for what no flag, variable or file set:
    the demo's prompt only for one text with two labels, a training pool no larger than
    the examples outside the validation split, and no calibration for a task without
    labels. Unchanged when the data cannot be read here (the peers then say why)."""
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.tasks import task_spec

    table = read_toml(args)

    def load(config: RunConfig) -> Any:
        spec, label_column = task_spec(config)
        return load_task(
            config.dataset, text_column=config.text_column, label_column=label_column, spec=spec
        )

    fitted = dict(defaults)
    task = None
    try:
        task = load(config)
    except UserError:
        pass
    if defaults.get("template") == DEMO_PROMPT["template"] and (
        task is None or not fits_demo_prompt(task)
    ):
        # not one text with two labels (or not readable so): the run's own or its preset's
        # prompt, read as the demo read it before the prompt search (calibrated)
        for name in DEMO_PROMPT:
            if _given(args, table, name) is None:
                fitted[name] = DEMO_DEFAULTS.get(name, OMITTED_WHEN_DEFAULT[name])
        try:
            task = load(replace(config, **{k: fitted[k] for k in DEMO_PROMPT}))
        except UserError:
            return fitted
    if task is None:
        return fitted
    pool = defaults.get("train_examples", 0)
    limit = task.pool_limit or len(task.train)
    if pool > limit and _given(args, table, "train_examples") is None:
        fitted["train_examples"] = limit
    if task.kind != "classification" and _given(args, table, "calibration") is None:
        fitted["calibration"] = ""
    return fitted


def cmd_demo(args: argparse.Namespace) -> int:
    demo = DemoSettings(**settings_values(args, DEMO_FIELDS, read_toml(args), {}))
    defaults = demo_defaults(args)
    config = run_config_from_args(args, defaults=defaults, extra_fields=DEMO_FIELDS)
    fitted = fit_to_data(args, config, defaults)
    if fitted != defaults:
        config = run_config_from_args(args, defaults=fitted, extra_fields=DEMO_FIELDS)
    if problem := config.daemon_problem():
        raise UserError(f"the demo runs real daemons: {problem}")
    from seedflood_p2p.workload.models import check_device  # imports torch: not for --help

    check_device(demo.device)
    work = demo.work_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    result = run_demo(
        config,
        peers=demo.peers,
        rounds=demo.rounds,
        minutes=demo.minutes,
        work=work,
        eval_every=demo.eval_every,
        eval_examples=demo.eval_examples,
        round_interval=demo.round_interval,
        final_eval_examples=demo.final_eval_examples,
        device=demo.device,
    )
    return 0 if result["ledgers_identical"] else 1


_last_status: dict[Path, dict] = {}


def _status(data_dir: Path) -> dict | None:
    """A peer's /status page; its last good answer once the peer has closed it."""
    try:
        port = int((data_dir / "status_port").read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=1) as response:
            _last_status[data_dir] = json.loads(response.read())
    except (OSError, ValueError):
        pass
    return _last_status.get(data_dir)


def finish_all(procs: dict[str, NodeProcess], work: Path) -> int:
    """Ask every peer to stop after the same round, so all end with the same ledger.

    A peer may already be past the round we propose (rounds of a tiny model take
    milliseconds), and each reply says where that peer will really stop: we agree on the
    largest reply by asking once more. A peer that cannot be asked gets SIGTERM instead."""

    def ask(name: str, after: int) -> int | None:
        try:
            port = int((work / name / "status_port").read_text())
            url = f"http://127.0.0.1:{port}/finish?after_round={after}"
            request = urllib.request.Request(url, method="POST")
            return int(json.loads(urllib.request.urlopen(request, timeout=5).read())["final_round"])
        except (OSError, ValueError, KeyError):
            return None

    rounds = [e["round"] for p in procs.values() for e in p.events() if e.get("event") == "round"]
    proposed = max(rounds, default=0) + 1
    replies = {name: ask(name, proposed) for name, proc in procs.items() if proc.alive}
    last = max((r for r in replies.values() if r is not None), default=proposed)
    for name, reply in replies.items():
        if reply is not None and reply != last:
            reply = ask(name, last)
        if reply is None:
            procs[name].proc.send_signal(15)
    return last


def _progress(peers: dict[str, NodeProcess], work: Path, rounds: int, started: float) -> dict:
    round_events = [e for p in peers.values() for e in p.events() if e.get("event") == "round"]
    evals = [e for e in peers["peer0"].events() if e.get("event") == "eval"]
    statuses = [s for s in (_status(work / name) for name in peers) if s]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    current = max((e["round"] for e in round_events), default=-1)
    recent = [e["loss"] for e in round_events if e["round"] >= current - 2]
    messages = max((s["ledger_messages"] for s in statuses), default=0)
    elapsed = time.monotonic() - started
    return {
        "round": current + 1,
        "rounds": rounds,
        "loss": sum(recent) / len(recent) if recent else float("nan"),
        "accuracy": last.get("eval_accuracy"),
        "eval_round": last.get("rounds_done"),
        "eval_examples": last.get("eval_examples"),
        "start_accuracy": first.get("eval_accuracy"),
        "below_start": below_start(first, last),
        "alive": sum(p.alive for p in peers.values()),
        "messages": messages,
        "rate": messages / elapsed if elapsed > 0 else 0.0,
        "bytes_out": sum(s.get("bytes_out", 0) for s in statuses),
        "elapsed": elapsed,
    }


# Where the figures are scored. The peers' periodic figure is on the first --eval-examples
# sentences of the test split (the peer daemon scores the run's test split); nothing is
# chosen on it. The replayed model at the end is scored once on the first
# --final-eval-examples test sentences. Settings are chosen on the validation split, in
# bench/bench_rounds.py (docs/LEARNING.md, "The validation protocol").
EVAL_SPLIT = "test"


def split_label(examples: int | None) -> str:
    """How a figure names its sentences: `test[:200]` (the first 200 of the test split)."""
    return f"{EVAL_SPLIT}[:{examples}]" if examples else EVAL_SPLIT


def below_start(first: dict, last: dict) -> bool:
    """Whether peer0's latest held-out figure is worse than its first: accuracy lower, or
    for a task without accuracy the loss higher."""
    if not first or last is first or last.get("rounds_done") == first.get("rounds_done"):
        return False
    if first.get("eval_accuracy") is not None and last.get("eval_accuracy") is not None:
        return last["eval_accuracy"] < first["eval_accuracy"]
    return last.get("eval_loss", 0.0) > first.get("eval_loss", float("inf"))


def _print_progress(p: dict, n_peers: int) -> None:
    acc = ""
    if p["accuracy"] is not None:
        acc = (
            f"  accuracy {p['accuracy']:.3f} on {split_label(p.get('eval_examples'))} "
            f"(after {p['eval_round']})"
        )
        if p.get("below_start"):
            acc += f" BELOW its start {p['start_accuracy']:.3f}"
    print(
        f"[{int(p['elapsed']) // 60:02d}:{int(p['elapsed']) % 60:02d}] round "
        f"{p['round']}/{p['rounds']}  loss {p['loss']:.4f}{acc}  peers {p['alive']}/{n_peers}"
        f"  messages {p['messages']} ({p['rate']:.1f}/s)  sent {p['bytes_out'] / 1e3:.1f} kB",
        flush=True,
    )


def consensus(work: Path, names: list[str], final_eval_examples: int = 0) -> dict:
    """Ledger digests of all peers, the canonical replay's hash, live-vs-replay deviation,
    and with `final_eval_examples` the replayed model's held-out figures on that many
    test examples (the count recorded with them)."""
    import torch
    from safetensors.torch import load_file

    from seedflood_p2p.algorithm.basis import load_schedule
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import trainable_tensors
    from seedflood_p2p.algorithm.trainer import evaluate_metrics
    from seedflood_p2p.apps.local import counted_updates
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model, weights_sha256
    from seedflood_p2p.workload.tasks import load_run_task

    finals = {
        n: json.loads((work / n / "final_status.json").read_text())
        for n in names
        if (work / n / "final_status.json").exists()
    }
    digests = {n: f["ledger_digest"] for n, f in finals.items()}
    with Ledger.open_existing(work / names[0] / "ledger.sqlite") as ledger:
        config = ledger.config
        model, tokenizer = load_model(config.model)
        messages = counted_updates(ledger, config)[0]  # `seedflood replay`'s
        replay(model, config, messages, schedule=load_schedule(ledger))
        per_round: dict[int, int] = {}
        for m in ledger.messages():
            per_round[m.round] = per_round.get(m.round, 0) + 1
    replayed = {m.name: m.weight.detach() for m in trainable_tensors(model, config)}
    deviation = {}
    for n in finals:
        live = load_file(work / n / "checkpoint.safetensors")
        deviation[n] = max(float((live[k] - t).abs().max()) for k, t in replayed.items())
    final_eval = None
    if final_eval_examples:
        print(f"scoring the replayed model on {final_eval_examples} test examples...", flush=True)
        task = load_run_task(config)
        metrics = evaluate_metrics(model, tokenizer, task, config, final_eval_examples)
        from seedflood_p2p.workload.data import split_sha256

        scored = task.test[:final_eval_examples]
        final_eval = {
            "eval_examples": len(scored),
            "calibration": config.calibration,  # how the label words were read
            "split": EVAL_SPLIT,  # scored once, at the end; nothing was chosen on it
            "split_sha256": split_sha256(scored, EVAL_SPLIT),
            **metrics,
        }
    return {
        "final_eval": final_eval,
        "ledgers_identical": len(set(digests.values())) == 1 and len(digests) == len(names),
        "ledger_digests": digests,
        "replay_sha256": weights_sha256(model),
        "max_live_deviation": deviation,
        "messages_per_round": per_round,
        "finals": finals,
        "dtype": str(torch.get_default_dtype()),
    }


def plot(work: Path, peers: dict[str, NodeProcess], result: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses: dict[int, list[float]] = {}
    for p in peers.values():
        for e in p.events():
            if e.get("event") == "round":
                losses.setdefault(e["round"], []).append(e["loss"])
    evals = [e for e in peers["peer0"].events() if e.get("event") == "eval"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    rounds = sorted(losses)
    ax = axes[0][0]
    ax.plot(
        rounds,
        [sum(losses[r]) / len(losses[r]) for r in rounds],
        lw=0.8,
        alpha=0.5,
        label="mean over peers",
    )
    window = 10
    if len(rounds) > window:
        means = [sum(losses[r]) / len(losses[r]) for r in rounds]
        smooth = [sum(means[i - window : i]) / window for i in range(window, len(means) + 1)]
        ax.plot(rounds[window - 1 :], smooth, lw=2, label=f"{window}-round average")
    ax.set(title="training loss (perturbed minibatch)", xlabel="round", ylabel="loss")
    ax.legend()
    ax = axes[0][1]
    if evals:
        x = [e["rounds_done"] for e in evals]
        ax.plot(x, [e.get("eval_accuracy", float("nan")) for e in evals], "o-", label="accuracy")
        ax.set(title="held-out accuracy (peer0's live model)", xlabel="rounds done")
        ax2 = ax.twinx()
        ax2.plot(x, [e["eval_loss"] for e in evals], "s--", color="tab:red", label="loss")
        ax2.set_ylabel("held-out loss", color="tab:red")
    ax = axes[1][0]
    per_round = result["messages_per_round"]
    ax.bar(list(per_round), list(per_round.values()), width=1.0)
    ax.set(title="update messages per round (ledger)", xlabel="round", ylabel="messages")
    ax = axes[1][1]
    names = list(result["max_live_deviation"])
    ax.bar(names, [max(v, 1e-12) for v in result["max_live_deviation"].values()])
    ax.set_yscale("log")
    verdict = "identical" if result["ledgers_identical"] else "DIFFERENT"
    ax.set(
        title=f"consensus: ledgers {verdict}; replay sha256 {result['replay_sha256'][:12]}",
        ylabel="max |live - replay| weight",
    )
    fig.suptitle(f"SeedFlood demo: {len(peers)} peers")
    fig.tight_layout()
    path = work / "demo.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(
    config: RunConfig,
    *,
    peers: int,
    rounds: int,
    minutes: float,
    work: Path,
    eval_every: int,
    eval_examples: int,
    round_interval: float = 0.0,
    final_eval_examples: int = 0,
    device: str = "cpu",
) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 2) // peers)
    print(
        f"SeedFlood demo: {peers} peers{'' if device == 'cpu' else ' on ' + device}, "
        f"model {config.model}, dataset {config.dataset}, "
        f"up to {rounds} rounds or {minutes:g} minutes; logs and results in {work}",
        flush=True,
    )
    pool = f"the first {config.train_examples}" if config.train_examples else "all"
    print(
        f"training {config.train_only or 'every matrix of the model'} on {pool} training "
        f"examples; held-out figures: peer0's on {split_label(eval_examples)} as it trains, "
        f"the replayed model's on {split_label(final_eval_examples)} once at the end",
        flush=True,
    )
    procs: dict[str, NodeProcess] = {}
    boot = None
    try:
        boot, address = start_bootstrap(work, config)
        print(f"bootstrap node listening at {address}", flush=True)
        for i in range(peers):
            extra = [
                "--until-round",
                str(rounds),
                "--min-peers",
                str(peers),
                "--startup-wait",
                "600",  # peer0 scores the base model first; the others wait for it
                "--metrics-port",
                "0",
                "--round-interval",
                str(round_interval),
                "--linger",
                "3",
                "--eval-examples",
                str(eval_examples),
                "--device",
                device,
            ]
            if i == 0 and eval_every:
                extra += ["--eval-every", str(eval_every)]
            extra += own_copies(config)
            procs[f"peer{i}"] = start_peer(work, f"peer{i}", address, extra, threads=threads)
        print("peers starting (loading the model)...", flush=True)
        while not any(e.get("event") == "ready" for p in procs.values() for e in p.events()):
            if not all(p.alive for p in procs.values()):
                failed = next(p for p in procs.values() if not p.alive)
                raise RuntimeError(f"{failed.name} exited during startup:\n{failed.tail()}")
            time.sleep(0.5)
        started = time.monotonic()
        last_print = 0.0
        finishing = 0.0  # when the peers were asked to finish
        budget_final_round = None  # the round all peers were asked to end at, if the time ran out
        while any(p.alive for p in procs.values()):
            if time.monotonic() - last_print > 3:
                _print_progress(_progress(procs, work, rounds, started), peers)
                last_print = time.monotonic()
            if finishing and time.monotonic() - finishing > 300:
                print("peers did not finish within 5 minutes: stopping them", flush=True)
                for p in procs.values():
                    p.proc.send_signal(15)
                finishing = float("inf")
            if time.monotonic() - started > minutes * 60 and not finishing:
                finishing = time.monotonic()
                budget_final_round = finish_all(procs, work)
                print(
                    f"time budget of {minutes:g} minutes reached: every peer finishes "
                    f"round {budget_final_round}, then stops",
                    flush=True,
                )
            time.sleep(0.5)
        for p in procs.values():
            p.wait_exit(300)
        final_progress = _progress(procs, work, rounds, started)
    finally:
        for p in procs.values():
            p.stop()
        if boot is not None:
            boot.stop()
    print("checking consensus (canonical replay of the ledger)...", flush=True)
    result = consensus(work, list(procs), final_eval_examples)
    evals = [e for e in procs["peer0"].events() if e.get("event") == "eval"]
    result["evals"] = evals
    result["eval_split"] = EVAL_SPLIT  # the evals' (peer0's periodic figure)
    result["below_start"] = below_start(evals[0], evals[-1]) if evals else False
    result["progress"] = final_progress
    result["time_budget_final_round"] = budget_final_round
    # where each peer computed, from its "ready" event
    result["devices"] = {
        name: next((e.get("device") for e in p.events() if e.get("event") == "ready"), None)
        for name, p in procs.items()
    }
    result["plot"] = str(plot(work, procs, result))
    (work / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    print_summary(result, evals)
    return result


def print_summary(result: dict, evals: list[dict]) -> None:
    print("\npeer     round  gossip  repair  dropped  ledger digest     max |live - replay|")
    for name, final in result["finals"].items():
        dropped = sum(v for k, v in final["dropped"].items() if k not in ("duplicate", "own"))
        print(
            f"{name:8s} {final['round']:5d}  {final['accepted']['gossip']:6d}  "
            f"{final['accepted']['repair']:6d}  {dropped:7d}  "
            f"{result['ledger_digests'][name][:16]}  {result['max_live_deviation'][name]:.2e}"
        )
    if evals:
        first, last = evals[0], evals[-1]
        acc = ""
        if "eval_accuracy" in first:
            acc = f", accuracy {first['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f}"
        on = f" on {last['eval_examples']} examples" if "eval_examples" in last else ""
        print(
            f"\nheld-out ({split_label(last.get('eval_examples'))}) loss {first['eval_loss']:.4f}"
            f" -> {last['eval_loss']:.4f}{acc} "
            f"(rounds {first['rounds_done']} -> {last['rounds_done']}{on})"
        )
        if below_start(first, last):
            figure = "accuracy" if "eval_accuracy" in last else "loss"
            print(
                f"BELOW START: the held-out {figure} ended worse than it began "
                f"({first.get('eval_' + figure):.4f} -> {last.get('eval_' + figure):.4f} on "
                f"{split_label(last.get('eval_examples'))}): this run made the model worse on "
                "those sentences"
            )
    if result.get("final_eval"):
        final = result["final_eval"]
        shown = "  ".join(f"{k} {v:.4f}" for k, v in final.items() if isinstance(v, float))
        read = f", {final['calibration']} calibration" if final.get("calibration") else ""
        split = final.get("split", EVAL_SPLIT)
        print(
            f"replayed model on {final['eval_examples']} held-out examples "
            f"({split}[:{final['eval_examples']}], scored once){read}: {shown}"
        )
    verdict = "yes" if result["ledgers_identical"] else "NO"
    print(
        f"consensus: all ledgers identical: {verdict}; canonical model sha256 "
        f"{result['replay_sha256']}"
    )
    print(f"plot: {result['plot']}")
    if not result["ledgers_identical"]:
        groups: dict[str, list[str]] = {}
        for name, digest in result["ledger_digests"].items():
            groups.setdefault(digest, []).append(name)
        print(
            "error: FORK: the peers' ledgers differ ("
            + "; ".join(f"{', '.join(n)}: {d[:16]}" for d, n in groups.items())
            + "): the run split; see the peers' logs for 'partitioned'",
            file=sys.stderr,
            flush=True,
        )
