"""One zeroth-order step, evaluation, and `seedflood train` (simulated peers in one process).

The step is the same one the peer daemon runs: sample the peer's minibatch
for the round, estimate the projected gradient along each of the message's k derived
directions (direction j on the j-th share of the batch, all k in the same two forward
passes), optionally normalise them, round them to wire precision. Applying is separate
(`live.LiveModel.apply`), so a sender applies its own message exactly as receivers do.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from seedflood_p2p.algorithm.basis import BasisArtifact, compute_basis
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.objective import (
    batch_loss,
    differentiable_example_losses,
    example_losses,
    label_word_logits,
)
from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
from seedflood_p2p.algorithm.subcge import Direction, SubCGE, ZerothOrderEstimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.rng import derive_key
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.batching import calibrated, make_batch, sample_batch
from seedflood_p2p.workload.data import Task

log = logging.getLogger("seedflood.train")


def batch_seed(run_key: bytes, peer: bytes, round_: int) -> int:
    """Which training examples a peer uses in a round (reproducible, distinct per peer)."""
    k0, k1 = derive_key("seedflood/data", run_key, peer, round_)
    return k1 << 32 | k0


def zo_step(
    engine: ZerothOrderEstimator,
    tokenizer,
    task: Task,
    peer: bytes,
    round_: int,
    prefix_cache: ExamplePrefixCache | None = None,
) -> tuple[UpdateMessage, float]:
    """Estimate this peer's update for `round_`; returns (message, training loss)."""
    config = engine.config
    examples = sample_batch(task, batch_seed(config.run_key, peer, round_), config.batch_size)
    direction = engine.direction(peer, round_)
    rows = calibrated(task, examples, direction.count)
    batch = make_batch(rows, tokenizer, task, config.max_length)
    with _cached(prefix_cache, rows, batch):
        g, loss = engine.estimate(
            lambda: example_losses(engine.model, batch, task.kind), direction, len(rows)
        )
    if not all(math.isfinite(x) for x in g):
        raise FloatingPointError(f"non-finite projected gradient at round {round_}: lower lr")
    return UpdateMessage(round_, peer, quantize_scalars(normalize(g, config.normalize))), loss


def zo_steps(
    engine: ZerothOrderEstimator,
    tokenizer,
    task: Task,
    peers: list[bytes],
    round_: int,
    prefix_cache: ExamplePrefixCache | None = None,
) -> list[tuple[UpdateMessage, float]]:
    """`zo_step` for several simulated peers in the same two forward passes: their batches
    are stacked and every example carries its own peer's direction (SubCGE's per-example
    perturbation). Each peer's scalars equal its `zo_step` up to float rounding (another
    batch composition and padding length), so a simulation may use it and a network peer,
    whose scalars audits recompute, does not. Returns (message, training loss) per peer."""
    if len(peers) == 1 or not isinstance(engine, SubCGE):
        return [zo_step(engine, tokenizer, task, p, round_, prefix_cache) for p in peers]
    config = engine.config
    size = config.batch_size
    examples = [
        e for p in peers for e in sample_batch(task, batch_seed(config.run_key, p, round_), size)
    ]
    own = [engine.direction(p, round_) for p in peers]
    rows = calibrated(task, examples, len(peers) * config.directions)
    batch = make_batch(rows, tokenizer, task, config.max_length)
    stacked = Direction(
        b"",
        round_,
        own[0].epoch,
        np.concatenate([d.a for d in own]),
        np.concatenate([d.b for d in own]),
        np.concatenate([d.sign for d in own]),
    )
    with _cached(prefix_cache, rows, batch):
        g, losses = engine.estimates(
            lambda: example_losses(engine.model, batch, task.kind), stacked, len(rows)
        )
    k = config.directions
    out = []
    for i, peer in enumerate(peers):
        mine = tuple(g[i * k : (i + 1) * k].tolist())
        if not all(math.isfinite(x) for x in mine):
            raise FloatingPointError(f"non-finite projected gradient at round {round_}: lower lr")
        message = UpdateMessage(round_, peer, quantize_scalars(normalize(mine, config.normalize)))
        out.append((message, float(losses[i * size : (i + 1) * size].mean())))
    return out


def normalize(g: tuple[float, ...], how: str) -> tuple[float, ...]:
    """The sender's own scaling of its estimates.

    "rms" divides by the root mean square of the k estimates, so a step's size does not
    follow the loss's scale (FZOO-style); with k == 1 that is the sign of the estimate.
    "none" and "unit" send the estimates as they are ("unit": receivers scale them, see
    `subcge.step_coefficients`, and audits can still recompute what was sent).
    """
    if how != "rms":
        return g
    rms = math.sqrt(sum(x * x for x in g) / len(g))
    return tuple(x / rms for x in g) if rms > 0 else g


def _cached(cache: ExamplePrefixCache | None, examples: list, batch: dict):
    return nullcontext() if cache is None else cache.batch(examples, batch)


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    task: Task,
    config: RunConfig,
    max_examples: int = 200,
    prefix_cache: ExamplePrefixCache | None = None,
) -> tuple[float, float | None]:
    """(mean loss, accuracy or None) on the first `max_examples` held-out examples."""
    metrics = evaluate_metrics(model, tokenizer, task, config, max_examples, prefix_cache)
    return metrics["loss"], metrics.get("accuracy")


@torch.no_grad()
def evaluate_metrics(
    model,
    tokenizer,
    task: Task,
    config: RunConfig,
    max_examples: int = 200,
    prefix_cache: ExamplePrefixCache | None = None,
    per_example: bool = False,
) -> dict[str, Any]:
    """Held-out figures on the first `max_examples` test examples: "loss" (mean over
    examples) and, for classification, "accuracy" and "macro_f1" (the mean over labels of
    each label's F1; a label neither predicted nor present counts 0 and is left out),
    otherwise "perplexity" (exp of the mean token loss: answer tokens for completion).
    `per_example` (classification) adds "correct": one "1"/"0" per example in order, so two
    models scored on the same sentences can be compared pairwise (a paired SE)."""
    examples = task.test[:max_examples]
    if not examples:
        raise UserError(
            f"nothing to evaluate: asked for {max_examples} held-out examples and the test "
            f"split has {len(task.test)}; pass --eval-examples (or --examples) >= 1"
        )
    classification = task.kind == "classification"
    total_loss, count, tokens, token_loss = 0.0, 0, 0, 0.0
    predicted: list[int] = []
    truth: list[int] = []
    for start in range(0, len(examples), config.batch_size):
        chunk = examples[start : start + config.batch_size]
        rows = calibrated(task, chunk)
        batch = make_batch(rows, tokenizer, task, config.max_length)
        if classification:
            with _cached(prefix_cache, rows, batch):
                logits = label_word_logits(model, batch).cpu()
            loss = torch.nn.functional.cross_entropy(logits, batch["labels"]).item()
            predicted += logits.argmax(dim=-1).tolist()
            truth += batch["labels"].tolist()
        else:
            with _cached(prefix_cache, rows, batch):
                loss, _ = batch_loss(model, batch, task.kind)
            n = int((batch["labels"][:, 1:] != -100).sum())
            token_loss += loss * n
            tokens += n
        total_loss += loss * len(chunk)
        count += len(chunk)
    out = {"loss": total_loss / count}
    if classification:
        out["accuracy"] = sum(p == t for p, t in zip(predicted, truth, strict=True)) / count
        out["macro_f1"] = macro_f1(predicted, truth, task.num_labels)
        if per_example:
            out["correct"] = "".join("1" if p == t else "0" for p, t in zip(predicted, truth))
    else:
        out["perplexity"] = math.exp(min(token_loss / max(tokens, 1), 700.0))
    return out


def macro_f1(predicted: list[int], truth: list[int], num_labels: int) -> float:
    """Mean F1 over the labels that occur in `truth` or `predicted`."""
    scores = []
    for label in range(num_labels):
        tp = sum(p == label and t == label for p, t in zip(predicted, truth, strict=True))
        fp = sum(p == label and t != label for p, t in zip(predicted, truth, strict=True))
        fn = sum(p != label and t == label for p, t in zip(predicted, truth, strict=True))
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores) if scores else 0.0


def format_metrics(metrics: dict[str, float]) -> str:
    """`loss 0.6931  accuracy 0.5000  macro-F1 0.3333` (or `... perplexity 2.0000`)."""
    names = {"macro_f1": "macro-F1"}
    return "  ".join(f"{names.get(k, k)} {v:.4f}" for k, v in metrics.items())


def basis_due(config: RunConfig, round_: int) -> int | None:
    """The epoch whose first round `round_` is, if a basis artifact is due then: epoch 0,
    and every `basis_refresh` epochs after it (a pure function of the settings)."""
    if not config.data_basis or round_ % config.refresh_period:
        return None
    epoch = config.epoch_of(round_)
    if epoch == 0 or (config.basis_refresh and epoch % config.basis_refresh == 0):
        return epoch
    return None


def make_basis(engine: ZerothOrderEstimator, tokenizer, task: Task, round_: int) -> BasisArtifact:
    """The activation basis of the model as it is now, on the first `basis_examples` training
    prompts (labels unused; basis "kfac" also backpropagates their losses for the U sides):
    what the run's basis publisher computes at an epoch's start."""
    config = engine.config
    examples = task.train[: config.basis_examples]
    size = config.batch_size
    batches = (
        make_batch(calibrated(task, examples[i : i + size]), tokenizer, task, config.max_length)
        for i in range(0, len(examples), size)
    )
    return compute_basis(
        engine.model,
        engine.matrices,
        batches,
        config.rank,
        config.basis_damping,
        meta={"run": config.run_id, "round": str(round_)},
        loss_of=(
            (lambda model, batch: differentiable_example_losses(model, batch, task.kind))
            if config.basis == "kfac"
            else None
        ),
        output_damping=config.basis_output_damping,
        fisher_power=config.basis_fisher_power,
    )


@dataclass
class RoundRecord:
    round: int
    train_loss: float
    eval_loss: float | None
    eval_accuracy: float | None
    seconds: float


def train_local(
    engine: ZerothOrderEstimator,
    tokenizer,
    task: Task,
    *,
    peers: int,
    rounds: int,
    ledger: Ledger | None = None,
    eval_every: int = 0,
    eval_examples: int = 200,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_basis: Callable[[int, BasisArtifact], None] | None = None,
    prefix_cache: ExamplePrefixCache | None = None,
    peers_per_pass: int = 1,
) -> list[RoundRecord]:
    """Simulated peers in one process: every round each peer estimates on the same model,
    the messages are logged, then all are applied as the network would apply them.

    `ledger` needs only `max_round` and `add` (a benchmark passes a stand-in); the model
    must already hold it (`LiveModel.restore`, or a replay), and the engine the ledger's basis
    artifacts. Under basis "activation" or "kfac" the loop is the basis publisher too: at each
    due epoch it computes the artifact from the model, uses it, and hands it to `on_basis`.
    `peers_per_pass` > 1 estimates that many peers in one pair of forward passes
    (`zo_steps`: on a GPU one large batch instead of many small ones)."""
    live = LiveModel(engine)
    peer_ids = [f"local-{i}".encode() for i in range(peers)]
    start = (ledger.max_round() + 1) if ledger is not None else 0
    records = []
    for round_ in range(start, rounds):
        t0 = time.perf_counter()
        due = basis_due(engine.config, round_)
        if due is not None and not any(e == due for e, _ in engine.schedule.entries):
            artifact = make_basis(engine, tokenizer, task, round_)
            engine.add_basis(due, artifact)
            log.info(
                "basis artifact for epoch %d: %s (%d bytes)",
                due,
                artifact.sha256[:16],
                artifact.size,
            )
            if on_basis is not None:
                on_basis(due, artifact)
        messages, losses = [], []
        for i in range(0, peers, peers_per_pass):
            chunk = peer_ids[i : i + peers_per_pass]
            for message, loss in zo_steps(engine, tokenizer, task, chunk, round_, prefix_cache):
                messages.append(message)
                losses.append(loss)
        if ledger is not None:
            ledger.add(messages)  # log before apply: the ledger is the source of truth
        live.apply(messages)
        eval_loss = eval_acc = None
        if eval_every and ((round_ + 1) % eval_every == 0 or round_ + 1 == rounds):
            eval_loss, eval_acc = evaluate(
                engine.model, tokenizer, task, engine.config, eval_examples, prefix_cache
            )
        record = RoundRecord(
            round_, sum(losses) / len(losses), eval_loss, eval_acc, time.perf_counter() - t0
        )
        records.append(record)
        if on_round is not None:
            on_round(record)
    return records
