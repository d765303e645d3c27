"""Tokenized tensors of a task's examples: prompts, label words, batches of a run.

Classification is scored by the language model itself: the prompt is the task's
template filled with the example's fields and the class is read from the next-token
logits of the label words (see :func:`make_batch`). Completion: prompt then answer,
the loss on the answer's tokens only.
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

__all__ = ["Batcher", "calibrated", "label_token_ids", "make_batch", "sample_batch"]


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

    def _prompt_ids(self, ex: Example, budget: int) -> list[int]:
        """The filled-in template in at most `budget` tokens: when too long, the longest
        field is cut at its end (then the next longest), the template's own text kept."""
        template, values = self.task.template, ex.values()
        ids = self._encode(template.format(**values))
        if len(ids) <= budget:
            return ids
        import string

        pieces: list[tuple[str, list[int]]] = []  # ("" for literal text, else the field)
        for literal, name, _, _ in string.Formatter().parse(template):
            if literal:
                pieces.append(("", self._encode(literal)))
            if name is not None:
                pieces.append((name, self._encode(values[name])))
        fixed = sum(len(t) for n, t in pieces if not n)
        room = budget - fixed
        if room < len([n for n, _ in pieces if n]):
            raise UserError(
                f"max length {self.max_length} leaves no room for the text after the prompt "
                f"template ({fixed} tokens). Raise --max-length"
            )
        lengths = _fit([len(t) if n else -1 for n, t in pieces], room)
        return [
            tok
            for (_, t), length in zip(pieces, lengths, strict=True)
            for tok in (t if length < 0 else t[:length])
        ]

    def _completion_row(self, ex: Example) -> tuple[list[int], int]:
        """(prompt + answer ids, where the answer starts): the answer ends with EOS, and
        keeps at least half of the row when the two do not fit."""
        eos = self.tokenizer.eos_token_id
        answer = self._encode(ex.target or "") + ([eos] if eos is not None else [])
        budget = self.max_length - len(self._bos)
        full = len(self._encode(self.task.template.format(**ex.values())))
        if full + len(answer) > budget:  # the answer keeps what the prompt leaves, or half
            answer = answer[: max(budget - full, budget - budget // 2, 1)]
        prompt = self._prompt_ids(ex, max(1, budget - len(answer)))
        return self._bos + prompt + answer, len(self._bos) + len(prompt)

    def make(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("make_batch needs at least one example")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise UserError("the tokenizer has no pad token. Load the model with load_model()")
        kind = self.task.kind
        rows, starts = [], []
        for ex in examples:
            if kind == "classification":
                budget = self.max_length - len(self._bos) - len(self._prefix)
                rows.append(self._bos + self._prompt_ids(ex, budget) + self._prefix)
            elif kind == "completion":
                row, start = self._completion_row(ex)
                rows.append(row)
                starts.append(start)
            else:
                rows.append((self._bos + self._encode(ex.text))[: self.max_length])
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, : len(r)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if kind == "classification":
            labels = []
            group = _calibration_group(examples)
            if group:
                batch["calibration_group"] = group
            for ex in examples:
                if ex.content_free:
                    continue
                if ex.label is None or not 0 <= ex.label < len(self._label_ids):
                    raise ValueError(
                        f"example without a valid label in a classification batch: {ex}"
                    )
                labels.append(ex.label)
            batch["target_positions"] = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
            batch["label_word_ids"] = torch.tensor(self._label_ids, dtype=torch.long)
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        else:
            labels_t = input_ids.masked_fill(attention_mask == 0, -100)
            for i, start in enumerate(starts):  # completion: the answer's tokens only
                labels_t[i, :start] = -100
            batch["labels"] = labels_t
        return batch


def _fit(lengths: list[int], room: int) -> list[int]:
    """Cut the longest of `lengths` (-1: a fixed piece, kept whole) until the others sum
    to at most `room`: every cut one is left at a common cap (or one more token)."""
    cut = [n for n in lengths if n >= 0]
    low, high = 0, max(cut)
    while low < high:  # the largest cap whose total fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if sum(min(n, mid) for n in cut) <= room else (low, mid - 1)
    spare = room - sum(min(n, low) for n in cut)
    out = []
    for n in lengths:
        if n < 0 or n <= low:
            out.append(n)
        else:
            extra = 1 if spare > 0 and n > low else 0
            spare -= extra
            out.append(low + extra)
    return out


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


def calibrated(task: Task, examples: Sequence[Example], groups: int = 1) -> list[Example]:
    """The rows of a batch of `examples` split into `groups` equal groups: as they are, or,
    when the task calibrates, each group followed by the task's content-free prompt. A
    group's label logits are then read relative to its own content-free row, scored under
    the same direction (SubCGE gives each equal share of a batch its own direction), so the
    label prior, the loss's one sharp direction, drops out of every estimate."""
    if not task.calibration or task.kind != "classification":
        return list(examples)
    if groups < 1 or len(examples) % groups:
        raise ValueError(f"{len(examples)} examples do not split into {groups} groups")
    size = len(examples) // groups
    rows: list[Example] = []
    for g in range(groups):
        rows += [*examples[g * size : (g + 1) * size], task.content_free]
    return rows


def _calibration_group(rows: Sequence[Example]) -> int:
    """Rows per group (the content-free row last) of a calibrated batch; 0: not calibrated."""
    marks = [i for i, ex in enumerate(rows) if ex.content_free]
    if not marks:
        return 0
    group = marks[0] + 1
    if group < 2 or len(rows) % group or marks != list(range(group - 1, len(rows), group)):
        raise ValueError("content-free rows must close equal groups: build rows with calibrated()")
    return group


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
