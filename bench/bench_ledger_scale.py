"""A ledger of P peers x R rounds (issue 46 item 2: 1,000 x 10,000 = ten million rows).

    taskset -c 0 nice -n 5 python bench/bench_ledger_scale.py --peers 1000 --rounds 100 \
        [--directions 1] [--behind 10] [--work-dir /tmp/ledger-scale] [--name ledger-scale]

1. Synthesis (resumable). A valid, signed, replayable run: P generated Ed25519 identities,
   each signs one update per round with the project's encoder (`encode_update`, with an
   8-byte held-state digest as audited runs send) and the signature go-libp2p-pubsub
   makes (`sigcheck.signed_bytes`) over a seqno as go-libp2p makes it (a per-publisher
   counter from a nanosecond clock), written to `WORK/ledger.sqlite` (the run's manifest
   names tiny-llama and its base hash) in chunks of whole rounds, each chunk one committed
   transaction. Everything is a function of (peer, round), so running the same command
   again continues after the last round on disk (a chunk half-written by a kill was rolled
   back by SQLite; INSERT OR IGNORE makes a repeated chunk a no-op).
2. Measured on the ledger as it stands:
   - disk bytes per row (database + WAL after a checkpoint), and where they go (columns);
   - daemon start that holds it: `Ledger.open_existing` (its quick_check), the reads a
     FloodNode and Admission make at start (`len`, `max_round`, `peer_rounds`), and the
     first `bucket_digests` (what repair serves: hashes every row once);
   - full replay (`algorithm/replay.py`) of every row on tiny-llama;
   - repair paging across the whole history: every page a server builds
     (`signed_after` + `encode_rows`) and a joiner takes (`decode_rows`,
     `check_rows_follow`, the signature checks in `SignaturePool`, `Ledger.add` into its
     own ledger);
   - a late joiner's ready time: the ledger (the repair paging above: the joiner needs the
     rows anyway) plus the checkpoint chain link and the tail (`LiveModel.checkpoint` at
     round R - BEHIND, then `LiveModel.restore` of it plus the rows after it);
   - a restart that holds the ledger and its own checkpoint (peer/join.py:check_ledger:
     rows the checkpoint covers skip their signatures; then cut and restore);
   - stage `trusting`: a joiner with `--history-sync background` (peer/latejoin.py). It
     trusts a link of round R - BEHIND and is ready after the rows after it (repair paging
     from that round into an empty ledger, signatures checked) and `restore_trusting`;
     then, in the background, the history (the paging stage's per-row cost) and one
     `check_history` pass over the whole ledger;
   - stage `chain` (`--period P`): a peer's next checkpoint-chain link, built as every
     link was before (the rows below it read, digested and cut in full) against extended
     from the last link by its period's rows (`CheckpointChain.extend`); same bytes.
   Every figure is also given per row, and extrapolated linearly to 10,000,000 rows.

Writes bench/results/NAME.json and NAME.md, naming the size measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

OUT = ROOT / "bench" / "results"
TARGET_ROWS = 10_000_000
CHUNK_ROWS = 20_000  # rows per committed chunk (whole rounds)
LATE_ROUNDS = 20  # rounds `disk_late_rounds` writes


def run_config(k: int, **changes):
    """The synthesised run (`changes`: other RunConfig fields, another run id)."""
    import dataclasses

    from seedflood_p2p.workload.models import load_model, weights_sha256

    model, _ = load_model("tiny-llama")
    return dataclasses.replace(_base_run(k, weights_sha256(model)), **changes)


def _base_run(k: int, base_sha256: str):
    from seedflood_p2p.core.config import RunConfig

    return RunConfig(
        model="tiny-llama",
        dataset="synthetic-sentiment",
        rank=4,
        refresh_period=5,
        lr=8e-3,
        n_ref=4,
        directions=k,
        salt="bench-ledger-scale",
        base_sha256=base_sha256,
    )


# Messages each peer publishes a round (--messages-per-round): its update, and nothing else
# in an honest run (audit records only on a mismatch; measured on real daemons by
# tests/test_round_mean_daemon.py, whose rows store seqno 0: one a round). 2 is what this
# bench assumed before (an update and one audit record a round).
MESSAGES_PER_ROUND = 1


def _seqno(j: int, round_: int) -> bytes:
    """The seqno peer `j` signs its update of `round_` with, as go-libp2p-pubsub makes it:
    an 8-byte big-endian counter that starts at the publisher's clock in nanoseconds and
    counts up one a message it publishes (MESSAGES_PER_ROUND a round; no restart)."""
    value = 1_764_300_000_000_000_000 + j * 1_000_000_007 + MESSAGES_PER_ROUND * round_ + 1
    return value.to_bytes(8, "big")


def synthesise(path: Path, peers: int, rounds: int, k: int, first: int = 0, config=None) -> dict:
    """Write rounds [max(done, first), rounds) of the run (default `run_config(k)`),
    CHUNK_ROWS rows a transaction."""
    import numpy as np
    import raw_gossip as rg

    from seedflood_p2p.network.transport.sigcheck import signed_bytes
    from seedflood_p2p.protocol.framing import topic_for
    from seedflood_p2p.protocol.message import Envelope, UpdateMessage, quantize_scalars
    from seedflood_p2p.protocol.update import encode_update
    from seedflood_p2p.storage.ledger import Ledger

    config = config or run_config(k)
    ledger = Ledger(path, config.run_id)
    ledger.claim(config, "a ledger of another bench run: pass another --work-dir")
    ids = rg.make_identities(peers, seed="bench-ledger-scale")
    topic = topic_for(config.run_id)
    per_chunk = max(1, CHUNK_ROWS // peers)
    done = ledger.max_round()  # the last round may be whole or, after a kill, absent
    start = max(first, done)  # redo the newest round held: a no-op if it is whole
    t = time.perf_counter()
    written = 0
    for lo in range(start, rounds, per_chunk):
        messages, envelopes = [], []
        for round_ in range(lo, min(rounds, lo + per_chunk)):
            rng = np.random.default_rng([7, round_])
            values = rng.standard_normal((peers, k))
            helds = rng.integers(1 << 40, 1 << 63, size=peers)
            for j, ident in enumerate(ids):
                scalars = quantize_scalars(values[j])
                data = encode_update(config.run_id, round_, scalars, int(helds[j]))
                seqno = _seqno(j, round_)
                signature = ident.key.sign(signed_bytes(ident.peer_id, data, seqno, topic))
                messages.append(UpdateMessage(round_, ident.peer_id, scalars))
                envelopes.append(Envelope(data, seqno, signature))
        written += len(ledger.add(messages, envelopes))
        print(f"  synthesised rounds < {min(rounds, lo + per_chunk)} ({len(ledger):,} rows)")
    seconds = time.perf_counter() - t
    rows = len(ledger)
    ledger.close()
    return {
        "rows": rows,
        "written_now": written,
        "seconds_now": round(seconds, 1),
        "us_per_row_written": round(1e6 * seconds / written, 1) if written else None,
    }


# The first layout's disk figures (run id and peer id bytes in every row), measured by this
# bench before issue 46's compact layout (same command, --work-dir /tmp/t46-scale): shown
# beside the current layout's.
LAYOUT0_DISK = {
    "bytes_per_row": 247.5,
    "column_bytes_per_row": {
        "run_id": 64.0,
        "peer": 38.0,
        "scalars": 2.0,
        "data (signed payload)": 22.0,
        "seqno": 8.0,
        "signature": 64.0,
        "round": 1.0,
    },
    "btree_and_record_overhead_per_row": 48.5,
}


def _int_bytes(column: str) -> str:
    """SQL: the bytes SQLite stores an integer column's value in (its record format: 0 and
    1 take none, then 1, 2, 3, 4, 6 or 8)."""
    bounds = ((127, 1), (32767, 2), (8388607, 3), (2147483647, 4), (140737488355327, 6))
    cases = " ".join(f"WHEN ABS({column}) <= {b} THEN {n}" for b, n in bounds)
    return f"CASE WHEN {column} IN (0, 1) THEN 0 {cases} ELSE 8 END"


def disk(path: Path) -> dict:
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    rows, *cols = db.execute(
        f"SELECT COUNT(*), AVG({_int_bytes('round')}), AVG({_int_bytes('peer')}), "
        "AVG(LENGTH(scalars)), AVG(LENGTH(data)), "
        f"AVG(CASE WHEN typeof(seqno) = 'integer' THEN {_int_bytes('seqno')} "
        "ELSE LENGTH(seqno) END), AVG(LENGTH(signature)) "
        "FROM messages"
    ).fetchone()
    peers, peer_bytes = db.execute("SELECT COUNT(*), SUM(LENGTH(peer)) FROM peers").fetchone()
    layout = db.execute("PRAGMA user_version").fetchone()[0]
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    page = db.execute("PRAGMA page_size").fetchone()[0]
    freelist = db.execute("PRAGMA freelist_count").fetchone()[0]
    try:  # the pages each table and index takes (SQLite's dbstat, where compiled in)
        table_pages = dict(
            db.execute("SELECT name, COUNT(*) FROM dbstat GROUP BY name ORDER BY 2 DESC")
        )
    except sqlite3.OperationalError:
        table_pages = None
    db.close()
    files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
    size = sum(f.stat().st_size for f in files if f.exists() and not f.name.endswith("-shm"))
    names = (
        "round",
        "peer (number)",
        "scalars",
        "data (signed payload)",
        "seqno (distance from what the round predicts)",
        "signature",
    )
    columns = {n: round(v, 1) for n, v in zip(names, cols, strict=True)}
    payload = sum(columns.values())
    per_row = size / rows
    out = {
        "layout": layout,
        "rows": rows,
        "file_bytes": size,
        "bytes_per_row": round(per_row, 1),
        "page_size": page,
        "pages": pages,
        "free_pages": freelist,
        "column_bytes_per_row": columns,
        "column_bytes_sum": round(payload, 1),
        "peers": peers,
        "peers_table_bytes_per_row": round((peer_bytes or 0) / rows, 2),
        "btree_and_record_overhead_per_row": round(per_row - payload, 1),
        "layout0": LAYOUT0_DISK,
    }
    if table_pages is not None:
        out["pages_by_table"] = table_pages
        out["messages_bytes_per_row"] = round(table_pages.get("messages", 0) * page / rows, 1)
    return out


def disk_late_rounds(work: Path, peers: int, k: int) -> dict:
    """`disk` of the last LATE_ROUNDS rounds of a TARGET_ROWS run alone: the round numbers
    (in the row and in the signed payload) and seqno distances there are as wide as at ten
    million rows (what the per-row figure above cannot show). Round 0 is written first, so
    each sender's first seqno is the run's first, then deleted (its pages are freed, the
    others untouched). The messages table's bytes per row is the figure to read: the
    peers table is not amortised over 20,000 rows."""
    rounds = TARGET_ROWS // peers
    path = work / "late-rounds.sqlite"
    for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        f.unlink(missing_ok=True)
    synthesise(path, peers, 1, k)
    synthesise(path, peers, rounds, k, first=rounds - LATE_ROUNDS)
    import sqlite3

    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM messages WHERE round = 0")
    out = disk(path)
    out["rounds"] = [rounds - LATE_ROUNDS, rounds - 1]
    del out["layout0"]
    return out


def start_path(path: Path) -> dict:
    """What a daemon that holds the ledger reads before it serves anything."""
    from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
    from seedflood_p2p.storage.ledger import Ledger

    out = {}
    t = time.perf_counter()
    ledger = Ledger.open_existing(path)
    out["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    n, newest, peers = len(ledger), ledger.max_round(), ledger.peer_rounds()
    out["count_maxround_peerrounds_s"] = time.perf_counter() - t
    t = time.perf_counter()
    digests = ledger.bucket_digests(BUCKET_ROUNDS)
    out["first_bucket_digests_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ledger.bucket_digests(BUCKET_ROUNDS)
    out["cached_bucket_digests_s"] = time.perf_counter() - t
    out["total_s"] = out["open_s"] + out["count_maxround_peerrounds_s"]
    out["total_s"] += out["first_bucket_digests_s"]
    ledger.close()
    # A restart: the digests of the buckets below the newest were kept in the file
    # (`bucket_digests` table, layout 3), so only the newest bucket is hashed again.
    t = time.perf_counter()
    ledger = Ledger.open_existing(path)
    out["restart_open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    len(ledger), ledger.max_round(), ledger.peer_rounds()
    out["restart_counts_s"] = time.perf_counter() - t
    t = time.perf_counter()
    kept = ledger.bucket_digests(BUCKET_ROUNDS)
    out["restart_bucket_digests_s"] = time.perf_counter() - t
    out["restart_total_s"] = (
        out["restart_open_s"] + out["restart_counts_s"] + out["restart_bucket_digests_s"]
    )
    assert kept == digests, "kept bucket digests differ from the ones computed"
    out = {k: round(v, 3) for k, v in out.items()}
    out.update(rows=n, newest_round=newest, peers=len(peers), buckets=len(digests))
    ledger.close()
    return out


def replay_all(path: Path) -> dict:
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    ledger = Ledger.open_existing(path)
    model, _ = load_model("tiny-llama")
    t = time.perf_counter()
    count = replay(model, ledger.config, ledger.messages())
    seconds = time.perf_counter() - t
    ledger.close()
    return {
        "rows": count,
        "seconds": round(seconds, 2),
        "us_per_row": round(1e6 * seconds / count, 1),
    }


def _fresh_ledger(path: Path, run_id: str):
    """An empty ledger file at `path` (any earlier one removed), written as a FloodNode's."""
    from seedflood_p2p.storage.ledger import Ledger

    for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        f.unlink(missing_ok=True)
    ledger = Ledger(path, run_id)
    ledger.sync_in_background()  # as a FloodNode's ledger
    return ledger


def _page_into(server, joiner, first_round: int = 0, max_rows: int = 0) -> dict:
    """Repair pages of `server`'s rows from `first_round` on (the first `max_rows` only,
    with it), each served, decoded, signature-checked in the pool and added to `joiner`:
    seconds per stage, pages, rows and reply bytes."""
    from seedflood_p2p.network.transport.sigcheck import SignaturePool
    from seedflood_p2p.protocol.framing import topic_for
    from seedflood_p2p.protocol.repair import UPDATE_ROWS

    topic = topic_for(server.run_id)
    kind, limit = UPDATE_ROWS, UPDATE_ROWS.page_rows
    hi = server.max_round()
    cursor = kind.first_cursor(first_round)
    times = dict.fromkeys(("serve", "decode", "signatures", "insert"), 0.0)
    pages = rows_in = reply_bytes = 0
    pool = SignaturePool()
    while True:
        t = time.perf_counter()
        data = kind.encode_rows(server.signed_after(cursor[0], cursor[1], hi, limit))
        times["serve"] += time.perf_counter() - t
        t = time.perf_counter()
        rows = kind.decode_rows(data, limit)
        kind.check_rows_follow(rows, cursor, hi)
        times["decode"] += time.perf_counter() - t
        if not rows:
            break
        t = time.perf_counter()
        ok = pool.check([(m.peer, e.data, e.seqno, topic, e.signature) for m, e in rows])
        assert all(ok)
        times["signatures"] += time.perf_counter() - t
        t = time.perf_counter()
        joiner.add([m for m, _ in rows], [e for _, e in rows])
        times["insert"] += time.perf_counter() - t
        pages += 1
        rows_in += len(rows)
        reply_bytes += len(data)
        cursor = kind.key(rows[-1][0])
        if len(rows) < limit or (max_rows and rows_in >= max_rows):
            break
    joiner.flush()
    pool.close()
    return {"times": times, "pages": pages, "rows": rows_in, "reply_bytes": reply_bytes}


def repair_paging(path: Path, work: Path, max_rows: int = 0) -> dict:
    """Every page of the whole history, served and taken in (signatures in the pool); with
    `max_rows`, the pages of the first max_rows rows only (a sample: every stage is a
    per-row cost, and the whole history at 10M rows takes most of an hour on one core)."""
    from seedflood_p2p.network.transport.sigcheck import default_workers
    from seedflood_p2p.protocol.repair import UPDATE_ROWS
    from seedflood_p2p.storage.ledger import Ledger

    server = Ledger.open_existing(path)
    joiner = _fresh_ledger(work / "joiner.sqlite", server.run_id)
    limit = UPDATE_ROWS.page_rows
    t0 = time.perf_counter()
    paged = _page_into(server, joiner, 0, max_rows)
    total = time.perf_counter() - t0
    times, rows_in = paged["times"], paged["rows"]
    sampled = bool(max_rows) and rows_in < len(server)
    same = None if sampled else joiner.digest() == server.digest()
    joiner.close()
    server.close()
    out = {k: round(v, 2) for k, v in times.items()}
    out.update(
        total_s=round(total, 2),
        pages=paged["pages"],
        rows=rows_in,
        reply_bytes_per_row=round(paged["reply_bytes"] / max(1, rows_in), 1),
        us_per_row={k: round(1e6 * v / max(1, rows_in), 1) for k, v in times.items()},
        signature_workers=default_workers(),
        page_rows=limit,
        joiner_digest_equals_server=same,
        sampled=sampled,
    )
    return out


def trusting_join(path: Path, work: Path, behind: int) -> dict:
    """A joiner that trusts a link of round R - behind: ready after the rows after it; then
    its history check, one pass over a ledger that holds every row (the server's here:
    the joiner's once repair has brought the history holds the same rows)."""
    import torch

    from seedflood_p2p.algorithm.live import LedgerCut, LiveModel
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.storage.checkpoint import read_checkpoint_meta
    from seedflood_p2p.storage.digests import digest_of
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    server = Ledger.open_existing(path)
    config = server.config
    link_round = max(0, server.max_round() + 1 - behind)
    link_dir = work / "link"
    link_dir.mkdir(exist_ok=True)
    t = time.perf_counter()
    model, _ = load_model(config.model)
    older = list(server.messages(0, link_round - 1))
    replay(model, config, older)
    LiveModel(make_estimator(model, config)).checkpoint(  # what the quorum's link holds
        link_dir, LedgerCut(older, digest_of(older), []), {"round": link_round}
    )
    setup_s = time.perf_counter() - t
    del model, older

    stages = {}
    t0 = t = time.perf_counter()
    joiner = _fresh_ledger(work / "trusting.sqlite", server.run_id)
    # the sync with the floor at the link's round (Repair.floor_round)
    tail_rows = _page_into(server, joiner, link_round)["rows"]
    stages["tail_sync_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model, _ = load_model(config.model)
    stages["model_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    live = LiveModel(make_estimator(model, config), joiner)
    live.trust(read_checkpoint_meta(link_dir))
    cut = live.streamed_cut()
    how = live.restore_trusting(cut, link_dir)
    cut.close()
    stages["restore_s"] = time.perf_counter() - t
    stages["ready_s"] = time.perf_counter() - t0
    assert how is not None and live.trusted_held == 0, how
    assert torch.isfinite(next(iter(live.weights().values()))).all()
    joiner.close()
    # the history check, once the ledger holds every row
    t = time.perf_counter()
    snapshot = server.snapshot()
    verdict = live.check_history(snapshot)
    snapshot.close()
    stages["history_check_s"] = time.perf_counter() - t
    assert verdict is True
    rows = len(server)
    server.close()
    out = {k: round(v, 2) for k, v in stages.items()}
    out.update(
        link_round=link_round,
        link_rows=rows - tail_rows,
        tail_rows=tail_rows,
        rows=rows,
        how=how,
        link_bytes=(link_dir / "checkpoint.safetensors").stat().st_size,
        link_setup_s=round(setup_s, 1),
        history_check_us_per_row=round(1e6 * stages["history_check_s"] / rows, 2),
    )
    return out


def chain_links(path: Path, work: Path, period: int) -> dict:
    """What a peer's next checkpoint-chain link costs at this history's length: built as
    every link was before (the ledger's rows below it read, digested and cut in full: a
    pass over all rows each period) against extended from the last link by its period's
    rows (`CheckpointChain.extend`, `ChainTail`); both write the same bytes."""
    from seedflood_p2p.algorithm.chain import CheckpointChain
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    server = Ledger.open_existing(path)
    config = server.config.replace(extra={**server.config.extra, "checkpoint_every": period})
    target = (server.max_round() + 1) // period * period
    previous = target - period

    def chain(name: str) -> CheckpointChain:
        directory = work / name
        shutil.rmtree(directory, ignore_errors=True)
        return CheckpointChain(load_model(config.model)[0], config, directory)

    t = time.perf_counter()
    whole = chain("chain-whole")
    whole.build(list(server.messages(0, previous - 1)), previous)  # the link before
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    rows = list(server.messages(0, target - 1))
    read_all_s = time.perf_counter() - t
    t = time.perf_counter()
    whole.tail = None  # as every link was built before: from all the rows below it
    whole.build(rows, target)
    build_all_s = time.perf_counter() - t
    del rows
    step = chain("chain-step")
    step.build(list(server.messages(0, previous - 1)), previous)
    t = time.perf_counter()
    new_rows = list(server.messages(previous, target - 1))
    below = server.count_below(previous)
    read_period_s = time.perf_counter() - t
    t = time.perf_counter()
    meta = step.extend(new_rows, target, below, server.replacements)
    extend_s = time.perf_counter() - t
    assert meta is not None
    same = all(
        (work / "chain-whole" / f).read_bytes() == (work / "chain-step" / f).read_bytes()
        for f in ("checkpoint.safetensors", "checkpoint.json")
    )
    rows_total = len(server)
    server.close()
    return {
        "period": period,
        "link_round": target,
        "rows_below_link": meta["ledger_messages"],
        "period_rows": len(new_rows),
        "rows": rows_total,
        "setup_s": round(setup_s, 1),
        "whole_read_s": round(read_all_s, 2),
        "whole_build_s": round(build_all_s, 2),
        "whole_s": round(read_all_s + build_all_s, 2),
        "extend_read_s": round(read_period_s, 3),
        "extend_s": round(extend_s, 3),
        "extended_s": round(read_period_s + extend_s, 3),
        "same_bytes": same,
    }


def trusting_markdown(res: dict) -> str:
    """The trusting joiner's table (`--stages trusting`, with `paging` for the history)."""
    tr = res["trusting"]
    rows, x = tr["rows"], TARGET_ROWS / tr["rows"]
    download = tr["link_bytes"] * 8 / 100e6  # at the daemon's --checkpoint-bandwidth 100
    paging = res.get("paging")
    scaled = rows != TARGET_ROWS  # a smaller ledger: the history's figures extrapolated

    def history(seconds_per_row: float) -> str:
        at_size = f"{seconds_per_row * tr['link_rows']:,.0f} s"
        if scaled:
            at_size += f" ({seconds_per_row * TARGET_ROWS:,.0f} s at 10M)"
        return f"{at_size}: {1e6 * seconds_per_row:.1f} us a row"

    fetched = (
        history(paging["total_s"] / paging["rows"])
        + f" on one core, from the first {paging['rows']:,} rows"
        if paging
        else "not measured in this run (the `paging` stage)"
    )
    return "\n".join(
        [
            f"# A joiner that trusts the quorum's link: ready time at {rows:,} rows",
            "",
            f"`{res['command']}`",
            "",
            f"{res['peers']:,} peers x {res['rounds']:,} rounds; the link is of round "
            f"{tr['link_round']:,} ({tr['link_rows']:,} rows), the tail after it "
            f"{tr['tail_rows']:,} rows (`--behind`). Load average {res['loadavg_start']} at "
            f"start, {res['loadavg_end']} at the end; pinned to one core. Ready needs only "
            "the tail, so it does not grow with the history; the history is fetched and "
            "checked after ready, while the peer trains.",
            "",
            "| stage | measured |",
            "|---|---|",
            f"| tail sync: repair pages of the rows after the link, signatures, insert | "
            f"{tr['tail_sync_s']} s |",
            f"| model load | {tr['model_load_s']} s |",
            f"| trust + cut + restore_trusting (load the link, replay the tail) | "
            f"{tr['restore_s']} s |",
            f"| **ready (sum)** | **{tr['ready_s']} s** (goal <= 60 s) |",
            f"| link download, not measured: {tr['link_bytes'] / 2**20:.1f} MiB at 100 Mbit/s | "
            f"{download:.2f} s |",
            f"| after ready: the history by repair (serve, decode, signatures, insert) | "
            f"{fetched} |",
            f"| after ready: `check_history`, one pass over the whole ledger | "
            f"{tr['history_check_s']} s ({tr['history_check_us_per_row']} us a row"
            + (f"; {tr['history_check_s'] * x:,.0f} s at 10M" if scaled else "")
            + ") |",
            "",
            f"Restored: {tr['how']}. The model is tiny-llama; a bigger model's link takes "
            "longer to download (its size at the bandwidth) and to load, nothing else changes.",
            "",
        ]
    )


def checkpoint_and_tail(path: Path, work: Path, behind: int) -> dict:
    """The joiner's (or restarter's) model: a checkpoint at round R - behind, plus the tail;
    and a restart's whole path with its own checkpoint (peer/join.py:check_ledger)."""
    import torch

    from seedflood_p2p.algorithm.live import LedgerCut, LiveModel
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.storage.digests import digest_of
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    ledger = Ledger.open_existing(path)
    config = ledger.config
    rounds = ledger.max_round() + 1
    cut_round = max(0, rounds - behind)
    model, _ = load_model(config.model)
    live = LiveModel(make_estimator(model, config), ledger)
    older = list(ledger.messages(0, cut_round - 1))
    t = time.perf_counter()
    replay(model, config, older)
    ckpt_dir = work / "peer"
    ckpt_dir.mkdir(exist_ok=True)
    meta = live.checkpoint(
        ckpt_dir,
        LedgerCut(older, digest_of(older), []),
        {
            "round": cut_round,
            "run_id": config.run_id,
            "ledger_rows_sha256": ledger.rows_sha256({(m.peer, m.round) for m in older}),
        },
    )
    setup_s = time.perf_counter() - t
    ledger.close()
    del model, live, older

    from peer.join import check_ledger

    out = {"checkpoint_round": cut_round, "checkpoint_rows": meta["ledger_messages"]}
    out["checkpoint_setup_s"] = round(setup_s, 1)
    stages = {}
    t0 = t = time.perf_counter()
    ledger = Ledger.open_existing(path)
    stages["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    own = min(ledger.peers())
    check = check_ledger(ledger, ledger.config, own, ckpt_dir)
    stages["check_ledger_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model, _ = load_model(config.model)
    stages["model_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    live = LiveModel(make_estimator(model, config), ledger)
    cut = live.streamed_cut()  # the daemon's (peer/latejoin.py): a snapshot, read in one pass
    stages["cut_s"] = time.perf_counter() - t
    t = time.perf_counter()
    how = live.restore(cut, ckpt_dir)
    cut.close()
    stages["restore_s"] = time.perf_counter() - t
    stages["total_s"] = time.perf_counter() - t0
    out["restart"] = {k: round(v, 2) for k, v in stages.items()}
    out["restart"]["how"] = how
    out["restart"]["signatures_checked"] = check.signed - check.trusted
    out["restart"]["signatures_trusted"] = check.trusted
    assert torch.isfinite(next(iter(live.weights().values()))).all()
    ledger.close()
    return out


def extrapolate(per_row_seconds: float) -> float:
    return round(per_row_seconds * TARGET_ROWS, 1)


def markdown(res: dict) -> str:
    d, s, r, p, c = res["disk"], res["start"], res["replay"], res["paging"], res["checkpoint"]
    rows = d["rows"]
    x = TARGET_ROWS / rows
    rs = c["restart"]
    # What grows with the history and what does not: the tail after a checkpoint stays
    # `behind` rounds, so its signatures and its replay are the same at 10M rows; the
    # scans (open, hashes of the covered rows, cut) grow with the rows.
    u = p["us_per_row"]
    same = "not compared (a sample)" if p.get("sampled") else p["joiner_digest_equals_server"]
    paged = p.get("rows") or rows  # a sample of the history (--paging-rows), or all of it
    paging_all = p["total_s"] * rows / paged  # the whole history at the sample's rate
    sig_us = u["signatures"]
    tail_sigs = rs["signatures_checked"] * sig_us / 1e6
    # The restore reads every row in its one pass (a snapshot, peer/latejoin.py): linear,
    # with its tail's replay (constant) scaled too, an overestimate.
    restart_linear = max(0.0, rs["total_s"] - rs["model_load_s"] - tail_sigs)
    restart_10m = restart_linear * x + rs["model_load_s"] + tail_sigs
    joiner_ledger = paging_all
    joiner_model = rs["cut_s"] + rs["restore_s"] + rs["model_load_s"]
    joiner_10m = (joiner_ledger + rs["cut_s"] + rs["restore_s"]) * x + rs["model_load_s"]
    lines = [
        f"# A ledger of {res['peers']:,} peers x {res['rounds']:,} rounds "
        f"(issue 46 item 2): measured at {rows:,} rows",
        "",
        f"`{res['command']}`",
        "",
        f"**Measured size: {rows:,} rows** ({res['peers']:,} peers x {res['rounds']:,} rounds, "
        f"k = {res['directions']}, audited payload with the 8-byte held digest), on a shared "
        "2-core machine (one core running another benchmark; this run pinned to the other, "
        f"load average {res['loadavg_start']} at start, {res['loadavg_end']} at the end). The "
        f"10M column multiplies the per-row figure by {x:,.0f} (linear: every stage here is "
        "a scan or a per-row cost; SQLite's B-tree depth grows by one level at most), except "
        "what does not grow with the history: the tail's signatures after a checkpoint "
        "(`--behind` rounds), the model load (`+ constant`); the restore's one pass over the "
        "rows is linear (its tail's replay scaled with it: an overestimate). Not included: p2pd's "
        "start and the network (the checkpoint link's download, request round trips).",
        "",
        "| figure | measured | per row | 10M rows (extrapolated) | goal |",
        "|---|---|---|---|---|",
        f"| disk (db + WAL) | {d['file_bytes'] / 2**20:,.1f} MiB | {d['bytes_per_row']} B | "
        f"{d['bytes_per_row'] * TARGET_ROWS / 2**30:,.1f} GiB | <= 120 B/row "
        f"(layout 0: {d['layout0']['bytes_per_row']} B) |",
        f"| full replay (tiny-llama) | {r['seconds']} s | {r['us_per_row']} us | "
        f"{extrapolate(r['seconds'] / rows)} s | |",
        f"| repair paging, whole history (serve, decode, signatures, insert) | "
        f"{p['total_s']} s"
        + (f" for the first {paged:,} rows" if p.get("sampled") else "")
        + f" | {round(1e6 * p['total_s'] / paged, 1)} us | "
        f"{extrapolate(p['total_s'] / paged)} s | |",
        f"| late joiner ready: ledger by repair + checkpoint link + tail | "
        f"{joiner_ledger + joiner_model:.1f} s | "
        f"{round(1e6 * (joiner_ledger + rs['cut_s'] + rs['restore_s']) / rows, 1)} us + constant | "
        f"{joiner_10m:,.1f} s | <= 60 s |",
        f"| restart holding ledger + own checkpoint (check_ledger, load, cut, restore) | "
        f"{rs['total_s']} s | {round(1e6 * restart_linear / rows, 1)} us + constant | "
        f"{restart_10m:,.1f} s | <= 60 s |",
        f"| daemon start reads (open + quick_check, counts, first bucket digests) | "
        f"{s['total_s']} s | {round(1e6 * s['total_s'] / rows, 2)} us | "
        f"{extrapolate(s['total_s'] / rows)} s | |",
        "",
        "## Disk: where a row's bytes go",
        "",
        f"Layout {d['layout']} (issue 46: storage/layout.py `SCHEMA`) beside layout 0, the "
        "first (measured by this bench before, same command; layout 0's seqno is 8 bytes "
        "whatever its value). A layout-0 file is converted in place when a peer opens it.",
        "",
        f"| column | layout 0: bytes per row | layout {d['layout']}: bytes per row |",
        "|---|---|---|",
    ]
    layout0 = d["layout0"]
    old = layout0["column_bytes_per_row"]
    now = d["column_bytes_per_row"]
    seqno = next(k for k in now if k.startswith("seqno"))
    late = res.get("disk_late")
    pairs = [
        ("run_id", old["run_id"], "- (stored once, in `meta`)"),
        ("peer", old["peer"], f"{now['peer (number)']} (its number in `peers`)"),
        ("round", old["round"], now["round"]),
        ("scalars (also inside the payload)", old["scalars"], now["scalars"]),
        ("data (signed payload)", old["data (signed payload)"], now["data (signed payload)"]),
        ("seqno", old["seqno"], f"{now[seqno]} (distance from what the round predicts)"),
        ("signature", old["signature"], now["signature"]),
    ]
    for name, before, after in pairs:
        lines.append(f"| {name} | {before} | {after} |")
    messages_overhead = round(d["messages_bytes_per_row"] - d["column_bytes_sum"], 1)
    others = round(d["bytes_per_row"] - d["messages_bytes_per_row"], 1)
    lines += [
        f"| B-tree, record headers, free space | {layout0['btree_and_record_overhead_per_row']} | "
        f"{messages_overhead} |",
        f"| other tables (`peers`: {d['peers']:,} ids once, and its index; meta; audits) | "
        f"(in the line above) | {others} |",
        f"| **total** | **{layout0['bytes_per_row']}** | **{d['bytes_per_row']}** |",
        "",
        f"{d['file_bytes'] / 2**20:.1f} MiB for {rows:,} rows ({d['pages']:,} pages of "
        f"{d['page_size']} B; the `messages` table alone {d['messages_bytes_per_row']} B a "
        "row). What a row cannot drop while any peer can still check it offline: the 64-byte "
        f"signature, the signed payload ({now['data (signed payload)']} B here), the seqno "
        f"(as a distance: {now[seqno]} B here) and the round and the signer's number: "
        f"{round(d['column_bytes_sum'] - now['scalars'], 1)} B; with the 2-byte scalars kept "
        f"(rows without an envelope have only them; replay reads them without decoding the "
        f"payload) {d['column_bytes_sum']} B. SQLite adds ~8 B of record header (one type "
        "byte a column, two for the signature) and 3 B of cell size and pointer: about "
        f"{round(d['column_bytes_sum'] + 11, 1)} B a row in a full page; the B-tree's leaves "
        f"are ~{100 * (d['column_bytes_sum'] + 11) / d['messages_bytes_per_row']:.0f}% full "
        "after appends (a split leaves slack; `VACUUM` packs them to 99%: ~111 B a row, a "
        f"one-off rewrite of the file). So ~{d['messages_bytes_per_row']:.0f} B a row is the "
        "floor of this payload as SQLite appends it; the signature alone is over half of it.",
    ]
    if late is not None:
        late_seqno = next(k for k in late["column_bytes_per_row"] if k.startswith("seqno"))
        lines += [
            "",
            f"At ten million rows the round numbers and seqno distances are wider: rounds "
            f"{late['rounds'][0]:,}-{late['rounds'][1]:,} of a {TARGET_ROWS // res['peers']:,}"
            f"-round run written alone take round {late['column_bytes_per_row']['round']} B, "
            "signed payload "
            f"{late['column_bytes_per_row']['data (signed payload)']} B (the round inside it "
            f"too, in layout 0 as well), seqno {late['column_bytes_per_row'][late_seqno]} B, "
            f"and {late['messages_bytes_per_row']} B a row in the `messages` table (here "
            f"{d['messages_bytes_per_row']} B): about the whole file's bytes per row at 10M "
            "rows, where the `peers` table is negligible. Less would need the scalars column "
            "dropped for signed rows (~2.3 B a row: a msgpack decode on every read, and "
            "`verify` loses its cross-check of row against payload) or a `VACUUM` (~12 B a "
            "row).",
        ]
    lines += [
        "",
        "## Stages",
        "",
        f"- Daemon start: open {s['open_s']} s (quick_check reads every page), len/max_round/"
        f"peer_rounds {s['count_maxround_peerrounds_s']} s, first bucket digests "
        f"{s['first_bucket_digests_s']} s (every row hashed once, then cached: "
        f"{s['cached_bucket_digests_s']} s), {s['buckets']} buckets. A restart, the older "
        f"buckets' digests kept in the file: {s.get('restart_total_s', '-')} s (open "
        f"{s.get('restart_open_s', '-')} s, counts {s.get('restart_counts_s', '-')} s, "
        f"bucket digests {s.get('restart_bucket_digests_s', '-')} s: the newest bucket only).",
        f"- Repair paging: {p['pages']:,} pages of up to {p['page_rows']} rows, "
        f"{p['reply_bytes_per_row']} reply bytes per row; per row: serve {u['serve']} us, "
        f"decode {u['decode']} us, signatures {u['signatures']} us "
        f"({p['signature_workers']} worker process(es)), insert {u['insert']} us; "
        f"the joiner's digest equals the server's: {same}. No "
        "network here: on the wire each page is one request/response over p2pd.",
        f"- Checkpoint at round {c['checkpoint_round']:,} ({c['checkpoint_rows']:,} rows "
        f"covered). Restart: open {rs['open_s']} s, check_ledger {rs['check_ledger_s']} s "
        f"({rs['signatures_checked']:,} signatures checked, {rs['signatures_trusted']:,} "
        f"trusted: their rows hash as the checkpoint recorded), model load "
        f"{rs['model_load_s']} s, snapshot {rs['cut_s']} s, restore {rs['restore_s']} s "
        f"({rs['how']}).",
        "",
        "Reading: the late joiner's time is the ledger's, not the model's. At 10M rows the "
        "signature checks alone take rows x the per-row figure above divided by the cores "
        "given to the pool; the checkpoint link and its tail take seconds. Ready in 60 s at "
        "10M rows would need the joiner not to check every historical signature before it "
        "starts (e.g. trust rows a quorum-offered checkpoint link covers, as a restart "
        "trusts its own checkpoint's rows, and check them in the background).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--directions", type=int, default=1)
    parser.add_argument("--behind", type=int, default=10, help="rounds after the checkpoint")
    parser.add_argument("--period", type=int, default=50, help="the chain stage's link period")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "ledger-scale"))
    parser.add_argument("--name", default="ledger-scale")
    parser.add_argument("--synth-only", action="store_true")
    parser.add_argument(
        "--messages-per-round",
        type=int,
        default=1,
        help="messages each peer publishes a round, which its seqnos count (1: an honest "
        "peer's update; 2: what this bench assumed before, an update and an audit record)",
    )
    parser.add_argument(
        "--stages",
        default="",
        help="comma-separated stages to run (disk, disk_late, start, replay, paging, "
        "checkpoint, trusting, chain; default all); a partial run writes the JSON and a list "
        "of its stages (trusting, alone or with paging: its own table)",
    )
    parser.add_argument(
        "--paging-rows",
        type=int,
        default=0,
        help="repair paging over the first N rows only (0: the whole history)",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    global MESSAGES_PER_ROUND
    MESSAGES_PER_ROUND = args.messages_per_round
    work = Path(args.work_dir) / (
        f"p{args.peers}-r{args.rounds}-k{args.directions}-m{args.messages_per_round}"
    )
    work.mkdir(parents=True, exist_ok=True)
    path = work / "ledger.sqlite"
    res = {
        "command": "taskset -c 0 nice -n 5 python bench/bench_ledger_scale.py "
        + " ".join(sys.argv[1:]),
        "peers": args.peers,
        "rounds": args.rounds,
        "directions": args.directions,
        "messages_per_round": args.messages_per_round,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    stages = [x for x in args.stages.split(",") if x]
    res["synthesis"] = synthesise(path, args.peers, args.rounds, args.directions)
    print("synthesis", res["synthesis"], flush=True)
    if args.synth_only:
        return
    for key, fn in (
        ("disk", lambda: disk(path)),
        ("disk_late", lambda: disk_late_rounds(work, args.peers, args.directions)),
        ("start", lambda: start_path(path)),
        ("replay", lambda: replay_all(path)),
        ("paging", lambda: repair_paging(path, work, args.paging_rows)),
        ("checkpoint", lambda: checkpoint_and_tail(path, work, args.behind)),
        ("trusting", lambda: trusting_join(path, work, args.behind)),
        ("chain", lambda: chain_links(path, work, args.period)),
    ):
        if stages and key not in stages:
            continue
        res[key] = fn()
        print(key, res[key], flush=True)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    if stages and set(stages) <= {"trusting", "paging"} and "trusting" in stages:
        text = trusting_markdown(res)
    else:
        text = partial_markdown(res, stages) if stages else markdown(res)
    (OUT / f"{args.name}.md").write_text(text)
    print(text)


def partial_markdown(res: dict, stages: list[str]) -> str:
    """Some stages only (--stages): each stage's figures as a list."""
    lines = [
        f"# Ledger at scale: stages {', '.join(stages)} at {res['peers'] * res['rounds']:,} rows",
        "",
        f"`{res['command']}`",
        "",
        f"Load average {res['loadavg_start']} at start, {res['loadavg_end']} at the end.",
        "",
    ]
    for stage in stages:
        lines += [f"## {stage}", ""]
        lines += [f"- {k}: {v}" for k, v in res[stage].items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
