#!/usr/bin/env python
# ruff: noqa: E501  (long f-strings build the markdown tables)
"""Network benchmark of SeedFlood-P2P on real go-libp2p daemons (127.0.0.1 only).

    python bench/bench_network.py [--quick] [--parts flood,bytes,latejoin] [--out PATH] [--merge]

Writes PATH.json and PATH.md (default bench/results/network.json and .md); with --merge the
parts not re-run are kept from the earlier PATH.json. Measures the library as it is: nothing
is patched or wrapped; durations per stage (decode, signature check, admission batch, repair
round trips and answers) come from the nodes' own timing histograms (network/monitoring/metrics.py).

1. flood     N = 8 and 16 (--peers) peer processes, one update per peer per round. Each process
             runs its own p2pd (via `create_p2p`) and a real `FloodNode` (decode, validate,
             SQLite ledger with synchronous=FULL, gossip committed in groups) with anti-entropy
             switched off while measuring, so the delivery ratio is GossipSub alone. Every
             process publishes one real 17-byte update per round (`FloodNode.publish` ->
             `encode_update`) at a random moment of the round, and timestamps (CLOCK_REALTIME,
             shared on one machine) its publishes and each update's ledger commit (the node's
             `on_accept` callback). The parent computes delivery (received / expected) and
             latency percentiles; decode and admission times are the histograms' means. Afterwards one explicit
             `sync_round()` shows repair completes the ledgers. Peers bootstrap off peer 0 (the
             hub), like real peers off a bootstrap node. Variants per N: ledgers on disk, on
             tmpfs (/dev/shm, --no-tmpfs skips it), and for N = 8 on disk with 80,000 old rows
             in every ledger, as late in a long run (--no-prefill).
2. bytes     Two daemons connected through a byte-counting TCP proxy; one publishes N updates
             (the 17-byte real payload: one float16 scalar, and 30 bytes for comparison with the transport docstring).
             Bytes per message per hop = (bytes during the publish window - idle rate x window)
             / messages received.
3. latejoin  A synthetic SQLite ledger of 10,000 (--late-rounds) rounds x 8 peers (80,000
             messages, 38-byte Ed25519 peer ids, random float32 scalars, real signed envelopes)
             for a SmolLM2-135M run (default rank and refresh period, base_sha256 from
             `weights_sha256`) is served by a donor FloodNode process. A fresh FloodNode process
             times `sync_with(donor)` on loopback (direct, then, unless --quick, once more
             through the byte-counting proxy for repair bytes). A torch process times the
             library's `replay()` on SmolLM2 with 1 torch thread, split into accumulate / basis
             generation (`epoch_bases`) / grouped epoch merges (`SubCGE.commit_grouped`), plus
             micro-probes; shorter samples of the first epochs, with torch's default threads
             (OpenMP active wait) and, unless --quick, 2 threads with OMP_WAIT_POLICY=PASSIVE,
             are extrapolated. Finally a real `seedflood peer` process joins the donor and is
             timed to its "ready" event.

Flood-only processes do not import torch: hivemind's package __init__ (which pulls torch,
~5 s and ~250 MiB per process) is bypassed by stub package modules (`_import_without_torch`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
DOWNLOAD_MBIT = 100.0
MAX_SYNC_EXCHANGES = 50  # late join: repair exchanges before the joiner gives up
UPDATE_BYTES = 17  # encode_update with one float16 scalar (checked when the bytes part sends it)


# ---------------------------------------------------------------------------------------------
# helpers


def _import_without_torch() -> None:
    """Import hivemind's p2p pieces without running hivemind/__init__ (which imports torch)."""
    if "hivemind" in sys.modules:
        return
    import importlib.util

    root = importlib.util.find_spec("hivemind").submodule_search_locations[0]
    for name, sub in (("hivemind", ""), ("hivemind.utils", "/utils")):
        module = types.ModuleType(name)
        module.__path__ = [root + sub]
        sys.modules[name] = module


def _proc_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _proc_cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return None


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _lat_stats(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(_pct(ms, 0.5), 2),
        "p90_ms": round(_pct(ms, 0.9), 2),
        "p99_ms": round(_pct(ms, 0.99), 2),
        "max_ms": round(max(ms), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def _stage_totals(metrics) -> dict:
    """{stage: {label: {"count", "sum_s"}}} from a node's timing histograms."""
    from seedflood_p2p.network.monitoring.metrics import histogram_totals

    return {
        "decode": histogram_totals(metrics.decode_seconds),
        "verify": histogram_totals(metrics.verify_seconds),
        "admit": histogram_totals(metrics.admit_seconds),
        "repair_call": histogram_totals(metrics.repair_call_seconds),
        "repair_serve": histogram_totals(metrics.repair_serve_seconds),
    }


def _stage_means(per_node: list[dict]) -> dict:
    """{"stage" or "stage/label": mean ms per observation} over several nodes' totals."""
    sums: dict[str, list[float]] = {}
    for stages in per_node:
        for stage, by_label in stages.items():
            for label, t in by_label.items():
                acc = sums.setdefault(f"{stage}/{label}" if label else stage, [0, 0.0])
                acc[0] += t["count"]
                acc[1] += t["sum_s"]
    return {k: round(1000 * s / n, 4) for k, (n, s) in sums.items() if n}


def _run_loop(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


class ByteProxy:
    """TCP proxy 127.0.0.1:port -> 127.0.0.1:target that counts bytes per direction."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = 0  # client -> target
        self.down = 0  # target -> client
        self.connections = 0
        self.server = None
        self.port = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pump(src, dst, up: bool) -> None:
            try:
                while data := await src.read(65536):
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pump(reader, w2, True), pump(r2, writer, False))

    def counters(self) -> tuple[int, int]:
        return self.up, self.down

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _spawn(mode: str, args: dict, log: Path, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), mode, json.dumps(args)]
    return subprocess.Popen(
        cmd,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env={**ENV, **(env or {})},
        cwd=str(ROOT),
    )


def _wait_file(path: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise RuntimeError(f"worker {p.args[2]} exited with {p.returncode} ({path})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {path}")
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """Stop only the processes this script started, by their PIDs."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# 1. flood workers


async def flood_worker(a: dict) -> None:
    _import_without_torch()
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.network.host import HostSettings, NetworkHost
    from seedflood_p2p.network.settings import NodeSettings
    from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
    from seedflood_p2p.storage.ledger import Ledger

    assert "torch" not in sys.modules, "flood worker imported torch"
    work, index = Path(a["work"]), a["index"]
    config = RunConfig(salt="bench-network-flood", base_sha256="0" * 64)
    # no repair while measuring; p2pd's defaults otherwise (no auto relay)
    settings = NodeSettings(repair_interval=1e9, publish_rate=50.0, auto_relay=False)
    initial = [a["bootstrap"]] if a.get("bootstrap") else []
    async with NetworkHost(HostSettings(node=settings, initial_peers=initial)) as host:
        p2p = host.p2p
        p2pd_pid = p2p._child.pid
        suffix = f"/p2p/{p2p.peer_id.to_base58()}"
        addr = [str(m) for m in await p2p.get_visible_maddrs()][0]
        addr = addr if addr.endswith(suffix) else addr + suffix

        accepts: list[tuple[str, int, float]] = []

        def on_accept(messages) -> None:
            t = time.time()
            accepts.extend((m.peer.hex(), m.round, t) for m in messages)

        ledger = Ledger(Path(a.get("ledger_dir") or work) / f"ledger{index}.sqlite", config.run_id)
        ledger.claim(config, "")
        prefill = int(a.get("prefill") or 0)
        if prefill:  # the same old rows on every peer (as after a long run): digests agree
            old_rng = random.Random(42)
            old_peers = [bytes.fromhex("002408011220") + old_rng.randbytes(32) for _ in range(8)]
            ledger.add(
                UpdateMessage(1_000_000 + r, p, (0.5,))
                for r in range(prefill // 8)
                for p in old_peers
            )
        node = host.flood_node(ledger, config, on_accept)
        await host.start_node()
        if index == 0:
            (work / "addr0.txt").write_text(addr)
        deadline = time.monotonic() + 60
        while len(await node.connected_peers()) < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        ready = {"peer": node.peer_id.hex(), "pid": os.getpid(), "p2pd_pid": p2pd_pid}
        (work / f"ready{index}.json").write_text(json.dumps(ready))

        go_path = work / "go.json"
        while not go_path.exists():
            await asyncio.sleep(0.05)
        go = json.loads(go_path.read_text())
        topic_peers_at_go = len(await node.connected_peers())
        cpu0 = (_proc_cpu_s(os.getpid()), _proc_cpu_s(p2pd_pid))
        rng = random.Random(1000 + index)
        publishes = []
        t0, period = go["t0"], go["period"]
        for k in range(go["rounds"]):
            target = t0 + k * period + rng.random() * period * go["jitter"]
            await asyncio.sleep(max(0.0, target - time.time()))
            scalar = quantize_scalars(rng.gauss(0.0, 1.0))
            t_pub = time.time()
            await node.publish(UpdateMessage(k, node.peer_id, scalar))
            publishes.append((k, t_pub, time.time()))
        await asyncio.sleep(go["drain"])
        cpu1 = (_proc_cpu_s(os.getpid()), _proc_cpu_s(p2pd_pid))
        ledger_before_repair = len(ledger) - prefill
        gossip_accepts = list(accepts)
        topic_peers = len(await node.connected_peers())
        connections = len(await p2p.list_peers())
        # Repair: the anti-entropy path, run explicitly (every peer at once).
        t = time.perf_counter()
        repaired = 0
        for _ in range(3):
            new = await node.sync_round()
            repaired += new
            if len(ledger) - prefill >= go["expected_ledger"]:
                break
            await asyncio.sleep(0.5)
        repair_s = time.perf_counter() - t
        result = {
            "index": index,
            "peer": node.peer_id.hex(),
            "publishes": publishes,
            "accepts": gossip_accepts,
            "gossip_duplicates": node.metrics.admission_counts()["gossip"]["duplicate"],
            "stages": _stage_totals(node.metrics),
            "accepts_all": accepts,
            "gossip_accepted_total": node.metrics.accepted_counts()["gossip"],
            "ledger_before_repair": ledger_before_repair,
            "ledger_after_repair": len(ledger) - prefill,
            "repaired": repaired,
            "repair_s": round(repair_s, 3),
            "drops": node.metrics.drop_counts(),
            "topic_peers_at_go": topic_peers_at_go,
            "topic_peers_end": topic_peers,
            "connections_end": connections,
            "subscription_dropped": sum(s.dropped for s in node._pubsub._subscriptions),
            "rss_python_mib": _proc_rss_mib(os.getpid()),
            "rss_p2pd_mib": _proc_rss_mib(p2pd_pid),
            "cpu_python_s": None if None in (cpu0[0], cpu1[0]) else cpu1[0] - cpu0[0],
            "cpu_p2pd_s": None if None in (cpu0[1], cpu1[1]) else cpu1[1] - cpu0[1],
            "torch_imported": "torch" in sys.modules,
        }
        tmp = work / f"result{index}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(work / f"result{index}.json")
        # Stay up until everyone has repaired (others sync from us), then leave.
        stop = work / "stop"
        deadline = time.monotonic() + 120
        while not stop.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    ledger.close()


def run_flood(
    n: int,
    rounds: int,
    period: float,
    jitter: float,
    base: Path,
    ledger_dir: str | None = None,
    prefill: int = 0,
) -> dict:
    """`ledger_dir`: where the workers' SQLite ledgers live (default: the work dir, on disk).
    `prefill`: rows already in every ledger (old rounds), as on a node late in a long run."""
    tmpfs, old = "_tmpfs" if ledger_dir else "", f"_prefill{prefill}" if prefill else ""
    work = base / f"flood{n}{tmpfs}{old}"
    work.mkdir(parents=True)
    load_start = _loadavg()
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        common = {"work": str(work), "ledger_dir": ledger_dir, "prefill": prefill}
        procs.append(_spawn("_flood-worker", {**common, "index": 0}, work / "w0.log"))
        _wait_file(work / "addr0.txt", procs, 60)
        boot = (work / "addr0.txt").read_text()
        for i in range(1, n):
            args = {**common, "index": i, "bootstrap": boot}
            procs.append(_spawn("_flood-worker", args, work / f"w{i}.log"))
        for i in range(n):
            _wait_file(work / f"ready{i}.json", procs, 120)
        startup_s = time.monotonic() - started
        time.sleep(3.0)  # a few GossipSub heartbeats (1 s) so the mesh is grafted
        drain = 5.0
        go = {
            "t0": time.time() + 1.0,
            "rounds": rounds,
            "period": period,
            "jitter": jitter,
            "drain": drain,
            "expected_ledger": n * rounds,
        }
        (work / "go.json").write_text(json.dumps(go))
        for i in range(n):
            _wait_file(work / f"result{i}.json", procs, rounds * period + 120)
        (work / "stop").write_text("")
        for p in procs:
            p.wait(60)
    except Exception:
        for i, _ in enumerate(procs):
            print(f"--- worker {i} log:\n{_tail(work / f'w{i}.log')}", file=sys.stderr)
        raise
    finally:
        _stop(procs)
    load_end = _loadavg()
    results = [json.loads((work / f"result{i}.json").read_text()) for i in range(n)]
    out = analyze_flood(n, rounds, period, jitter, results, startup_s, load_start, load_end, drain)
    out["ledger_storage"] = "tmpfs (/dev/shm, fsync is free)" if ledger_dir else "disk (/tmp)"
    out["ledger_prefilled_rows"] = prefill
    return out


def analyze_flood(
    n, rounds, period, jitter, results, startup_s, load_start, load_end, drain
) -> dict:
    pub_time = {}
    publish_call = []
    for r in results:
        for k, t_pub, t_done in r["publishes"]:
            pub_time[(r["peer"], k)] = t_pub
            publish_call.append(t_done - t_pub)
    expected = delivered = delivered_eventually = 0
    accept_lat = []
    per_receiver = []
    complete_rounds = total_rounds = 0
    for r in results:
        others = {(p, k) for (p, k) in pub_time if p != r["peer"]}
        expected += len(others)
        got = {}  # by gossip, before the repair pass
        for p, k, t in r["accepts"]:
            if (p, k) in others and (p, k) not in got:
                got[(p, k)] = t
                accept_lat.append(t - pub_time[(p, k)])
        delivered += len(got)
        # the counter also holds gossip accepted after the drain window, during repair
        delivered_eventually += r["gossip_accepted_total"]
        per_receiver.append(r["gossip_accepted_total"] / max(1, len(others)))
        by_round = {}
        for _, k in got:
            by_round[k] = by_round.get(k, 0) + 1
        for k in range(rounds):
            total_rounds += 1
            complete_rounds += by_round.get(k, 0) == n - 1
    after_repair = sum(r["ledger_after_repair"] for r in results)
    cpu_py = [r["cpu_python_s"] for r in results if r["cpu_python_s"] is not None]
    cpu_d = [r["cpu_p2pd_s"] for r in results if r["cpu_p2pd_s"] is not None]
    wall = rounds * period + 3.0
    return {
        "peers": n,
        "rounds": rounds,
        "round_rate_hz": round(1 / period, 3),
        "publish_jitter": f"uniform in [0, {jitter} x round)",
        "messages_per_s_total": round(n / period, 1),
        "duration_s": round(rounds * period, 1),
        "startup_s": round(startup_s, 2),
        "expected_deliveries": expected,
        "delivered_gossip": delivered_eventually,
        "delivery_ratio": round(delivered_eventually / expected, 6) if expected else None,
        "delivered_gossip_eventually": delivered_eventually,
        "delivered_by_drain_deadline": delivered,
        "delivery_ratio_by_drain_deadline": round(delivered / expected, 6) if expected else None,
        "drain_s": drain,
        "min_receiver_ratio": round(min(per_receiver), 6),
        "rounds_complete_before_repair": round(complete_rounds / total_rounds, 6),
        "app_duplicates": sum(r["gossip_duplicates"] for r in results),
        "ledger_complete_after_repair": after_repair == n * n * rounds,
        "ledger_rows_after_repair": after_repair,
        "ledger_rows_expected": n * n * rounds,
        "repaired_messages": sum(r["repaired"] for r in results),
        "latency_ledger_commit": _lat_stats(accept_lat),
        "publish_call": _lat_stats(publish_call),
        # mean durations per stage over all peers, from the nodes' histograms
        "stage_mean_ms": _stage_means([r["stages"] for r in results]),
        "drops": {k: sum(r["drops"][k] for r in results) for k in results[0]["drops"]},
        "subscription_queue_drops": sum(r["subscription_dropped"] for r in results),
        "topic_peers_at_go": [r["topic_peers_at_go"] for r in results],
        "connections_end": [r["connections_end"] for r in results],
        "rss_python_mib_mean": round(statistics.fmean(r["rss_python_mib"] for r in results), 1),
        "rss_p2pd_mib_mean": round(statistics.fmean(r["rss_p2pd_mib"] for r in results), 1),
        "cpu_share_python_per_peer": round(statistics.fmean(cpu_py) / wall, 4) if cpu_py else None,
        "cpu_share_p2pd_per_peer": round(statistics.fmean(cpu_d) / wall, 4) if cpu_d else None,
        "cpu_ms_per_delivery_all_procs": round(
            1000 * (sum(cpu_py) + sum(cpu_d)) / max(1, delivered), 3
        ),
        "torch_imported_in_workers": any(r["torch_imported"] for r in results),
        "loadavg_start": load_start,
        "loadavg_end": load_end,
    }


# ---------------------------------------------------------------------------------------------
# 2. bytes per hop


async def bytes_worker(a: dict) -> None:
    _import_without_torch()
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.network.transport.p2pd import create_p2p
    from seedflood_p2p.network.transport.pubsub import PubSubClient
    from seedflood_p2p.protocol.framing import topic_for
    from seedflood_p2p.protocol.update import encode_update

    n_msgs, rate = a["messages"], a["rate"]
    run_id = RunConfig(salt="bench-network-bytes").run_id
    topic = topic_for(run_id)
    # the topic before commit 0ee5513 ("Shorter GossipSub topic"), for comparison
    old_topic = f"seedflood/{run_id[:32]}/updates"
    port_a = _free_port()
    receiver = await create_p2p(identity_path=None, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port_a}"])
    proxy = ByteProxy(port_a)
    port_p = await proxy.start()
    sender = await create_p2p(
        identity_path=None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[f"/ip4/127.0.0.1/tcp/{port_p}/p2p/{receiver.peer_id.to_base58()}"],
    )
    ca, cb = PubSubClient(receiver, max_rate=None), PubSubClient(sender, max_rate=rate, burst=1)
    out = {"proxy_port": port_p, "receiver_port": port_a}
    try:
        sub = await ca.subscribe(topic)
        sub_short = await ca.subscribe(old_topic)
        await cb.subscribe(topic)
        await cb.subscribe(old_topic)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all([await ca.list_peers(t) and await cb.list_peers(t) for t in (topic, old_topic)]):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(4.0)  # mesh graft
        received: list = []

        async def collect(subscription):
            async for m in subscription:
                received.append(m)

        collectors = [asyncio.create_task(collect(s)) for s in (sub, sub_short)]

        async def idle(seconds: float) -> tuple[float, float]:
            u0, d0 = proxy.counters()
            await asyncio.sleep(seconds)
            u1, d1 = proxy.counters()
            return (u1 - u0) / seconds, (d1 - d0) / seconds

        def payload_of(size: int, k: int) -> bytes:
            if size == UPDATE_BYTES:  # a real update: one float16 scalar
                payload = encode_update(run_id, 100000 + k, (0.123456,))
                assert len(payload) == size, "the update encoding changed: fix UPDATE_BYTES"
                return payload
            return bytes([k % 251]) * size

        windows = []
        idle_before = await idle(a["idle_s"])
        cases = [(size, topic) for size in a["sizes"]] + [(UPDATE_BYTES, old_topic)]
        for size, case_topic in cases:
            got0 = len(received)
            u0, d0 = proxy.counters()
            t0 = time.monotonic()
            for k in range(n_msgs):
                await cb.publish(case_topic, payload_of(size, k))
            await asyncio.sleep(2.0)
            window = time.monotonic() - t0
            u1, d1 = proxy.counters()
            msgs = received[got0:]
            windows.append(
                {
                    "payload_bytes": len(payload_of(size, 0)),
                    "topic": case_topic,
                    "topic_bytes": len(case_topic),
                    "published": n_msgs,
                    "received": len(msgs),
                    "window_s": round(window, 2),
                    "bytes_sender_to_receiver": u1 - u0,
                    "bytes_receiver_to_sender": d1 - d0,
                    "wire_size_signed_message": msgs[0].wire_size if msgs else None,
                }
            )
        idle_after = await idle(a["idle_s"])
        for c in collectors:
            c.cancel()
        idle_up = (idle_before[0] + idle_after[0]) / 2
        idle_down = (idle_before[1] + idle_after[1]) / 2
        for w in windows:
            n_rx = max(1, w["received"])
            w["per_message_per_hop_bytes"] = round(
                (w["bytes_sender_to_receiver"] - idle_up * w["window_s"]) / n_rx, 1
            )
            w["reverse_per_message_bytes"] = round(
                (w["bytes_receiver_to_sender"] - idle_down * w["window_s"]) / n_rx, 1
            )
        out.update(
            {
                "idle_bytes_per_s_sender_to_receiver": [
                    round(idle_before[0], 1),
                    round(idle_after[0], 1),
                ],
                "idle_bytes_per_s_receiver_to_sender": [
                    round(idle_before[1], 1),
                    round(idle_after[1], 1),
                ],
                "proxy_connections": proxy.connections,
                "windows": windows,
                "identity": "Ed25519 (create_p2p default), signed strict",
            }
        )
    finally:
        await ca.close()
        await cb.close()
        await sender.shutdown()
        proxy.close()
        await receiver.shutdown()
    Path(a["out"]).write_text(json.dumps(out))


def run_bytes(base: Path, quick: bool) -> dict:
    work = base / "bytes"
    work.mkdir(parents=True)
    out = work / "bytes.json"
    args = {
        "out": str(out),
        "messages": 100 if quick else 300,
        "rate": 30.0,
        "sizes": [UPDATE_BYTES, 30],
        "idle_s": 4.0 if quick else 8.0,
    }
    load_start = _loadavg()
    p = _spawn("_bytes-worker", args, work / "bytes.log")
    try:
        p.wait(300)
    finally:
        _stop([p])
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"bytes worker failed:\n{_tail(work / 'bytes.log')}")
    result = json.loads(out.read_text())
    result["loadavg_start"], result["loadavg_end"] = load_start, _loadavg()
    return result


# ---------------------------------------------------------------------------------------------
# 3. late join


LATE_ROUNDS, LATE_PEERS = 10_000, 8


def build_ledger_worker(a: dict) -> None:
    """Torch process: hash SmolLM2's base weights and write the synthetic source ledger.

    Each row carries a real signed envelope, as FloodNode stores gossip: the 17-byte update
    payload, an 8-byte seqno and the Ed25519 signature go-libp2p-pubsub makes ("libp2p-pubsub:"
    + PSMessage{from, data, seqno, topic}) by one of 8 generated peer keys.
    """
    _import_without_torch()  # hivemind's protobufs without running hivemind/__init__
    import numpy as np
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.proto import p2pd_pb2 as pb

    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature
    from seedflood_p2p.protocol.framing import topic_for
    from seedflood_p2p.protocol.message import Envelope, UpdateMessage
    from seedflood_p2p.protocol.update import check_envelope, encode_update
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model, weights_sha256

    t = time.perf_counter()
    model, _ = load_model("smollm2-135m")
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    base = weights_sha256(model)
    hash_s = time.perf_counter() - t
    config = RunConfig(model="smollm2-135m", base_sha256=base)
    rng = np.random.default_rng(7)
    # Ed25519 libp2p peer ids: identity multihash (0x00, 0x24) of PublicKey{Ed25519, 32 bytes}
    keys = [Ed25519PrivateKey.generate() for _ in range(a["peers"])]
    raw = ser.Encoding.Raw, ser.PublicFormat.Raw
    peers = [bytes.fromhex("002408011220") + k.public_key().public_bytes(*raw) for k in keys]
    assert all(len(p) == 38 for p in peers)
    scalars = rng.standard_normal(a["rounds"] * a["peers"]).astype(np.float32)
    topic = topic_for(config.run_id)
    seqno0 = time.time_ns()
    messages, envelopes = [], []
    t = time.perf_counter()
    for t_ in range(a["rounds"]):
        for j, (peer, key) in enumerate(zip(peers, keys)):
            message = UpdateMessage(t_, peer, (float(scalars[t_ * len(peers) + j]),))
            data = encode_update(config.run_id, t_, message.scalars)
            seqno = (seqno0 + t_).to_bytes(8, "big")
            body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[topic])
            setattr(body, "from", peer)
            signature = key.sign(b"libp2p-pubsub:" + body.SerializeToString())
            messages.append(message)
            envelopes.append(Envelope(data, seqno, signature))
    sign_s = time.perf_counter() - t
    for i in (0, len(messages) // 2, len(messages) - 1):  # the library accepts them
        check_envelope(messages[i], envelopes[i], config.run_id, verify_pubsub_signature)
    t = time.perf_counter()
    n_verify = min(2000, len(messages))
    for i in range(n_verify):
        verify_pubsub_signature(
            messages[i].peer, envelopes[i].data, envelopes[i].seqno, topic, envelopes[i].signature
        )
    verify_us = (time.perf_counter() - t) / n_verify * 1e6
    t = time.perf_counter()
    ledger = Ledger(Path(a["path"]), config.run_id)
    ledger.claim(config, "")
    ledger.add(messages, envelopes)
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    digest = ledger.digest()
    digest_s = time.perf_counter() - t
    n = len(ledger)
    ledger.close()
    params = sum(p.numel() for p in model.parameters())
    Path(a["out"]).write_text(
        json.dumps(
            {
                "run_id": config.run_id,
                "base_sha256": base,
                "rank": config.rank,
                "refresh_period": config.refresh_period,
                "messages": n,
                "ledger_digest": digest,
                "model_load_s": round(load_s, 2),
                "weights_sha256_s": round(hash_s, 2),
                "ledger_write_s": round(write_s, 2),
                "sign_s": round(sign_s, 2),
                "verify_pubsub_signature_us": round(verify_us, 1),
                "ledger_digest_s": round(digest_s, 2),
                "ledger_file_mib": round(Path(a["path"]).stat().st_size / 2**20, 2),
                "model_params": params,
                "fp32_bytes": params * 4,
            }
        )
    )


async def donor_worker(a: dict) -> None:
    _import_without_torch()
    from seedflood_p2p.network.host import HostSettings, NetworkHost
    from seedflood_p2p.network.settings import NodeSettings
    from seedflood_p2p.storage.ledger import Ledger

    work = Path(a["work"])
    ledger = Ledger.open_existing(a["ledger"])
    config = ledger.config
    assert config.run_id == ledger.run_id
    port = _free_port()
    settings = NodeSettings(repair_interval=1e9, auto_relay=False)  # p2pd defaults
    listen = [f"/ip4/127.0.0.1/tcp/{port}"]
    async with NetworkHost(HostSettings(node=settings, listen=listen)) as host:
        p2p = host.p2p
        node = host.flood_node(ledger, config)
        await host.start_node()
        info = {
            "addr": f"/ip4/127.0.0.1/tcp/{port}/p2p/{p2p.peer_id.to_base58()}",
            "port": port,
            "peer": p2p.peer_id.to_base58(),
            "p2pd_pid": p2p._child.pid,
        }
        (work / "donor.json").write_text(json.dumps(info))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        (work / "donor_timings.json").write_text(json.dumps(_stage_totals(node.metrics)))


async def joiner_worker(a: dict) -> None:
    """Fresh FloodNode: time sync_with(donor), directly and through the counting proxy."""
    _import_without_torch()
    from hivemind.p2p import PeerID

    from seedflood_p2p.network.host import HostSettings, NetworkHost
    from seedflood_p2p.network.monitoring.metrics import value
    from seedflood_p2p.network.settings import NodeSettings
    from seedflood_p2p.storage.ledger import Ledger

    work = Path(a["work"])
    donor = json.loads((work / "donor.json").read_text())
    with Ledger.open_existing(a["source"]) as src:
        config, run_id, source_rows = src.config, src.run_id, len(src)
    donor_id = PeerID.from_base58(donor["peer"])
    settings = NodeSettings(repair_interval=1e9, auto_relay=False)  # p2pd defaults
    results = {}
    proxy = None
    for label in a["passes"]:
        path = work / f"joiner_{label}.sqlite"
        if label == "proxy":
            proxy = ByteProxy(donor["port"])
            port = await proxy.start()
            initial = f"/ip4/127.0.0.1/tcp/{port}/p2p/{donor['peer']}"
        else:
            initial = donor["addr"]
        t_start = time.perf_counter()
        host = NetworkHost(HostSettings(node=settings, initial_peers=[initial]))
        async with host:
            daemon_s = time.perf_counter() - t_start
            ledger = Ledger(path, run_id)
            ledger.claim(config, "")
            node = host.flood_node(ledger, config)
            await host.start_node()
            # What the peer daemon does with the default min_peers=0: sync_round() right away.
            topic_peers_immediately = len(await node.connected_peers())
            bytes0 = proxy.counters() if proxy else (0, 0)
            # Repair takes at most a budget of rows per exchange (and an exchange may time out
            # on a busy donor), so a long history takes several: exchange until complete.
            t, new, exchanges = time.perf_counter(), 0, 0
            while len(ledger) < source_rows and exchanges < MAX_SYNC_EXCHANGES:
                new += await node.sync_with(donor_id)
                exchanges += 1
            sync_s = time.perf_counter() - t
            bytes1 = proxy.counters() if proxy else (0, 0)
            stages = _stage_totals(node.metrics)  # of the first sync only
            t = time.perf_counter()
            again = await node.sync_with(donor_id)
            noop_s = time.perf_counter() - t
            t = time.perf_counter()
            digest = ledger.digest()
            digest_s = time.perf_counter() - t
            results[label] = {
                "daemon_start_s": round(daemon_s, 3),
                "topic_peers_right_after_start": topic_peers_immediately,
                "synced_messages": new,
                "sync_exchanges": exchanges,
                "sync_s": round(sync_s, 3),
                "messages_per_s": round(new / sync_s, 1) if sync_s else None,
                "fetch_calls": stages["repair_call"]["fetch"]["count"],
                "fetch_rpc_s": round(stages["repair_call"]["fetch"]["sum_s"], 3),
                "digest_rpc_s": round(stages["repair_call"]["digest"]["sum_s"], 3),
                # policy + ledger writes of the repaired rows (the signature checks apart)
                "accept_s": round(stages["admit"]["repair"]["sum_s"], 3),
                "check_envelope_s": round(stages["verify"][""]["sum_s"], 3),
                "dropped": {k: v for k, v in node.metrics.drop_counts().items() if v},
                "fetch_payload_bytes": int(value(node.metrics.repair_bytes_in.labels("fetch"))),
                "second_sync_new": again,
                "second_sync_noop_s": round(noop_s, 3),
                "ledger_messages": len(ledger),
                "ledger_digest": digest,
                "ledger_digest_s": round(digest_s, 3),
            }
            if proxy:
                results[label]["wire_bytes_donor_to_joiner"] = bytes1[1] - bytes0[1]
                results[label]["wire_bytes_joiner_to_donor"] = bytes1[0] - bytes0[0]
                results[label]["wire_bytes_per_message"] = round(
                    (bytes1[1] - bytes0[1]) / max(1, new), 2
                )
        ledger.close()
        if proxy:
            proxy.close()
    # Probe: the same signature checks spread over a process pool (cryptography holds the
    # GIL during Ed25519 verify, so threads do not help).
    with Ledger.open_existing(work / "joiner_direct.sqlite") as done:
        rows = done.signed_after(-1, b"\xff" * 64, 1 << 62, 1 << 30)
    packed = [(m.peer, e.data, e.seqno, e.signature) for m, e in rows]
    probe = {"rows": len(packed)}
    t, c = time.perf_counter(), time.process_time()
    ok = sum(_verify_chunk(run_id, packed[i : i + 4096]) for i in range(0, len(packed), 4096))
    probe["serial_s"], probe["serial_cpu_s"] = time.perf_counter() - t, time.process_time() - c
    probe["serial_ok"] = ok
    from concurrent.futures import ProcessPoolExecutor

    workers = os.cpu_count() or 2
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_verify_chunk, [run_id] * workers, [packed[:8]] * workers))  # warm up
        t = time.perf_counter()
        chunks = [packed[i : i + 4096] for i in range(0, len(packed), 4096)]
        ok = sum(pool.map(_verify_chunk, [run_id] * len(chunks), chunks))
        probe["pool_s"], probe["pool_workers"], probe["pool_ok"] = (
            time.perf_counter() - t,
            workers,
            ok,
        )
    probe = {k: round(v, 3) if isinstance(v, float) else v for k, v in probe.items()}
    probe["us_per_row_serial"] = round(1e6 * probe["serial_s"] / max(1, len(packed)), 1)
    results["verify_probe"] = probe
    Path(a["out"]).write_text(json.dumps(results))


def _verify_chunk(run_id: str, rows: list) -> int:
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature
    from seedflood_p2p.protocol.framing import topic_for

    topic = topic_for(run_id)
    return sum(verify_pubsub_signature(p, d, q, topic, g) for p, d, q, g in rows)


def replay_worker(a: dict) -> None:
    """Torch process: time replay() of the synced ledger on SmolLM2, split into parts.

    a: ledger, out, threads (None: torch default), max_round (None: all), rounds, probes.
    replay() folds messages with SubCGE.accumulate and merges the epochs with
    SubCGE.commit_grouped (bases from subcge.epoch_bases); those three are timed.
    """
    import torch

    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import StageTimes, layer_basis, trainable_tensors
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model, weights_sha256

    if a.get("threads"):
        torch.set_num_threads(a["threads"])
    out: dict = {
        "torch_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset: active spin)"),
        "loadavg_start": _loadavg(),
    }
    ledger = Ledger.open_existing(a["ledger"])
    config = ledger.config
    max_round = a.get("max_round")
    t = time.perf_counter()
    model, _ = load_model(config.model)
    out["model_load_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    assert weights_sha256(model) == config.base_sha256
    out["base_hash_check_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    n_read = sum(1 for _ in ledger.messages(0, max_round))
    out["ledger_read_s"] = round(time.perf_counter() - t, 3)

    times = StageTimes()
    t, c = time.perf_counter(), time.process_time()
    count = replay(model, config, ledger.messages(0, max_round), times=times)
    replay_s, replay_cpu = time.perf_counter() - t, time.process_time() - c
    per_commit = times.merge_calls
    epochs = len({config.epoch_of(m.round) for m in ledger.messages(0, max_round)})
    full_epochs = a.get("rounds", LATE_ROUNDS) // config.refresh_period
    out.update(
        {
            "messages": count,
            "messages_read_check": n_read,
            "epochs": epochs,
            "rank": config.rank,
            "refresh_period": config.refresh_period,
            "trainable_matrices": len(trainable_tensors(model, config)),
            "trainable_params": sum(m.weight.numel() for m in trainable_tensors(model, config)),
            "replay_s": round(replay_s, 2),
            "replay_cpu_s": round(replay_cpu, 2),
            "accumulate_s": round(times.wall["accumulate"], 2),
            "merge_total_s": round(times.wall["merge"], 2),
            "merge_basis_generation_s": round(times.wall["basis"], 2),
            "merge_matmul_s": round(times.wall["merge"] - times.wall["basis"], 2),
            "other_s": round(replay_s - times.wall["accumulate"] - times.wall["merge"], 2),
            "cpu_s": {k: round(v, 2) for k, v in times.cpu.items()},
            "merge_ms_first_epoch": round(1000 * per_commit[0], 1) if per_commit else None,
            "merge_calls": len(per_commit),
            "merge_ms_per_call_median": round(1000 * statistics.median(per_commit), 1),
            "merge_ms_per_call_p90": round(1000 * _pct(per_commit, 0.9), 1),
        }
    )
    if 0 < epochs < full_epochs:
        out["extrapolated_full_replay_s"] = round(replay_s * full_epochs / epochs, 1)
    else:
        out["replayed_weights_sha256"] = weights_sha256(model)
    print(f"replay: {json.dumps(out)}", flush=True)

    if a.get("probes"):
        t = time.perf_counter()
        for _ in range(20):
            layer_basis(config.run_key, 0, 0, 1536, 576, config.rank)
        layer_basis_ms = (time.perf_counter() - t) / 20 * 1000
        w = torch.randn(1536, 576)
        uv = torch.randint(0, 2, (1536 + 576, config.rank)).float() * 2 - 1
        u, v = uv[:1536], uv[1536:]
        c8 = torch.randn(config.rank, config.rank)
        w.addmm_(u @ c8, v.T, alpha=-1.0)
        t = time.perf_counter()
        for _ in range(50):
            w.addmm_(u @ c8, v.T, alpha=-1.0)
        rank_r_ms = (time.perf_counter() - t) / 50 * 1000
        a_, b_ = torch.randn(1536, 400), torch.randn(400, 576)
        w.addmm_(a_, b_)
        t = time.perf_counter()
        for _ in range(20):
            w.addmm_(a_, b_)
        gflops = 20 * 2 * 1536 * 576 * 400 / (time.perf_counter() - t) / 1e9
        out["probes"] = {
            "layer_basis_1536x576_ms": round(layer_basis_ms, 3),
            "rank_r_merge_1536x576_ms": round(rank_r_ms, 3),
            "rank_r_merge_GB_per_s": round(2 * w.numel() * 4 / rank_r_ms / 1e6, 2),
            "rank_400_gemm_gflops": round(gflops, 1),
        }
    out["loadavg_end"] = _loadavg()
    ledger.close()
    Path(a["out"]).write_text(json.dumps(out))


def _e2e_peer(work: Path, donor_addr: str, min_peers: int, timeout: float, rounds: int) -> dict:
    """A real `seedflood peer` joining the donor; time from launch to its "ready" event."""
    data = work / f"e2e_peer_minpeers{min_peers}"
    log = work / f"e2e_peer_minpeers{min_peers}.log"
    cmd = [
        sys.executable, "-m", "seedflood", "--log-format", "json", "peer",
        "--bootstrap", donor_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
        "--data-dir", str(data), "--until-round", str(rounds), "--linger", "1",
        "--min-peers", str(min_peers), "--repair-interval", "1000", "--threads", "1",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=ENV, cwd=str(ROOT)
    )
    ready = None
    events = []
    try:
        deadline = t0 + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            events = []
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    with contextlib.suppress(json.JSONDecodeError):
                        events.append(json.loads(line))
            ready = next((e for e in events if e.get("event") == "ready"), None)
            if ready is not None:
                break
            time.sleep(0.2)
        ready_s = time.monotonic() - t0 if ready else None
    finally:
        _stop([proc], grace=60)
    return {
        "min_peers": min_peers,
        "launch_to_ready_s": None if ready_s is None else round(ready_s, 2),
        "ready_round": None if ready is None else ready.get("round"),
        "ready_source": None if ready is None else ready.get("source"),
        "ready_fetched": None if ready is None else ready.get("fetched"),
        "exit_code": proc.returncode,
        "log_tail": _tail(log, 12) if not ready or ready.get("fetched") == 0 else None,
    }


def run_latejoin(base: Path, quick: bool, rounds: int = LATE_ROUNDS) -> dict:
    work = base / "latejoin"
    work.mkdir(parents=True)
    out: dict = {"loadavg_start": _loadavg(), "rounds": rounds, "peers": LATE_PEERS}
    source = work / "source.sqlite"
    procs: list[subprocess.Popen] = []
    try:
        p = _spawn(
            "_build-ledger",
            {
                "path": str(source),
                "out": str(work / "build.json"),
                "rounds": rounds,
                "peers": LATE_PEERS,
            },
            work / "build.log",
        )
        if p.wait(900) != 0:
            raise RuntimeError(f"ledger build failed:\n{_tail(work / 'build.log')}")
        out["build"] = json.loads((work / "build.json").read_text())
        print(f"  source ledger: {out['build']}", flush=True)

        donor = _spawn("_donor", {"work": str(work), "ledger": str(source)}, work / "donor.log")
        procs.append(donor)
        _wait_file(work / "donor.json", procs, 60)
        passes = ["direct"] if quick else ["direct", "proxy"]
        p = _spawn(
            "_joiner",
            {
                "work": str(work),
                "source": str(source),
                "out": str(work / "joiner.json"),
                "passes": passes,
            },
            work / "joiner.log",
        )
        procs.append(p)
        if p.wait(900) != 0:
            raise RuntimeError(f"joiner failed:\n{_tail(work / 'joiner.log')}")
        out["sync"] = json.loads((work / "joiner.json").read_text())
        for label, s in out["sync"].items():
            if label == "verify_probe":
                continue
            s["digest_equals_source"] = s["ledger_digest"] == out["build"]["ledger_digest"]
        print(f"  sync: {out['sync']}", flush=True)

        ledger = str(work / "joiner_direct.sqlite")
        # main measurement: the library's replay() with one torch thread
        runs = [("replay", {"threads": 1, "probes": True}, {})]
        # samples: torch's default threads (2) with OpenMP's default active spin-wait, and
        # 2 threads with OMP_WAIT_POLICY=PASSIVE; first epochs only, extrapolated
        runs.append(("replay_default_threads_sample", {"max_round": 99}, {}))
        if not quick:
            runs.append(
                (
                    "replay_2threads_passive_sample",
                    {"threads": 2, "max_round": 999},
                    {"OMP_WAIT_POLICY": "PASSIVE"},
                )
            )
        for name, extra, env in runs:
            args = {"ledger": ledger, "out": str(work / f"{name}.json"), "rounds": rounds, **extra}
            p = _spawn("_replay", args, work / f"{name}.log", env)
            procs.append(p)
            if p.wait(3600) != 0:
                raise RuntimeError(f"{name} failed:\n{_tail(work / f'{name}.log')}")
            out[name] = json.loads((work / f"{name}.json").read_text())
            print(f"  {name}: {out[name]}", flush=True)

        donor_addr = json.loads((work / "donor.json").read_text())["addr"]
        out["end_to_end_peer"] = [_e2e_peer(work, donor_addr, 0, 1800, rounds)]
        if out["end_to_end_peer"][0]["ready_fetched"] == 0:
            # the default (min_peers=0) started without syncing: measure with min_peers=1 too
            out["end_to_end_peer"].append(_e2e_peer(work, donor_addr, 1, 1800, rounds))
        print(f"  e2e: {out['end_to_end_peer']}", flush=True)
    finally:
        _stop(procs)
    with contextlib.suppress(OSError, ValueError):
        out["donor_stages"] = json.loads((work / "donor_timings.json").read_text())
    sync_s = out["sync"]["direct"]["sync_s"]
    replay_s = out["replay"]["replay_s"]
    fp32 = out["build"]["fp32_bytes"]
    target = fp32 * 8 / (DOWNLOAD_MBIT * 1e6)
    out["target"] = {
        "fp32_weights_bytes": fp32,
        "download_s_at_100_mbit": round(target, 1),
        "sync_plus_replay_s": round(sync_s + replay_s, 2),
        "replay_cpu_s_one_thread": out["replay"]["replay_cpu_s"],
        "met": sync_s + replay_s < target,
        "margin_s": round(target - (sync_s + replay_s), 2),
        "ratio_to_target": round((sync_s + replay_s) / target, 3),
    }
    out["loadavg_end"] = _loadavg()
    return out


# ---------------------------------------------------------------------------------------------
# report


def write_markdown(res: dict, path: Path) -> None:
    """Render `res` as markdown. Also renders results of older versions of this script: the
    keys "library" (part_runs), "bench_patch_*" (flood), "batched_merge_prototype" (replay)
    and "sync_plus_batched_replay_s" (target) come only from such runs."""
    L = []
    L.append("# Network benchmark (SeedFlood-P2P on go-libp2p daemons, 127.0.0.1)\n")
    L.append(f"{res['cpus']} cores. Each part below comes from one run of this script:\n")
    for part, run in res.get("part_runs", {}).items():
        lib = f"; library from {run['library']}" if run.get("library") else ""
        L.append(f"- {part}: {run['started']}, `{run['command']}`{lib}")
    L.append(
        "\nLoad averages include this benchmark's own processes (16 peers = 16 Python "
        "processes + 16 p2pd); other benchmarks shared the 2 cores during most of the runs, "
        "so latencies and wall-clock timings are inflated; CPU seconds are given where they "
        "matter.\n"
    )
    if "flood" in res:
        L.append("## 1. Flood delivery and latency (one update per peer per round, no repair)\n")
        L.append(
            "| peers | ledger | rounds/s | msgs/s total | duration s | delivery (gossip only) | min per peer "
            "| rounds complete | decode / gossip admit batch mean ms | ledger-commit p50 / p99 ms "
            "| publish() p50 / p99 ms | after repair | RSS py / p2pd MiB | CPU/peer py+p2pd | load avg |"
        )
        L.append("|" + "---|" * 15)
        for f in res["flood"]:
            sm, lc, pc = f.get("stage_mean_ms", {}), f["latency_ledger_commit"], f["publish_call"]
            old = f["ledger_prefilled_rows"] // 1000
            L.append(
                f"| {f['peers']} | {f['ledger_storage'].split()[0]}"
                f"{f' + {old}k old rows' if old else ''}"
                f"{' + len() fix' if f.get('bench_patch_cached_len') else ''}"
                f"{' + group commit' if f.get('bench_patch_group_commit') else ''} "
                f"| {f['round_rate_hz']} | {f['messages_per_s_total']} | {f['duration_s']} "
                f"| {f['delivery_ratio']:.4%} ({f['delivered_gossip']}/{f['expected_deliveries']}; "
                f"{f['delivery_ratio_by_drain_deadline']:.2%} within round + {f['drain_s']:.0f} s) "
                f"| {f['min_receiver_ratio']:.4%} | {f['rounds_complete_before_repair']:.2%} "
                f"| {sm.get('decode', '-')} / {sm.get('admit/gossip', '-')} "
                f"| {lc.get('p50_ms')} / {lc.get('p99_ms')} | {pc.get('p50_ms')} / {pc.get('p99_ms')} "
                f"| {'complete' if f['ledger_complete_after_repair'] else 'INCOMPLETE'} "
                f"({f['repaired_messages']} repaired) "
                f"| {f['rss_python_mib_mean']} / {f['rss_p2pd_mib_mean']} "
                f"| {f['cpu_share_python_per_peer']:.1%} + {f['cpu_share_p2pd_per_peer']:.1%} "
                f"| {f['loadavg_start']} -> {f['loadavg_end']} |"
            )
        L.append("")
        L.append(
            "Decode and admit: mean time per gossip payload decoded and per admission batch "
            "(policy + SQLite commit, synchronous=FULL), from the nodes' own timing histograms "
            "(`seedflood_decode_seconds`, `seedflood_admit_seconds`); ledger commit = the "
            "update accepted at the receiver, i.e. ready to apply. "
            "Latency is measured from just before the sender's `FloodNode.publish` "
            "(which first commits its own ledger row). Delivery counts every update that "
            "reached the receiver by gossip before the explicit repair pass (anti-entropy is "
            "off while measuring); 'rounds complete' = share of (receiver, round) pairs with "
            "all n-1 updates by gossip. Topic peers and connections per peer at the end: "
            + "; ".join(
                f"{f['peers']} peers ({f['ledger_storage'].split()[0]}"
                f"{', prefilled' if f.get('ledger_prefilled_rows') else ''}"
                f"{', len() fix' if f.get('bench_patch_cached_len') else ''}"
                f"{', group commit' if f.get('bench_patch_group_commit') else ''}): "
                f"{f['topic_peers_at_go'][0]} topic peers, connections {f['connections_end']}"
                for f in res["flood"]
            )
            + ".\n"
        )
    if "bytes" in res:
        b = res["bytes"]
        L.append("## 2. Bytes on the wire per update per hop (byte-counting TCP proxy)\n")
        L.append(
            "| payload bytes | topic (bytes) | signed GossipSub message (wire_size) "
            "| bytes per hop (sender -> receiver) | reverse bytes per msg | received / published |"
        )
        L.append("|---|---|---|---|---|---|")
        for w in b["windows"]:
            L.append(
                f"| {w['payload_bytes']} | `{w['topic']}` ({w['topic_bytes']}) "
                f"| {w['wire_size_signed_message']} | {w['per_message_per_hop_bytes']} "
                f"| {w['reverse_per_message_bytes']} | {w['received']} / {w['published']} |"
            )
        L.append("")
        L.append(
            f"Idle traffic (subtracted): {b['idle_bytes_per_s_sender_to_receiver']} B/s one way, "
            f"{b['idle_bytes_per_s_receiver_to_sender']} B/s the other; proxy connections: "
            f"{b['proxy_connections']}. Identity: {b['identity']}.\n"
        )
    if "latejoin" in res:
        j = res["latejoin"]
        bld, rp, tg = j["build"], j["replay"], j["target"]
        for x in (
            rp,
            j.get("replay_default_threads_sample", {}),
            j.get("replay_2threads_passive_sample", {}),
        ):
            for new, old in (
                ("merge_ms_per_call_median", "merge_ms_per_epoch_median"),
                ("merge_ms_per_call_p90", "merge_ms_per_epoch_p90"),
                ("merge_calls", "epochs"),
            ):  # results written by older versions
                if new not in x and old in x:
                    x[new] = x[old]
        sd = j["sync"]["direct"]
        L.append(
            f"## 3. Late join: {j['rounds']:,} rounds x {j['peers']} peers = {bld['messages']:,} "
            "messages, SmolLM2-135M\n"
        )
        L.append(
            f"Run config: rank {bld['rank']}, refresh period {bld['refresh_period']} "
            f"({rp['epochs']} epochs), {rp['trainable_matrices']} trainable matrices, "
            f"{rp['trainable_params'] / 1e6:.1f}M trainable params; source ledger "
            f"{bld['ledger_file_mib']} MiB on disk.\n"
        )
        L.append("| step | wall s | notes |")
        L.append("|---|---|---|")
        L.append(
            f"| sync (repair protocol, loopback) | {sd['sync_s']} | {sd['synced_messages']:,} msgs "
            f"in {sd.get('sync_exchanges', 1)} repair exchange(s), "
            f"{sd['messages_per_s']:,} msg/s, {sd['fetch_calls']} fetch RPCs ({sd['fetch_rpc_s']} s incl. "
            f"donor), signature + payload checks {sd['check_envelope_s']} s, local validate + ledger "
            f"write {sd['accept_s']} s, digest RPC {sd['digest_rpc_s']} s; "
            f"ledger digest equals source: {sd['digest_equals_source']} |"
        )
        if "proxy" in j["sync"]:
            sp = j["sync"]["proxy"]
            L.append(
                f"| sync via counting proxy | {sp['sync_s']} | {sp['wire_bytes_donor_to_joiner']:,} B "
                f"on the wire = {sp['wire_bytes_per_message']} B/message (fetch payload "
                f"{sp['fetch_payload_bytes']:,} B) |"
            )
        if "verify_probe" in j["sync"]:
            vp = j["sync"]["verify_probe"]
            L.append(
                f"| probe: the {vp['rows']:,} signature checks alone | {vp['serial_s']} serial / "
                f"{vp['pool_s']} on a {vp['pool_workers']}-process pool | {vp['us_per_row_serial']} us per "
                f"row serially (CPU {vp['serial_cpu_s']} s); threads do not help (GIL held) |"
            )
        L.append(
            f"| no-op anti-entropy pass after sync | {sd['second_sync_noop_s']} | digests equal, "
            f"{sd['second_sync_new']} new |"
        )
        L.append(
            f"| **replay() total, 1 torch thread** | **{rp['replay_s']}** | CPU {rp['replay_cpu_s']} s |"
        )
        L.append(
            f"| - accumulate (fold into r x r cores) | {rp['accumulate_s']} | CPU {rp['cpu_s']['accumulate']} s |"
        )
        L.append(
            f"| - epoch merges ({rp['epochs']} epochs) | {rp['merge_total_s']} | CPU {rp['cpu_s']['merge']} s; "
            f"{rp['merge_calls']} merge calls: first {rp['merge_ms_first_epoch']} ms (copy-on-write faults on "
            f"the mmapped weights), median {rp['merge_ms_per_call_median']} ms, p90 "
            f"{rp['merge_ms_per_call_p90']} ms |"
        )
        L.append(
            f"| -- of which basis generation (Philox) | {rp['merge_basis_generation_s']} | "
            f"CPU {rp['cpu_s']['basis']} s, {rp['epochs']} epoch bases |"
        )
        L.append(
            f"| -- of which low-rank updates of W (rank {bld['rank']} per epoch) | {rp['merge_matmul_s']} | |"
        )
        L.append(
            f"| - other (ledger read, ordering checks) | {rp['other_s']} | ledger read alone "
            f"{rp['ledger_read_s']} s |"
        )
        for key, label in (
            ("replay_default_threads_sample", "torch default threads, OpenMP active wait"),
            ("replay_2threads_passive_sample", "2 threads, OMP_WAIT_POLICY=PASSIVE"),
        ):
            if key in j:
                x = j[key]
                L.append(
                    f"| replay() {label}: first {x['epochs']} epochs | {x['replay_s']} | "
                    f"-> {x.get('extrapolated_full_replay_s')} s for {rp['epochs']} epochs (linear "
                    "extrapolation: pessimistic, the sample's first merge carries the copy-on-write "
                    f"faults); median merge "
                    f"{x['merge_ms_per_call_median']} ms/call, threads {x['torch_threads']} |"
                )
        if "batched_merge_prototype" in rp:
            bp = rp["batched_merge_prototype"]
            L.append(
                f"| prototype: batched replay (1 thread) | {bp['total_s']} | CPU {bp['cpu_s']} s: accumulate "
                f"{bp['accumulate_s']} s, bases (1 Philox call per {bp['epoch_group']} epochs, bit-identical: "
                f"{bp['bases_bit_identical_to_layer_basis']}) {bp['basis_generation_s']} s, one rank-"
                f"{bp['epoch_group'] * bld['rank']} GEMM per matrix per {bp['epoch_group']} epochs "
                f"{bp['gemm_s']} s; max abs diff vs "
                f"replay {bp['max_abs_diff_vs_replay']:.2e} (largest update {bp['max_abs_update_by_replay']:.2e}) |"
            )
        L.append(
            f"| **sync + replay** | **{tg['sync_plus_replay_s']}** | target: fp32 download "
            f"{tg['fp32_weights_bytes'] / 1e6:.0f} MB at 100 Mbit/s = {tg['download_s_at_100_mbit']} s -> "
            f"**{'MET' if tg['met'] else 'MISSED'}** ({tg['ratio_to_target']}x target) |"
        )
        if "sync_plus_batched_replay_s" in tg:
            L.append(f"| sync + prototype batched replay | {tg['sync_plus_batched_replay_s']} | |")
        L.append(
            f"| (not counted) model load / base hash check | {rp['model_load_s']} / "
            f"{rp['base_hash_check_s']} | needed with either approach |"
        )
        for e in j.get("end_to_end_peer", []):
            L.append(
                f"| real `seedflood peer --threads 1` launch -> ready (min_peers={e['min_peers']}) | "
                f"{e['launch_to_ready_s']} | model from {e.get('ready_source')} "
                f"({e.get('ready_fetched')} fetched from peers) |"
            )
        if "probes" in rp:
            pr = rp["probes"]
            L.append("")
            L.append(
                f"Probes (1 thread, cache-warm 1536 x 576 matrix): layer_basis {pr['layer_basis_1536x576_ms']} ms; "
                f"rank-{bld['rank']} merge {pr['rank_r_merge_1536x576_ms']} ms "
                f"({pr['rank_r_merge_GB_per_s']} GB/s of W read+written); rank-400 GEMM "
                f"{pr['rank_400_gemm_gflops']} GFLOP/s."
            )
        L.append(f"\nLoad average during late join: {j['loadavg_start']} -> {j['loadavg_end']}.\n")
    path.write_text("\n".join(L) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    parser.add_argument(
        "--parts", default="flood,bytes,latejoin", help="comma-separated parts to run"
    )
    parser.add_argument("--peers", default="8,16", help="flood: comma-separated peer counts")
    parser.add_argument("--round-rate", type=float, default=3.0, help="rounds per second")
    parser.add_argument("--duration", type=float, default=None, help="seconds per flood run")
    parser.add_argument(
        "--jitter", type=float, default=1.0, help="publish offset, fraction of a round"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other parts' results of an earlier run in the output",
    )
    parser.add_argument(
        "--late-rounds",
        type=int,
        default=LATE_ROUNDS,
        help="rounds in the late-join ledger (x 8 peers)",
    )
    parser.add_argument(
        "--no-prefill",
        action="store_true",
        help="skip the 8-peer flood variant with 80,000 old rows in every ledger",
    )
    parser.add_argument(
        "--no-tmpfs",
        action="store_true",
        help="skip the flood variant with ledgers on tmpfs (/dev/shm)",
    )
    parser.add_argument(
        "--out", default=str(RESULTS / "network"), help="output path without suffix"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    duration = args.duration or (12.0 if args.quick else 45.0)
    period = 1.0 / args.round_rate
    rounds = int(round(duration / period))
    base = Path(tempfile.mkdtemp(prefix="bench_network_"))
    out = Path(args.out)
    previous = {}
    if args.merge and out.with_suffix(".json").exists():
        previous = json.loads(out.with_suffix(".json").read_text())
    res: dict = {
        **previous,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python", "bench/bench_network.py", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "loadavg_start": _loadavg(),
        "quick": args.quick,
        "workdir": str(base),
    }
    res.pop("runs", None)
    res["part_runs"] = {k: v for k, v in res.get("part_runs", {}).items() if k not in parts}
    for part in ("flood", "bytes", "latejoin"):
        if part in parts:
            res["part_runs"][part] = {"started": res["started"], "command": res["command"]}
    res["part_runs"] = dict(sorted(res["part_runs"].items()))
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["loadavg_end"] = _loadavg()
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))
        write_markdown(res, out.with_suffix(".md"))

    try:
        if "flood" in parts:
            res["flood"] = []
            configs = []
            for n in [int(x) for x in args.peers.split(",")]:
                configs += [(n, False, 0)] if args.no_tmpfs else [(n, False, 0), (n, True, 0)]
                if n == 8 and not args.no_prefill:
                    configs.append((n, False, 80_000))
            for n, tmpfs, prefill in configs:
                print(
                    f"flood: {n} peers, {rounds} rounds at {args.round_rate}/s, ledger "
                    f"{'tmpfs' if tmpfs else 'disk'}, prefilled {prefill}",
                    flush=True,
                )
                shm = None
                if tmpfs:
                    shm = tempfile.mkdtemp(prefix="bench_network_", dir="/dev/shm")
                try:
                    f = run_flood(n, rounds, period, args.jitter, base, shm, prefill)
                finally:
                    if shm:
                        shutil.rmtree(shm, ignore_errors=True)
                res["flood"].append(f)
                keys = (
                    "peers",
                    "ledger_storage",
                    "delivery_ratio",
                    "stage_mean_ms",
                    "latency_ledger_commit",
                    "ledger_complete_after_repair",
                )
                print(json.dumps({k: f[k] for k in keys}), flush=True)
                save()
        if "bytes" in parts:
            print("bytes per hop", flush=True)
            res["bytes"] = run_bytes(base, args.quick)
            print(json.dumps(res["bytes"]["windows"]), flush=True)
            save()
        if "latejoin" in parts:
            print("late join", flush=True)
            res["latejoin"] = run_latejoin(base, args.quick, args.late_rounds)
            print(json.dumps(res["latejoin"]["target"]), flush=True)
            save()
    finally:
        save()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


WORKERS = {
    "_flood-worker": lambda a: _run_loop(flood_worker(a)),
    "_bytes-worker": lambda a: _run_loop(bytes_worker(a)),
    "_build-ledger": build_ledger_worker,
    "_donor": lambda a: _run_loop(donor_worker(a)),
    "_joiner": lambda a: _run_loop(joiner_worker(a)),
    "_replay": replay_worker,
}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in WORKERS:
        WORKERS[sys.argv[1]](json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
