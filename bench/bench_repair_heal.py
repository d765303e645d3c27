"""Repair throughput after a partition heals, without daemons and without waiting for one.

    nice -n 19 python bench/bench_repair_heal.py [--rounds 4300] [--latency 0.02]

The topology and schedule of bench/bench_partition.py (h1 a bootstrap node that never
trains, h2..h5 peers, the cut {h1, h2, h3} | {h4, h5}, repair_interval 1 s), but the
partition is made up: every peer signs one row per round for --rounds rounds, and each
side's ledgers hold only their side's rows (8 rounds before the cut are everywhere).
At t = 0 the partition "heals": every node runs repair-on-connect with each node of the
other side (`repair_new_peer`, as network/peers/reconnect.py does) and its anti-entropy
loop (a random connected node every 0.5-1.5 s), the real FloodNode code, on real ledger
files, with each repair call routed to the server's handler after --latency seconds
(what a p2pd stream round trip costs). Reports the seconds until every ledger equals the
union, the exchanges made, the pages fetched and the rows re-fetched in vain. All five
nodes share one process and one event loop (the real ones share 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.signer import RUN, Peer  # noqa: E402
from seedflood_p2p.core.config import RunConfig  # noqa: E402
from seedflood_p2p.network.gossip import repair  # noqa: E402
from seedflood_p2p.network.gossip.flood import FloodNode  # noqa: E402
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, histogram_totals  # noqa: E402
from seedflood_p2p.network.settings import NodeSettings  # noqa: E402
from seedflood_p2p.storage.ledger import Ledger  # noqa: E402

SIDE_A, SIDE_B = (1, 2, 3), (4, 5)
WARMUP = 8


class _Id:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Id) and other.raw == self.raw


def build(workdir: Path, rounds: int) -> tuple[dict[int, FloodNode], dict[int, Peer]]:
    hosts = {h: Peer() for h in (*SIDE_A, *SIDE_B)}
    rows = {h: [hosts[h].row(r, (0.5 - r * 1e-4,)) for r in range(rounds)] for h in hosts if h > 1}
    manifest = RunConfig()
    nodes = {}
    for h, who in hosts.items():
        (workdir / f"h{h}").mkdir()
        p2p = types.SimpleNamespace(peer_id=_Id(who.id), daemon_listen_maddr={"unix": "unused"})
        ledger = Ledger(workdir / f"h{h}" / "ledger.sqlite", RUN)
        side = SIDE_A if h in SIDE_A else SIDE_B
        held = [
            row
            for author, own in rows.items()
            for row in own
            if author in side or row[0].round < WARMUP
        ]
        ledger.add([m for m, _ in held], [e for _, e in held])
        settings = NodeSettings(repair_interval=1.0)
        node = FloodNode(p2p, ledger, manifest, NodeMetrics(), settings)
        if h > 1:
            node.admission.own_round = rounds  # the peers train on at the heal
        nodes[h] = node
    return nodes, hosts


async def heal(nodes: dict[int, FloodNode], latency: float, timeout: float) -> dict:
    by_id = {node.peer_id: node for node in nodes.values()}
    calls = {"digest": 0, "fetch": 0}

    async def call_bytes(p2p, peer_id, name, request, timeout, max_response=None):
        server = by_id[peer_id.to_bytes()]
        calls[name.split(".")[1]] = calls.get(name.split(".")[1], 0) + 1
        await asyncio.sleep(latency / 2)
        reply = await server.repair.handlers[name](p2p.peer_id, request)
        await asyncio.sleep(latency / 2)
        return reply

    repair.call_bytes = call_bytes
    for h, node in nodes.items():
        others = [_Id(n.peer_id) for g, n in nodes.items() if g != h]

        async def connected(others=others):
            return list(others)

        node.connected_peers = connected
    union = set()
    for node in nodes.values():
        union |= {(m.round, m.peer) for m in node.ledger.messages()}
    target = len(union)
    started = time.perf_counter()
    tasks = [asyncio.create_task(node._anti_entropy_loop()) for node in nodes.values()]
    for h, node in nodes.items():  # repair on connect, across the cut
        for g, other in nodes.items():
            if (h in SIDE_A) != (g in SIDE_A):
                peer = _Id(other.peer_id)
                if hasattr(node, "repair_new_peer"):
                    tasks.append(asyncio.create_task(node.repair_new_peer(peer)))
                else:  # the code before it (--code): side by side
                    tasks.append(asyncio.create_task(node.sync_round([peer])))
    done_at = {}
    while time.perf_counter() - started < timeout:
        for h, node in nodes.items():
            if h not in done_at and len(node.ledger) == target:
                done_at[h] = round(time.perf_counter() - started, 2)
        if len(done_at) == len(nodes):
            break
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    digests = {node.ledger.digest() for node in nodes.values()}
    metrics = {h: n.metrics for h, n in nodes.items()}
    return {
        "identical_after_s": max(done_at.values()) if len(done_at) == len(nodes) else None,
        "complete_after_s": done_at,
        "identical": len(digests) == 1 and len(done_at) == len(nodes),
        "rows_union": target,
        "calls": calls,
        "repaired": {h: int(m.repaired._value.get()) for h, m in metrics.items()},
        "repair_admissions": {
            h: {
                k: int(v)
                for k, v in (
                    (o, m.admissions.labels("repair", o)._value.get())
                    for o in ("accepted", "duplicate", "dropped")
                )
            }
            for h, m in metrics.items()
        },
        "aborted": {
            h: sum(int(c._value.get()) for c in m.repair_aborted._metrics.values())
            for h, m in metrics.items()
        },
        "verified": {
            h: histogram_totals(m.verify_seconds).get("", {}).get("count", 0)
            for h, m in metrics.items()
        },
        "admit_seconds": {
            h: histogram_totals(m.admit_seconds.labels("repair")) for h, m in metrics.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4300)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per repair call")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    random.seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="sf-repair-heal-") as work:
        t0 = time.perf_counter()
        nodes, _ = build(Path(work), args.rounds)
        built = time.perf_counter() - t0
        result = asyncio.run(heal(nodes, args.latency, args.timeout))
        for node in nodes.values():
            node.bans.close()
            node.ledger.close()
    result.update(
        rounds=args.rounds,
        latency_s=args.latency,
        build_s=round(built, 1),
        loadavg=os.getloadavg(),
        command="nice -n 19 python bench/bench_repair_heal.py " + " ".join(sys.argv[1:]),
    )
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
