"""Audits: anyone can recompute anyone's update, so a cheater is caught by recomputation.

An update (peer p, round t, scalars g) is a pure function of the model p trained on:
the minibatch and the directions both come from (run, p, t). An auditor recomputes it
on its own live model and compares. Live models differ by which recent updates are
merged, so an honest recomputation is close to, not equal to, the claim; `AuditRule`
(core/extra_settings.py, a run's `AuditSettings.rule`) says how close (set from
bench/results/audit_mismatch.md).

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

from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.core.rng import derive_key
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage

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


def recompute(
    engine, tokenizer, task, message: UpdateMessage, prefix_cache=None
) -> tuple[float, ...]:
    """The scalars an honest sender would have sent for (message.peer, message.round),
    recomputed on the engine's current model (exactly the sender's step: `zo_step`; with
    the auditor's own `prefix_cache`, if it keeps one)."""
    from seedflood_p2p.algorithm.trainer import zo_step  # trainer imports live -> replay

    recomputed, _ = zo_step(engine, tokenizer, task, message.peer, message.round, prefix_cache)
    return recomputed.scalars


def relative_error(claimed: Iterable[float], recomputed: Iterable[float]) -> float:
    """max_j |c_j - r_j| / max(|c_j|, |r_j|): the measure the bench reports (0 if both 0)."""
    c = np.asarray(tuple(claimed), dtype=np.float64)
    r = np.asarray(tuple(recomputed), dtype=np.float64)
    scale = np.maximum(np.abs(c), np.abs(r))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(scale > 0, np.abs(c - r) / scale, 0.0)
    return float(rel.max())


# --------------------------------------------------------------------------- verdicts


@dataclass
class Case:
    """All votes on one update (accused, round)."""

    accused: bytes
    round: int
    claimed: tuple[float, ...] | None  # None: the update is not in the ledger (yet)
    mismatch: set[bytes] = field(default_factory=set)  # auditors whose recomputation differs
    match: set[bytes] = field(default_factory=set)
    outcome: str = "open"  # open | confirmed (accused banned) | refuted (accusers banned)


@dataclass(frozen=True)
class Judgement:
    banned: dict[bytes, str]  # peer -> why (the first case that banned it, in case order)
    cases: list[Case]

    @property
    def accusations(self) -> int:
        return sum(1 for c in self.cases if c.mismatch)


def choose_records(records: Iterable[AuditRecord]) -> dict[tuple[bytes, int, bytes], AuditRecord]:
    """One record per (accused, round, auditor): of two, the smaller scalars (as
    `protocol.update.keeps_new` orders equivocations); the accused's own records are left out."""
    chosen: dict[tuple[bytes, int, bytes], AuditRecord] = {}
    for record in records:
        if record.auditor == record.accused:
            continue
        key = (record.accused, record.round, record.auditor)
        held = chosen.get(key)
        if held is None or _scalar_order(record.scalars) < _scalar_order(held.scalars):
            chosen[key] = record
    return chosen


def judge(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    records: Iterable[AuditRecord],
    settings: AuditSettings,
    voters: frozenset[bytes] | None = None,
    court: frozenset[bytes] = frozenset(),
) -> Judgement:
    """What a set of audit records decides, given the claimed scalars of each (round, peer).

    A pure function of its arguments: the same ledger judges the same everywhere, whatever
    order its records arrived in. Only cases with at least one mismatch exist (a published
    match alone accuses no one). An auditor's votes count once per case (of two records
    from one auditor for one update, the smaller scalars, as `protocol.update.keeps_new` orders
    equivocations); the accused's own records do not count. With `voters` (probation:
    the established identities), only their records vote. With a `court` (probation: the
    run's founders), a case any member of the court voted on is decided by the court's
    votes alone (quorum: min(quorum, court size)), and a confirmed case also bans the
    voters outside the court that matched the cheat (a false vouch costs its author, as a
    false accusation does): identities that earned their standing cannot outvote the
    founders, nor vouch for a cheat unpunished.
    """
    rule = settings.rule
    chosen = choose_records(records)
    if voters is not None:
        chosen = {key: r for key, r in chosen.items() if key[2] in voters}
    votes: dict[tuple[bytes, int], list[AuditRecord]] = defaultdict(list)
    for key in sorted(chosen):
        votes[key[:2]].append(chosen[key])
    cases, banned = [], {}
    for (accused, round_), rows in sorted(votes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        claimed = claims.get((round_, accused))
        case = Case(accused, round_, claimed)
        if claimed is None:
            cases.append(case)
            continue
        for row in rows:
            bad = rule.mismatches(claimed, row.scalars)
            (case.mismatch if bad else case.match).add(row.auditor)
        if not case.mismatch:
            continue
        q = settings.quorum
        mismatch, match = case.mismatch, case.match
        if court and (court & (mismatch | match)):
            mismatch, match = mismatch & court, match & court
            q = min(q, len(court))
        if len(mismatch) >= q and len(mismatch) > len(match):
            case.outcome = "confirmed"
            banned.setdefault(accused, f"update of round {round_} failed {len(mismatch)} audits")
            if court:
                for auditor in sorted(case.match - court):
                    banned.setdefault(auditor, f"vouched for round {round_}'s failed update")
        elif len(match) >= q and len(match) > len(mismatch):
            case.outcome = "refuted"
            for auditor in sorted(case.mismatch):
                banned.setdefault(auditor, f"false accusation against round {round_}'s update")
        cases.append(case)
    return Judgement(banned, [c for c in cases if c.mismatch])


def _scalar_order(scalars: tuple[float, ...]) -> tuple:
    return tuple((x, math.copysign(1.0, x)) for x in scalars)


def counted(messages: Iterable[UpdateMessage], banned: Mapping[bytes, str]) -> list[UpdateMessage]:
    """The updates that count: every update of a banned peer is void."""
    return [m for m in messages if m.peer not in banned]


def verdict_changes(
    before: Mapping[bytes, str], after: Mapping[bytes, str], held: Iterable[UpdateMessage]
) -> list[UpdateMessage]:
    """What a live model must add when the banned set moves from `before` to `after`, given
    the updates it holds: a newly banned peer's updates negated (taken back, as an
    equivocation's loser is), an unbanned one's applied again."""
    out = []
    for m in held:
        if m.peer in after and m.peer not in before:
            out.append(m.negated())
        elif m.peer in before and m.peer not in after:
            out.append(m)
    return out


def judge_messages(
    messages: Iterable[UpdateMessage], records: Iterable[AuditRecord], settings: AuditSettings
) -> tuple[list[UpdateMessage], Judgement]:
    """The updates that count among `messages` (order kept) and the judgement behind it."""
    messages = list(messages)
    judgement = judge({(m.round, m.peer): m.scalars for m in messages}, records, settings)
    return counted(messages, judgement.banned), judgement


def judge_ledger(ledger, settings: AuditSettings) -> tuple[list[UpdateMessage], Judgement]:
    """`judge_messages` over a ledger's updates (canonical order) and audit records: what
    a replay applies (`seedflood replay`) and what a live peer's model must equal."""
    return judge_messages(ledger.messages(), ledger.audits(), settings)
