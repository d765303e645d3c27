"""Rebuild a model as base weights + every ledger message, in canonical order.

Messages are folded into their epoch's r x r cores; the cores of MERGE_GROUP
epochs are merged with one GEMM per matrix (rank MERGE_GROUP * r), so a replay
costs O(messages + epochs * r * d) flops but only epochs / MERGE_GROUP passes
over the weights (10,000 rounds x 8 peers on SmolLM2, 1 thread: 14.4 s, was 62 s). Replaying
the same messages on two machines of the same dtype and device class gives
bitwise-identical weights: the order of every floating-point operation is
fixed by the canonical order (round, peer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from torch import nn

from seedflood_p2p.algorithm.basis import BasisSchedule
from seedflood_p2p.algorithm.subcge import StageTimes, ZerothOrderEstimator, make_estimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.message import UpdateMessage

# The joiner's rule between downloading a checkpoint and replaying the rows it covers
# (peer/daemon.py) uses this cost model: folding one message, and one core's float32 GEMM
# rate for the grouped merges (2 * MERGE_GROUP * r * d flops per group). Calibrated on the
# project's 2-core machines: SmolLM2, 80,000 rows, 500 epochs replay in ~14 s on 1 thread.
REPLAY_ROW_SECONDS = 25e-6
REPLAY_FLOPS = 50e9
CHUNK = 4096  # messages folded per call; chunking does not change the result
MERGE_GROUP = 25  # epochs merged per GEMM (SubCGE); part of the replay's definition


def replay(
    model: nn.Module,
    config: RunConfig,
    messages: Iterable[UpdateMessage],
    progress: Callable[[int, int], None] | None = None,
    times: StageTimes | None = None,
    schedule: BasisSchedule | None = None,
    engine: ZerothOrderEstimator | None = None,
) -> int:
    """Apply `messages` (canonical order required) to `model` in place; returns the count.
    `times`, if given, collects the seconds spent per stage (accumulate, basis, merge).
    `schedule`: the run's basis artifacts (from the ledger), never recomputed here.
    `engine`: the caller's estimator on `model`, holding the artifacts already; it stays
    open and keeps what the replay leaves in it (under momentum the velocity, which the
    training that resumes next goes on from). Default: a fresh one, closed at the end."""
    own = engine is None
    if engine is None:
        engine = make_estimator(model, config)
        for first_epoch, sha in schedule.entries if schedule else []:
            engine.add_basis(first_epoch, schedule.artifacts[sha])
    if times is not None:
        engine.times = times
    round_sizes = None
    if config.round_sized:  # a round's step depends on its size: count first
        messages = list(messages)
        round_sizes = Counter(m.round for m in messages)
    buffer: list[UpdateMessage] = []
    epoch, count, last = None, 0, None
    for message in messages:
        key = (message.round, message.peer)
        if last is not None and key <= last:
            raise ValueError(f"replay needs canonical (round, peer) order; got {key} after {last}")
        last = key
        message_epoch = config.epoch_of(message.round)
        if epoch is not None and (message_epoch != epoch or len(buffer) >= CHUNK):
            count += engine.accumulate(buffer, round_sizes)
            buffer = []
            if message_epoch != epoch:
                if not hasattr(engine, "commit_grouped"):
                    engine.commit()
                elif len(engine.pending_epochs) >= MERGE_GROUP:
                    engine.commit_grouped(MERGE_GROUP)
                if progress is not None:
                    progress(count, epoch)
        epoch = message_epoch
        buffer.append(message)
    count += engine.accumulate(buffer, round_sizes)
    if hasattr(engine, "commit_grouped"):
        engine.commit_grouped(MERGE_GROUP)
    else:
        engine.commit()
    if own:
        engine.close()
    return count


def estimate_replay_seconds(rows: int, rounds: int, config: RunConfig, params: int) -> float:
    """Seconds a replay of `rows` messages spanning `rounds` rounds takes on one core, for a
    model of `params` trainable parameters (the cost model above; an estimate, not a bound)."""
    epochs = -(-max(rounds, 1) // config.refresh_period)
    merges = -(-epochs // MERGE_GROUP)
    flops = merges * 2 * MERGE_GROUP * config.rank * params
    return rows * REPLAY_ROW_SECONDS + flops / REPLAY_FLOPS
