"""Which weights SubCGE trains, and the rank-one perturbation applied in the forward pass.

Trainable tensors:
- every 2-D weight of a Linear, Embedding or transformers Conv1D module (a matrix W,
  m x k as stored; embeddings only when asked);
- optionally the scale vector of every normalisation layer (RMSNorm, LayerNorm), held
  as an m x 1 matrix. Measured on SmolLM2 + MR (bench/results/grad_energy.md): these
  35k weights carry ~10% of the loss gradient's energy in 0.03% of the parameters, and a
  zeroth-order step gains in proportion to that density.

The two-point estimate evaluates the model at W + s * u v^T without touching W: a
forward hook adds the rank-one term to the module's output, so the stored weights stay
bitwise unchanged (MeZO's in-place add/subtract drifts by rounding, which would break
consensus). A forward may carry several directions at once: example b of the batch is
evaluated along direction ``rows[b]`` (one forward, many directions). Tied weights (an
embedding reused as the LM head) are one matrix hooked at every module that uses it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

try:  # GPT-2 style models store linear maps as (in, out) in a Conv1D module.
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a hard dependency
    Conv1D = ()


@dataclass
class Perturbation:
    """Directions active in a forward pass: W_eff(example b) = W + scale[j] u[j] v[j]^T,
    j = rows[b]. u is [G, m], v is [G, k], scale [G]; with G == 1 every example shares it."""

    u: torch.Tensor
    v: torch.Tensor
    scale: torch.Tensor

    def per_example(self, rows: torch.Tensor | None) -> Perturbation:
        if rows is None or self.u.shape[0] == 1:
            return self
        return Perturbation(self.u[rows], self.v[rows], self.scale[rows])


@dataclass
class TrainableMatrix:
    name: str
    weight: nn.Parameter
    modules: list[nn.Module]
    kind: str  # "linear" | "conv1d" | "embedding" | "norm"
    perturbation: Perturbation | None = field(default=None)

    @property
    def is_embedding(self) -> bool:
        return self.kind == "embedding"

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "norm":
            return (self.weight.shape[0], 1)
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def as_2d(self) -> torch.Tensor:
        """The weight as its m x k matrix (a view: writing it writes the weight)."""
        return self.weight.view(self.shape)

    def add_(self, delta: torch.Tensor, alpha: float = 1.0) -> None:
        """W += alpha * delta, delta in the m x k shape of `shape`."""
        self.as_2d().add_(delta, alpha=alpha)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(
        "RMSNorm"
    )


def find_trainable_matrices(
    model: nn.Module,
    include_embeddings: bool = False,
    include_norms: bool = False,
    only: str = "",
) -> list[TrainableMatrix]:
    """The model's trainable tensors in a canonical order (sorted by parameter name).

    `only`: comma-separated shell globs over parameter names (e.g.
    ``model.norm.weight,model.layers.2[89].*``); when given, candidates must match one.
    """
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    users: dict[int, list[nn.Module]] = {}
    kinds: dict[int, str] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter):
            continue
        if weight.dim() == 1 and include_norms and _is_norm(module):
            kind = "norm"
        elif weight.dim() != 2:
            continue
        elif isinstance(module, nn.Embedding):
            kind = "embedding"
        elif isinstance(module, nn.Linear):
            kind = "linear"
        elif Conv1D and isinstance(module, Conv1D):
            kind = "conv1d"
        else:
            continue
        users.setdefault(id(weight), []).append(module)
        # A tied weight used by an Embedding and a Linear counts as an embedding.
        if kinds.get(id(weight)) != "embedding":
            kinds[id(weight)] = kind
    matrices = []
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if id(param) not in users:
            continue
        if kinds[id(param)] == "embedding" and not include_embeddings:
            continue
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        matrices.append(TrainableMatrix(name, param, users[id(param)], kinds[id(param)]))
    return matrices


def _normalized_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a norm layer multiplies its scale vector by (d output / d weight)."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, eps=module.eps)
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _project(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x @ v per example: x [B, ..., k], v [G, k] with G in (1, B) -> [B, ...]."""
    if v.shape[0] == 1:
        return x @ v[0]
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    return torch.bmm(flat, v.unsqueeze(-1)).reshape(x.shape[:-1])


def _expand(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[G, n] -> [G, 1, ..., 1, n] broadcasting against `like` [B, ..., n]."""
    return t.reshape(t.shape[0], *([1] * (like.dim() - 2)), t.shape[-1])


def _scale(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return s.reshape(s.shape[0], *([1] * (like.dim() - 1)))


def _rank_one_hook(matrix: TrainableMatrix):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        p = matrix.perturbation
        if p is None:
            return None
        x = args[0]
        if p.u.shape[0] > 1 and p.u.shape[0] != x.shape[0]:
            raise ValueError(f"{p.u.shape[0]} directions for a batch of {x.shape[0]}")
        if matrix.kind == "norm":  # y = w * xhat; W is m x 1, v is a +-1 scalar
            s = p.scale * p.v[:, 0]
            return output + _scale(s, output) * _expand(p.u, output) * _normalized_input(module, x)
        if isinstance(module, nn.Embedding):  # y = W[x]
            ux = p.u[0][x] if p.u.shape[0] == 1 else torch.gather(p.u, 1, x.reshape(x.shape[0], -1))
            ux = ux.reshape(x.shape) * _scale(p.scale, x)
            return output + ux.unsqueeze(-1) * _expand(p.v, output)
        if isinstance(module, nn.Linear):  # y = x W^T, W is (out, in)
            proj = _project(x, p.v) * _scale(p.scale, x[..., 0])
            return output + proj.unsqueeze(-1) * _expand(p.u, output)
        proj = _project(x, p.u) * _scale(p.scale, x[..., 0])  # Conv1D: y = x W, W (in, out)
        return output + proj.unsqueeze(-1) * _expand(p.v, output)

    return hook


def install_perturbation_hooks(matrices: list[TrainableMatrix]) -> list:
    """Attach the rank-one hooks; returns handles (call .remove() to detach)."""
    handles = []
    for matrix in matrices:
        for module in matrix.modules:
            handles.append(module.register_forward_hook(_rank_one_hook(matrix)))
    return handles


class SharedPrefix:
    """Run the blocks before the first trained one once for both sides of an estimate.

    The +eps and -eps forward passes of a two-point estimate differ only from the first
    decoder block that holds a trained tensor on. When a run trains only late blocks (and
    the final norm or head), the first pass records that block's input and the second pass
    starts there: the earlier blocks are swapped for stand-ins that hand the recorded
    hidden states on. The result is bitwise what a full second pass computes.
    Models without a `base_model.layers` list, or whose embeddings train, share nothing.
    """

    def __init__(self, model: nn.Module, matrices: list[TrainableMatrix]) -> None:
        self.layers: nn.ModuleList | None = None
        self.first = 0
        layers = getattr(getattr(model, "base_model", model), "layers", None)
        if not isinstance(layers, nn.ModuleList) or any(m.is_embedding for m in matrices):
            return
        trained = {id(mod) for m in matrices for mod in m.modules}
        for index, block in enumerate(layers):
            if any(id(mod) in trained for mod in block.modules()):
                self.first = index
                break
        else:
            self.first = len(layers)  # only modules after the blocks train (final norm, head)
        if self.first > 0:
            self.layers = layers
        self._recorded: object = None

    @property
    def active(self) -> bool:
        return self.layers is not None

    @contextmanager
    def record(self) -> Iterator[None]:
        """Keep what the last untrained block returns during this forward."""
        if self.layers is None:
            yield
            return

        def keep(module: nn.Module, args: tuple, output: object) -> None:
            self._recorded = output

        handle = self.layers[self.first - 1].register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()

    @contextmanager
    def reuse(self) -> Iterator[None]:
        """Skip the untrained blocks: hand on what `record` kept."""
        if self.layers is None or self._recorded is None:
            yield
            return
        originals = [self.layers[i] for i in range(self.first)]
        try:
            for i in range(self.first - 1):
                self.layers[i] = _PassThrough()
            self.layers[self.first - 1] = _Recorded(self._recorded)
            yield
        finally:
            for i, block in enumerate(originals):
                self.layers[i] = block
            self._recorded = None


class _PassThrough(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


class _Recorded(nn.Module):
    def __init__(self, output: object) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.output
