#!/usr/bin/env python
"""Memory of p2pd: hivemind's bundled binary against our build of it, side by side.

    python bench/bench_p2pd_memory.py [--daemons 3] [--seconds 10]

The bundled p2pd is UPX-packed: its stub unpacks the whole 28 MB image into anonymous
memory of each process. Our build (network/transport/p2pd_build.py) is the unpacked file
itself, so its code and read-only data are file-backed pages, shared by every daemon of
the machine. Per build, --daemons daemons are started as a peer starts them
(`create_p2p`: GossipSub on, loopback, subscribed to one topic), left idle for --seconds,
and each one's VmRSS, RssAnon, RssFile, PSS and USS read from /proc. Both builds run at
once, interleaved, so they share the machine's state.

Writes bench/results/p2pd-memory.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results"

from seedflood_p2p.network.transport.p2pd import DEFAULT_MESH, create_p2p  # noqa: E402
from seedflood_p2p.network.transport.pubsub import PubSubClient  # noqa: E402


def memory_kib(pid: int) -> dict[str, int]:
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            status[key] = int(value.split()[0])
    rollup = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        rollup[key] = int(value.split()[0])
    status["PSS"] = rollup["Pss"]
    status["USS"] = rollup["Private_Clean"] + rollup["Private_Dirty"]
    return status


async def measure(daemons: int, seconds: float) -> dict:
    builds = {"bundled": None, "ours": DEFAULT_MESH}
    started: dict[str, list] = {name: [] for name in builds}
    try:
        for _ in range(daemons):
            for name, mesh in builds.items():
                p2p = await create_p2p(
                    identity_path=None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], mesh=mesh
                )
                await PubSubClient(p2p).subscribe("p2pd-memory")
                started[name].append(p2p)
        await asyncio.sleep(seconds)
        rows = {}
        for name, p2ps in started.items():
            samples = [memory_kib(p2p._child.pid) for p2p in p2ps]
            rows[name] = {
                "binary": os.readlink(f"/proc/{p2ps[0]._child.pid}/exe"),
                **{k: statistics.median(s[k] for s in samples) / 1024 for k in samples[0]},
            }
        return rows
    finally:
        for p2ps in started.values():
            for p2p in p2ps:
                await p2p.shutdown()


def write_md(result: dict, path: Path) -> None:
    keys = ["VmRSS", "RssAnon", "RssFile", "PSS", "USS"]
    lines = [
        "# p2pd's memory: the bundled binary against our build, side by side",
        "",
        f"    {result['command']}",
        "",
        f"{result['daemons']} idle daemons of each build at once (GossipSub on, one topic "
        f"subscribed, loopback), read after {result['seconds']:.0f} s; medians, MiB. "
        f"{result['machine']}.",
        "",
        "| build | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in keys) + " |")
    lines += [
        "",
        "RssFile and PSS: our build's code and read-only data are pages of one file, shared "
        "by every daemon that maps it (PSS splits them among those); the bundled binary's "
        "are anonymous copies the UPX stub wrote into each process.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = asyncio.run(measure(args.daemons, args.seconds))
    result = {
        "command": "python bench/bench_p2pd_memory.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, load average {load:.1f} at the start",
        "daemons": args.daemons,
        "seconds": args.seconds,
        "rows": rows,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "p2pd-memory.json").write_text(json.dumps(result, indent=1) + "\n")
    write_md(result, OUT / "p2pd-memory.md")
    print((OUT / "p2pd-memory.md").read_text())


if __name__ == "__main__":
    main()
