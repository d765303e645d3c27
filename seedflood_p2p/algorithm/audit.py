"""Audits: anyone can recompute anyone's update, so a cheater is caught by recomputation.

An update (peer p, round t, scalars g) is a pure function of the model p trained on:
the minibatch and the directions both come from (run, p, t). An auditor recomputes it
on its own live model and compares. Live models differ by which recent updates are
merged, so an honest recomputation is close to, not equal to, the claim; `AuditRule`
says how close (set from bench/results/audit_mismatch.md).

Everything here is a pure function: who audits what (`audit_draw`, `selects`), the
recomputation (`recompute`), the comparison (`AuditRule`), and what a set of audit
records in the ledger decides (`judge`): which peers are banned, so which updates count
(`counted`). Live peers and a replay call the same `judge` on the same records and
therefore agree on the model whatever order the records arrived in.

Who audits what. Auditor a audits update (p, t) when `audit_draw(secret_a, run, p, t)`
< rate, where secret_a is a's own secret (its private key seed in the daemon): the
sender cannot compute it, so it cannot predict or pick its auditors, and auditors
draw independently. With h honest auditors each drawing with probability q, an update
is audited by at least one of them with probability 1 - (1 - q)^h (`p_audited`).
Each audit costs what one training step costs (two forward passes), so a peer that
audits q * (n - 1) updates per round spends that share of its training CPU on audits:
q = cpu_share / (n - 1) (`audit_rate`): 10% at 16 peers gives q = 0.00667 and every
update an audit with probability 1 - (1 - q)^15 = 9.5%.

Verdicts (`judge`). An audit that finds a mismatch is published as an `AuditRecord`
(auditor, accused, round, recomputed scalars), signed by the auditor. Every peer that
sees a mismatch record for (p, t) re-checks (p, t) itself and publishes its own record,
mismatch or not. For each accused update the records of peers other than p are votes:
mismatch or match, decided by the rule against the scalars the ledger holds for (p, t).
At `quorum` votes of one kind that outnumber the other kind the case is decided: p is
banned (its updates all voided), or every auditor that voted mismatch is banned (a false
accusation costs its author). Fewer votes: the case stays open and nothing changes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from seedflood_p2p.algorithm.rng import derive_key
from seedflood_p2p.protocol.message import UpdateMessage

# ------------------------------------------------------------------------ who audits what


def audit_draw(secret: bytes, run_key: bytes, peer: bytes, round_: int) -> float:
    """A uniform draw in [0, 1) that only the holder of `secret` can compute."""
    k0, k1 = derive_key("seedflood/audit", secret, run_key, peer, round_)
    return ((k1 << 32 | k0) >> 11) / float(1 << 53)


def selects(secret: bytes, run_key: bytes, peer: bytes, round_: int, rate: float) -> bool:
    """Does the auditor holding `secret` audit update (peer, round)?"""
    return audit_draw(secret, run_key, peer, round_) < rate


def audit_rate(peers: int, cpu_share: float = 0.10) -> float:
    """Per-auditor sampling rate that spends `cpu_share` of a peer's training CPU on audits
    (an audit costs one training step; a peer sees peers - 1 others' updates per round)."""
    return min(1.0, cpu_share / max(1, peers - 1))


def p_audited(rate: float, honest_auditors: int) -> float:
    """Probability that one update is audited by at least one of `honest_auditors`."""
    return 1.0 - (1.0 - rate) ** honest_auditors


def rounds_to_catch(rate: float, honest_auditors: int, confidence: float = 0.99) -> int:
    """Rounds after which a peer cheating every round has been audited at least once,
    with probability `confidence`."""
    p = p_audited(rate, honest_auditors)
    if p <= 0:
        return math.inf  # type: ignore[return-value]
    if p >= 1:
        return 1
    return math.ceil(math.log(1 - confidence) / math.log(1 - p))


# ---------------------------------------------------------------------- the recomputation


def recompute(engine, tokenizer, task, message: UpdateMessage) -> tuple[float, ...]:
    """The scalars an honest sender would have sent for (message.peer, message.round),
    recomputed on the engine's current model (exactly the sender's step: `zo_step`)."""
    from seedflood_p2p.algorithm.trainer import zo_step  # trainer imports live -> replay

    recomputed, _ = zo_step(engine, tokenizer, task, message.peer, message.round)
    return recomputed.scalars


@dataclass(frozen=True)
class AuditRule:
    """When does a recomputed update contradict the claim?

    Per scalar, |claimed - recomputed| > max(absolute, relative * max(|claimed|,
    |recomputed|)). `relative` bounds the honest disagreement of two live models that
    differ by a few rounds of merged updates; `absolute` keeps scalars near zero (where
    a relative error means nothing) from accusing anyone. Defaults: from the measured
    honest mismatch, bench/results/audit_mismatch.md.
    """

    relative: float = 0.5
    absolute: float = 0.05

    def mismatches(self, claimed: Iterable[float], recomputed: Iterable[float]) -> bool:
        c = np.asarray(tuple(claimed), dtype=np.float64)
        r = np.asarray(tuple(recomputed), dtype=np.float64)
        if c.shape != r.shape:
            return True
        bound = np.maximum(self.absolute, self.relative * np.maximum(np.abs(c), np.abs(r)))
        return bool(np.any(np.abs(c - r) > bound))


def relative_error(claimed: Iterable[float], recomputed: Iterable[float]) -> float:
    """max_j |c_j - r_j| / max(|c_j|, |r_j|): the measure the bench reports (0 if both 0)."""
    c = np.asarray(tuple(claimed), dtype=np.float64)
    r = np.asarray(tuple(recomputed), dtype=np.float64)
    scale = np.maximum(np.abs(c), np.abs(r))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(scale > 0, np.abs(c - r) / scale, 0.0)
    return float(rel.max())
