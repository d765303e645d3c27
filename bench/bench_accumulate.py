#!/usr/bin/env python
"""The ingest fast paths against what they replaced, side by side in one process (issue 46
item 1, second half; the stage table of bench/results/ingest.md is the "before").

    PYTHONPATH=. python bench/bench_accumulate.py             # ~2-4 CPU-min
    PYTHONPATH=. python bench/bench_accumulate.py --repeats 1 # a quick look

Rows (process CPU time per update or per gossip batch; each pair measured interleaved,
best of --repeats, on the same inputs; every "after" is checked to give the same bits):

- SubCGE coordinates: `message_coordinates` of one round of M = 1,000 updates (k
  directions over the model's matrices) before (every Philox counter built, one pass over
  all) and now (`philox4x32_grid` in cache-sized chunks).
- SubCGE accumulate: `SubCGE.accumulate` of that round, before (the one-pass reference:
  those coordinates, per-message `coefficients`) and now (chunks, `step_coefficient_rows`);
  the cores compared bit for bit.
- quorum round, per gossip batch of B updates: B claims raised, then the reference round:
  a plain dict and `quorum_round` (sorting every identity's claim) before, a `RoundClaims`
  now, at M = 1,000 and 10,000 identities.
- live peers, per admitted batch: a pass over M peers per batch before;
  `DaemonAudits.live_count` (counted at most once per LIVE_COUNT_SECONDS) now, at 500
  batches/s of a simulated clock.
- a waiting round's look (`Pacing.wait_ready`, every tick): which live peers, not banned
  nor on probation, are behind, and the slowest round. A pass over every live peer before;
  `Pacing.behind` on the flood node's `PeerTable` (an index of live peers by round) now;
  at M = 1,000 and 10,000 with 1% of them behind, 20 banned and 1% on probation.
- SQLite: `Ledger.add` per update (CPU and wall, fsync included) at the batch sizes the
  gossip group commit (GOSSIP_COALESCE) makes of a steady flow at 1,000 to 5,000 updates/s.

Writes bench/results/accumulate.json and accumulate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from bench_ingest import run_config  # the same runs as the live ceiling rows

from seedflood_p2p.algorithm import subcge
from seedflood_p2p.algorithm.subcge import make_estimator, message_coordinates
from seedflood_p2p.core.rng import derive_key, philox4x32
from seedflood_p2p.protocol.message import Envelope, UpdateMessage, quantize_scalars
from seedflood_p2p.protocol.update import RoundClaims, quorum_round
from seedflood_p2p.workload.models import load_model

OUT = Path(__file__).parent / "results"


def old_coordinates(run_key, peers, rounds, num_layers, rank, directions=1):
    n, k = len(peers), directions
    keys = np.array(
        [derive_key("seedflood/message", run_key, p, t) for p, t in zip(peers, rounds)],
        dtype=np.uint64,
    ).reshape(n, 2)
    blocks = -(-3 * num_layers // 4)
    counters = np.zeros((n * k * blocks, 4), dtype=np.uint64)
    counters[:, 0] = np.tile(np.arange(blocks, dtype=np.uint64), n * k)
    counters[:, 1] = np.tile(np.repeat(np.arange(k, dtype=np.uint64), blocks), n)
    key0 = np.repeat(keys[:, 0], k * blocks)
    key1 = np.repeat(keys[:, 1], k * blocks)
    words = philox4x32(counters, (key0, key1)).reshape(n * k, blocks * 4)[:, : 3 * num_layers]
    words = words.reshape(n, k, num_layers, 3).astype(np.int64)
    sign = np.where(words[..., 2] & 1, 1.0, -1.0)
    return words[..., 0] % rank, words[..., 1] % rank, sign


def old_accumulate(engine, messages, round_sizes=None) -> None:
    L, r, k = len(engine.matrices), engine.config.rank, engine.config.directions
    a, b, sign = old_coordinates(
        engine.run_key, [m.peer for m in messages], [m.round for m in messages], L, r, k
    )
    if round_sizes is None and engine.config.round_sized:
        round_sizes = Counter(m.round for m in messages)
    sizes = round_sizes or {}
    coef = np.stack([engine.coefficients(m, sizes.get(m.round, 1)) for m in messages])
    index = (np.arange(L) * r * r + a * r + b).reshape(len(messages), k * L)
    value = (sign * coef[:, :, None]).reshape(len(messages), k * L)
    epochs = np.array([engine.config.epoch_of(m.round) for m in messages], dtype=np.int64)
    for epoch in np.unique(epochs):
        rows = epochs == epoch
        core = engine._pending.setdefault(int(epoch), np.zeros((L, r * r)))
        np.add.at(core.reshape(-1), index[rows].ravel(), value[rows].ravel())


def cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def best_pair(old, new, repeats: int) -> tuple[float, float]:
    """Best CPU seconds of old() and new(), run alternately."""
    a, b = [], []
    for _ in range(repeats):
        a.append(cpu(old))
        b.append(cpu(new))
    return min(a), min(b)


def subcge_rows(model: str, k: int, m: int, repeats: int) -> dict:
    net, _ = load_model(model)
    config = run_config(model, k)
    rng = np.random.default_rng(1)
    peers = [rng.bytes(38) for _ in range(m)]
    messages = [UpdateMessage(7, p, quantize_scalars(rng.uniform(-1, 1, k))) for p in peers]
    old_engine, new_engine = make_estimator(net, config), make_estimator(net, config)
    L, r = len(new_engine.matrices), config.rank
    args = (config.run_key, peers, [7] * m, L, r, k)
    new, old = message_coordinates(*args), old_coordinates(*args)
    if not all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(new, old)):
        raise RuntimeError("the coordinates differ from the reference")
    c_old, c_new = best_pair(
        lambda: old_coordinates(*args), lambda: message_coordinates(*args), repeats
    )

    def fresh_old() -> None:
        old_engine._pending.clear()
        old_accumulate(old_engine, messages)

    def fresh_new() -> None:
        new_engine._pending.clear()
        new_engine.accumulate(messages)

    a_old, a_new = best_pair(fresh_old, fresh_new, repeats)
    same = sorted(old_engine._pending) == sorted(new_engine._pending) and all(
        np.array_equal(old_engine._pending[e], new_engine._pending[e]) for e in old_engine._pending
    )
    if not same:
        raise RuntimeError("the accumulated cores differ from the reference")
    us = lambda s: round(s / m * 1e6, 1)  # noqa: E731
    return {
        "model": model,
        "k": k,
        "M": m,
        "matrices": L,
        "coordinates us/upd": [us(c_old), us(c_new)],
        "accumulate us/upd": [us(a_old), us(a_new)],
        "accumulate updates/s per core": [round(m / a_old), round(m / a_new)],
        "bit-identical": True,
    }


def quorum_row(m: int, batch: int, repeats: int) -> dict:
    peers = [i.to_bytes(38, "big") for i in range(m)]
    rng = random.Random(m)
    start = {p: 5 + rng.randrange(3) for p in peers}
    batches = 400 if m == 1_000 else 100
    raises = [[rng.choice(peers) for _ in range(batch)] for _ in range(batches)]

    def run(claims, quorum) -> list[int]:
        out = [quorum(claims)]  # as a running node: its claims known, their quorum asked
        for j, group in enumerate(raises):
            for p in group:
                if 6 + j > claims.get(p, -1):  # Admission.note_claim
                    claims[p] = 6 + j
            out.append(quorum(claims))
        return out

    results = {}

    def timed(name, claims, quorum) -> float:
        """CPU seconds of the batches alone (the claims built and asked once before)."""
        quorum(claims)
        t = time.process_time()
        results[name] = run(claims, quorum)
        return time.process_time() - t

    a, b = [], []
    for _ in range(repeats):
        a.append(timed("old", dict(start), lambda c: quorum_round(c.values())))
        b.append(timed("new", RoundClaims(start), lambda c: c.quorum_round()))
    t_old, t_new = min(a), min(b)
    if results["old"] != results["new"]:
        raise RuntimeError("the quorum rounds differ")
    per = lambda s: round(s / batches * 1e6, 1)  # noqa: E731
    return {"M": m, "B": batch, "us per batch": [per(t_old), per(t_new)]}


def _live_pass(table: dict, timeout: float, now: float) -> dict:
    """Before: the live peers by one pass over the whole table."""
    return {p: st for p, st in table.items() if now - st.last_seen < timeout}


def live_row(m: int, repeats: int) -> dict:
    from peer import audit_duty
    from seedflood_p2p.network.gossip.peer_table import PeerState

    now = time.monotonic()
    table = {i.to_bytes(38, "big"): PeerState(5, now) for i in range(m)}
    live_peers = _live_pass
    calls = 1000  # 2 s of batches at 500/s
    clock = [now]
    daemon = audit_duty.DaemonAudits(
        None, None, None, lambda: len(live_peers(table, 60.0, clock[0]))
    )
    real = audit_duty.time.monotonic

    def old() -> None:
        for j in range(calls):
            len(live_peers(table, 60.0, now + j * 0.002))

    def new() -> None:
        audit_duty.time.monotonic = lambda: clock[0]
        try:
            daemon._alive = (-float("inf"), 0)
            for j in range(calls):
                clock[0] = now + j * 0.002
                daemon.live_count()
        finally:
            audit_duty.time.monotonic = real

    t_old, t_new = best_pair(old, new, repeats)
    per = lambda s: round(s / calls * 1e6, 2)  # noqa: E731
    return {"M": m, "us per batch": [per(t_old), per(t_new)]}


def pacing_row(m: int, repeats: int) -> dict:
    from peer.rounds import Pacing
    from peer.settings import PeerSettings
    from seedflood_p2p.network.gossip.peer_table import PeerTable
    from seedflood_p2p.network.monitoring.metrics import NodeMetrics

    now = time.monotonic()
    ids = [i.to_bytes(38, "big") for i in range(m)]
    behind_ids, probation = set(ids[: m // 100]), set(ids[m // 100 : m // 50])
    banned = set(ids[m // 50 : m // 50 + 20])
    table = PeerTable()
    for p in ids:
        table.heard(p, 3 if p in behind_ids or p in banned else 9, now - 1.0)
    settings = PeerSettings(max_staleness=2)
    pacing = Pacing(
        settings,
        NodeMetrics(),
        lambda: table,
        lambda: False,
        banned=banned.__contains__,
        probationer=probation.__contains__,
    )
    round_ = 10
    oldest = round_ - 1 - settings.max_staleness
    calls = 200

    def old_look() -> tuple:
        live = {
            p: st
            for p, st in _live_pass(table, settings.liveness_timeout, now).items()
            if p not in banned and p not in probation
        }
        behind = [p for p, st in live.items() if st.round < oldest]
        return behind, min((st.round for st in live.values()), default=round_)

    answers = {}

    def old() -> None:
        for _ in range(calls):
            answers["old"] = old_look()

    def new() -> None:
        for _ in range(calls):
            answers["new"] = pacing.behind(now, oldest, round_ - 1)

    t_old, t_new = best_pair(old, new, repeats)
    (b_old, s_old), (b_new, s_new) = answers["old"], answers["new"]
    if set(b_old) != set(b_new) or s_old != s_new or set(b_new) != behind_ids:
        raise RuntimeError("the looks differ")
    per = lambda s: round(s / calls * 1e6, 1)  # noqa: E731
    return {"M": m, "behind": len(b_new), "us per look": [per(t_old), per(t_new)]}


def sqlite_rows(repeats: int, k: int = 16) -> list[dict]:
    from seedflood_p2p.network.gossip.flood import GOSSIP_COALESCE
    from seedflood_p2p.storage.ledger import Ledger

    run_id = "ab" * 8
    rng = np.random.default_rng(2)
    n = 240
    messages = [
        UpdateMessage(5 + i // 60, rng.bytes(38), quantize_scalars(rng.uniform(-1, 1, k)))
        for i in range(n)
    ]
    envelopes = [Envelope(rng.bytes(60), rng.bytes(8), rng.bytes(64)) for _ in range(n)]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-accumulate-"))
    try:
        for rate in (None, 1000, 2000, 5000):
            batch = 1 if rate is None else max(1, round(rate * GOSSIP_COALESCE))
            cpus, walls = [], []
            for rep in range(repeats):
                ledger = Ledger(work / f"l{rate}-{rep}.sqlite", run_id)
                c, w = time.process_time(), time.perf_counter()
                for j in range(0, n, batch):
                    ledger.add(messages[j : j + batch], envelopes[j : j + batch])
                cpus.append(time.process_time() - c)
                walls.append(time.perf_counter() - w)
                ledger.close()
            rows.append(
                {
                    "flow": "one commit per update (before)" if rate is None else f"{rate}/s",
                    "B": batch,
                    "cpu us/upd": round(min(cpus) / n * 1e6, 1),
                    "wall us/upd": round(min(walls) / n * 1e6, 1),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def write_md(result: dict, path: Path) -> None:
    lines = [
        "# Ingest fast paths: before and after, side by side (issue 46 item 1)",
        "",
        "    PYTHONPATH=. python bench/bench_accumulate.py",
        "",
        f"Machine: {result['machine']}. Process CPU time, best of {result['repeats']} "
        "interleaved runs; before and after measured in the same process on the same inputs, "
        "each after checked bit for bit against its before.",
        "",
        "## SubCGE: one round of M updates",
        "",
        "| model | k | M | matrices | coordinates us/upd before / after | accumulate us/upd "
        "before / after | accumulate updates/s per core before / after | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["subcge"]:
        c, a, u = (
            row["coordinates us/upd"],
            row["accumulate us/upd"],
            row["accumulate updates/s per core"],
        )
        lines.append(
            f"| {row['model']} | {row['k']} | {row['M']:,} | {row['matrices']} | "
            f"{c[0]} / {c[1]} | {a[0]} / {a[1]} | {u[0]:,} / {u[1]:,} | "
            f"{a[0] / a[1]:.1f}x |"
        )
    lines += [
        "",
        "## Per gossip batch: the quorum round (B claims raised, then the reference round)",
        "",
        "| M | B | us per batch before / after |",
        "|---|---|---|",
    ]
    for row in result["quorum"]:
        b = row["us per batch"]
        lines.append(f"| {row['M']:,} | {row['B']} | {b[0]} / {b[1]} |")
    lines += [
        "",
        "## Per admitted batch: live peers for the audit rate (500 batches/s)",
        "",
        "| M | us per batch before / after |",
        "|---|---|",
    ]
    for row in result["live"]:
        b = row["us per batch"]
        lines.append(f"| {row['M']:,} | {b[0]} / {b[1]} |")
    if result.get("pacing"):
        lines += [
            "",
            "## Per tick of a waiting round: who is behind (live, not banned, not on probation)",
            "",
            *([result["pacing_note"] + ".", ""] if result.get("pacing_note") else []),
            "| M | behind | us per look before / after | speed-up |",
            "|---|---|---|---|",
        ]
        for row in result["pacing"]:
            b = row["us per look"]
            lines.append(
                f"| {row['M']:,} | {row['behind']} | {b[0]} / {b[1]} | {b[0] / b[1]:.0f}x |"
            )
    lines += [
        "",
        "## SQLite: Ledger.add per update at the group commit's batch sizes",
        "",
        "| flow | B | CPU us/upd | wall us/upd (fsync) |",
        "|---|---|---|---|",
    ]
    for row in result["sqlite"]:
        lines.append(f"| {row['flow']} | {row['B']} | {row['cpu us/upd']} | {row['wall us/upd']} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--identities", type=int, default=1000, help="M: updates of the round")
    ap.add_argument(
        "--only-pacing",
        action="store_true",
        help="measure only the waiting round's look; keep the other rows of accumulate.json",
    )
    args = ap.parse_args()
    if args.only_pacing:
        result = json.loads((OUT / "accumulate.json").read_text())
        result["pacing"] = [pacing_row(m, args.repeats) for m in (1_000, 10_000)]
        load = os.getloadavg()[0]
        result["pacing_note"] = (
            f"measured alone (--only-pacing) on {time.strftime('%Y-%m-%d')}, load average "
            f"{load:.1f} at the start, best of {args.repeats}"
        )
        (OUT / "accumulate.json").write_text(json.dumps(result, indent=1) + "\n")
        write_md(result, OUT / "accumulate.md")
        print((OUT / "accumulate.md").read_text())
        return
    torch.set_num_threads(1)
    load = os.getloadavg()
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, load average "
        f"{load[0]:.1f} at the start",
        "repeats": args.repeats,
        "chunks": {
            "COORDINATE_CHUNK": subcge.COORDINATE_CHUNK,
            "ACCUMULATE_CHUNK": subcge.ACCUMULATE_CHUNK,
        },
        "subcge": [
            subcge_rows(model, k, args.identities, args.repeats)
            for model, k in (("tiny-llama", 1), ("tiny-llama", 16), ("smollm2-135m", 16))
        ],
        "quorum": [
            quorum_row(m, batch, args.repeats) for m in (1_000, 10_000) for batch in (1, 16)
        ],
        "live": [live_row(m, args.repeats) for m in (1_000, 10_000)],
        "pacing": [pacing_row(m, args.repeats) for m in (1_000, 10_000)],
        "sqlite": sqlite_rows(args.repeats),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "accumulate.json").write_text(json.dumps(result, indent=1) + "\n")
    write_md(result, OUT / "accumulate.md")
    print((OUT / "accumulate.md").read_text())


if __name__ == "__main__":
    main()
