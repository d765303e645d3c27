"""A frozen prefix cached per example: forward passes start at the first trained block.

When a run trains only the upper decoder blocks (`train_only`), every forward pass of an
example computes the same hidden states up to the first trained block, round after round.
`ExamplePrefixCache` keeps, per training or held-out example, the hidden states the last
frozen block returns (its real tokens only: rows are right padded and attention is
causal, so padding never changes them), and later batches of cached examples skip the
frozen blocks. An opt-in for `seedflood train` and the learning benchmark, where the same
examples recur thousands of times; a row that uses it says so. The hidden states of a
cached example equal a full pass's to float rounding (another batch composition), not
bitwise, so a network peer does not use it (audits recompute scalars with full passes).

Memory: tokens x hidden x 4 bytes per cached example (SmolLM2: ~2.3 kB per token).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from seedflood_p2p.algorithm.trainable import (
    SharedPrefix,
    TrainableMatrix,
    _PassThrough,
    _Recorded,
)


class ExamplePrefixCache:
    def __init__(self, model: nn.Module, matrices: list[TrainableMatrix]) -> None:
        prefix = SharedPrefix(model, matrices)
        self.layers = prefix.layers  # None: nothing before the first trained block
        self.first = prefix.first
        self.hidden: dict[int, torch.Tensor] = {}  # id(example) -> [tokens, hidden]
        self.hits = self.misses = 0

    @property
    def active(self) -> bool:
        return self.layers is not None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.hidden.values())

    @contextmanager
    def batch(self, examples: Sequence[object], attention_mask: torch.Tensor) -> Iterator[None]:
        """Forward passes inside run on the batch of `examples` (rows in that order, with
        `attention_mask`): from the cache when every example is in it, else recording."""
        if self.layers is None:
            yield
            return
        keys = [id(e) for e in examples]
        lengths = attention_mask.sum(dim=1).tolist()
        if all(k in self.hidden for k in keys):
            self.hits += 1
            some = next(iter(self.hidden.values()))
            out = some.new_zeros((len(keys), attention_mask.shape[1], some.shape[1]))
            for row, (key, n) in enumerate(zip(keys, lengths)):
                out[row, :n] = self.hidden[key][:n]
            originals = [self.layers[i] for i in range(self.first)]
            try:
                for i in range(self.first - 1):
                    self.layers[i] = _PassThrough()
                self.layers[self.first - 1] = _Recorded(out)
                yield
            finally:
                for i, block in enumerate(originals):
                    self.layers[i] = block
            return
        self.misses += 1
        seen: list[torch.Tensor] = []

        def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not seen:  # the first pass is the unperturbed-prefix one: all passes agree
                seen.append(output.detach())

        handle = self.layers[self.first - 1].register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()
        if seen:
            for row, (key, n) in enumerate(zip(keys, lengths)):
                self.hidden.setdefault(key, seen[0][row, :n].clone())
