"""What each simulated SeedFlood peer has not received yet, kept apart from the one shared
model: SubCGE cores (`CoreBacklog`, O(r^2) per peer and epoch) or whole messages
(`MessageBacklog`, for the naive full-size directions)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from seedflood_p2p.algorithm.subcge import NaiveSeedReplay, SubCGE
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.sim.network import Deliveries


class CoreBacklog:
    """SubCGE: for each peer, the r x r cores of the messages it has not received yet.

    The shared model S holds every message sent so far. `commit` subtracts
    U C V^T, so peer q's own model is S + sum_e U_e D_q,e V_e^T, where D_q,e
    folds q's missing messages of epoch e with the entries `accumulate` folds
    (`SubCGE.core_entries`) and is merged by the same `SubCGE.merge_core`.
    Memory: n * L * r^2 floats per epoch in flight, whatever the model size.
    When a peer's count of missing messages in an epoch reaches zero its core
    is reset to exact zeros, so once the network is quiet every peer's model is bitwise S again.
    """

    def __init__(self, engine: SubCGE, n: int) -> None:
        if engine.velocity is not None or engine.curvature is not None:
            # their rows' weights depend on the round they are folded in, which a
            # per-peer backlog of late rows does not model
            raise UserError(
                "the network simulator's backlog does not model momentum or curvature: "
                "set both to 0"
            )
        self.engine = engine
        self.n = n
        self.layers = len(engine.matrices)
        self.rank = engine.config.rank
        self.size = self.layers * self.rank * self.rank
        self.cores: dict[int, np.ndarray] = {}  # epoch -> (n, L * r * r) float64
        self.counts: dict[int, np.ndarray] = {}  # epoch -> (n,) messages missing
        self._terms: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # round -> index, value

    def add(self, round_: int, messages: list[UpdateMessage], late: list[Deliveries]) -> None:
        if not late:
            return
        _, index, value = self.engine.core_entries(messages)  # all of one round: one epoch
        self._terms[round_] = (index, value)
        self._fold(late, +1)

    def remove(self, arrived: list[Deliveries]) -> None:
        self._fold(arrived, -1)

    def forget(self, round_: int) -> None:
        self._terms.pop(round_, None)

    def _fold(self, batches: list[Deliveries], direction: int) -> None:
        by_epoch: dict[int, list[Deliveries]] = defaultdict(list)
        for batch in batches:
            by_epoch[self.engine.config.epoch_of(batch.round)].append(batch)
        for epoch, group in by_epoch.items():
            flat, weights, receivers = [], [], []
            for batch in group:
                index, value = self._terms[batch.round]
                flat.append((batch.receivers[:, None] * self.size + index[batch.senders]).ravel())
                weights.append(value[batch.senders].ravel())
                receivers.append(batch.receivers)
            total = np.bincount(
                np.concatenate(flat), np.concatenate(weights), minlength=self.n * self.size
            ).reshape(self.n, self.size)
            count = np.bincount(np.concatenate(receivers), minlength=self.n)
            if epoch not in self.cores:
                self.cores[epoch] = np.zeros((self.n, self.size))
                self.counts[epoch] = np.zeros(self.n, dtype=np.int64)
            self.cores[epoch] += direction * total
            self.counts[epoch] += direction * count
            if direction < 0:
                self.cores[epoch][self.counts[epoch] == 0] = 0.0
                if not self.counts[epoch].any():
                    del self.cores[epoch], self.counts[epoch]

    def has_missing(self, peer: int) -> bool:
        return any(count[peer] for count in self.counts.values())

    def nbytes(self) -> int:
        return sum(c.nbytes + self.counts[e].nbytes for e, c in self.cores.items())

    @torch.no_grad()
    def apply_view(self, peer: int) -> None:
        """Turn S into peer's model: add back U D V^T of its missing messages (O(r*d))."""
        for epoch, core in self.cores.items():
            if self.counts[epoch][peer]:
                self.engine.merge_core(epoch, core[peer].reshape(self.layers, -1), alpha=1.0)

    @torch.no_grad()
    def deviation_rows(self) -> list[torch.Tensor]:
        """Per matrix, the (n, m*k) differences between each peer's model and S."""
        r = self.rank
        rows = []
        for i, matrix in enumerate(self.engine.matrices):
            m, k = matrix.shape
            block = torch.zeros(self.n, m, k, dtype=torch.float32)
            for epoch, core in self.cores.items():
                u, v = self.engine.basis(epoch)[i]
                c = torch.from_numpy(core[:, i * r * r : (i + 1) * r * r].reshape(-1, r, r))
                block += torch.einsum("mr,nrs,ks->nmk", u.float(), c.float(), v.float())
            rows.append(block.reshape(self.n, m * k))
        return rows


class MessageBacklog:
    """Naive replay: for each peer, the messages it has not received yet.

    A peer's view is S minus its missing messages, applied by the engine
    itself (accumulate the negated messages, commit): O(missing * d) per view.
    """

    def __init__(self, engine: NaiveSeedReplay, n: int) -> None:
        self.engine = engine
        self.n = n
        self.missing: list[dict[tuple[int, int], UpdateMessage]] = [{} for _ in range(n)]
        self._messages: dict[int, list[UpdateMessage]] = {}

    def add(self, round_: int, messages: list[UpdateMessage], late: list[Deliveries]) -> None:
        if not late:
            return
        self._messages[round_] = messages
        for batch in late:
            for p, q in zip(batch.senders.tolist(), batch.receivers.tolist()):
                self.missing[q][(round_, p)] = messages[p]

    def remove(self, arrived: list[Deliveries]) -> None:
        for batch in arrived:
            for p, q in zip(batch.senders.tolist(), batch.receivers.tolist()):
                del self.missing[q][(batch.round, p)]

    def forget(self, round_: int) -> None:
        self._messages.pop(round_, None)

    def has_missing(self, peer: int) -> bool:
        return bool(self.missing[peer])

    def nbytes(self) -> int:
        return 64 * sum(len(m) for m in self.missing)  # rough: one small object per entry

    def apply_view(self, peer: int) -> None:
        back = [m.negated() for m in sorted(self.missing[peer].values())]
        self.engine.accumulate(back)
        self.engine.commit()

    @torch.no_grad()
    def deviation_rows(self) -> list[torch.Tensor]:
        shared = [m.weight.detach().clone() for m in self.engine.matrices]
        rows = [torch.zeros(self.n, m.weight.numel()) for m in self.engine.matrices]
        for peer in range(self.n):
            if not self.has_missing(peer):
                continue
            self.apply_view(peer)
            for block, matrix, s in zip(rows, self.engine.matrices, shared):
                block[peer] = (matrix.weight - s).reshape(-1).float()
                matrix.weight.copy_(s)
        return rows
