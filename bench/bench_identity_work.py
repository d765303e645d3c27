#!/usr/bin/env python
"""CPU seconds to make one identity with a run's identity work (issue 45 item 2).

    PYTHONPATH=. python bench/bench_identity_work.py                 # ~2-4 CPU-min
    PYTHONPATH=. python bench/bench_identity_work.py --identities 3  # a quick look

For each difficulty d (leading zero bits of blake2b-256(run id || peer id),
core/extra_settings.py `IdentityWork`), grinds --identities keys the way `seedflood keygen`
does (`network/transport/identity.py:grind_identity`, one core) for a fixed run id and
records each one's process CPU seconds and keys tried. The tries are geometric with mean
2^d, so the spread is about as large as the mean: a newcomer may be lucky or unlucky by
a factor of a few; an attacker making many keys pays the mean per key.

Writes bench/results/identity-work.json and identity-work.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import IdentityWork, work_bits
from seedflood_p2p.network.transport.identity import grind_identity

OUT = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--difficulties", type=int, nargs="+", default=[8, 12, 16, 18])
    parser.add_argument(
        "--identities",
        type=int,
        default=6,
        help="keys per difficulty at least (cheap ones get more: 2^20 / 2^d, at most 200)",
    )
    args = parser.parse_args()
    config = RunConfig(extra={"identity_work": {"difficulty": max(args.difficulties)}})
    rows = []
    for d in args.difficulties:
        work = IdentityWork(d, config.run_key)
        cpu, tries = [], []
        for _ in range(min(200, max(args.identities, (1 << 20) >> d))):
            start = time.process_time()
            _, peer, n = grind_identity(work)
            cpu.append(time.process_time() - start)
            tries.append(n)
            assert work_bits(config.run_key, peer) >= d
        row = {
            "difficulty": d,
            "identities": len(cpu),
            "expected_tries": 1 << d,
            "mean_tries": statistics.fmean(tries),
            "cpu_s_mean": statistics.fmean(cpu),
            "cpu_s_stdev": statistics.stdev(cpu) if len(cpu) > 1 else 0.0,
            "cpu_s_min": min(cpu),
            "cpu_s_max": max(cpu),
            "us_per_try": 1e6 * sum(cpu) / sum(tries),
            "cpu_s": cpu,
            "tries": tries,
        }
        rows.append(row)
        print(
            f"d={d}: {row['cpu_s_mean']:.3f} CPU s mean (sd {row['cpu_s_stdev']:.3f}, "
            f"{row['cpu_s_min']:.3f}..{row['cpu_s_max']:.3f}), {row['mean_tries']:,.0f} tries",
            flush=True,
        )
    meta = {
        "run_id": config.run_id,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "identity-work.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# Identity work: CPU seconds per identity",
        "",
        "`PYTHONPATH=. python bench/bench_identity_work.py` (bench/bench_identity_work.py): "
        "the identities of each row (column n), ground on one core as `seedflood "
        "keygen` does (Ed25519 keys drawn until blake2b-256(run id || peer id) has d "
        f"leading zero bits). {meta['date']}, {meta['machine']}, Python {meta['python']}, "
        f"{meta['cpus']} cores, load average {meta['load_average'][0]:.1f} (a shared "
        "machine: wall time is not reported, CPU time is the process's).",
        "",
        "| difficulty (bits) | n | expected keys | mean keys | CPU s mean | CPU s sd | "
        "CPU s min..max | us per key |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['difficulty']} | {r['identities']} | {r['expected_tries']:,} | "
            f"{r['mean_tries']:,.0f} | "
            f"{r['cpu_s_mean']:.3f} | {r['cpu_s_stdev']:.3f} | "
            f"{r['cpu_s_min']:.3f}..{r['cpu_s_max']:.3f} | {r['us_per_try']:.1f} |"
        )
    lines += [
        "",
        "The keys tried are geometric with mean 2^d: the spread of one identity's cost is",
        "about its mean, and each further bit doubles the mean. The cost is per identity",
        "and per run (the run id is the salt), paid once, before the key joins.",
        "",
    ]
    (OUT / "identity-work.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
