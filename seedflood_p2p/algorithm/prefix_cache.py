"""A frozen prefix cached per example: forward passes start at the first trained block.

When a run trains only the upper decoder blocks (`train_only`), every forward pass of an
example computes the same hidden states up to the first trained block, round after round.
`ExamplePrefixCache` keeps, per training or held-out example, the hidden states the last
frozen block returns (its real tokens only: rows are right padded and attention is
causal, so padding never changes them). A batch's uncached examples first run through the
frozen blocks, each alone at its own length; then every pass of the batch starts from
the cache. So an example costs one prefix pass the first time it is seen and none after:
the held-out sentences a peer scores again and again, the content-free row of every
calibrated batch, and training examples that recur.

Each alone, so an example's hidden states are a function of the example only, never of
the batch it first came in: a sender and its auditor, whatever they cached before, feed
the trained blocks the same numbers and recompute the same scalars bit for bit, as the
audit rule's rounding tolerance needs (algorithm/audit_rules.py; a pass of the whole padded
batch differs in the last bits, and a two-point scalar divides those by 2 eps). They
differ from a full pass of the model to float rounding, so every peer of a run that
trains upper blocks computes them this way: `max_bytes` 0 keeps nothing and still does.
`max_bytes` bounds the memory (least recently used examples go first): tokens x hidden x
4 bytes per example, ~2.3 kB per token for SmolLM2, ~60 kB for an MR prompt.
"""

from __future__ import annotations

from collections import OrderedDict
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


class _PrefixDone(Exception):
    """Raised by the last frozen block's hook: the prefix pass needs nothing after it."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class ExamplePrefixCache:
    """Per example (by identity), the last frozen block's output; see the module doc."""

    def __init__(
        self, model: nn.Module, matrices: list[TrainableMatrix], max_bytes: int | None = None
    ) -> None:
        prefix = SharedPrefix(model, matrices)
        self.model = model
        self.layers = prefix.layers  # None: nothing before the first trained block
        self.first = prefix.first
        self.max_bytes = max_bytes  # None: unbounded
        # id(example) -> (example, [tokens, hidden]); the example is held so its id is never
        # reused by another object while the entry lives
        self.hidden: OrderedDict[int, tuple[object, torch.Tensor]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0  # rows found in the cache / examples computed
        self.evicted = 0

    @property
    def active(self) -> bool:
        return self.layers is not None

    def status(self) -> dict:
        """Rows found, examples computed, held, pushed out; megabytes held."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "examples": len(self.hidden),
            "evicted": self.evicted,
            "mb": round(self.nbytes / 2**20, 1),
        }

    def fill(self, examples: Sequence[object], batch: dict) -> list[torch.Tensor]:
        """The cached hidden states of `examples` (rows of the tokenized `batch`, in that
        order), running the frozen blocks on the rows not cached yet."""
        keys = [id(e) for e in examples]
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        found = {k: self.hidden[k][1] for k in keys if k in self.hidden}
        for k in found:
            self.hidden.move_to_end(k)
        missing = [row for row, k in enumerate(keys) if k not in found]
        self.hits += len(keys) - len(missing)
        for row in missing:
            if keys[row] in found:  # the same example twice in one batch
                continue
            found[keys[row]] = self._prefix_pass(batch["input_ids"][row, : lengths[row]])
            self.misses += 1
            self.keep(examples[row], found[keys[row]])
        return [found[k] for k in keys]

    @contextmanager
    def batch(self, examples: Sequence[object], batch: dict) -> Iterator[None]:
        """Forward passes inside run on the tokenized `batch` of `examples` (rows in that
        order) from the cache: the frozen blocks are skipped."""
        if self.layers is None:
            yield
            return
        states = self.fill(examples, batch)
        mask = batch["attention_mask"]
        out = states[0].new_zeros((len(states), mask.shape[1], states[0].shape[1]))
        for row, s in enumerate(states):
            out[row, : s.shape[0]] = s
        originals = [self.layers[i] for i in range(self.first)]
        try:
            for i in range(self.first - 1):
                self.layers[i] = _PassThrough()
            self.layers[self.first - 1] = _Recorded(out)
            yield
        finally:
            for i, block in enumerate(originals):
                self.layers[i] = block

    @torch.no_grad()
    def _prefix_pass(self, tokens: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden]: the last frozen block's output for one example's `tokens`
        (no padding); the later blocks never run."""
        device = next(self.model.parameters()).device

        def stop(module: nn.Module, args: tuple, output: object) -> None:
            raise _PrefixDone(output[0] if isinstance(output, tuple) else output)

        handle = self.layers[self.first - 1].register_forward_hook(stop)
        try:
            ids = tokens.unsqueeze(0).to(device)
            self.model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids))
        except _PrefixDone as done:
            return done.hidden[0].detach().clone()
        finally:
            handle.remove()
        raise RuntimeError("the prefix pass never reached the last frozen block")

    def keep(self, example: object, states: torch.Tensor) -> None:
        """Cache `states` ([tokens, hidden], real tokens only) for `example`."""
        key = id(example)
        if key in self.hidden:
            return
        size = states.numel() * states.element_size()
        if self.max_bytes is not None and size > self.max_bytes:
            return
        self.hidden[key] = (example, states)
        self.nbytes += size
        while self.max_bytes is not None and self.nbytes > self.max_bytes:
            _, (_, old) = self.hidden.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
            self.evicted += 1
