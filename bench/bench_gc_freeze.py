"""A daemon's repair intake with its startup heap walked by the collector, and frozen.

    taskset -c 0 python bench/bench_gc_freeze.py [--rows 100000] [--repeats 3]

One process imports what a peer daemon imports (torch, transformers, hivemind, the peer
package) and builds the tiny model, as a daemon has before it serves. Then it decodes
repair pages (`RowKind.decode_rows` over pages a server encodes, 4,096 signed update rows
each, as a joiner's intake does first) in turns: with the heap as the collector sees it
after startup, and after `core.heap.freeze_startup_heap` (`gc.unfreeze` between turns puts
it back), `--repeats` times each. CPU seconds per turn; the table gives the median
microseconds a row. Writes bench/results/gc-freeze.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parent / "results"


def pages(rows: int) -> list[bytes]:
    from seedflood_p2p.protocol.message import Envelope, UpdateMessage
    from seedflood_p2p.protocol.repair import UPDATE_ROWS
    from seedflood_p2p.protocol.update import encode_update

    peers = [bytes([0, 36, 8, 1, 18, 32]) + i.to_bytes(32, "big") for i in range(1000)]
    out, page = [], []
    for i in range(rows):
        round_, peer = i // len(peers), peers[i % len(peers)]
        data = encode_update("ab" * 32, round_, (0.5,), 1 << 50)
        envelope = Envelope(data, (1 << 60).to_bytes(8, "big"), bytes(64))
        page.append((UpdateMessage(round_, peer, (0.5,)), envelope))
        if len(page) == 4096:
            out.append(UPDATE_ROWS.encode_rows(page))
            page = []
    if page:
        out.append(UPDATE_ROWS.encode_rows(page))
    return out


def intake(encoded: list[bytes]) -> float:
    """CPU seconds to decode every page, keeping a page's rows while the next is decoded
    (a joiner holds a page and the one asked ahead)."""
    from seedflood_p2p.protocol.repair import UPDATE_ROWS

    start, held = time.process_time(), []
    for page in encoded:
        held = [held[-1]] if held else []
        held.append(UPDATE_ROWS.decode_rows(page, 4096))
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import peer.daemon  # noqa: F401  (what a daemon imports)
    from seedflood_p2p.core.heap import freeze_startup_heap
    from seedflood_p2p.workload.models import load_model

    model = load_model("tiny-llama")  # noqa: F841  (held, as a daemon holds its model)
    encoded = pages(args.rows)
    gc.collect()
    tracked = len(gc.get_objects())
    turns: dict[str, list[float]] = {"walked": [], "frozen": []}
    for _ in range(args.repeats):
        turns["walked"].append(intake(encoded))
        frozen = freeze_startup_heap()
        turns["frozen"].append(intake(encoded))
        gc.unfreeze()
    us = {k: [round(1e6 * s / args.rows, 2) for s in v] for k, v in turns.items()}
    med = {k: statistics.median(v) for k, v in us.items()}
    res = {
        "command": "taskset -c 0 python bench/bench_gc_freeze.py " + " ".join(sys.argv[1:]),
        "rows": args.rows,
        "repeats": args.repeats,
        "affinity": len(os.sched_getaffinity(0)),
        "objects_tracked_after_startup": tracked,
        "objects_frozen": frozen,
        "us_per_row": us,
        "median_us_per_row": med,
        "speedup": round(med["walked"] / med["frozen"], 2),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "gc-freeze.json").write_text(json.dumps(res, indent=1))
    lines = [
        "# Repair intake beside a daemon's startup heap: walked by the collector, or frozen",
        "",
        f"`{res['command'].strip()}` (affinity {res['affinity']} core). The process imported "
        f"what a peer daemon imports and loaded the tiny model: {tracked:,} objects tracked "
        f"by the collector, {frozen:,} frozen by `freeze_startup_heap`. Each turn decodes "
        f"{args.rows:,} signed update rows in repair pages of 4,096 (`decode_rows`); turns "
        "alternate, the heap unfrozen again between them.",
        "",
        "| heap | us a row (median) | each turn |",
        "|---|---:|---|",
        f"| walked by every collection (before) | {med['walked']} | {us['walked']} |",
        f"| frozen (`gc.freeze`, the daemons now) | {med['frozen']} | {us['frozen']} |",
        "",
        f"{res['speedup']}x less CPU a decoded row. The daemons freeze their heap once "
        "everything is loaded, before they serve (peer/daemon.py, bootstrap/node.py).",
    ]
    (OUT / "gc-freeze.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
