"""Cheaters and audits in the simulator (issue 11): n peers in lockstep, some of them cheat.

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

Audits (`algorithm/audit.py`): honest auditor a audits update (p, t) when its secret
draw selects it (rate = cpu_share / (n - 1)); a mismatch is an accusation; every honest
peer then re-checks the update and votes; cheaters vouch for each other's updates (a
match vote for every accusation against a fellow cheater) and accuse nobody. Records
go into a ledger-like list, `judge` decides, and a newly banned peer's updates are taken
back from S (negated) and not applied any more. The auditor recomputes with another
torch thread count than the sender used, as a peer on another machine would.
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

from seedflood_p2p.algorithm.audit import (
    CHEATS,
    AuditSettings,
    audit_rate,
    cheat,
    judge,
    p_audited,
    recompute,
    selects,
    verdict_changes,
)
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.algorithm.trainer import evaluate, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.workload.models import load_model
from seedflood_p2p.workload.tasks import load_run_task


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

    def __post_init__(self) -> None:
        if not 0 <= self.cheaters < self.peers:
            raise UserError(f"cheaters must be 0..{self.peers - 1} (got {self.cheaters})")
        unknown = sorted(set(self.kinds) - set(CHEATS))
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

    torch.set_num_threads(1)
    measure(0)
    for t in range(config.rounds):
        messages = []
        for peer in peers:
            if peer in banned:
                continue  # its updates would not count: every peer drops them
            message, _ = zo_step(engine, tokenizer, task, peer, t)
            counts["train_estimates"] += 1
            if peer in kind_of:
                message = UpdateMessage(t, peer, cheat(kind_of[peer], message.scalars, pool, rng))
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
            for message, recomputed, voted in accused:  # re-checks by everyone else
                for a in honest:
                    if a != message.peer and a not in voted and a not in banned:
                        records.append(AuditRecord(message.peer, t, a, recomputed))
                        counts["audit_estimates"] += 1
                if message.peer in kind_of:  # fellow cheaters vouch for it
                    records += [
                        AuditRecord(message.peer, t, c, message.scalars)
                        for c in kind_of
                        if c != message.peer and c not in banned
                    ]
            judgement = judge(claims, records, settings)
            if judgement.banned.keys() != banned.keys():
                live.apply(verdict_changes(banned, judgement.banned, applied))
                applied = [m for m in applied if m.peer not in judgement.banned]
                for peer in judgement.banned.keys() - banned.keys():
                    ban_round[peer] = t
                banned = dict(judgement.banned)
        waiting[t + settings.lag] = messages
        due = [m for m in waiting.pop(t, []) if m.peer not in banned]
        live.apply(due)
        applied += due
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
