"""How long a peer's model thread is held while it builds a checkpoint-chain link from all
rows (its first link, or after a late row or a ban changed the rows below the last one):
the old way, one call (read every row below the link, then `CheckpointChain.build`), and
the new one, a step at a time (`LateJoin._rows_below` + `build_steps`: STEP_ROWS rows a
read or pass, one period a replay), side by side on the same ledger and scratch model.
Training runs between model-thread calls, so the longest call is the longest a round can
wait for the chain.

    python bench/bench_chain_steps.py --ledger PATH [--target R] [--name chain-steps]

PATH: a ledger file (e.g. bench_join_history.py's history.sqlite, a million rows of the
tiny model); R: the link round (default: the largest multiple of its period below its
newest round). Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _one_call(chain, ledger, target: int) -> tuple[float, dict]:
    """The old path: one model-thread call reads the rows below `target` and builds."""
    started = time.perf_counter()
    snapshot = ledger.snapshot()
    rows = list(itertools.takewhile(lambda m: m.round < target, snapshot))
    meta = chain.build(rows, target, ledger.replacements)
    return time.perf_counter() - started, meta


def _stepped(chain, ledger, target: int) -> tuple[float, float, int, dict]:
    """The new path: (total s, longest step s, steps, meta)."""
    from seedflood_p2p.algorithm.chain import STEP_ROWS

    longest, steps, started = 0.0, 0, time.perf_counter()
    snapshot = ledger.snapshot()
    it, rows = iter(snapshot), []
    while True:  # LateJoin._rows_below, one call a step
        t0 = time.perf_counter()
        taken, more = 0, True
        for m in itertools.islice(it, STEP_ROWS):
            if m.round >= target:
                more = False
                break
            rows.append(m)
            taken += 1
        more = more and taken == STEP_ROWS
        longest, steps = max(longest, time.perf_counter() - t0), steps + 1
        if not more:
            break
    gen = chain.build_steps(rows, target, ledger.replacements)
    while True:
        t0 = time.perf_counter()
        try:
            next(gen)
        except StopIteration as done:
            meta = done.value
            longest, steps = max(longest, time.perf_counter() - t0), steps + 1
            break
        longest, steps = max(longest, time.perf_counter() - t0), steps + 1
    return time.perf_counter() - started, longest, steps, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--target", type=int, default=0)
    parser.add_argument("--name", default="chain-steps")
    args = parser.parse_args()
    import torch

    from seedflood_p2p.algorithm.chain import STEP_ROWS, CheckpointChain
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    torch.set_num_threads(1)
    with Ledger.open_existing(args.ledger) as ledger:
        config = ledger.config
        period = config.checkpoint_every or 50
        target = args.target or ledger.max_round() // period * period
        rows_below = ledger.count_below(target)
        print(f"{len(ledger):,} rows, link of round {target} ({rows_below:,} rows)", flush=True)
        out = {"ledger": str(args.ledger), "rows": len(ledger), "target": target}
        out.update(rows_below=rows_below, period=period, step_rows=STEP_ROWS)
        with tempfile.TemporaryDirectory() as work:
            for kind in ("one_call", "stepped"):  # each from the base, on a fresh dir
                chain = CheckpointChain(load_model(config.model)[0], config, Path(work) / kind)
                chain.period = period
                if kind == "one_call":
                    total, meta = _one_call(chain, ledger, target)
                    out[kind] = {"total_s": round(total, 2), "longest_s": round(total, 2)}
                else:
                    total, longest, steps, meta = _stepped(chain, ledger, target)
                    out[kind] = {
                        "total_s": round(total, 2),
                        "longest_s": round(longest, 3),
                        "steps": steps,
                    }
                out[kind]["weights_sha256"] = meta["weights_sha256"]
                print(kind, out[kind], flush=True)
    same = out["one_call"]["weights_sha256"] == out["stepped"]["weights_sha256"]
    out["same_link"] = same
    out["load_average"] = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    one, step = out["one_call"], out["stepped"]
    (RESULTS / f"{args.name}.md").write_text(
        f"# A chain link built from all rows: the model thread held once, or a step at a time\n\n"
        f"`python bench/bench_chain_steps.py --ledger {args.ledger.name}`; 2 shared cores, 1 "
        f"torch thread, load {out['load_average']:.2f}. Ledger: {out['rows']:,} rows "
        f"({config.model}); link of round {target}, {rows_below:,} rows below it, period "
        f"{period}; each path from the base on its own scratch model, one after the other. "
        f"*longest* = the longest model-thread call, which a round waits for at most.\n\n"
        f"| path | total s | longest call s | calls |\n|---|---|---|---|\n"
        f"| one call (before) | {one['total_s']} | {one['longest_s']} | 1 |\n"
        f"| a step at a time (STEP_ROWS {STEP_ROWS:,}) | {step['total_s']} | "
        f"{step['longest_s']} | {step['steps']} |\n\n"
        f"The same link bytes' weights either way: {same}.\n"
    )
    print(f"wrote bench/results/{args.name}.md", flush=True)


if __name__ == "__main__":
    main()
