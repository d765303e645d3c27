"""Losses the estimator minimises: prompt-based classification and language modelling.

Batches come from `seedflood_p2p.workload.batching.make_batch`. Classification reads the
logits of the label words (" terrible" / " great") at the end of the prompt
and takes the cross-entropy over those words only, as MeZO does; a calibrated task reads
them relative to a content-free prompt's (`batching.calibrated`). Only the
target positions go through the LM head, which saves its full-vocabulary
matmul at every other position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def on_model_device(model: nn.Module, batch: dict) -> dict:
    """The batch's tensors on the model's device (batches are built on the CPU; a no-op
    there, so CPU runs are unchanged)."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        return batch
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@torch.no_grad()
def label_word_logits(model: nn.Module, batch: dict) -> torch.Tensor:
    """[batch, num_labels] logits of the label words at each prompt's last position."""
    return _label_word_logits(model, batch)


def _label_word_logits(model: nn.Module, batch: dict) -> torch.Tensor:
    batch = on_model_device(model, batch)
    hidden = model.base_model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    last = hidden[rows, batch["target_positions"]]
    logits = model.get_output_embeddings()(last)  # goes through the perturbation hooks
    logits = logits[:, batch["label_word_ids"]].float()
    return calibrate(logits, batch.get("calibration_group", 0))


def calibrate(logits: torch.Tensor, group: int) -> torch.Tensor:
    """Label logits of a batch's rows read relative to their group's content-free row,
    which closes each group of `group` rows (workload.batching.calibrated); the
    content-free rows are dropped. `group` 0: the logits as they are."""
    if not group:
        return logits
    grouped = logits.view(-1, group, logits.shape[1])
    return (grouped[:, :-1] - grouped[:, -1:]).reshape(-1, logits.shape[1])


@torch.no_grad()
def example_losses(model: nn.Module, batch: dict, kind: str) -> torch.Tensor:
    """[batch] loss of each example (what per-example directions are estimated on)."""
    return differentiable_example_losses(model, batch, kind)


def differentiable_example_losses(model: nn.Module, batch: dict, kind: str) -> torch.Tensor:
    """`example_losses` under the caller's grad mode: a K-FAC basis publisher backpropagates
    it (algorithm/basis.py); peers never do."""
    batch = on_model_device(model, batch)
    if kind == "classification":
        logits = _label_word_logits(model, batch)
        return F.cross_entropy(logits, batch["labels"], reduction="none")
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    token = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), labels, reduction="none", ignore_index=-100
    )
    return token.sum(1) / (labels != -100).sum(1).clamp(min=1)


@torch.no_grad()
def batch_loss(model: nn.Module, batch: dict, kind: str) -> tuple[float, float | None]:
    """(mean loss, accuracy or None) of one batch."""
    batch = on_model_device(model, batch)
    if kind == "classification":
        logits = label_word_logits(model, batch)
        labels = batch["labels"]
        loss = F.cross_entropy(logits, labels)
        accuracy = (logits.argmax(dim=-1) == labels).float().mean().item()
        return loss.item(), accuracy
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
    )
    return out.loss.float().item(), None
