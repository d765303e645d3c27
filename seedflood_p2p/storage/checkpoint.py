"""Checkpoint files: a live model's trainable weights and the ledger cut they equal.

Two files in a directory: `checkpoint.safetensors` (the weights) and `checkpoint.json`
(at least `ledger_digest`, the digest of the ledger messages the weights hold on top of
the base). The JSON is written after the weights, each one fsynced before and after its
rename, so a JSON that is there names weights that are there: a crash while writing
leaves the previous checkpoint, or none, never a JSON describing other weights.

The JSON also records the cut itself, compactly (`encode_cut`: per peer, its rounds as
ranges), and `weights_sha256`, a hash of the tensors in the file (`tensors_sha256`). A
restart then loads the weights if the file hashes as recorded and the ledger's rows
inside the cut still digest to `ledger_digest`, and applies only the ledger rows outside
it (algorithm/live.py:LiveModel.restore), instead of replaying everything.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from seedflood_p2p.storage.cut import CutRanges, cut_contains

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


def read_checkpoint_tensor(directory: Path, name: str) -> torch.Tensor | None:
    """One tensor of the checkpoint file, without reading the others; None if it has none
    of that name."""
    from safetensors import safe_open

    with safe_open(Path(directory) / WEIGHTS_FILE, framework="pt", device="cpu") as f:
        return f.get_tensor(name) if name in f.keys() else None  # noqa: SIM118 - not a dict


def tensors_sha256(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order (name, dtype, shape, bytes): a checkpoint
    file whose tensors do not hash to its JSON's `weights_sha256` is damaged or edited."""
    h = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def unchanged_rows(ledger, directory: Path) -> CutRanges | None:
    """The (peer, round) rows the checkpoint in `directory` covers, if `ledger` still holds
    them byte for byte as when it was written (its `ledger_rows_sha256`, recorded by the
    peer daemon beside the cut); else None. Those rows were checked when they were admitted
    or at an earlier start, so `Ledger.verify(trusted=...)` need not check their signatures
    again: a restart checks only the rows after its checkpoint."""
    try:
        meta = read_checkpoint_meta(directory)
        covered = cut_contains(meta["ledger_cut"])
        recorded = meta["ledger_rows_sha256"]
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None
    return covered if ledger.rows_sha256(covered) == recorded else None
