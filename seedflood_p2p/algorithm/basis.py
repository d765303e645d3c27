"""Curvature-aware SubCGE bases: data-derived V sides, shipped as run artifacts.

With random +-1 bases every direction of a weight matrix's subspace is as likely as any
other, so a step's size is set by the sharpest direction (the loss's curvature along the
label prior is ~100x the next) and the rest learns slowly: the gap to Adam is
conditioning. For a linear map y = W x the gradient is delta x^T, so its row space lies
in the span of the layer's inputs, and K-FAC's input factor A = E[x x^T] is the curvature
that space carries. An *activation basis* takes, per linear matrix, the top-r eigenvectors
of A (measured on unlabelled prompts: forward passes only) scaled by (lambda + damping)^-1/2,
so directions drawn from it have covariance ~ A^-1 on that subspace: whitened ZO. The
U (output) side stays Philox +-1.

A *K-FAC basis* (basis "kfac") also replaces U, by the top eigenvectors of K-FAC's output
factor G = E[g g^T], g = dL/dy the loss's gradient at the layer's output, whitened the same
way: directions then have covariance ~ G^-1 (x) A^-1 on the subspace, K-FAC's natural
gradient preconditioner. G needs one backward pass per publisher batch (labels used): the
publisher pays it once per artifact; peers only ever run forward passes along it. Its
factors also say how sharp each matrix is, so a K-FAC basis can scale the matrices against
each other too (`fisher_gains`; off by default).

Eigenvectors computed in floating point differ between machines in their last bits, so a
basis is never recomputed by a replaying peer: it is an *artifact*, the exact bytes of a
safetensors file, named by their SHA-256 and scheduled from an epoch on
(`BasisSchedule`). Pure tensors in, bytes out: no file or network I/O here.

A hostile artifact is bounded by `check`: right names and shapes, finite values, and every
column's squared norm at most `MAX_GAIN**2` times a +-1 column's (k), so no artifact makes
a direction, and hence one update, move the weights by more than MAX_GAIN x an honest
random direction's; what it can still do is choose useless directions (slow learning),
which is why a run names who publishes artifacts (the run settings) and the digest pins
what every peer applies.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from seedflood_p2p.algorithm.objective import on_model_device
from seedflood_p2p.algorithm.trainable import TrainableMatrix
from seedflood_p2p.core.errors import UserError

ARTIFACT_KIND = "seedflood/activation-basis/1"  # V sides only
KFAC_ARTIFACT_KIND = "seedflood/kfac-basis/1"  # U and V sides (an older peer refuses it)
# Bound on a direction's norm relative to a +-1 direction of the same matrix: per matrix,
# (longest U column / a +-1 one) x (longest V column / a +-1 one) <= MAX_GAIN.
MAX_GAIN = 8.0
# An output-gradient eigenvalue below this x the largest counts as zero (float32 sums).
NULL_EIGENVALUE = 1e-8
MAX_ARTIFACT_BYTES = 1 << 31


@dataclass(frozen=True)
class BasisArtifact:
    """V sides (k x r, float32) of the linear matrices a run trains, by parameter name, and
    for a K-FAC basis their U sides (m x r) too.

    `body` is the artifact's exact bytes and `sha256` their digest: what the ledger names.
    """

    v: dict[str, torch.Tensor]
    meta: dict[str, str]
    body: bytes
    sha256: str
    u: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.body)


def activation_covariances(
    model: torch.nn.Module,
    matrices: list[TrainableMatrix],
    batches: Iterable[dict[str, torch.Tensor]],
) -> dict[str, tuple[torch.Tensor, int]]:
    """Per linear matrix, sum of x x^T (float64, k x k) over the tokens its module saw with
    attention_mask 1, and the token count. Forward passes only, no labels."""
    linear = [m for m in matrices if m.kind == "linear"]
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    mask_holder: dict[str, torch.Tensor] = {}

    def make_hook(matrix: TrainableMatrix):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach()
            mask = mask_holder.get("mask")
            if mask is not None and x.dim() == 3 and x.shape[:2] == mask.shape:
                x = x[mask.bool()]
            x = x.reshape(-1, x.shape[-1]).double()
            s = sums.get(matrix.name)
            sums[matrix.name] = x.T @ x if s is None else s.addmm_(x.T, x)
            counts[matrix.name] = counts.get(matrix.name, 0) + x.shape[0]

        return hook

    handles = [
        module.register_forward_pre_hook(make_hook(matrix))
        for matrix in linear
        for module in matrix.modules[:1]
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                batch = on_model_device(model, batch)
                mask_holder["mask"] = batch["attention_mask"]
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for handle in handles:
            handle.remove()
    return {name: (sums[name], counts[name]) for name in sums}


def output_gradient_covariances(
    model: torch.nn.Module,
    matrices: list[TrainableMatrix],
    batches: Iterable[dict[str, torch.Tensor]],
    loss_of: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor],
) -> dict[str, tuple[torch.Tensor, int]]:
    """Per linear matrix, sum of g g^T (float64, m x m), g = dL/dy at the matrix's output,
    over the tokens with attention_mask 1, and the token count; L = loss_of(model, batch)
    summed over the batch. One backward pass per batch; the weights get no gradient (the
    graph starts at the embeddings' output)."""
    linear = [m for m in matrices if m.kind == "linear"]
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    mask_holder: dict[str, torch.Tensor] = {}

    def accumulate(name: str, g: torch.Tensor) -> None:
        mask = mask_holder.get("mask")
        if mask is not None and g.dim() == 3 and g.shape[:2] == mask.shape:
            g = g[mask.bool()]
        g = g.reshape(-1, g.shape[-1]).double()
        s = sums.get(name)
        sums[name] = g.T @ g if s is None else s.addmm_(g.T, g)
        counts[name] = counts.get(name, 0) + g.shape[0]

    def on_output(matrix: TrainableMatrix):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(lambda g: accumulate(matrix.name, g.detach()))

        return hook

    def grad_from_here(module: torch.nn.Module, args: tuple, output: torch.Tensor):
        return output.detach().requires_grad_(True)

    handles = [
        module.register_forward_hook(on_output(matrix))
        for matrix in linear
        for module in matrix.modules[:1]
    ]
    handles.append(model.get_input_embeddings().register_forward_hook(grad_from_here))
    try:
        for batch in batches:
            batch = on_model_device(model, batch)
            mask_holder["mask"] = batch["attention_mask"]
            with torch.enable_grad():
                loss_of(model, batch).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return {name: (sums[name], counts[name]) for name in sums}


def whitened_top_eigenvectors(
    covariance: torch.Tensor,
    rank: int,
    damping: float,
    max_gain: float = MAX_GAIN,
    damp_top: bool = False,
) -> torch.Tensor:
    """k x r: the top-r eigenvectors of `covariance`, column j scaled by
    (lambda_j + damping * mean(lambda))^-1/2 (`damp_top`: the mean of the top r only, and
    columns with a numerically zero eigenvalue set to zero), then all scaled so the mean
    squared norm of the nonzero columns is k (a +-1 column's), and no column exceeds
    max_gain x sqrt(k)."""
    return _whiten(covariance, rank, damping, max_gain, damp_top)[0]


def _whiten(
    covariance: torch.Tensor, rank: int, damping: float, max_gain: float, damp_top: bool
) -> tuple[torch.Tensor, float]:
    """`whitened_top_eigenvectors`, and the RMS length its nonzero columns had before they
    were rescaled to a +-1 column's, relative to one (0.0 when every column is zero): how
    long the side would be if only the curvature set it."""
    k = covariance.shape[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance.double())
    top = torch.argsort(eigenvalues, descending=True)[:rank]
    lam = eigenvalues[top].clamp(min=0.0)
    floor = damping * float((lam if damp_top else eigenvalues.clamp(min=0.0)).mean()) + 1e-30
    scale = (lam + floor).rsqrt()
    if damp_top:
        # G = E[g g^T]: along an eigenvector with a (numerically) zero eigenvalue no example's
        # gradient has any component, so a probe there is wasted (a classifier head's G has
        # rank one). Such columns get no length; the others keep a +-1 column's each.
        scale = torch.where(lam > NULL_EIGENVALUE * lam[0], scale, 0.0)
    kept = scale > 0
    if not bool(kept.any()):
        return torch.zeros(k, len(top)), 0.0  # no gradient reaches this matrix at all
    raw_gain = float((scale * scale)[kept].mean()) ** 0.5
    scale = scale * (k**0.5 / raw_gain)
    scale = scale.clamp(max=max_gain * k**0.5 * 0.999)
    basis = eigenvectors[:, top] * scale
    # A fixed sign per column (eigh's is arbitrary): the largest entry positive.
    flip = torch.sign(basis.gather(0, basis.abs().argmax(0, keepdim=True))).squeeze(0)
    return (basis * torch.where(flip == 0, 1.0, flip)).float().contiguous(), raw_gain / k**0.5


def fisher_gains(raw: dict[str, float], limits: dict[str, float], power: float) -> dict[str, float]:
    """Per matrix, the factor its unit-RMS K-FAC directions are scaled by:
    (F_m / F_typical)^power, capped at `limits` (the gain bound). F_m is the K-FAC Fisher
    along a +-1-length direction of matrix m, 1 / raw_m^2 (`raw`: the RMS length at which
    its whitened directions have unit curvature), and F_typical their geometric mean over
    the matrices, so a typical matrix keeps a +-1 direction's length.

    power 0 leaves every matrix as long as a +-1 direction; -1/2 gives each matrix its
    curvature-set length (K-FAC's natural gradient across matrices too); > 0 lengthens
    the matrices along which the loss changes most, where a two-point estimate's signal
    is (measured: docs/LEARNING.md)."""
    live = {name: g for name, g in raw.items() if g > 0}
    if not live or power == 0:
        return {name: 1.0 for name in raw}
    logs = {name: math.log(g) for name, g in live.items()}
    typical = sum(logs.values()) / len(logs)
    return {
        name: min(math.exp(-2 * power * (logs[name] - typical)), limits[name])
        if name in live
        else 1.0
        for name in raw
    }


def compute_basis(
    model: torch.nn.Module,
    matrices: list[TrainableMatrix],
    batches: Iterable[dict[str, torch.Tensor]],
    rank: int,
    damping: float,
    meta: dict[str, str] | None = None,
    loss_of: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
    output_damping: float = 0.1,
    fisher_power: float = 0.0,
) -> BasisArtifact:
    """The activation basis of the model's current weights on `batches` (an artifact); with
    `loss_of` (per-example losses, differentiable) the K-FAC basis: U sides from the output
    gradients too, each clamped so the matrix's direction gain stays within MAX_GAIN.

    The U side is damped by `output_damping` x the mean of its top-r eigenvalues, not of
    all: G is often rank-deficient (a classifier's head sees gradients along its label
    words only), and damped against the mean of all its eigenvalues the null directions
    would take every column's length.

    `fisher_power` (K-FAC only): the matrices' directions scaled against each other by
    `fisher_gains`; 0, every matrix's as long as a +-1 direction on average."""
    if fisher_power and loss_of is None:
        raise ValueError("fisher_power needs the output gradients (loss_of): a K-FAC basis")
    batches = list(batches)
    covariances = activation_covariances(model, matrices, batches)
    gradients = output_gradient_covariances(model, matrices, batches, loss_of) if loss_of else {}
    v, u, raw, limits = {}, {}, {}, {}
    for matrix in matrices:
        if matrix.name in covariances:
            total, count = covariances[matrix.name]
            v[matrix.name], v_raw = _whiten(total / max(count, 1), rank, damping, MAX_GAIN, False)
        if matrix.name in gradients:
            total, count = gradients[matrix.name]
            left = MAX_GAIN / _gain(v[matrix.name])
            u[matrix.name], u_raw = _whiten(total / max(count, 1), rank, output_damping, left, True)
            raw[matrix.name] = u_raw * v_raw
            longest = _gain(u[matrix.name])
            limits[matrix.name] = left * 0.999 / longest if longest > 0 else 1.0
    gains = fisher_gains(raw, limits, fisher_power) if fisher_power else {}
    for name, gain in gains.items():
        u[name] = (u[name] * gain).contiguous()
    info = {"kind": ARTIFACT_KIND, "rank": str(rank), "damping": repr(damping)}
    if u:
        info.update(kind=KFAC_ARTIFACT_KIND, output_damping=repr(output_damping))
    if fisher_power:  # the gains travel with the artifact, for whoever wants to see them
        info.update(
            fisher_power=repr(fisher_power),
            fisher_gains=json.dumps({n: round(g, 6) for n, g in sorted(gains.items())}),
        )
    info.update(meta or {})
    return encode(v, info, u)


def _gain(t: torch.Tensor) -> float:
    """The longest column of `t` relative to a +-1 column of its length."""
    return (float(t.double().pow(2).sum(0).max()) / t.shape[0]) ** 0.5


def encode(
    v: dict[str, torch.Tensor], meta: dict[str, str], u: dict[str, torch.Tensor] | None = None
) -> BasisArtifact:
    tensors = {f"v/{name}": t.contiguous().cpu() for name, t in sorted(v.items())}
    tensors.update({f"u/{name}": t.contiguous().cpu() for name, t in sorted((u or {}).items())})
    body = st_save(tensors, metadata=meta)
    return BasisArtifact(dict(v), dict(meta), body, hashlib.sha256(body).hexdigest(), dict(u or {}))


def decode(body: bytes, sha256: str | None = None) -> BasisArtifact:
    """An artifact from its bytes; checks the digest when given. Never executes anything
    (safetensors holds tensors and string metadata only)."""
    if len(body) > MAX_ARTIFACT_BYTES:
        raise UserError(f"basis artifact is {len(body)} bytes, over {MAX_ARTIFACT_BYTES}")
    digest = hashlib.sha256(body).hexdigest()
    if sha256 is not None and digest != sha256:
        raise UserError(
            f"basis artifact {sha256[:16]} does not match its digest (got {digest[:16]}): "
            "the file is corrupt or not the run's; fetch it again"
        )
    try:
        tensors = st_load(body)
        meta = _metadata(body)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad artifact
        raise UserError(f"basis artifact {digest[:16]} is not a safetensors file ({exc})") from None
    kind = meta.get("kind")
    if kind not in (ARTIFACT_KIND, KFAC_ARTIFACT_KIND):
        raise UserError(f"basis artifact {digest[:16]} is of kind {kind!r}")
    v = {name[2:]: t for name, t in tensors.items() if name.startswith("v/")}
    u = {name[2:]: t for name, t in tensors.items() if name.startswith("u/")}
    if u and kind != KFAC_ARTIFACT_KIND:
        raise UserError(f"basis artifact {digest[:16]} has U sides but is of kind {kind!r}")
    return BasisArtifact(v, meta, body, digest, u)


def _metadata(body: bytes) -> dict[str, str]:
    n = int.from_bytes(body[:8], "little")
    if n > len(body) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(body[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def check(artifact: BasisArtifact, matrices: list[TrainableMatrix], rank: int) -> None:
    """Refuse an artifact that does not fit the run's matrices or breaks the gain bound."""
    names = {m.name: m for m in matrices}
    for name, t in artifact.v.items():
        matrix = names.get(name)
        where = f"basis artifact {artifact.sha256[:16]}, matrix '{name}'"
        if matrix is None or matrix.kind != "linear":
            raise UserError(f"{where}: not a linear matrix this run trains")
        _check_side(where, t, matrix.shape[1], rank)
        if _gain(t) > MAX_GAIN:
            raise UserError(f"{where}: a column is longer than {MAX_GAIN:g} x a +-1 column")
    for name, t in artifact.u.items():
        matrix = names.get(name)
        where = f"basis artifact {artifact.sha256[:16]}, matrix '{name}' (U side)"
        if name not in artifact.v:
            raise UserError(f"{where}: a U side without a V side")
        _check_side(where, t, matrix.shape[0], rank)
        if _gain(t) * _gain(artifact.v[name]) > MAX_GAIN:
            raise UserError(
                f"{where}: its directions are longer than {MAX_GAIN:g} x a +-1 direction"
            )


def _check_side(where: str, t: torch.Tensor, rows: int, rank: int) -> None:
    """One side of a matrix's basis: rows x rank float32, every value finite."""
    if tuple(t.shape) != (rows, rank) or t.dtype != torch.float32:
        raise UserError(f"{where}: shape {tuple(t.shape)} {t.dtype}, expected ({rows}, {rank})")
    if not torch.isfinite(t).all():
        raise UserError(f"{where}: holds non-finite values")


@dataclass
class BasisSchedule:
    """Which artifact shapes which epochs: epoch e uses the artifact with the largest
    first epoch <= e, or the random +-1 basis before the first. A pure function of the
    (first epoch, sha256) list, which the ledger records."""

    entries: list[tuple[int, str]] = field(default_factory=list)
    artifacts: dict[str, BasisArtifact] = field(default_factory=dict)

    def add(self, first_epoch: int, artifact: BasisArtifact) -> None:
        if any(e == first_epoch for e, _ in self.entries):
            raise ValueError(f"epoch {first_epoch} already has a basis artifact")
        bisect.insort(self.entries, (first_epoch, artifact.sha256))
        self.artifacts[artifact.sha256] = artifact

    def for_epoch(self, epoch: int) -> BasisArtifact | None:
        i = bisect.bisect_right(self.entries, (epoch, "\uffff")) - 1
        return self.artifacts[self.entries[i][1]] if i >= 0 else None


def load_schedule(ledger) -> BasisSchedule:
    """The ledger's basis artifacts, read from the store beside it and checked by digest
    (replayed from the artifact, never recomputed)."""
    from seedflood_p2p.storage.artifacts import ArtifactStore, read_schedule

    store, schedule = ArtifactStore.beside(ledger.path), BasisSchedule()
    for first_epoch, sha in read_schedule(ledger):
        schedule.add(first_epoch, decode(store.get(sha), sha))
    return schedule
