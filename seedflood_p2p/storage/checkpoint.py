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

import bisect
import hashlib
import json
import os
from collections.abc import Iterable
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


def tensors_sha256(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order (name, dtype, shape, bytes): a checkpoint
    file whose tensors do not hash to its JSON's `weights_sha256` is damaged or edited."""
    h = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def encode_cut(rows: Iterable[tuple[bytes, int]]) -> dict[str, list[list[int]]]:
    """(peer, round) rows as {peer hex: [[first, last], ...]}: a peer that published
    every round from 0 to 10,000 is one range, so the cut stays small."""
    encoder = CutEncoder()
    for peer, round_ in sorted(set(rows), key=lambda row: (row[1], row[0])):
        encoder.add(peer, round_)
    return encoder.encoded()


class CutEncoder:
    """`encode_cut`, fed rows in canonical order (each peer's rounds ascending) one at a
    time: memory of the ranges, not of the rows (a checkpoint of 10M rows at stop)."""

    def __init__(self) -> None:
        self._ranges: dict[bytes, list[list[int]]] = {}

    def add(self, peer: bytes, round_: int) -> None:
        ranges = self._ranges.setdefault(peer, [])
        if ranges and round_ <= ranges[-1][1]:
            raise ValueError(f"rounds of {peer.hex()[-8:]} out of order: {round_}")
        if ranges and ranges[-1][1] == round_ - 1:
            ranges[-1][1] = round_
        else:
            ranges.append([round_, round_])

    def encoded(self) -> dict[str, list[list[int]]]:
        return {peer.hex(): ranges for peer, ranges in sorted(self._ranges.items())}

    def copy(self) -> CutEncoder:
        other = CutEncoder()
        other._ranges = {peer: [list(r) for r in ranges] for peer, ranges in self._ranges.items()}
        return other


class CutRanges:
    """The (peer, round) rows of an `encode_cut` value, kept as its ranges: `in` and `len`
    as a set of the rows would give, in memory of the ranges (a peer's 10,000 rounds are
    two ints, not 10,000 tuples: a restart at 10M rows would otherwise build a set of
    10M tuples, ~1 GB, to ask which rows its checkpoint covers)."""

    def __init__(self, cut: dict[str, list[list[int]]]) -> None:
        if not isinstance(cut, dict):
            raise ValueError("ledger_cut is not a table")
        self._firsts: dict[bytes, list[int]] = {}
        self._lasts: dict[bytes, list[int]] = {}
        self._rows = 0
        for peer_hex, ranges in cut.items():
            peer = bytes.fromhex(peer_hex)
            firsts, lasts = self._firsts.setdefault(peer, []), self._lasts.setdefault(peer, [])
            for first, last in ranges:
                if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last):
                    raise ValueError(f"bad round range {first}..{last}")
                if lasts and first <= lasts[-1]:
                    raise ValueError(f"round ranges of {peer_hex[-8:]} overlap or are unsorted")
                firsts.append(first)
                lasts.append(last)
                self._rows += last - first + 1

    def __contains__(self, row: tuple[bytes, int]) -> bool:
        peer, round_ = row
        firsts = self._firsts.get(peer)
        if not firsts:
            return False
        i = bisect.bisect_right(firsts, round_) - 1
        return i >= 0 and round_ <= self._lasts[peer][i]

    def __len__(self) -> int:
        return self._rows


def cut_contains(cut: dict[str, list[list[int]]]) -> CutRanges:
    """The (peer, round) rows of an `encode_cut` value; ValueError if it is malformed."""
    return CutRanges(cut)


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
