"""A diagonal curvature estimate in a fixed basis's core coordinates, learned from the rows.

HiSo's idea (arXiv 2506.02370, issue 47 lever (c)): the scalars already say how far the run
moved along each coordinate, so a diagonal second moment of those moves can precondition
later rounds without sending anything more. Here, with one fixed basis (K-FAC at the base),
a round's rows add a core D_t to each matrix's r x r coordinates, and

    v_t = b v_(t-1) + (1 - b) D_t^2                      (elementwise; v_0 = 0)
    s_t = (v_(t-1) + mean(v_(t-1)))^(-1/4),  scaled per matrix to mean(s^2) = 1

is the scale of round t: a direction's perturbation along coordinate (a, b) is multiplied
by s_t[a, b], and so is its step, so a row moves the model s^2 (~ v^(-1/2), as Adam or
RMSprop would) times its derivative. Adding mean(v) shrinks the estimate of coordinates few
rows have touched (a round of 4 peers touches 64 of a matrix's 1,024) towards the typical
one; the per-matrix scaling keeps each matrix's mean step where the plain rule puts it.

A pure function of the ledger, but not a linear one: a row of round s changes the scale of
every round after s, so the rows must be folded in round order (a late row raises). That
suits `seedflood train` and the benches, whose rounds run in order; a network run would have
to fix each round's scale from settled rounds and rebuild later rounds on a late row, which
is not built (RunConfig.daemon_problem refuses it). Memory: three L x r^2 float64 tables
(v, the round's D, s): 24 L r^2 bytes, 344 kB for two SmolLM2 blocks at rank 32.
"""

from __future__ import annotations

import numpy as np


class Curvature:
    """The diagonal estimate of a run: rows of rounds < `head` are in `second` (v), the
    rows of round `head` so far in `delta` (D), and `scale` is s of round `head`."""

    def __init__(self, decay: float, shape: tuple[int, int]) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"curvature decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.head = 0
        self.second = np.zeros(shape, dtype=np.float64)
        self.delta = np.zeros(shape, dtype=np.float64)
        self.scale = np.ones(shape, dtype=np.float64)

    def advance(self, round_: int) -> None:
        """Make `round_` (>= head) the round being folded: earlier rounds' D go into v."""
        if round_ < self.head:
            raise ValueError(
                f"a row of round {round_} after round {self.head} began: a curvature run "
                "folds rows in round order (its scale of every later round depends on it)"
            )
        if round_ == self.head:
            return
        b = self.decay
        self.second *= b
        self.second += (1.0 - b) * self.delta * self.delta
        self.second *= b ** (round_ - self.head - 1)  # rounds without rows: D = 0
        self.delta[:] = 0.0
        self.head = round_
        self.scale = scale_of(self.second)

    def factors(self, index: np.ndarray) -> np.ndarray:
        """s of the head round at flat core indices (l * r * r + a * r + b)."""
        return self.scale.reshape(-1)[index]


def scale_of(second: np.ndarray) -> np.ndarray:
    """s = (v + mean v)^(-1/4) per matrix (a row of `second`), scaled so mean(s^2) = 1; a
    matrix no row has moved keeps s = 1."""
    scale = np.ones_like(second)
    for layer, v in enumerate(second):
        typical = float(v.mean())
        if typical > 0.0:
            s = (v + typical) ** -0.25
            scale[layer] = s / np.sqrt(np.mean(s * s))
    return scale
