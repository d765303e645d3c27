"""Cheaters and audits in the simulator: n peers in lockstep, some of them cheat.

Every peer trains on the settled model S_t = base + every counted update of rounds
< t - lag (lag 0: each round's updates are merged before the next, as `seedflood train`
does; the daemon needs lag >= max_staleness + 1 for every peer to hold that state). Flooding is
instantaneous and lossless here (the simulator's delay 0), so S_t is every peer's model
and an audit recomputes on exactly the state the sender used, as the protocol asks.

A cheater sends, instead of its honest scalars g (computed, then replaced: it could
also skip the work):

    sign-flip   -g
    random      a scalar drawn from the honest claims seen so far (size of an honest one)
    scale3      3 g

Audits (`algorithm/audit_rules.py`): honest auditor a audits update (p, t) when its secret
draw selects it (rate = cpu_share / (n - 1)); a mismatch is an accusation; every honest
peer then re-checks the update and votes; cheaters vouch for each other's updates (a
match vote for every accusation against a fellow cheater) and accuse nobody. Records
go into a ledger-like list, `judge` decides, and a newly banned peer's updates are taken
back from S (negated) and not applied any more. The auditor recomputes with another
torch thread count than the sender used, as a peer on another machine would.

Many identities (`probation`): the honest peers are the run's founders; every other
identity is on probation (`algorithm/probation.py`). Each round every established honest
peer may spend `share` of a training step on probation audits (tokens, as in the daemon):
probationers' updates of the round are audited in peer order (oldest identity first), a
match published as a vouch, a mismatch as an accusation that every established peer
re-checks. `standing` decides what counts; an update that starts counting is applied
late, one that stops counting is taken back. Sybil behaviours besides the cheats:
"honest" (a new identity that trains honestly) and "late-flip" (honest for `turn`
rounds, then sign-flip). Sybils vouch for each other (3 fellows a round each) and, with
`accuse`, every one of them accuses an honest peer's update every round.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from seedflood_p2p.algorithm.audit_rules import (
    audit_rate,
    judge,
    p_audited,
    recompute,
    selects,
    verdict_changes,
)
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.probation import standing
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.algorithm.trainer import evaluate, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, quantize_scalars
from seedflood_p2p.workload.models import load_model
from seedflood_p2p.workload.tasks import load_run_task

CHEATS = ("sign-flip", "random", "scale3")  # what a cheater sends instead of its scalars g
SYBIL_KINDS = ("honest", "late-flip")  # simulator-only behaviours of new identities


def cheat(kind: str, scalars: tuple[float, ...], pool: list[tuple[float, ...]], rng) -> tuple:
    """What a cheater of `kind` sends instead of its honest `scalars` (float16 as on the
    wire): "sign-flip" -g, "scale3" 3 g, "random" one of the honest claims in `pool`
    (chosen with `rng`): the size of an honest scalar, pointing nowhere it computed. The
    simulator's cheaters, and the tests' cheating daemon (harness/hooked_peer.py)."""
    if kind == "sign-flip":
        return quantize_scalars([-x for x in scalars])
    if kind == "scale3":
        return quantize_scalars([3 * x for x in scalars])
    if kind != "random":
        raise ValueError(f"unknown cheat {kind!r}: one of {CHEATS}")
    return rng.choice(pool) if pool else scalars


@dataclass(frozen=True)
class CheatConfig:
    peers: int = 16
    rounds: int = 60
    cheaters: int = 0  # the last `cheaters` peers cheat, kinds in CHEATS order, cycled
    kinds: tuple[str, ...] = CHEATS
    audits: bool = True
    settings: AuditSettings = field(default_factory=lambda: AuditSettings(enabled=True))
    eval_every: int = 10
    eval_examples: int = 200
    auditor_threads: int = 2  # the sender computes with 1 thread
    seed: int = 0
    run: RunConfig = field(default_factory=RunConfig)
    probation: bool = False  # the honest peers are founders; the others on probation
    vouches: int = 3
    share: float = 0.25  # probation audits per established honest peer per round
    turn: int = 15  # "late-flip" sybils cheat from this round on
    accuse: bool = False  # sybils accuse an honest peer's update every round

    def __post_init__(self) -> None:
        if not 0 <= self.cheaters < self.peers:
            raise UserError(f"cheaters must be 0..{self.peers - 1} (got {self.cheaters})")
        unknown = sorted(set(self.kinds) - set(CHEATS) - set(SYBIL_KINDS))
        if unknown or not self.kinds:
            raise UserError(f"unknown cheat kinds {unknown}: choose from {CHEATS}")


def simulate_cheaters(config: CheatConfig, progress: Any = None) -> dict:
    """Run one configuration; returns a JSON-ready dict (curves, bans, audit counts)."""
    started = time.perf_counter()
    run = config.run
    settings = config.settings
    model, tokenizer = load_model(run.model)
    task = load_run_task(run)
    engine = SubCGE(model, run, basis_cache=config.rounds // run.refresh_period + 3)
    live = LiveModel(engine)
    peers = [f"sim-{i}".encode() for i in range(config.peers)]
    kind_of = {
        peers[config.peers - 1 - i]: config.kinds[i % len(config.kinds)]
        for i in range(config.cheaters)
    }
    secrets = {p: b"secret/" + p + bytes([config.seed]) for p in peers}
    honest = [p for p in peers if p not in kind_of]
    probation = ProbationSettings(
        frozenset(honest) if config.probation else frozenset(), config.vouches, config.share
    )
    sybils = [p for p in peers if p in kind_of]
    tokens = dict.fromkeys(honest, 0.0)
    held: list[UpdateMessage] = []  # merged rounds' updates that do not count (yet)
    judged = standing({}, [], settings, probation)
    ever_counted: set[tuple[bytes, int]] = set()
    first_counted: dict[bytes, int] = {}
    established_round: dict[bytes, int] = {}
    rate = audit_rate(config.peers, settings.cpu_share)
    rng = random.Random(config.seed)
    claims: dict[tuple[int, bytes], tuple[float, ...]] = {}
    pool: list[tuple[float, ...]] = []
    records: list[AuditRecord] = []
    applied: list[UpdateMessage] = []  # in S now
    waiting: dict[int, list[UpdateMessage]] = defaultdict(list)  # round -> to merge later
    banned: dict[bytes, str] = {}
    ban_round: dict[bytes, int] = {}
    counts = {
        "train_estimates": 0,
        "audit_estimates": 0,
        "audits": 0,
        "mismatches": 0,
        "honest_audited": 0,
        "honest_mismatches": 0,
        "probation_audits": 0,
        "probation_backlog": 0,
    }
    evals = []

    def measure(done: int) -> None:
        loss, acc = evaluate(model, tokenizer, task, run, config.eval_examples)
        evals.append({"round": done, "loss": loss, "accuracy": acc, **counts})
        if progress is not None:
            progress(config, evals[-1])

    def audit(message: UpdateMessage) -> tuple[float, ...]:
        threads = torch.get_num_threads()
        torch.set_num_threads(config.auditor_threads)
        try:
            return recompute(engine, tokenizer, task, message)
        finally:
            torch.set_num_threads(threads)

    def accuse(t: int, messages: list[UpdateMessage], established) -> list[AuditRecord]:
        """Every unbanned sybil accuses an honest peer's update of round t; the other honest
        peers (established ones, with probation) re-check it, as daemons re-check every
        mismatch record they see."""
        victim = honest[t % len(honest)]
        if victim in banned:
            return []
        wrong = tuple(-x - 1.0 for x in claims[(t, victim)])
        accusers = [s for s in sybils if s not in banned]
        out = [AuditRecord(victim, t, s, wrong) for s in accusers]
        if established is not None and not set(accusers) & established:
            return out  # no vote among them: nobody re-checks (as in the daemon)
        checkers = [
            a
            for a in honest
            if a != victim and a not in banned and (established is None or a in established)
        ]
        if checkers:
            recomputed = audit(next(m for m in messages if m.peer == victim))
            counts["audit_estimates"] += len(checkers)
            out += [AuditRecord(victim, t, a, recomputed) for a in checkers]
        return out

    torch.set_num_threads(1)
    measure(0)
    for t in range(config.rounds):
        messages = []
        for peer in peers:
            if peer in banned:
                continue  # its updates would not count: every peer drops them
            message, _ = zo_step(engine, tokenizer, task, peer, t)
            counts["train_estimates"] += 1
            kind = kind_of.get(peer)
            if kind == "late-flip":
                kind = "sign-flip" if t >= config.turn else "honest"
            if kind is not None and kind != "honest":
                message = UpdateMessage(t, peer, cheat(kind, message.scalars, pool, rng))
            else:
                pool.append(message.scalars)
            claims[(t, peer)] = message.scalars
            messages.append(message)
        if config.audits:
            accused = []
            for message in messages:
                auditors = [
                    a
                    for a in honest
                    if a != message.peer and a not in banned
                    and selects(secrets[a], run.run_key, message.peer, t, rate)
                ]  # fmt: skip
                if not auditors:
                    continue
                recomputed = audit(message)  # the same state for every auditor: once
                counts["audit_estimates"] += len(auditors)
                counts["audits"] += len(auditors)
                bad = settings.rule.mismatches(message.scalars, recomputed)
                if message.peer not in kind_of:
                    counts["honest_audited"] += 1
                    counts["honest_mismatches"] += int(bad)
                if bad:
                    counts["mismatches"] += len(auditors)
                    records += [AuditRecord(message.peer, t, a, recomputed) for a in auditors]
                    accused.append((message, recomputed, set(auditors)))
            if probation.enabled:  # probation audits, within each auditor's budget
                auditors = [a for a in honest if a in judged.established and a not in banned]
                for a in auditors:
                    tokens[a] = min(tokens[a] + probation.share, max(1.0, 2 * probation.share))
                queue = [
                    m for m in messages if m.peer in kind_of and m.peer not in judged.established
                ]
                for message in queue:
                    auditor = next((a for a in auditors if tokens[a] >= 1), None)
                    if auditor is None:
                        counts["probation_backlog"] += 1
                        continue
                    tokens[auditor] -= 1
                    recomputed = audit(message)
                    counts["audit_estimates"] += 1
                    counts["probation_audits"] += 1
                    records.append(AuditRecord(message.peer, t, auditor, recomputed))
                    if settings.rule.mismatches(message.scalars, recomputed):
                        accused.append((message, recomputed, {auditor}))
                for i, s in enumerate(sybils):  # the cartel vouches for its own
                    if s in banned:
                        continue
                    for fellow in (sybils[(i + j) % len(sybils)] for j in (1, 2, 3)):
                        if fellow != s and (t, fellow) in claims:
                            records.append(AuditRecord(fellow, t, s, claims[(t, fellow)]))
            if config.accuse and honest:  # the cartel accuses an honest peer every round
                records += accuse(t, messages, judged.established if probation.enabled else None)
            for message, recomputed, voted in accused:  # re-checks by everyone else
                on_probation = probation.enabled and message.peer not in judged.established
                for a in honest:
                    if probation.enabled and a not in judged.established:
                        continue
                    if a != message.peer and a not in voted and a not in banned:
                        records.append(AuditRecord(message.peer, t, a, recomputed))
                        counts["audit_estimates"] += 1
                        if on_probation:  # probation work: out of the budget (a debt)
                            tokens[a] -= 1
                            counts["probation_audits"] += 1
                if message.peer in kind_of:  # fellow cheaters vouch for it
                    records += [
                        AuditRecord(message.peer, t, c, message.scalars)
                        for c in kind_of
                        if c != message.peer and c not in banned
                    ]
            if probation.enabled:
                judged = standing(claims, records, settings, probation)
                for peer in judged.banned.keys() - banned.keys():
                    ban_round[peer] = t
                for peer in judged.established - judged.founders:
                    established_round.setdefault(peer, t)
                banned = dict(judged.banned)
                drop = [m for m in applied if not judged.counts(m.peer, m.round)]
                add = [m for m in held if judged.counts(m.peer, m.round)]
                if drop or add:
                    live.apply([m.negated() for m in drop] + add)
                    applied = [m for m in applied if judged.counts(m.peer, m.round)] + add
                    held = [m for m in held if not judged.counts(m.peer, m.round)] + drop
            else:
                judgement = judge(claims, records, settings)
                if judgement.banned.keys() != banned.keys():
                    live.apply(verdict_changes(banned, judgement.banned, applied))
                    applied = [m for m in applied if m.peer not in judgement.banned]
                    for peer in judgement.banned.keys() - banned.keys():
                        ban_round[peer] = t
                    banned = dict(judgement.banned)
        waiting[t + settings.lag] = messages
        merged = waiting.pop(t, [])
        if probation.enabled:
            due = [m for m in merged if judged.counts(m.peer, m.round)]
            held += [m for m in merged if not judged.counts(m.peer, m.round)]
        else:
            due = [m for m in merged if m.peer not in banned]
        live.apply(due)
        applied += due
        for m in applied:
            if m.peer in kind_of and (m.peer, m.round) not in ever_counted:
                ever_counted.add((m.peer, m.round))
                first_counted.setdefault(m.peer, t)
        done = t + 1
        if done == config.rounds or (config.eval_every and done % config.eval_every == 0):
            measure(done)
    engine.close()
    n_honest_auditors = len(honest) - 1
    return {
        "config": {
            **{k: v for k, v in dataclasses.asdict(config).items() if k not in ("run",)},
            "run": dataclasses.asdict(run),
        },
        "cheaters": {p.decode(): k for p, k in kind_of.items()},
        "banned": {p.decode(): {"round": ban_round[p], "why": why} for p, why in banned.items()},
        "false_bans": sorted(p.decode() for p in banned if p not in kind_of),
        # cheating from round 0: rounds it took (ban at the end of round r: r + 1); with
        # several cheaters of one kind, the slowest (summary_row lists each)
        "rounds_to_ban": {
            kind_of[p]: ban_round[p] + 1 for p in sorted(banned, key=ban_round.get) if p in kind_of
        },
        "sybil_updates_counted": len(ever_counted),
        "sybil_updates_counted_at_end": sum(1 for m in applied if m.peer in kind_of),
        "sybil_updates_sent": sum(1 for (_, p) in claims if p in kind_of),
        "first_counted_round": {p.decode(): r for p, r in first_counted.items()},
        "established_round": {p.decode(): r for p, r in established_round.items()},
        "established_at_end": sorted(p.decode() for p in judged.established - judged.founders),
        "audit_rate": rate,
        "p_audited_per_update": p_audited(rate, n_honest_auditors),
        "counts": counts,
        "audit_cpu_share": counts["audit_estimates"] / max(1, counts["train_estimates"]),
        "evals": evals,
        "final": evals[-1],
        "seconds": time.perf_counter() - started,
    }


def summary_row(result: dict) -> dict:
    c = result["config"]
    return {
        "peers": c["peers"],
        "cheaters": c["cheaters"],
        "audits": c["audits"],
        "lag": c["settings"]["lag"],
        "final_loss": result["final"]["loss"],
        "final_accuracy": result["final"]["accuracy"],
        "banned": len(result["banned"]),
        "false_bans": len(result["false_bans"]),
        "rounds_to_ban": {  # per cheater, in peer order: several may share a kind
            f"{peer} {kind}": result["banned"][peer]["round"] + 1
            if peer in result["banned"]
            else None
            for peer, kind in sorted(result["cheaters"].items())
        },
        "honest_audited": result["counts"]["honest_audited"],
        "honest_mismatches": result["counts"]["honest_mismatches"],
        "audit_cpu_share": result["audit_cpu_share"],
    }


def mean_curve(results: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([e["round"] for e in results[0]["evals"]])
    y = np.mean([[e["loss"] for e in r["evals"]] for r in results], axis=0)
    return x, y
