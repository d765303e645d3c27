"""How long a split network takes to heal, with real daemons in network namespaces.

    sudo nice -n 19 python bench/bench_partition.py [--partition 180] [--out PATH]

Runs harness/partition.py (5 hosts: bootstrap + 4 peers, tiny model; the cut
{h1, h2, h3} | {h4, h5} for --partition seconds, every connection across it aborted),
and reports when each side said "partitioned", when each peer reconnected after the heal,
how long after the heal all five ledgers held the same rows through the last round made
before it (read from each node's ledger file while it runs), and whether every ledger
ended identical. The load average is recorded at start and end (timings are CPU-bound).
Writes PATH.json and PATH.md (default bench/results/partition-<seconds>s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.cluster import run_toml  # noqa: E402
from harness.partition import NamespaceNet, run_partition, skip_reason  # noqa: E402


def _load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partition", type=float, default=180.0, help="seconds")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out = Path(args.out or ROOT / "bench" / "results" / f"partition-{args.partition:g}s")
    testnet = NamespaceNet(f"sfb{os.getpid() % 100000}", "10.79.0")
    if reason := skip_reason(testnet):
        sys.exit(f"cannot run: {reason}")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sf-partition-") as work:
        result = run_partition(
            Path(work), testnet, ["--config", str(run_toml(Path(work)))], args.partition
        )
    result["loadavg_start"], result["loadavg_end"] = load_start, os.getloadavg()
    result["cpus"] = os.cpu_count()
    result["command"] = "sudo nice -n 19 python bench/bench_partition.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    heal = result["first_reconnection_after_heal_s"]
    lines = [
        f"# Partition of {args.partition:g} s (`{result['command'].strip()}`)",
        "",
        f"{result['hosts']} namespaced hosts (h1 bootstrap, h2..h{result['hosts']} peers), "
        f"cut {result['cut']['side_a']} | {list(result['cut']['side_b'])}, tiny model, "
        f"{result['rounds']} rounds; wall time {result['wall_s']} s.",
        "",
        "| host | said partitioned after (s) | round at heal | reconnected after heal (s) |",
        "|---|---|---|---|",
    ]
    for h in sorted(heal):
        seen = result["partitioned_seen"].get(h, {}).get("after_s")
        lines.append(
            f"| h{h} | {'' if seen is None else f'{seen:.1f}'} | "
            f"{result['rounds_at_heal'][h]} | {heal[h]} |"
        )
    identical = result["identical_through_heal_round_after_s"]
    lines += [
        "",
        f"**Ledgers identical after the heal: {identical if identical is not None else 'NOT SEEN'}"
        f" s** (all 5 ledgers held the same {result['final_prefix_rows']} rows through round "
        f"{result['heal_round']}, the newest round made before the heal; "
        f"{result['expected_prefix_rows']} expected; polled every 0.5 s).",
        "",
        f"Ledgers identical: {'yes' if result['ledgers_identical'] else 'NO'} "
        f"({result['bootstrap_rows']} rows at the bootstrap node, "
        f"{result['expected_rows']} expected); exit codes {result['exit_codes']}.",
        "",
        "said partitioned: seconds from the cut until /status showed it (polled on h2 and",
        "the last host only); reconnected: the host's first `reconnected` line after the",
        "heal (each starts a repair pass at once). Ledgers identical after the heal: each",
        "node's ledger file read (read-only SQLite) while the nodes run; the first poll at",
        "which every node's rows through the heal round equal the final ledgers' rows.",
        "Whole ledgers are compared when the run ends.",
        "",
        f"Load average (1, 5, 15 min) at start {_load(result['loadavg_start'])}, at end "
        f"{_load(result['loadavg_end'])}, on {result['cpus']} CPUs (shared machine).",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
