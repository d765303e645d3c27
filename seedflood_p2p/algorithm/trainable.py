"""Which weights SubCGE trains, and the rank-one perturbation applied in the forward pass.

Every 2-D weight of a Linear, Embedding or transformers Conv1D module is a
trainable matrix W (m x k, as stored). The two-point estimate evaluates the
model at W + s * u v^T without touching W: a forward hook adds the rank-one
term to the module's output, so the stored weights stay bitwise unchanged
(MeZO's in-place add/subtract drifts by rounding, which would break consensus).
Tied weights (an embedding reused as the LM head) are one matrix hooked at
every module that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

try:  # GPT-2 style models store linear maps as (in, out) in a Conv1D module.
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a hard dependency
    Conv1D = ()


@dataclass
class TrainableMatrix:
    name: str
    weight: nn.Parameter
    modules: list[nn.Module]
    is_embedding: bool
    # Set while a perturbed forward runs: (u, v, scale) with W_eff = W + scale * u v^T.
    perturbation: tuple[torch.Tensor, torch.Tensor, float] | None = field(default=None)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]


def find_trainable_matrices(
    model: nn.Module, include_embeddings: bool = False
) -> list[TrainableMatrix]:
    """The model's trainable matrices in a canonical order (sorted by parameter name)."""
    users: dict[int, list[nn.Module]] = {}
    embedding_ids: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if isinstance(module, nn.Embedding):
            embedding_ids.add(id(weight))
        elif not isinstance(module, (nn.Linear, Conv1D)):
            continue
        users.setdefault(id(weight), []).append(module)
    matrices = []
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if id(param) not in users:
            continue
        is_embedding = id(param) in embedding_ids
        if is_embedding and not include_embeddings:
            continue
        matrices.append(TrainableMatrix(name, param, users[id(param)], is_embedding))
    return matrices


def _rank_one_hook(matrix: TrainableMatrix):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if matrix.perturbation is None:
            return None
        u, v, scale = matrix.perturbation
        x = args[0]
        if isinstance(module, nn.Embedding):  # y = W[x]
            return output + scale * u[x].unsqueeze(-1) * v
        if isinstance(module, nn.Linear):  # y = x W^T, W is (out, in)
            return output + scale * (x @ v).unsqueeze(-1) * u
        return output + scale * (x @ u).unsqueeze(-1) * v  # Conv1D: y = x W, W is (in, out)

    return hook


def install_perturbation_hooks(matrices: list[TrainableMatrix]) -> list:
    """Attach the rank-one hooks; returns handles (call .remove() to detach)."""
    handles = []
    for matrix in matrices:
        for module in matrix.modules:
            handles.append(module.register_forward_hook(_rank_one_hook(matrix)))
    return handles
