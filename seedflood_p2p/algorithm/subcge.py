"""SubCGE: subspace coordinate-wise gradient estimation (the project's definition).

Per epoch e = round // T and trainable matrix l there is a shared basis
U_l^e (m x r) and V_l^e (k x r) of +1/-1 entries, drawn from Philox keyed by
(run, e, l). A message of peer p for round t carries k scalars, one per direction
j < k; the seed of (run, p, t, j) picks per matrix a coordinate (a_l, b_l) in
[r] x [r] and a sign, so direction j is Z_j = {sign_l * U[:, a_l] V[:, b_l]^T}.
Its scalar is the two-point estimate along Z_j on group j of the round's minibatch
(k = batch size: one direction per example, all in the same two forward passes).

Aggregation: each direction adds sign_l * coef_j into the r x r core C_l of its epoch
(O(k * layers) per message); merging applies W_l -= U_l C_l V_l^T (O(r*d)), once
per round on a live peer and once per epoch in a replay, whatever the number
of messages. Everything here is pure computation on tensors: no I/O.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from seedflood_p2p.algorithm.basis import BasisArtifact, BasisSchedule, check
from seedflood_p2p.algorithm.curvature import Curvature
from seedflood_p2p.algorithm.momentum import Velocity
from seedflood_p2p.algorithm.trainable import (
    Perturbation,
    SharedPrefix,
    TrainableMatrix,
    find_trainable_matrices,
    install_perturbation_hooks,
)
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.rng import derive_key, philox4x32, philox4x32_grid, random_signs
from seedflood_p2p.protocol.message import UpdateMessage


@dataclass(frozen=True)
class Direction:
    """One message's k directions: per direction and matrix the coordinate (a, b) and sign.

    The naive baseline leaves a, b, sign empty and regenerates from (peer, round).
    """

    peer: bytes
    round: int
    epoch: int
    a: np.ndarray  # int64 [k, L]
    b: np.ndarray  # int64 [k, L]
    sign: np.ndarray  # float64 [k, L], +1 or -1

    @property
    def count(self) -> int:
        return max(1, self.a.shape[0])


def step_coefficients(
    scalars: tuple[float, ...], round_: int, config: RunConfig, round_size: int = 1
) -> np.ndarray:
    """The step size of each of a message's directions: a pure function of the message, the
    run settings (see `RunConfig.normalize`, `RunConfig.step_rule`) and, under "round_mean"
    or "round_sqrt", how many updates the ledger holds for the round; the same on every peer
    and in replay."""
    g = np.asarray(scalars, dtype=np.float64)
    if config.normalize == "unit":  # no clip first: it would bend the direction of k > 1
        rms = math.sqrt(float(np.mean(g * g)))
        g = g / rms if rms > 0 else g
    else:
        g = np.clip(g, -config.clip, config.clip)
    return config.lr_at(round_) / (step_divisor(config, round_size) * len(g)) * g


def step_coefficient_rows(
    scalars: np.ndarray,
    rounds: list[int],
    config: RunConfig,
    round_sizes: Mapping[int, int] | None = None,
) -> np.ndarray:
    """`step_coefficients` of n messages at once: scalars [n, k] float64, their rounds, and
    round -> updates held (1 where absent). The same bits as n calls (tests/test_subcge.py):
    the same elementwise IEEE operations on each row (numpy reduces each row of g * g the
    way it reduces one row alone) and each row's factor computed as there, once per
    (round, size)."""
    g = np.asarray(scalars, dtype=np.float64)
    n, k = g.shape
    if config.normalize == "unit":
        rms = np.sqrt(np.mean(g * g, axis=1))  # IEEE sqrt: math.sqrt's bits
        g = g / np.where(rms > 0, rms, 1.0)[:, None]  # x / 1.0 == x: rows of zeros stay
    else:
        g = np.clip(g, -config.clip, config.clip)
    sizes = round_sizes or {}
    factors: dict[tuple[int, int], float] = {}
    factor = np.empty(n, dtype=np.float64)
    for i, round_ in enumerate(rounds):
        key = (round_, sizes.get(round_, 1))
        f = factors.get(key)
        if f is None:
            f = factors[key] = config.lr_at(round_) / (step_divisor(config, key[1]) * k)
        factor[i] = f
    return factor[:, None] * g


def step_divisor(config: RunConfig, round_size: int) -> float:
    """What an update's lr is divided by, from the updates its round holds (n >= 1):

    - "per_update": n_ref, whatever the round holds;
    - "round_mean": max(n, n_ref): the round's updates are averaged, so 64 peers make one
      better step rather than 64 steps, and n_ref keeps a round of a few peers from taking
      a whole step on a noisy estimate (a round of n < n_ref moves n / n_ref of it);
    - "round_sqrt": sqrt(n * n_ref) below n_ref, n from it: a round of n < n_ref moves
      sqrt(n / n_ref) of a full round's step, as the mean of n noisy estimates (1/n of one's
      variance) warrants. IEEE sqrt is correctly rounded: the same on every machine.
    """
    n = max(int(round_size), 1)
    if config.step_rule == "round_mean":
        return float(max(n, config.n_ref))
    if config.step_rule == "round_sqrt":
        return float(n) if n >= config.n_ref else math.sqrt(n * config.n_ref)
    return float(config.n_ref)


COORDINATE_CHUNK = 16384  # Philox counters per pass: the working set stays in cache
ACCUMULATE_CHUNK = 1 << 17  # core entries (k * L per message) per pass of `accumulate`


def message_coordinates(
    run_key: bytes,
    peers: list[bytes],
    rounds: list[int],
    num_layers: int,
    rank: int,
    directions: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, sign), each of shape [n, k, L], for the k directions of n messages at once.

    Word i of matrix l in direction j comes from Philox counter ((3l + i) // 4, j) under
    the message's key (run, peer, round). The modulo bias of `% rank` is below rank / 2^32.
    Messages go through `philox4x32_grid` a few at a time (COORDINATE_CHUNK counters): one
    pass over a whole round of SmolLM2 k=16 updates (2,528 counters each) would stream
    ~20 MB temporaries through memory a few hundred times, 10-20x slower per update.
    """
    n, k, L = len(peers), directions, num_layers
    keys = np.array(
        [derive_key("seedflood/message", run_key, p, t) for p, t in zip(peers, rounds)],
        dtype=np.uint64,
    ).reshape(n, 2)
    blocks = -(-3 * L // 4)
    a = np.empty((n, k, L), dtype=np.int64)
    b = np.empty((n, k, L), dtype=np.int64)
    sign = np.empty((n, k, L), dtype=np.float64)
    step = max(1, COORDINATE_CHUNK // (k * blocks))
    r, one = np.uint32(rank), np.uint32(1)
    # x % r == x & (r - 1) for unsigned x when r is a power of two: one cheaper pass
    reduce = np.bitwise_and if rank & (rank - 1) == 0 else np.remainder
    r = r - one if reduce is np.bitwise_and else r
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        words = philox4x32_grid(keys[lo:hi], k, blocks).reshape(hi - lo, k, blocks * 4)
        words = words[:, :, : 3 * L].reshape(hi - lo, k, L, 3)
        a[lo:hi] = reduce(words[..., 0], r)
        b[lo:hi] = reduce(words[..., 1], r)
        sign[lo:hi] = words[..., 2] & one  # 0 or 1, exactly
    sign *= 2.0  # 2 * bit - 1: +1.0 or -1.0, exactly
    sign -= 1.0
    return a, b, sign


def layer_basis(run_key: bytes, epoch: int, layer: int, m: int, k: int, rank: int) -> np.ndarray:
    """U (m x r) stacked over V (k x r): an (m + k) x r array of +1/-1 (float32)."""
    key = derive_key("seedflood/basis", run_key, epoch, layer)
    return random_signs(key, 0, (m + k) * rank).reshape(m + k, rank)


def epoch_bases(
    run_key: bytes, epochs: list[int], shapes: list[tuple[int, int]], rank: int
) -> list[np.ndarray]:
    """`layer_basis` for several epochs and every layer from ONE Philox call.

    Bit-identical to ``layer_basis(run_key, e, l, m, k, rank)`` (same keys, same counters
    (i, 0, 0, 0)); per layer a float32 array of shape (len(epochs), m + k, rank). Calling
    layer_basis per layer costs ~0.1-0.3 ms of NumPy call overhead each, 210 times an epoch
    on SmolLM2 (12-27 s of a 62-163 s replay of 500 epochs).
    """
    counts = [(m + k) * rank for m, k in shapes]
    words = [-(-c // 32) for c in counts]  # one bit per sign, as random_signs
    blocks = [-(-w // 4) for w in words]  # Philox gives 4 words per counter
    starts = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    per_epoch = int(sum(blocks))
    keys = np.array(
        [derive_key("seedflood/basis", run_key, e, i) for e in epochs for i in range(len(shapes))],
        dtype=np.uint64,
    ).reshape(-1, 2)
    reps = np.tile(np.array(blocks), len(epochs))
    counters = np.zeros((per_epoch * len(epochs), 4), dtype=np.uint64)
    per_layer = np.concatenate([np.arange(b, dtype=np.uint64) for b in blocks])
    counters[:, 0] = np.tile(per_layer, len(epochs))
    words = philox4x32(counters, (np.repeat(keys[:, 0], reps), np.repeat(keys[:, 1], reps)))
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")
    bits = bits.reshape(len(epochs), per_epoch * 128)
    out = []
    for i, (m, k) in enumerate(shapes):
        lo = int(starts[i]) * 128
        signs = bits[:, lo : lo + counts[i]].astype(np.float32) * 2.0 - 1.0
        out.append(signs.reshape(len(epochs), m + k, rank))
    return out


def trainable_tensors(model: nn.Module, config: RunConfig) -> list[TrainableMatrix]:
    """The tensors a run trains, as its settings select them."""
    return find_trainable_matrices(
        model,
        include_embeddings=config.include_embeddings,
        include_norms=config.train_norms,
        only=config.train_only,
    )


@dataclass
class StageTimes:
    """Wall and CPU seconds an engine spent per stage of applying updates ("accumulate",
    "basis", "merge"; a merge includes its basis generation), and each merge call's wall
    seconds. For benchmarks and metrics: timing never changes what is computed."""

    wall: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    merge_calls: list[float] = field(default_factory=list)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] += time.perf_counter() - wall
            self.cpu[name] += time.process_time() - cpu
            if name == "merge":
                self.merge_calls.append(time.perf_counter() - wall)


class ZerothOrderEstimator:
    """What SubCGE and the naive baseline share: the two-point estimate.

    Subclasses say how a direction is derived, how a forward pass is perturbed
    along it, and how accepted messages are folded into the weights.
    """

    def __init__(self, model: nn.Module, config: RunConfig) -> None:
        self.model = model
        self.config = config
        self.run_key = config.run_key
        self.matrices: list[TrainableMatrix] = trainable_tensors(model, config)
        self.prefix = SharedPrefix(model, self.matrices)
        self.times = StageTimes()
        if not self.matrices:
            raise UserError(
                "the model has no trainable weights (2-D weights of a Linear, Embedding or "
                "Conv1D module, or norm scales with train_norms) matching the run's settings: "
                "check train_only, or set include_embeddings / train_norms"
            )

    @property
    def num_parameters(self) -> int:
        return sum(m.weight.numel() for m in self.matrices)

    def direction(self, peer: bytes, round_: int) -> Direction:
        raise NotImplementedError

    @contextmanager
    def perturbed(
        self, direction: Direction, scale: float, batch_size: int | None = None
    ) -> Iterator[None]:
        raise NotImplementedError
        yield

    def accumulate(
        self, messages: Iterable[UpdateMessage], round_sizes: Mapping[int, int] | None = None
    ) -> int:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def advance(self, head: int) -> None:
        """Make the pending state that of round `head` (momentum: carry the velocity on);
        without momentum a row's weight does not depend on the round, so nothing."""

    def rewind(self, head: int) -> None:
        """The state back to round `head`, once the rows of rounds >= head are taken back
        (momentum only; without it, nothing)."""

    def momentum_state(self) -> tuple[int, np.ndarray] | None:
        """(head, velocity) under momentum, for `load_momentum_state`; None without."""
        return None

    @property
    def momentum_head(self) -> int | None:
        """The round whose state the weights are, under momentum; None without."""
        return None

    def load_momentum_state(self, state: tuple[int, np.ndarray] | None) -> None:
        if state is not None:
            raise ValueError("this run has no momentum state")

    def close(self) -> None:
        """Detach anything attached to the model."""

    def coefficients(self, message: UpdateMessage, round_size: int = 1) -> np.ndarray:
        """Step size of each of a message's k directions: lr_t / (n_ref * k) * clip(g_j),
        or with `normalize = "unit"` lr_t / (n_ref * k) * g_j / rms(g): the receiver scales
        every message to the same size, so no sender can push harder than an honest one
        (the scalars stay as estimated, for audits to recompute)."""
        return step_coefficients(message.scalars, message.round, self.config, round_size)

    @torch.no_grad()
    def estimate(
        self,
        loss_fn: Callable[[], float | torch.Tensor],
        direction: Direction,
        batch_size: int | None = None,
    ) -> tuple[tuple[float, ...], float]:
        """Two-point estimates (L_j(+eps) - L_j(-eps)) / 2eps, one per direction j; returns
        (g_1..g_k, mean loss). With k > 1, `loss_fn` returns per-example losses [B] and
        direction j is estimated on the j-th of k equal groups of the batch, all in the same
        two forward passes; with k == 1 it may return the mean loss."""
        g, losses = self.estimates(loss_fn, direction, batch_size)
        return tuple(g.tolist()), float(losses.mean())

    def estimates(
        self,
        loss_fn: Callable[[], float | torch.Tensor],
        direction: Direction,
        batch_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's estimator (`RunConfig.one_sided_passes`): `two_point` or `one_sided`."""
        if self.config.one_sided_passes:
            return self.one_sided(loss_fn, direction, batch_size)
        return self.two_point(loss_fn, direction, batch_size)

    @torch.no_grad()
    def two_point(
        self,
        loss_fn: Callable[[], float | torch.Tensor],
        direction: Direction,
        batch_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`estimate` as tensors: (g [k] float64, the mean of the +eps and -eps losses
        [B], or [1] when `loss_fn` returns one mean loss)."""
        eps, k = self.config.eps, direction.count
        losses = []
        for scale, shared in ((eps, self.prefix.record()), (-eps, self.prefix.reuse())):
            with self.perturbed(direction, scale, batch_size), shared:
                losses.append(torch.as_tensor(loss_fn(), dtype=torch.float64).reshape(-1))
        plus, minus = losses
        if k > 1 and plus.numel() % k:
            raise ValueError(f"{plus.numel()} losses do not split into {k} directions")
        return ((plus - minus) / (2 * eps)).reshape(k, -1).mean(dim=1), 0.5 * (plus + minus)

    @torch.no_grad()
    def one_sided(
        self,
        loss_fn: Callable[[], float | torch.Tensor],
        direction: Direction,
        batch_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One-sided estimates (L_j(+eps) - L_j(0)) / eps sharing one unperturbed pass:
        the k directions in m = `one_sided_passes` sets of g = k/m, the batch in g groups,
        direction p*g + j on group j in perturbed pass p. Returns (g [k] float64, the
        unperturbed losses [B]). `direction` may stack several peers' k directions (their
        batches stacked in the same order, as `zo_steps` does): each peer's set p is
        estimated in pass p, on its own groups."""
        eps, k, m = self.config.eps, self.config.directions, self.config.one_sided_passes
        total = direction.count
        if total % k:
            raise ValueError(f"{total} directions are not whole messages of {k}")
        g = k // m
        # pass p perturbs, for every stacked peer i, its directions i*k + p*g ... + g - 1
        sets = [
            np.concatenate(
                [np.arange(i * k + p * g, i * k + (p + 1) * g) for i in range(total // k)]
            )
            for p in range(m)
        ]
        with self.prefix.record():
            base = torch.as_tensor(loss_fn(), dtype=torch.float64).reshape(-1)
        if len(sets[0]) > 1 and base.numel() % len(sets[0]):
            raise ValueError(f"{base.numel()} losses do not split into {len(sets[0])} groups")
        out = torch.empty(total, dtype=torch.float64, device=base.device)
        for chosen in sets:
            part = Direction(
                direction.peer,
                direction.round,
                direction.epoch,
                direction.a[chosen],
                direction.b[chosen],
                direction.sign[chosen],
            )
            with self.perturbed(part, eps, batch_size), self.prefix.reuse():
                plus = torch.as_tensor(loss_fn(), dtype=torch.float64).reshape(-1)
            where = torch.from_numpy(chosen).to(base.device)
            out[where] = ((plus - base) / eps).reshape(len(chosen), -1).mean(1)
        return out, base


def _round_runs(messages: list[UpdateMessage]) -> list[tuple[int, int, int]]:
    """(round, lo, hi) for each run of consecutive messages of one round."""
    rounds = np.array([m.round for m in messages], dtype=np.int64)
    starts = [0, *(np.flatnonzero(np.diff(rounds)) + 1).tolist(), len(messages)]
    return [(int(rounds[lo]), lo, hi) for lo, hi in zip(starts[:-1], starts[1:])]


def _rank_limit(matrix: TrainableMatrix) -> int:
    # A norm's scale vector is an m x 1 matrix whose V is one +-1 sign per basis column.
    return matrix.shape[0] if matrix.kind == "norm" else min(matrix.shape)


class SubCGE(ZerothOrderEstimator):
    """SubCGE on a model: bases, pending r x r cores per epoch, merges."""

    def __init__(self, model: nn.Module, config: RunConfig, basis_cache: int = 3) -> None:
        super().__init__(model, config)
        rank = config.rank
        too_small = [m for m in self.matrices if rank > _rank_limit(m)]
        if too_small:
            worst = min(too_small, key=_rank_limit)
            raise UserError(
                f"rank {rank} is larger than weight '{worst.name}' allows "
                f"(shape {worst.shape[0]} x {worst.shape[1]}): choose a rank <= "
                f"{_rank_limit(worst)}"
            )
        self._basis_cache_size = basis_cache
        self._bases: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pending: dict[int, np.ndarray] = {}  # epoch -> [L, r*r] float64
        # momentum > 0 (a fixed basis): the round the weights are of, and the velocity core
        shape = (len(self.matrices), rank * rank)
        self.velocity = Velocity(config.momentum, shape) if config.momentum else None
        # curvature > 0 (a fixed basis, rows in round order): a diagonal scale of the core
        # coordinates, learned from the rows (algorithm/curvature.py)
        self.curvature = Curvature(config.curvature, shape) if config.curvature else None
        self._hooks = install_perturbation_hooks(self.matrices)
        self.schedule = BasisSchedule()  # curvature-aware V sides by epoch (basis.py)

    def add_basis(self, first_epoch: int, artifact: BasisArtifact) -> None:
        """Use `artifact`'s V sides from `first_epoch` on (until a later one's). Merge pending
        cores first: an epoch's basis must not change under a core already folded into it."""
        check(artifact, self.matrices, self.config.rank)
        if self.velocity is not None:
            missing = [m.name for m in self.matrices if m.name not in artifact.u]
            if missing:
                raise UserError(
                    f"momentum needs a basis with both sides for every trained matrix: "
                    f"artifact {artifact.sha256[:16]} has no U side for '{missing[0]}' "
                    f"({len(missing)} matrices): train linear matrices only (no train_norms)"
                )
        if any(e >= first_epoch for e in self._pending):
            raise ValueError(f"epoch {first_epoch} or later has pending updates: commit first")
        self.schedule.add(first_epoch, artifact)
        self._bases = {e: b for e, b in self._bases.items() if e < first_epoch}

    def _overrides(self, epoch: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The epoch's artifact sides: (U by matrix name, V by matrix name)."""
        artifact = self.schedule.for_epoch(epoch)
        return ({}, {}) if artifact is None else (artifact.u, artifact.v)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- shared randomness -------------------------------------------------
    def basis(self, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(U_l, V_l)] of an epoch, on the weights' device and dtype (cached)."""
        if epoch not in self._bases:
            bases = []
            u_sides, v_sides = self._overrides(epoch)
            for index, matrix in enumerate(self.matrices):
                m, k = matrix.shape
                uv = layer_basis(self.run_key, epoch, index, m, k, self.config.rank)
                uv = torch.from_numpy(uv).to(matrix.weight.device, matrix.weight.dtype)
                u, v = u_sides.get(matrix.name), v_sides.get(matrix.name)
                u = uv[:m] if u is None else u.to(uv.device, uv.dtype)
                v = uv[m:] if v is None else v.to(uv.device, uv.dtype)
                bases.append((u, v))
            self._bases[epoch] = bases
            while len(self._bases) > self._basis_cache_size:
                # Evict the oldest other epoch: a late message may ask for an old one.
                del self._bases[min(e for e in self._bases if e != epoch)]
        return self._bases[epoch]

    def direction(self, peer: bytes, round_: int) -> Direction:
        a, b, sign = message_coordinates(
            self.run_key,
            [peer],
            [round_],
            len(self.matrices),
            self.config.rank,
            self.config.directions,
        )
        return Direction(peer, round_, self.config.epoch_of(round_), a[0], b[0], sign[0])

    @contextmanager
    def perturbed(
        self, direction: Direction, scale: float, batch_size: int | None = None
    ) -> Iterator[None]:
        """Forward passes inside see W + scale * Z_j on the examples of group j (batch split
        into k equal groups; `batch_size` needed when k > 1); W itself is never written."""
        bases = self.basis(direction.epoch)
        k = direction.count
        rows = None
        if k > 1:
            if not batch_size or batch_size % k:
                raise ValueError(f"{k} directions need a batch size divisible by {k}")
            rows = torch.arange(batch_size, device=bases[0][0].device) // (batch_size // k)
        # Every matrix's coordinates in one copy each to the weights' device (on a GPU, three
        # host-to-device copies a forward pass instead of three per matrix).
        device, dtype = bases[0][0].device, bases[0][0].dtype
        a_all = torch.from_numpy(direction.a).to(device)
        b_all = torch.from_numpy(direction.b).to(device)
        signs = scale * direction.sign
        if self.curvature is not None and direction.a.size:
            self.curvature.advance(direction.round)  # the scale of this round
            r, L = self.config.rank, len(self.matrices)
            signs = signs * self.curvature.factors(
                direction.a * r + direction.b + np.arange(L) * r * r
            )
        s_all = torch.from_numpy(signs).to(device, dtype)
        try:
            for i, matrix in enumerate(self.matrices):
                u_all, v_all = bases[i]
                a, b, s = a_all[:, i], b_all[:, i], s_all[:, i]
                p = Perturbation(u_all[:, a].T, v_all[:, b].T, s)
                matrix.perturbation = p.per_example(rows)
            yield
        finally:
            for matrix in self.matrices:
                matrix.perturbation = None

    # -- aggregation -------------------------------------------------------
    def core_entries(
        self, messages: list[UpdateMessage], round_sizes: Mapping[int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where n messages land in their epochs' cores: (epochs [n], index [n, k*L],
        value [n, k*L]). An epoch's core is L r x r blocks flattened to one row of L*r*r
        floats; message i adds value[i, j] at index[i, j], in the order of j (direction
        major, then layer). `accumulate` and the simulator's per-peer backlog both fold
        these entries, so they agree to the bit. `round_sizes` (round -> updates the ledger
        holds for it) matters under a round-sized step rule only; without it each round's size
        is its count among `messages`."""
        L, r, k = len(self.matrices), self.config.rank, self.config.directions
        if any(len(m.scalars) != k for m in messages):
            raise ValueError(f"every message of this run carries {k} scalars")
        n = len(messages)
        a, b, sign = message_coordinates(
            self.run_key, [m.peer for m in messages], [m.round for m in messages], L, r, k
        )
        if round_sizes is None and self.config.round_sized:
            round_sizes = Counter(m.round for m in messages)
        if n:  # every message's coefficients in one pass: `coefficients`' bits
            scalars = np.array([m.scalars for m in messages], dtype=np.float64).reshape(n, k)
            coef = step_coefficient_rows(
                scalars, [m.round for m in messages], self.config, round_sizes
            )
        else:
            coef = np.zeros((0, k))
        index = a  # (n, k, L): l * r * r + a * r + b, in place (exact integers)
        index *= r
        index += b
        index += np.arange(L) * r * r
        value = sign  # sign * coef, in place (the same products)
        value *= coef[:, :, None]
        epochs = np.array([self.config.epoch_of(m.round) for m in messages], dtype=np.int64)
        return epochs, index.reshape(n, k * L), value.reshape(n, k * L)

    def accumulate(
        self, messages: Iterable[UpdateMessage], round_sizes: Mapping[int, int] | None = None
    ) -> int:
        """Fold messages into their epochs' cores: O(layers) each. Returns the count.

        Within one call, entries are added in the order given (np.add.at is
        sequential), so a replay in canonical order is reproducible bit for bit. Messages
        go through `core_entries` ACCUMULATE_CHUNK entries at a time, in order: each core
        receives the same additions in the same order as from one pass, and the working
        set stays in cache (a round of 1,000 SmolLM2 k=16 updates is 3.4 M entries).
        """
        messages = list(messages)
        if not messages:
            return 0
        L, r, k = len(self.matrices), self.config.rank, self.config.directions
        if any(len(m.scalars) != k for m in messages):
            raise ValueError(f"every message of this run carries {k} scalars")
        if round_sizes is None and self.config.round_sized:
            round_sizes = Counter(m.round for m in messages)  # of the whole call, as before
        step = max(1, ACCUMULATE_CHUNK // (k * L))
        with self.times.stage("accumulate"):
            for lo in range(0, len(messages), step):
                epochs, index, value = self.core_entries(messages[lo : lo + step], round_sizes)
                if self.velocity is not None:
                    self._fold_with_momentum(messages[lo : lo + step], index, value)
                    continue
                if self.curvature is not None:
                    self._fold_with_curvature(messages[lo : lo + step], index, value)
                    continue
                present = np.unique(epochs)
                for epoch in present:
                    # one epoch in the chunk (the usual: a round's updates): no copy
                    rows = slice(None) if len(present) == 1 else epochs == epoch
                    shape = (L, r * r)
                    core = self._pending.setdefault(int(epoch), np.zeros(shape, dtype=np.float64))
                    np.add.at(core.reshape(-1), index[rows].ravel(), value[rows].ravel())
        return len(messages)

    def _fold_with_momentum(
        self, messages: list[UpdateMessage], index: np.ndarray, value: np.ndarray
    ) -> None:
        """Fold rows under momentum (algorithm/momentum.py), a run of equal rounds at a time:
        a row of round s >= head first moves the state on to s + 1; a row `lag` rounds
        before the head adds w(lag) x its entries to the pending core and b^(lag-1) x them
        to the velocity (both 1 for a row of the round just passed)."""
        velocity, L, r = self.velocity, len(self.matrices), self.config.rank
        for round_, lo, hi in _round_runs(messages):
            self._add_pending(round_, velocity.advance(round_ + 1))
            epoch = self.config.epoch_of(round_)
            core = self._pending.setdefault(epoch, np.zeros((L, r * r), dtype=np.float64))
            weight, decay = velocity.factors(velocity.head - round_)
            where, entries = index[lo:hi].ravel(), value[lo:hi].ravel()
            np.add.at(core.reshape(-1), where, entries if weight == 1.0 else entries * weight)
            moving = entries if decay == 1.0 else entries * decay
            np.add.at(velocity.core.reshape(-1), where, moving)

    def _fold_with_curvature(
        self, messages: list[UpdateMessage], index: np.ndarray, value: np.ndarray
    ) -> None:
        """Fold rows under the curvature scale (algorithm/curvature.py), a run of equal
        rounds at a time: each row's entries times its round's s at their coordinates, into
        the pending core and into the round's D."""
        curvature, L, r = self.curvature, len(self.matrices), self.config.rank
        for round_, lo, hi in _round_runs(messages):
            curvature.advance(round_)
            where = index[lo:hi].ravel()
            entries = value[lo:hi].ravel() * curvature.factors(where)
            epoch = self.config.epoch_of(round_)
            core = self._pending.setdefault(epoch, np.zeros((L, r * r), dtype=np.float64))
            np.add.at(core.reshape(-1), where, entries)
            np.add.at(curvature.delta.reshape(-1), where, entries)

    def _add_pending(self, round_: int, core: np.ndarray | None) -> None:
        if core is not None:
            shape = (len(self.matrices), self.config.rank**2)
            pending = self._pending.setdefault(self.config.epoch_of(round_), np.zeros(shape))
            pending += core

    def advance(self, head: int) -> None:
        if self.velocity is not None:
            self._add_pending(max(head - 1, 0), self.velocity.advance(head))

    def rewind(self, head: int) -> None:
        if self.velocity is not None:
            self._add_pending(head, self.velocity.rewind(head))

    def momentum_state(self) -> tuple[int, np.ndarray] | None:
        return None if self.velocity is None else self.velocity.state()

    @property
    def momentum_head(self) -> int | None:
        return None if self.velocity is None else self.velocity.head

    def load_momentum_state(self, state: tuple[int, np.ndarray] | None) -> None:
        if (state is None) != (self.velocity is None):
            raise ValueError("momentum state given to a run without momentum, or missing")
        if state is not None:
            self.velocity.load(state)

    @property
    def pending_epochs(self) -> list[int]:
        return sorted(self._pending)

    @torch.no_grad()
    def commit(self, epochs: Iterable[int] | None = None) -> None:
        """Merge pending cores into the weights: W_l -= U_l C_l V_l^T, O(r*d) per epoch."""
        for epoch in sorted(self._pending if epochs is None else epochs):
            core = self._pending.pop(epoch, None)
            if core is not None:
                self.merge_core(epoch, core, alpha=-1.0)

    @torch.no_grad()
    def merge_core(self, epoch: int, core: np.ndarray, alpha: float) -> None:
        """W_l += alpha * U_l C_l V_l^T for each layer l whose block of `core` (L x r*r, as
        `core_entries` indexes it) is not all zero."""
        r = self.config.rank
        bases = self.basis(epoch)
        for i, matrix in enumerate(self.matrices):
            if not core[i].any():
                continue
            u, v = bases[i]
            c = torch.from_numpy(core[i].reshape(r, r)).to(u.device, u.dtype)
            matrix.as_2d().addmm_(u @ c, v.T, alpha=alpha)

    @torch.no_grad()
    def commit_grouped(self, group: int = 25) -> None:
        """Merge every pending epoch, `group` epochs at a time: per matrix ONE GEMM of rank
        group * r instead of `group` rank-r addmm_ passes over W.

        The same update as commit() up to float32 rounding (another summation order), and
        deterministic for a fixed `group`. The per-epoch merge is memory-bound (it streams
        W once per epoch: 500 x 425 MB for 10,000 rounds of SmolLM2); one GEMM per group is
        compute-bound. Bases come from `epoch_bases` (one Philox call per group).
        Memory: group x (m + k) x r float32 per layer, ~250 MB for SmolLM2 at group 25.
        """
        shapes = [tuple(m.shape) for m in self.matrices]
        epochs = sorted(self._pending)
        for g in range(0, len(epochs), group):
            with self.times.stage("merge"):
                self._merge_group(epochs[g : g + group], shapes)

    def _merge_group(self, chunk: list[int], shapes: list[tuple[int, int]]) -> None:
        r = self.config.rank
        cores = [self._pending.pop(e) for e in chunk]
        with self.times.stage("basis"):
            signs = epoch_bases(self.run_key, chunk, shapes, r)
        overrides = [self._overrides(e) for e in chunk]
        for i, matrix in enumerate(self.matrices):
            m, k = shapes[i]
            w = matrix.as_2d()
            uv = torch.from_numpy(signs[i]).to(w.device, w.dtype)
            for j, (u_sides, v_sides) in enumerate(overrides):
                if matrix.name in u_sides:
                    uv[j, :m] = u_sides[matrix.name].to(w.device, w.dtype)
                if matrix.name in v_sides:
                    uv[j, m:] = v_sides[matrix.name].to(w.device, w.dtype)
            c = np.stack([core[i].reshape(r, r) for core in cores])
            c = torch.from_numpy(c).to(w.device, w.dtype)
            uc = torch.bmm(uv[:, :m], c).permute(1, 0, 2).reshape(m, len(chunk) * r)
            vv = uv[:, m:].permute(1, 0, 2).reshape(k, len(chunk) * r)
            w.addmm_(uc, vv.T, alpha=-1.0)
        del signs


class NaiveSeedReplay(ZerothOrderEstimator):
    """The baseline (MeZO, FedKSeed, Just One Byte): a full-size Gaussian per message.

    Each message's direction is regenerated from its seed at apply time, so
    applying n messages costs O(n * d). The Gaussian comes from torch's CPU
    generator, as in MeZO: it is for comparison on one machine, not for the
    network (it is not bit-identical across devices).
    """

    def __init__(self, model: nn.Module, config: RunConfig) -> None:
        super().__init__(model, config)
        self._pending: list[UpdateMessage] = []

    def _seed(self, peer: bytes, round_: int) -> int:
        k0, k1 = derive_key("seedflood/naive", self.run_key, peer, round_)
        return (k1 << 32 | k0) & 0x7FFF_FFFF_FFFF_FFFF

    def _gaussians(
        self, peer: bytes, round_: int
    ) -> Iterator[tuple[TrainableMatrix, torch.Tensor]]:
        gen = torch.Generator(device="cpu").manual_seed(self._seed(peer, round_))
        for matrix in self.matrices:
            z = torch.randn(matrix.weight.shape, generator=gen, dtype=torch.float32)
            yield matrix, z.to(matrix.weight.device, matrix.weight.dtype)

    def direction(self, peer: bytes, round_: int) -> Direction:
        empty = np.zeros((0, 0))
        return Direction(peer, round_, self.config.epoch_of(round_), empty, empty, empty)

    @contextmanager
    def perturbed(
        self, direction: Direction, scale: float, batch_size: int | None = None
    ) -> Iterator[None]:
        """In-place perturbation, restored from a copy so W is bitwise unchanged."""
        saved = [m.weight.detach().clone() for m in self.matrices]
        try:
            with torch.no_grad():
                for matrix, z in self._gaussians(direction.peer, direction.round):
                    matrix.weight.add_(z, alpha=scale)
            yield
        finally:
            with torch.no_grad():
                for matrix, original in zip(self.matrices, saved):
                    matrix.weight.copy_(original)

    def accumulate(
        self, messages: Iterable[UpdateMessage], round_sizes: Mapping[int, int] | None = None
    ) -> int:
        messages = list(messages)  # per_update only (config): round sizes do not matter
        self._pending.extend(messages)
        return len(messages)

    @torch.no_grad()
    def commit(self) -> None:
        """O(n * d): regenerate and add every message's full-size direction."""
        for message in self._pending:
            (coef,) = self.coefficients(message)
            for matrix, z in self._gaussians(message.peer, message.round):
                matrix.weight.add_(z, alpha=-coef)
        self._pending = []


def make_estimator(model: nn.Module, config: RunConfig) -> ZerothOrderEstimator:
    if config.estimator == "naive":
        return NaiveSeedReplay(model, config)
    return SubCGE(model, config)
