"""Tokenized tensors of a task's examples: prompts, label words, batches of a run.

Classification is scored by the language model itself: the prompt is
``template.format(text=...)`` and the class is read from the next-token
logits of the label words (see :func:`make_batch`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.workload.data import Example, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Batcher", "label_token_ids", "make_batch", "sample_batch"]


def label_token_ids(
    tokenizer: PreTrainedTokenizerBase, label_words: Sequence[str]
) -> tuple[list[int], list[int]]:
    """``(common_prefix_ids, label_word_ids)`` for scoring label words by one token.

    Each label word is tokenized on its own; the longest common prefix of
    those token lists is appended to every prompt, and the label is read from
    the logit of the first token where the words differ. (For a byte-level
    tokenizer " great"/" terrible" share the space token; for SmolLM2 each is
    a single token and the prefix is empty.)
    """
    seqs = [list(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in label_words]
    if len(seqs) < 2:
        raise UserError("a classification task needs at least 2 label words")
    k = 0
    while all(len(s) > k for s in seqs) and len({s[k] for s in seqs}) == 1:
        k += 1
    if any(len(s) <= k for s in seqs):
        raise UserError(
            f"label words {list(label_words)!r}: one tokenizes to a prefix of another. "
            "Choose label words that differ in at least one token"
        )
    firsts = [s[k] for s in seqs]
    if len(set(firsts)) != len(firsts):
        raise UserError(
            f"label words {list(label_words)!r} do not all differ at their first differing "
            f"token (token ids {firsts}). Choose label words that start differently"
        )
    return seqs[0][:k], firsts


def _bos_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts in front of a text (BOS or nothing)."""
    with_special = list(tokenizer("x")["input_ids"])
    without = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    for i in range(len(with_special) - len(without) + 1):
        if with_special[i : i + len(without)] == without:
            return with_special[:i]
    return []


@dataclass
class Batcher:
    """Builds batches for one (task, tokenizer) pair, caching the label tokens.

    ``Batcher(task, tokenizer, max_length)(examples)`` is
    ``make_batch(examples, tokenizer, task, max_length)``.
    """

    task: Task
    tokenizer: PreTrainedTokenizerBase
    max_length: int = 256
    _prefix: list[int] = field(init=False, repr=False)
    _label_ids: list[int] = field(init=False, repr=False)
    _bos: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise UserError(f"max length {self.max_length} is too small: use at least 16")
        self._bos = _bos_prefix(self.tokenizer)
        if self.task.kind == "classification":
            self._prefix, self._label_ids = label_token_ids(self.tokenizer, self.task.label_words)
        else:
            self._prefix, self._label_ids = [], []

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        return self.make(examples)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt_ids(self, text: str) -> list[int]:
        template = self.task.template
        budget = self.max_length - len(self._bos) - len(self._prefix)
        ids = self._encode(template.format(text=text))
        if len(ids) <= budget:
            return ids
        # Too long: cut the end of the text, keep the template around it.
        before, _, after = template.partition("{text}")
        head = self._encode(before) if before else []
        tail = self._encode(after) if after else []
        room = budget - len(head) - len(tail)
        if room < 1:
            raise UserError(
                f"max length {self.max_length} leaves no room for the text after the prompt "
                f"template ({len(head) + len(tail)} tokens). Raise --max-length"
            )
        return head + self._encode(text)[:room] + tail

    def make(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("make_batch needs at least one example")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise UserError("the tokenizer has no pad token. Load the model with load_model()")
        classification = self.task.kind == "classification"
        rows = []
        for ex in examples:
            if classification:
                rows.append(self._bos + self._prompt_ids(ex.text) + self._prefix)
            else:
                rows.append((self._bos + self._encode(ex.text))[: self.max_length])
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, : len(r)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if classification:
            labels = []
            for ex in examples:
                if ex.label is None or not 0 <= ex.label < len(self._label_ids):
                    raise ValueError(
                        f"example without a valid label in a classification batch: {ex}"
                    )
                labels.append(ex.label)
            batch["target_positions"] = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
            batch["label_word_ids"] = torch.tensor(self._label_ids, dtype=torch.long)
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        else:
            batch["labels"] = input_ids.masked_fill(attention_mask == 0, -100)
        return batch


def make_batch(
    examples: Sequence[Example],
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    max_length: int = 256,
) -> dict[str, torch.Tensor]:
    """Tensors for a batch of examples (right padded with the tokenizer's pad token).

    Always ``input_ids`` and ``attention_mask`` of shape ``[B, L]``.
    Classification: the prompt is ``task.template`` filled with the text
    (the text is cut at its end if the row would exceed ``max_length``),
    followed by the label words' common token prefix; ``target_positions``
    ``[B]`` is the last real position of each row (whose next-token logits
    score the labels), ``label_word_ids`` ``[num_labels]`` the token that
    stands for each label and ``labels`` ``[B]`` the class indices.
    Language modelling: ``labels`` is ``input_ids`` with padding set to -100
    (the model shifts it), rows cut to ``max_length`` tokens.
    A BOS token is prepended when the tokenizer normally adds one.
    For many batches with one tokenizer, a :class:`Batcher` avoids
    re-tokenizing the label words each time.
    """
    return Batcher(task, tokenizer, max_length).make(examples)


def sample_batch(task: Task, rng_seed: int, batch_size: int) -> list[Example]:
    """``batch_size`` training examples drawn by ``random.Random(rng_seed)``.

    Without replacement when the train set is large enough, with replacement
    otherwise; the same seed always gives the same examples.
    """
    if not task.train:
        raise UserError(f"task '{task.name}' has no training examples")
    if batch_size < 1:
        raise UserError(f"batch size {batch_size} must be at least 1")
    rng = random.Random(rng_seed)
    if batch_size <= len(task.train):
        return rng.sample(task.train, batch_size)
    return rng.choices(task.train, k=batch_size)
