"""Checkpoint files: a live model's trainable weights and the ledger cut they equal.

Two files in a directory: `checkpoint.safetensors` (the weights) and `checkpoint.json`
(at least `ledger_digest`, the digest of the ledger messages the weights hold on top of
the base). The JSON is written after the weights, each one fsynced before and after its
rename, so a JSON that is there names weights that are there: a crash while writing
leaves the previous checkpoint, or none, never a JSON describing other weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "checkpoint.safetensors"
META_FILE = "checkpoint.json"


def _durable_replace(tmp: Path, final: Path) -> None:
    """Rename `tmp` over `final` once its bytes are on disk, and the rename too."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_checkpoint(directory: Path, weights: dict[str, torch.Tensor], meta: dict) -> None:
    directory = Path(directory)
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(weights, tmp)
    _durable_replace(tmp, directory / WEIGHTS_FILE)
    tmp = directory / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    _durable_replace(tmp, directory / META_FILE)  # after the weights: see the docstring


def read_checkpoint_meta(directory: Path) -> dict:
    """The checkpoint's JSON; FileNotFoundError when there is none (a fresh peer)."""
    return json.loads((Path(directory) / META_FILE).read_text())


def read_checkpoint_weights(directory: Path, device: str | torch.device) -> dict:
    return load_file(Path(directory) / WEIGHTS_FILE, device=str(device))
