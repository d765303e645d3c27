"""The multi-process tests' core check: a peer's live model is base + ledger.

A peer's checkpoint holds its live weights, merged round by round in arrival order; a
replay of its counted updates applies them in canonical order. The same sums in another
order: they agree to float32 rounding (LIVE_VS_REPLAY_ATOL), not bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.workload.models import load_model, weights_sha256

LIVE_VS_REPLAY_ATOL = 1e-5


def replay_equals_live(
    data_dir: Path,
    config: RunConfig,
    messages: list[UpdateMessage],
    *,
    schedule=None,
    atol: float = LIVE_VS_REPLAY_ATOL,
) -> tuple[str, torch.nn.Module]:
    """Replay `messages` onto the run's base model, assert that the peer's live checkpoint
    (DATA_DIR/checkpoint.safetensors) equals it on every trained matrix to `atol`, and
    return the replay's weights sha256 and the replayed model."""
    model, _ = load_model(config.model)
    replay(model, config, messages, schedule=schedule)
    live = load_file(Path(data_dir) / "checkpoint.safetensors")
    for matrix in make_estimator(model, config).matrices:
        torch.testing.assert_close(live[matrix.name], matrix.weight.detach(), atol=atol, rtol=0)
    return weights_sha256(model), model
