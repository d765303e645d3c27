"""Momentum from the ledger: heavy-ball momentum in a fixed basis's core coordinates.

When the run's basis never changes (one K-FAC artifact, both sides, for every round), the
rows of round s add a core G_s to each matrix's r x r coordinates, and heavy-ball momentum
(m_t = b m_(t-1) + G_t, W_(t+1) = W_t - U m_t V^T) makes the state of round T (every row of
the rounds before T applied)

    S_T = base - U_l (sum over rows i with s_i < T of w(T - s_i) c_i) V_l^T,
    w(d) = 1 + b + ... + b^(d-1)          (w(1) = 1: a row counts once in its own round),

still a linear function of the ledger and of T. So a replay folds each row once with its
weight and merges once (O(n + r*d), as without momentum), a late row is two more additions,
and b = 0 is the plain rule. `Velocity` keeps T (`head`) and M_T = sum b^(T-1-s_i) c_i
(L x r*r float64: 8 L r^2 bytes, 115 kB for two SmolLM2 blocks at rank 32); moving T on by
one round adds b M_T to the model's pending core and scales M_T by b.

Every factor is built from IEEE multiplications and additions in a fixed order (no pow,
no exp), so every machine computes the same bits. Lags past MAX_LAG weigh as MAX_LAG: b^4096
is below 2e-18 for every allowed b, so this changes nothing a float32 weight can hold.
"""

from __future__ import annotations

import numpy as np

MAX_LAG = 4096  # rounds; part of the rule's definition (see above)


class Velocity:
    """The momentum state of a run with a fixed basis: the round the state is of (`head`:
    rows of rounds < head are in it) and the velocity core M_head."""

    def __init__(self, beta: float, shape: tuple[int, int]) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.head = 0
        self.core = np.zeros(shape, dtype=np.float64)
        # weight[d] = w(d), carry[d] = b^(d-1), for lags 1 <= d; index 0 unused
        self._weight = [0.0, 1.0]
        self._carry = [0.0, 1.0]

    @property
    def nbytes(self) -> int:
        return self.core.nbytes

    def factors(self, lag: int) -> tuple[float, float]:
        """(w(lag), b^(lag-1)) for a row `lag` >= 1 rounds before the head: its weight in
        the state and in the velocity."""
        if lag < 1:
            raise ValueError(f"a row of round >= head has no weight yet (lag {lag})")
        lag = min(lag, MAX_LAG)
        while len(self._weight) <= lag:
            self._weight.append(1.0 + self.beta * self._weight[-1])
            self._carry.append(self.beta * self._carry[-1])
        return self._weight[lag], self._carry[lag]

    def advance(self, head: int) -> np.ndarray | None:
        """Move the state on to round `head` (>= the current one). Returns what the model must
        add to its pending core (sum of b M over the rounds passed), or None if nothing."""
        if head <= self.head:
            return None
        carry = None
        for _ in range(head - self.head):
            if not self.core.any():  # nothing left to carry: jump
                break
            self.core *= self.beta
            if carry is None:
                carry = self.core.copy()
            else:
                carry += self.core
        self.head = head
        return carry

    def rewind(self, head: int) -> np.ndarray | None:
        """Move the state back to round `head` (<= the current one), once every row of the
        rounds from `head` on has been taken back. Returns what the model must add to its
        pending core, or None if nothing.

        The rows left (rounds s < head) are weighted w(H - s) in the state and b^(H-1-s) in
        the velocity, H the current head. Since w(H - s) - w(head - s) = b^(head-s) w(H -
        head), the state moves by -w(H - head) b M_head, with M_head = velocity /
        b^(H-head): a division by b^(H-head) >= b^MAX_REWIND (an audit's rewind, 30
        rounds), which amplifies rounding by at most 24x at b = 0.9."""
        if head >= self.head:
            return None
        if head < 0:
            raise ValueError(f"cannot rewind to round {head}")
        gap = self.head - head
        if not self.core.any():
            self.head = head
            return None
        decay = 1.0
        for _ in range(gap):
            decay *= self.beta
        if decay == 0.0:
            raise ValueError(f"cannot rewind {gap} rounds at momentum {self.beta}: b^gap is 0")
        weight, _ = self.factors(gap)
        self.core /= decay  # M_head
        self.head = head
        return self.core * (-weight * self.beta)

    def state(self) -> tuple[int, np.ndarray]:
        """(head, a copy of the velocity): what `load` puts back."""
        return self.head, self.core.copy()

    def load(self, state: tuple[int, np.ndarray]) -> None:
        head, core = state
        if core.shape != self.core.shape:
            raise ValueError(f"velocity of shape {core.shape}, expected {self.core.shape}")
        self.head, self.core = int(head), np.array(core, dtype=np.float64)
