"""What a peer's applied rows cost as a run grows: memory per row and the CPU of one
audit's state work, with old rows packed (peer/applied_rows.py) and, side by side in the
same run, without (every row a message in one list, as before).

    python bench/bench_applied_rows.py [--peers 100] [--rounds 200 1000 10000] [--k 1 16]

For each (k, rows held = peers x rounds): bytes per row held (tracemalloc: the rows
only, without the held-digest hash cache, which is bounded), and the milliseconds of the
per-audit work that reads the held rows: the held-state search for a sender that lacked
one row (`StateRewind.held_missing`) and the late-state guesses (`late_states`), median of
5. Writes bench/results/applied-rows.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer.applied_rows import AppliedRows  # noqa: E402
from peer.state_rewind import FROZEN_AFTER, StateRewind  # noqa: E402
from seedflood_p2p.protocol.held_state import row_hash, state_digest  # noqa: E402
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars  # noqa: E402

LAG = 3


def build(peers: list[bytes], rounds: int, k: int, frozen_after: int) -> AppliedRows:
    """The rows of `rounds` rounds, applied one round at a time as a peer does."""
    rng = np.random.default_rng(0)
    rows = AppliedRows(lambda key: row_hash(*key), frozen_after)
    for t in range(rounds):
        scalars = rng.normal(size=(len(peers), k))
        rows.extend([UpdateMessage(t, p, quantize_scalars(s)) for p, s in zip(peers, scalars)], t)
        rows.freeze(t + LAG)
    return rows


def audit_ms(rows: AppliedRows, peers: list[bytes], rounds: int) -> float:
    """One audit's reads of the held rows: sender peers[0] of round `rounds + LAG` lacked
    peers[1]'s newest row."""
    rewind = StateRewind(None, LAG, lambda peer, round_, limit: True)  # type: ignore[arg-type]
    keys = [(m.peer, m.round) for m in rows]
    held = (state_digest(keys) - row_hash(peers[1], rounds - 1)) % (1 << 64)
    round_ = rounds + LAG
    times = []
    for _ in range(5):
        start = time.perf_counter()
        missing = rewind.held_missing(peers[0], round_, held, rows, [])
        rewind.late_states(peers[0], round_, rows, [])
        times.append((time.perf_counter() - start) * 1000)
        assert missing is not None and [(m.peer, m.round) for m in missing] == [
            (peers[1], rounds - 1)
        ]
    return statistics.median(times)


def measure(n_peers: int, rounds: int, k: int, packed: bool) -> dict:
    peers = [f"peer-{i:05d}".encode() for i in range(n_peers)]
    gc.collect()
    tracemalloc.start()
    rows = build(peers, rounds, k, FROZEN_AFTER + LAG if packed else 1 << 62)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "k": k,
        "peers": n_peers,
        "rounds": rounds,
        "rows": len(rows),
        "packed": packed,
        "frozen_rows": rows.frozen(),
        "bytes_per_row": round(size / len(rows), 1),
        "audit_ms": round(audit_ms(rows, peers, rounds), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--rounds", type=int, nargs="+", default=[200, 1000, 10000])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "applied-rows"))
    a = ap.parse_args()
    out = []
    for k in a.k:
        for rounds in a.rounds:
            for packed in (False, True):
                row = measure(a.peers, rounds, k, packed)
                out.append(row)
                print(json.dumps(row), flush=True)
    command = "python bench/bench_applied_rows.py " + " ".join(sys.argv[1:])
    Path(a.out + ".json").write_text(json.dumps({"command": command, "rows": out}, indent=1))
    lines = [
        "# A peer's applied rows: packed after FROZEN_AFTER rounds, against one list",
        "",
        f"- command: `{command.strip()}`",
        f"- FROZEN_AFTER = {FROZEN_AFTER} rounds (+ lag {LAG}); both columns measured in "
        "the same run on the same rows",
        "- bytes/row: tracemalloc of the rows held (not the bounded hash cache); audit ms: "
        "held-state search + late-state guesses of one audit, median of 5",
        "",
        "| k | peers | rounds | rows | bytes/row list | bytes/row packed | audit ms list "
        "| audit ms packed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i in range(0, len(out), 2):
        listed, packed = out[i], out[i + 1]
        lines.append(
            f"| {listed['k']} | {listed['peers']} | {listed['rounds']} | {listed['rows']:,} "
            f"| {listed['bytes_per_row']} | {packed['bytes_per_row']} | {listed['audit_ms']} "
            f"| {packed['audit_ms']} |"
        )
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
