"""The ingest ceiling of one peer daemon (issue 46 item 1): pre-signed, valid updates from
M Ed25519 identities flooded at rising rates into one real `seedflood peer` and its p2pd.

    PYTHONPATH=. python bench/bench_ingest.py --model tiny-llama --directions 1 16 \
        --identities 1000 10000 [--rates 250 500 1000 2000 4000] [--seconds 8]
    PYTHONPATH=. python bench/bench_ingest.py --bare ...        # control: p2pd alone
    PYTHONPATH=. python bench/bench_ingest.py --stages-only ... # the stage costs alone

Setup per (model, k): a bootstrap node creates an open run (no founders, no allow list,
no tickets: every identity counts; audits on, the default), a peer daemon joins it
(`--round-interval` paces its own training), and once the peer is ready the bootstrap
node is stopped, so the peer's p2pd has no mesh peer to forward to and nothing else on
the machine receives the flood. The publisher (this process) starts its own p2pd (plain
hivemind P2P: no pubsub router of its own, which would reset the stream below when it
reopened its own), dials the peer and opens a raw "/meshsub/1.1.0" stream to it
(bench/raw_gossip.py), and writes one signed GossipSub message per RPC, as a forwarding
neighbour does, paced in ticks of 5 ms. Message i of a step is identity i mod M's update
of round base + i // M: one update per identity and round (M = 1,000 at 2,000/s is 2
updates/s per identity, under SENDER_RATE), rounds from the peer's own round, so every
update is inside the window; k float16 scalars in [-1, 1] and a held-state digest
(audited runs carry one). Signing happens before the timed part.

Per step: `sent`, `in_ledger` (rows of those rounds by those identities after the flood
drained: lost = sent - in_ledger), arrival -> ledger latency (the send time of message j
of round r against the first poll of the peer's ledger, read-only, every 5 ms, whose count
of round r reached j + 1: in-order matching, ~5 ms resolution), CPU seconds of the
daemon's Python process (and of its event-loop thread apart) and of its p2pd
(/proc/PID/stat utime + stime, before and after, the idle rate of a quiet window before
the first step subtracted), the daemon's own histograms (/metrics, wall time: decode,
admit, apply) and RSS. The rates rise until a step loses over 5% or sends below 90% of
its rate; the highest lossless step is the row's ceiling.

Stage costs (`stage_micro`): the daemon's own functions run in this process on the same
kind of updates, CPU time per update (STAGE_NOTE). py-spy on the live daemon was tried:
on this machine its samples include threads blocked in fsync, so it over-attributes.

Rows go to bench/results/ingest.json (keyed by model, k, M) as each finishes; a rerun
skips finished rows (--force redoes them). ingest.md is written from the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import raw_gossip as rg  # noqa: E402

# p2pd's queues that drop a message when full (NodeSettings / MeshSettings field names)
QUEUES = ("validation_queue", "subscription_buffer", "inbound_queue", "outbound_queue")

from seedflood_p2p.apps.localnet import NodeProcess, start_bootstrap, start_peer  # noqa: E402
from seedflood_p2p.core.config import RunConfig  # noqa: E402
from seedflood_p2p.protocol.framing import topic_for  # noqa: E402
from seedflood_p2p.protocol.message import quantize_scalars  # noqa: E402
from seedflood_p2p.protocol.update import encode_update  # noqa: E402

OUT = ROOT / "bench" / "results"
TICK = 0.005  # seconds between the publisher's writes
POLL = 0.005  # seconds between ledger polls
CLK = os.sysconf("SC_CLK_TCK")
MAX_MESSAGES = 120_000  # per step


def run_config(model: str, k: int) -> RunConfig:
    if model == "tiny-llama":
        return RunConfig(
            model="tiny-llama",
            dataset="synthetic-sentiment",
            rank=4,
            refresh_period=5,
            lr=8e-3,
            n_ref=4,
            batch_size=max(8, k),
            directions=k,
            salt="bench-ingest",
        )
    return RunConfig(
        model=model,
        dataset="mr",
        max_length=32,
        batch_size=max(8, k),
        directions=k,
        salt="bench-ingest",
    )


# -- processes ---------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid` (tid -> seconds); the main thread's tid is pid."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            out[int(task.name)] = cpu_seconds_of(task / "stat")
    return out


def cpu_seconds_of(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def memory(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024  # MiB
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                out += [int(c) for c in kids]
                todo += [int(c) for c in kids]
    return out


def p2pd_of(pid: int) -> int:
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == "p2pd":
                return child
    raise RuntimeError(f"no p2pd under process {pid}")


def rss_mib(pid: int) -> float:
    """VmRSS of `pid`, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.read().decode()


def metric_sums(port: int) -> dict[str, float]:
    """The daemon's stage histograms: {name: seconds} and {name_count: n}."""
    wanted = {
        "seedflood_decode_seconds": "decode",
        'seedflood_admit_seconds{source="gossip"}': "admit",
        "seedflood_apply_seconds": "apply",
    }
    out: dict[str, float] = {}
    for line in http(port, "/metrics").splitlines():
        name, _, number = line.rpartition(" ")
        for prefix, stage in wanted.items():
            base, _, labels = prefix.partition("{")
            for suffix in ("_sum", "_count"):
                if name == base + suffix + ("{" + labels if labels else ""):
                    out[stage + suffix] = float(number)
    return out


class Daemon:
    """A run's bootstrap node and one peer; the bootstrap node stopped once the peer is
    ready, so the peer is alone with the publisher."""

    def __init__(self, work: Path, config: RunConfig, round_interval: float) -> None:
        from seedflood_p2p.network.transport.identity import load_or_create_identity

        self.work = work
        self.config = config
        boot, address = start_bootstrap(work, config)
        peer_dir = work / "peer"
        peer_dir.mkdir(parents=True)
        self.peer_id = load_or_create_identity(peer_dir / "identity.key")
        port = free_port()
        self.address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{self.peer_id.to_base58()}"
        flags = [
            *("--round-interval", str(round_interval), "--metrics-port", "0"),
            *("--listen", f"/ip4/127.0.0.1/tcp/{port}"),
        ]
        self.proc: NodeProcess = start_peer(work, "peer", address, flags)
        try:
            self._wait_ready()
        finally:
            boot.stop()
        self.pid = self.proc.proc.pid
        self.p2pd = p2pd_of(self.pid)
        self.ledger = peer_dir / "ledger.sqlite"

    def _wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        self.port = None
        while True:
            for event in self.proc.events():
                if event.get("event") == "http":
                    self.port = event["port"]
                if event.get("event") == "ready" and self.port is not None:
                    return
            if not self.proc.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the peer did not get ready:\n{self.proc.tail()}")
            time.sleep(0.3)

    def status(self) -> dict:
        return json.loads(http(self.port, "/status"))

    def snapshot(self) -> dict:
        return {
            "t": time.monotonic(),
            "daemon_cpu": cpu_seconds(self.pid),
            "threads": thread_cpu(self.pid),
            "p2pd_cpu": cpu_seconds(self.p2pd),
            "daemon_mem": memory(self.pid),
            "p2pd_mem": memory(self.p2pd),
            "metrics": metric_sums(self.port),
        }

    def stop(self) -> None:
        self.proc.stop(timeout=60)


# -- the flood ---------------------------------------------------------------------------
def build_step(ids, run_id: str, k: int, base: int, count: int, seq0: int, rng) -> list[bytes]:
    """`count` single-message RPC frames: message i is ids[i % M]'s update of round
    base + i // M, signed; seqnos from seq0."""
    topic = topic_for(run_id)
    frames = []
    m = len(ids)
    for i in range(count):
        scalars = quantize_scalars(rng.uniform(-1, 1, k))
        held = int(rng.integers(1 << 40, 1 << 63))
        data = encode_update(run_id, base + i // m, scalars, held)
        frames.append(rg.rpc(publish=[rg.signed_message(ids[i % m], data, seq0 + i, topic)]))
    return frames


class LedgerPoller(threading.Thread):
    """Counts the step's rows per round in the peer's ledger every POLL seconds (read-only,
    only when another connection committed: PRAGMA data_version), and notes when each
    count was first seen."""

    def __init__(
        self, path: Path, run_id: str, base: int, last: int, own: bytes, expected: Counter
    ) -> None:
        super().__init__(daemon=True)
        self.expected = expected  # round -> rows the step sends
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.run_id, self.base, self.last, self.own = run_id, base, last, own
        self.seen: dict[int, list[tuple[float, int]]] = {}  # round -> [(time, count)]
        self.counts: dict[int, int] = {}
        self.stop_flag = threading.Event()

    def poll(self) -> None:
        lo = self.base
        while lo <= self.last and self.counts.get(lo, 0) >= self.full(lo):
            lo += 1
        if lo > self.last:
            return
        rows = self.db.execute(
            "SELECT round, count(*) FROM messages WHERE round BETWEEN ? AND ? "
            f"AND peer IS NOT {OWN_NUMBER} GROUP BY round",  # the file holds one run
            (lo, min(self.last, lo + 4), self.own),
        ).fetchall()
        now = time.monotonic()
        for round_, n in rows:
            if n > self.counts.get(round_, 0):
                self.counts[round_] = n
                self.seen.setdefault(round_, []).append((now, n))

    def full(self, round_: int) -> int:
        return self.expected.get(round_, 0)

    def run(self) -> None:
        version = None
        while not self.stop_flag.is_set():
            v = self.db.execute("PRAGMA data_version").fetchone()[0]
            if v != version:
                version = v
                with contextlib.suppress(sqlite3.OperationalError):
                    self.poll()
            time.sleep(POLL)
        self.db.close()


async def flood(stream: rg.RawStream, frames: list[bytes], rate: float, limit: float):
    """Write frames at `rate` per second (ticks of TICK); each frame's send time. Stops
    after `limit` seconds whatever was sent."""
    sent_at = np.zeros(len(frames))
    t0 = time.monotonic()
    sent = 0
    while sent < len(frames):
        now = time.monotonic()
        if now - t0 > limit:
            break
        due = min(len(frames), int((now - t0) * rate) + 1)
        if due > sent:
            await stream.send(b"".join(frames[sent:due]))
            sent_at[sent:due] = now
            sent = due
        await asyncio.sleep(max(0.0, t0 + (sent / rate) - time.monotonic(), TICK / 5))
    return sent_at[:sent], time.monotonic() - t0


# `messages` names a row's peer by its number in `peers` (storage/ledger.py); the file holds
# one run (`run_id` stays an argument for the callers).
OWN_NUMBER = "(SELECT id FROM peers WHERE peer = ?)"


def latencies(poller: LedgerPoller, sent_at: np.ndarray, base: int, m: int) -> np.ndarray:
    out = []
    for i, t in enumerate(sent_at):
        round_, j = base + i // m, i % m
        for seen_t, n in poller.seen.get(round_, []):
            if n >= j + 1:
                out.append(seen_t - t)
                break
    return np.array(out)


def ledger_rows(path: Path, run_id: str, base: int, last: int, own: bytes) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return db.execute(
            "SELECT count(*) FROM messages WHERE round BETWEEN ? AND ? "
            f"AND peer IS NOT {OWN_NUMBER}",
            (base, last, own),
        ).fetchone()[0]


def thread_split(before, after, pid, idle, window, per) -> dict[str, float]:
    """The daemon's CPU per update: its event-loop thread (receive, decode, admission,
    SQLite commits, /status) and its other threads (the model thread: training, apply,
    audits; torch's and asyncio's worker threads), each with its idle rate subtracted."""
    main = after["threads"].get(pid, 0.0) - before["threads"].get(pid, 0.0)
    rest = sum(v - before["threads"].get(t, 0.0) for t, v in after["threads"].items() if t != pid)
    return {
        "event loop": round((main - idle["main"] * window) / per * 1e6, 1),
        "other threads": round((rest - idle["rest"] * window) / per * 1e6, 1),
    }


async def step(
    daemon: Daemon,
    stream: rg.RawStream,
    ids,
    rate: float,
    seconds: float,
    state: dict,
    idle: dict,
    publisher_p2pd: int,
) -> dict:
    run_id = daemon.run_id
    m = len(ids)
    count = min(MAX_MESSAGES, int(rate * seconds))
    base = max(state["next_round"], daemon.status()["round"])
    rng = np.random.default_rng(state["seq"])
    t_sign = time.monotonic()
    frames = build_step(ids, run_id, daemon.config.directions, base, count, state["seq"], rng)
    sign_s = time.monotonic() - t_sign
    last = base + (count - 1) // m
    state["seq"] += count
    state["next_round"] = last + 1
    own = daemon.peer_id.to_bytes()
    expected = Counter(base + i // m for i in range(count))
    poller = LedgerPoller(daemon.ledger, run_id, base, last, own, expected)
    load = os.getloadavg()[0]
    before = daemon.snapshot()
    pub_before = cpu_seconds(publisher_p2pd)
    poller.start()
    spy = start_profile(state.get("profile"), daemon.pid, f"{run_id[:8]}-r{int(rate)}", seconds)
    sent_at, send_s = await flood(stream, frames, rate, seconds * 1.5 + 5)
    sent = len(sent_at)
    # drain: until every row is in, or nothing new for 3 s (at most 60 s)
    quiet_since, total, deadline = time.monotonic(), -1, time.monotonic() + 60
    while time.monotonic() < deadline:
        now_total = sum(poller.counts.values())
        if now_total >= sent:
            break
        if now_total != total:
            total, quiet_since = now_total, time.monotonic()
        elif time.monotonic() - quiet_since > 3.0:
            break
        await asyncio.sleep(0.05)
    after = daemon.snapshot()
    pub_after = cpu_seconds(publisher_p2pd)
    profile = finish_profile(spy)
    poller.stop_flag.set()
    poller.join(5)
    in_ledger = ledger_rows(daemon.ledger, run_id, base, last, own)
    lat = latencies(poller, sent_at[: min(sent, in_ledger + m)], base, m)
    window = after["t"] - before["t"]
    daemon_cpu = after["daemon_cpu"] - before["daemon_cpu"] - idle["daemon"] * window
    p2pd_cpu = after["p2pd_cpu"] - before["p2pd_cpu"] - idle["p2pd"] * window
    per = max(in_ledger, 1)
    metrics = {
        k: after["metrics"].get(k, 0.0) - before["metrics"].get(k, 0.0) for k in after["metrics"]
    }
    row = {
        "rate": rate,
        "sent": sent,
        "send_seconds": round(send_s, 2),
        "offered_rate": round(sent / send_s, 1) if send_s else 0.0,
        "in_ledger": in_ledger,
        "lost": sent - in_ledger,
        "accepted_rate": round(in_ledger / max(send_s, 1e-9), 1),
        "rounds": [base, last],
        "latency_ms": {
            "p50": round(float(np.percentile(lat, 50)) * 1e3, 1) if len(lat) else None,
            "p99": round(float(np.percentile(lat, 99)) * 1e3, 1) if len(lat) else None,
            "max": round(float(lat.max()) * 1e3, 1) if len(lat) else None,
            "matched": len(lat),
        },
        "window_s": round(window, 2),
        "daemon_cpu_s": round(daemon_cpu, 3),
        "p2pd_cpu_s": round(p2pd_cpu, 3),
        "daemon_cpu_us_per_update": round(daemon_cpu / per * 1e6, 1),
        "daemon_threads_us_per_update": thread_split(before, after, daemon.pid, idle, window, per),
        "p2pd_cpu_us_per_update": round(p2pd_cpu / per * 1e6, 1),
        "publisher_p2pd_cpu_us_per_update": round((pub_after - pub_before) / per * 1e6, 1),
        "stage_us_per_update": {
            "decode (histogram)": round(metrics.get("decode_sum", 0) / per * 1e6, 1),
            "admit: policy + SQLite + hand-on (histogram)": round(
                metrics.get("admit_sum", 0) / per * 1e6, 1
            ),
            "apply: SubCGE accumulate + commit, per round (histogram)": round(
                metrics.get("apply_sum", 0) / per * 1e6, 1
            ),
        },
        "admit_batches": metrics.get("admit_count", 0),
        "apply_rounds": metrics.get("apply_count", 0),
        "daemon_rss_mib": after["daemon_mem"].get("VmRSS"),
        "daemon_peak_rss_mib": after["daemon_mem"].get("VmHWM"),
        "p2pd_rss_mib": after["p2pd_mem"].get("VmRSS"),
        "sign_seconds": round(sign_s, 2),
        "load": round(load, 2),
    }
    if profile is not None:
        row["profile"] = profile
    print(
        f"  rate {rate:>6}/s  sent {sent:>6} in {send_s:5.1f} s  ledger {in_ledger:>6}  "
        f"lost {row['lost']:>5}  p50/p99 {row['latency_ms']['p50']}/{row['latency_ms']['p99']} ms"
        f"  daemon {row['daemon_cpu_us_per_update']} us/upd  p2pd "
        f"{row['p2pd_cpu_us_per_update']} us/upd",
        flush=True,
    )
    return row


# -- where the live daemon's CPU goes: py-spy, samples of the thread holding the GIL ------
def start_profile(folder: Path | None, pid: int, name: str, seconds: float):
    """py-spy recording the daemon for the flood's `seconds` (collapsed stacks, only
    samples whose thread holds the GIL: Python CPU, not threads waiting in fsync or on
    the GIL). None if no folder was asked for."""
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.txt"
    cmd = ["py-spy", "record", "--gil", "--rate", "250", "--format", "raw", "--nonblocking"]
    cmd += ["--duration", str(int(seconds + 1)), "--pid", str(pid), "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, out


def _frame(frame: str) -> str:
    """py-spy's "function (path/file.py:line)" as "function file.py:line"."""
    name, _, where = frame.partition(" (")
    return f"{name.split(' ')[0]} {where.rstrip(')').rsplit('/', 1)[-1]}"


def finish_profile(spy) -> dict | None:
    """The recording's top functions by self samples and by inclusive samples."""
    if spy is None:
        return None
    proc, out = spy
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    if not out.exists():
        return {"error": "py-spy wrote nothing (is ptrace allowed?)"}
    own, inclusive, total = Counter(), Counter(), 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    share = lambda c: [[f, round(n / max(total, 1), 3)] for f, n in c.most_common(25)]  # noqa: E731
    return {"samples": total, "file": str(out), "self": share(own), "inclusive": share(inclusive)}


# -- stage costs: the daemon's own functions, CPU time in this process ----------------------
STAGE_NOTE = (
    "Each stage is the daemon's own function, run in the bench process on updates like the "
    "flood's (CPU time by time.process_time, per update; wall time where it differs: the "
    "fsync): pubsub delivery = pubsub._read_frame of p2pd's PSMessage frame, "
    "Subscription._convert, the queue and the Envelope; decode = decode_update; admission = "
    "Admission.gossip minus Ledger.add (sender rules, window, policy, counters); SQLite = "
    "Ledger.add (WAL, synchronous=FULL, one transaction per batch of B); audit draw = "
    "audit_rules.selects (every accepted update), live peers = PeerTable.live_count over M "
    "peers (its index; DaemonAudits counts at most once a second); SubCGE = accumulate of one "
    "round of M updates, apply = LiveModel.apply (accumulate + commit) of that round; "
    "signature = verify_pubsub_signature (for gossip p2pd makes this check in Go, inside "
    "its CPU; Python makes it for repair rows)."
)


def _cpu(fn) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of fn()."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def _ledger_stages(work, run_id, k, own, batch, arrivals, messages, envelopes):
    """CPU of Admission.gossip and of Ledger.add alone (and its wall time), in batches of
    `batch`, each on a fresh ledger file."""
    from seedflood_p2p.network.gossip.admission import Admission
    from seedflood_p2p.network.monitoring.metrics import NodeMetrics
    from seedflood_p2p.storage.ledger import Ledger

    n = len(messages) if batch > 1 else min(len(messages), 500)  # one fsync a row: keep it short
    gossip_ledger = Ledger(work / f"g{batch}.sqlite", run_id)
    add_ledger = Ledger(work / f"a{batch}.sqlite", run_id)
    admission = Admission(gossip_ledger, k, own, NodeMetrics(), 10)
    chunks = range(0, n, batch)
    g_cpu, _ = _cpu(lambda: [admission.gossip(arrivals[j : j + batch]) for j in chunks])
    a_cpu, a_wall = _cpu(
        lambda: [add_ledger.add(messages[j : j + batch], envelopes[j : j + batch]) for j in chunks]
    )
    if not len(gossip_ledger) == n == len(add_ledger):
        raise RuntimeError("the stage benchmark lost rows")
    return g_cpu / n, a_cpu / n, a_wall / n


def stage_micro(model: str, k: int, m: int, run_id: str, n: int = 4000) -> dict:
    """CPU us per update of each stage of the daemon's receive path (STAGE_NOTE)."""
    from hivemind.proto import p2pd_pb2 as pb

    from seedflood_p2p.algorithm.audit_rules import selects
    from seedflood_p2p.network.transport import pubsub as ps
    from seedflood_p2p.protocol.message import Envelope, UpdateMessage
    from seedflood_p2p.protocol.update import decode_update

    ids = rg.make_identities(min(m, n), "stages")
    peers = [i.peer_id for i in ids]
    topic = topic_for(run_id)
    rng = np.random.default_rng(1)
    datas, rounds = [], []
    for i in range(n):
        scalars = quantize_scalars(rng.uniform(-1, 1, k))
        rounds.append(5 + i // m)
        datas.append(
            encode_update(run_id, rounds[-1], scalars, int(rng.integers(1 << 40, 1 << 62)))
        )
    seqnos = [(i + 1).to_bytes(8, "big") for i in range(n)]
    sigs = [rng.bytes(64) for _ in range(n)]
    senders = [peers[i % len(peers)] for i in range(n)]
    out: dict[str, object] = {}
    us = lambda seconds: round(seconds / n * 1e6, 1)  # noqa: E731

    # pubsub delivery: p2pd's frames through the subscription's reader, converter and queue
    stream = b""
    for i in range(n):
        msg = pb.PSMessage(data=datas[i], seqno=seqnos[i], topicIDs=[topic], signature=sigs[i])
        setattr(msg, "from", senders[i])
        body = msg.SerializeToString()
        stream += rg.uvarint(len(body)) + body

    async def deliver() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(stream)
        sub = ps.Subscription(None, topic, True, 1 << 20)
        queue: asyncio.Queue = asyncio.Queue()
        for _ in range(n):
            queue.put_nowait(sub._convert(await ps._read_frame(reader, pb.PSMessage)))
            item = queue.get_nowait()
            Envelope(item.data, item.seqno_bytes, item.signature)

    cpu, _ = _cpu(lambda: asyncio.run(deliver()))
    out["pubsub delivery"] = us(cpu)
    cpu, _ = _cpu(lambda: [decode_update(datas[i], run_id, senders[i], k) for i in range(n)])
    out["decode"] = us(cpu)

    messages = [decode_update(datas[i], run_id, senders[i], k) for i in range(n)]
    envelopes = [Envelope(datas[i], seqnos[i], sigs[i]) for i in range(n)]
    own = rg.make_identities(1, "own")[0].peer_id
    work = Path(tempfile.mkdtemp(prefix="ingest-stages-"))
    try:
        arrivals = list(zip(senders, envelopes, strict=True))
        for batch in (1, 16, 256):
            g_cpu, a_cpu, a_wall = _ledger_stages(
                work, run_id, k, own, batch, arrivals, messages, envelopes
            )
            out[f"admission (B={batch})"] = round((g_cpu - a_cpu) * 1e6, 1)
            out[f"SQLite (B={batch})"] = f"{a_cpu * 1e6:.1f} ({a_wall * 1e6:.0f} wall)"
    finally:
        shutil.rmtree(work, ignore_errors=True)

    secret = bytes(range(64))
    key = bytes.fromhex(run_id)
    cpu, _ = _cpu(lambda: [selects(secret, key, senders[i], rounds[i], 1e-4) for i in range(n)])
    out["audit draw"] = us(cpu)
    from seedflood_p2p.protocol.update import quorum_round

    claims = {i: 5 + (i % 3) for i in range(m)}  # Admission.claims: one per identity
    reps = 50
    c = time.process_time()
    for _ in range(reps):
        quorum_round(claims.values())
    out["quorum round, per batch"] = round((time.process_time() - c) / reps * 1e6, 1)
    from seedflood_p2p.network.gossip.peer_table import PeerTable

    table = PeerTable()
    for i in range(m):
        table.heard(i.to_bytes(38, "big"), 5, time.monotonic())
    reps = 200
    c = time.process_time()
    for _ in range(reps):
        table.live_count(time.monotonic(), 60.0)
    out["live peers, per batch"] = round((time.process_time() - c) / reps * 1e6, 1)

    # SubCGE: one round of M updates into the cores, and apply (accumulate + commit)
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.workload.models import load_model

    net, _tok = load_model(model)
    engine = make_estimator(net, run_config(model, k))
    round_msgs = [
        UpdateMessage(
            7,
            peers[i % len(peers)] if m <= len(peers) else rg.ed25519_peer_id(i.to_bytes(32, "big")),
            messages[i % n].scalars,
        )
        for i in range(m)
    ]
    cpu, _ = _cpu(lambda: engine.accumulate(round_msgs))
    out["SubCGE accumulate"] = round(cpu / m * 1e6, 1)
    live = LiveModel(make_estimator(net, run_config(model, k)))
    cpu, wall = _cpu(lambda: live.apply(round_msgs))
    out["apply (accumulate + commit), per update of a round of M"] = round(cpu / m * 1e6, 1)
    out["matrices"] = len(engine.matrices)
    return out


def verify_micro(n: int = 2000) -> float:
    """us per Ed25519 GossipSub signature check in Python (the check repair makes; p2pd
    makes the same check in Go for every gossip message before Python sees it)."""
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature

    ids = rg.make_identities(16, "verify")
    topic = "sf/0123456789abcdef"
    items = []
    for i in range(n):
        data = b"\x95\x03\xc4\x04abcd\x05\xc4\x02\x00<\xcf" + bytes(8)
        body_seq = i.to_bytes(8, "big")
        msg = rg.signed_message(ids[i % 16], data, i, topic)
        sig = msg[-64:]
        items.append((ids[i % 16].peer_id, data, body_seq, topic, sig))
    t = time.process_time()  # CPU time: the machine is shared
    for item in items:
        if not verify_pubsub_signature(*item):
            raise RuntimeError("a signature of raw_gossip did not verify")
    return (time.process_time() - t) / n * 1e6


# -- one row: (model, k, M) -------------------------------------------------------------------
async def measure(args, model: str, k: int, ms: list[int], done: dict, out_json: Path) -> None:
    from hivemind.p2p import P2P

    config = run_config(model, k)
    work = Path(tempfile.mkdtemp(prefix=f"ingest-{model}-k{k}-"))
    interval = args.round_interval or (1.0 if model == "tiny-llama" else 10.0)
    print(f"{model} k={k}: starting the run in {work} (round interval {interval} s)", flush=True)
    daemon = Daemon(work, config, interval)
    publisher = None
    try:
        run_id = daemon.status()["run_id"]  # the bootstrap node hashed the base into it
        daemon.run_id = run_id
        publisher = await P2P.create(
            initial_peers=[daemon.address], host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        publisher_p2pd = publisher._child.pid
        stream = await rg.open_raw_stream(publisher, daemon.peer_id, topic_for(run_id))
        state = {"next_round": 0, "seq": 1, "profile": args.profile}
        # the idle rate of both processes (training at its interval, repair, status)
        await asyncio.sleep(2)
        a = daemon.snapshot()
        await asyncio.sleep(args.idle_seconds)
        b = daemon.snapshot()
        span = b["t"] - a["t"]
        main = daemon.pid
        idle = {
            "daemon": (b["daemon_cpu"] - a["daemon_cpu"]) / span,
            "p2pd": (b["p2pd_cpu"] - a["p2pd_cpu"]) / span,
            "main": (b["threads"].get(main, 0) - a["threads"].get(main, 0)) / span,
        }
        idle["rest"] = idle["daemon"] - idle["main"]
        print(f"  idle: daemon {idle['daemon']:.3f} cores, p2pd {idle['p2pd']:.3f}", flush=True)
        for m in ms:
            key = f"{model}/k{k}/M{m}"
            if key in done["rows"] and not args.force:
                print(f"  {key}: done, skipped", flush=True)
                continue
            t_ids = time.monotonic()
            ids = rg.make_identities(m)
            print(f"  M={m}: {m} identities in {time.monotonic() - t_ids:.1f} s", flush=True)
            steps = []
            for rate in args.rates:
                row = await step(
                    daemon, stream, ids, rate, args.seconds, state, idle, publisher_p2pd
                )
                steps.append(row)
                await asyncio.sleep(args.pause)
                if row["lost"] > 0.05 * row["sent"] or row["offered_rate"] < 0.9 * rate:
                    break  # past the ceiling: one overloaded step shows what is lost
            ok = [s for s in steps if not s["lost"] and s["offered_rate"] >= 0.9 * s["rate"]]
            best = max(ok, key=lambda s: s["rate"]) if ok else None
            status = daemon.status()
            done["rows"][key] = {
                "model": model,
                "k": k,
                "identities": m,
                "run_id": run_id,
                "round_interval_s": interval,
                "idle_cores": {k2: round(v, 4) for k2, v in idle.items()},
                "ceiling": best,
                "steps": steps,
                "daemon_status": {
                    "dropped": status.get("dropped"),
                    "accepted": status.get("accepted"),
                    "ledger_messages": status.get("ledger_messages"),
                    "round": status.get("round"),
                },
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            out_json.write_text(json.dumps(done, indent=1))
            write_md(done, out_json.with_suffix(".md"))
        await stream.close()
    finally:
        if publisher is not None:
            await publisher.shutdown()
        daemon.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


# -- control: p2pd alone, its subscriber only counting ---------------------------------------
async def bare_p2pd(
    rates: list[float],
    seconds: float,
    m: int,
    k: int = 1,
    queues: int = 32,
    profile: bool = False,
    seen_ttl: float = 120.0,
) -> list[dict]:
    """The same flood into a p2pd whose only subscriber (our PubSubClient) counts arrivals
    and drops them: what p2pd delivers without a daemon behind it, and its CPU; with
    `profile`, p2pd's own CPU profile of each step (Go's pprof, bench/pprof.py)."""
    import urllib.request

    import pprof
    from hivemind.p2p import P2P

    from seedflood_p2p.network.transport.p2pd import create_p2p
    from seedflood_p2p.network.transport.p2pd_build import MeshSettings
    from seedflood_p2p.network.transport.pubsub import PubSubClient

    run_id = "ab" * 32
    topic = topic_for(run_id)
    mesh = MeshSettings(seen_ttl=seen_ttl, **{name: queues for name in QUEUES})
    pprof_port = free_port() if profile else None
    target = await create_p2p(
        identity_path=None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        mesh=mesh,
        extra_flags={"pprof": True, "pprofPort": pprof_port} if profile else None,
    )

    def cpu_profile(span: float) -> bytes:
        url = f"http://127.0.0.1:{pprof_port}/debug/pprof/profile?seconds={max(1, int(span))}"
        with urllib.request.urlopen(url, timeout=span + 30) as reply:
            return reply.read()

    publisher = None
    rows = []
    try:
        client = PubSubClient(target)
        sub = await client.subscribe(topic)
        got = {"n": 0}

        async def count() -> None:
            async for _ in sub:
                got["n"] += 1

        counter = asyncio.create_task(count())
        addrs = [str(a) for a in await target.get_visible_maddrs()]
        publisher = await P2P.create(initial_peers=addrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        stream = await rg.open_raw_stream(publisher, target.peer_id, topic)
        ids = rg.make_identities(m)
        target_pid = target._child.pid
        base, seq = 10, 1
        for rate in rates:
            count_ = int(rate * seconds)
            frames = build_step(ids, run_id, k, base, count_, seq, np.random.default_rng(seq))
            base, seq = base + count_ // m + 1, seq + count_
            start, cpu0 = got["n"], cpu_seconds(target_pid)
            profiling = asyncio.to_thread(cpu_profile, seconds) if profile else None
            profiling = asyncio.ensure_future(profiling) if profiling else None
            sent_at, send_s = await flood(stream, frames, rate, seconds * 1.5 + 5)
            quiet = time.monotonic()
            last = got["n"]
            while got["n"] - start < len(sent_at) and time.monotonic() - quiet < 3.0:
                await asyncio.sleep(0.05)
                if got["n"] != last:
                    last, quiet = got["n"], time.monotonic()
            arrived = got["n"] - start
            row = {
                "rate": rate,
                "sent": len(sent_at),
                "offered_rate": round(len(sent_at) / send_s, 1),
                "delivered": arrived,
                "lost": len(sent_at) - arrived,
                "p2pd_cpu_us_per_update": round(
                    (cpu_seconds(target_pid) - cpu0) / max(arrived, 1) * 1e6, 1
                ),
            }
            row["p2pd_rss_mib"] = rss_mib(target_pid)  # the seen cache holds seen_ttl s of ids
            if profiling is not None:
                row["p2pd_profile"] = pprof.top(await profiling)
            print(f"  bare p2pd: {row}", flush=True)
            rows.append(row)
            await asyncio.sleep(2)
        counter.cancel()
        await stream.close()
        await client.close()
    finally:
        if publisher is not None:
            await publisher.shutdown()
        await target.shutdown()
    return rows


# -- the table -------------------------------------------------------------------------------
def write_md(done: dict, path: Path) -> None:
    lines = [
        "# Ingest ceiling of one peer daemon (issue 46 item 1)",
        "",
        "Commands (each row is resumable: a rerun skips finished rows):",
        "",
        *[f"    {c}" for c in done.get("commands", [])],
        "",
        f"Machine: {done['machine']}. Rows finished before 2026-12-04 shared it with other "
        "work (load average 9-35 on 2 cores); the rows of 2026-12-04 ran with nothing else "
        "on it but the bench (its publisher, the daemon and their two p2pd); each step's "
        "1-minute load average at its start is in the JSON (`load`). Rates and latencies "
        "stay noisy (an audit's recomputation or a round's apply can hold the GIL for a "
        "while, so a step below the ceiling may lose a few updates); CPU per update is the "
        "steadier figure. One `seedflood peer` (audits on, open run, its "
        "bootstrap node stopped once it was ready: no mesh peer to forward to) fed by a raw "
        "/meshsub/1.1.0 stream of pre-signed updates from M identities, one message per RPC, "
        "at rising rates, 8 s a step. CPU per update: /proc utime+stime of the daemon's "
        "Python process (its event-loop thread apart) and of its p2pd over the step, each "
        "one's idle rate subtracted (training at the round interval, repair, status), divided "
        "by the rows that reached the ledger. Latency: publisher write -> row visible in the "
        "ledger (read-only poll every 5 ms). admit: the daemon's own histogram "
        "`seedflood_admit_seconds{gossip}`, wall time (policy, SQLite commit with its fsync, "
        "hand-on), per update. Lost updates: the daemon's admission dropped none (its "
        "`dropped` counters stayed 0 in every row), so every loss is inside p2pd or between "
        "p2pd and the daemon (GossipSub's validation and subscription queues drop when full: "
        f"{done.get('p2pd_queues', 32)} deep in these rows, GossipSub's default 32 unless set "
        "with --p2pd-queues in our p2pd build); with no other peer holding them, repair "
        "cannot bring them back here.",
        "",
        "| model | k | M | offered /s | accepted /s | lost | p50 / p99 ms | daemon CPU us/upd "
        "(event loop) | p2pd CPU us/upd | admit wall us/upd | admit calls | RSS daemon (peak) / "
        "p2pd MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in done["rows"].values():
        for s in row["steps"]:
            st = list(s["stage_us_per_update"].values())
            loop = s.get("daemon_threads_us_per_update", {}).get("event loop")
            mark = " **ceiling**" if row["ceiling"] == s else ""
            lines.append(
                f"| {row['model']} | {row['k']} | {row['identities']:,} | {s['offered_rate']:,.0f}"
                f"{mark} | {s['accepted_rate']:,.0f} | {s['lost']} | "
                f"{s['latency_ms']['p50']} / {s['latency_ms']['p99']} | "
                f"{s['daemon_cpu_us_per_update']:.0f} ({loop:.0f}) | "
                f"{s['p2pd_cpu_us_per_update']:.0f} | {st[1]:.0f} | {s['admit_batches']:.0f} | "
                f"{s['daemon_rss_mib']:.0f} ({s['daemon_peak_rss_mib']:.0f}) / "
                f"{s['p2pd_rss_mib']:.0f} |"
            )
    lines += ["", "## Ceilings", ""]
    lines += ["| model | k | M | highest lossless rate /s | p50 / p99 ms | daemon + p2pd us/upd |"]
    lines += ["|---|---|---|---|---|---|"]
    for row in done["rows"].values():
        c = row["ceiling"]
        if c is None:
            lines.append(f"| {row['model']} | {row['k']} | {row['identities']:,} | none | | |")
            continue
        lines.append(
            f"| {row['model']} | {row['k']} | {row['identities']:,} | {c['offered_rate']:,.0f} | "
            f"{c['latency_ms']['p50']} / {c['latency_ms']['p99']} | "
            f"{c['daemon_cpu_us_per_update']} + {c['p2pd_cpu_us_per_update']} |"
        )
    profiled = [(row, s) for row in done["rows"].values() for s in row["steps"] if s.get("profile")]
    if profiled:
        lines += ["", "## Where the live daemon's CPU goes (py-spy, `--profile`)", ""]
        lines += [
            "Samples of the thread holding the GIL (`py-spy record --gil`, 250 Hz, over the "
            "flood), at each row's first step past its ceiling (the last step if none): the "
            "functions with the most samples of their own, as a share of all samples.",
            "",
            "| model | k | M | rate /s | lost | top functions (own samples) |",
            "|---|---|---|---|---|---|",
        ]
        for row in done["rows"].values():
            steps = [s for s in row["steps"] if s.get("profile", {}).get("self")]
            if not steps:
                continue
            rate = row["ceiling"]["rate"] if row["ceiling"] else -1
            s = next((x for x in steps if x["rate"] > rate), steps[-1])
            top = ", ".join(f"`{f}` {share:.0%}" for f, share in s["profile"]["self"][:6])
            lines.append(
                f"| {row['model']} | {row['k']} | {row['identities']:,} | {s['rate']:,.0f} | "
                f"{s['lost']} | {top} |"
            )
    if done.get("stages"):
        lines += ["", "## CPU per update by stage (this process, time.process_time)", ""]
        lines += [STAGE_NOTE, ""]
        names = list(next(iter(done["stages"].values())))
        lines += ["| stage | " + " | ".join(done["stages"]) + " |"]
        lines += ["|---|" + "---|" * len(done["stages"])]
        for name in names:
            cells = [str(v.get(name, "")) for v in done["stages"].values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if done.get("verify_us") is not None:
        lines += [
            "",
            f"Ed25519 GossipSub signature check in Python (`verify_pubsub_signature`, "
            "libsodium, OpenSSL only for its no since the eighteenth session, CPU time): "
            f"{done['verify_us']:.1f} us each. For gossip "
            "p2pd makes this check in Go (inside its CPU above) before Python sees the "
            "message; Python makes it for repair rows only.",
        ]
    for m, rows in done.get("bare", {}).items():
        lines += [
            "",
            f"## Control: p2pd alone (a subscriber that only counts), {m}, k = 1, p2pd queues "
            f"{done.get('p2pd_queues', 32)}, seen TTL {done.get('seen_ttl', 120.0):g} s",
            "",
            "| offered /s | delivered | lost | p2pd CPU us/upd | p2pd RSS after MiB |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['offered_rate']:,.0f} | {r['delivered']} | {r['lost']} | "
                f"{r['p2pd_cpu_us_per_update']} | {r.get('p2pd_rss_mib', '-')} |"
            )
        profiled = [r for r in rows if r.get("p2pd_profile")]
        if profiled:
            lines += [
                "",
                "Where p2pd's CPU goes (Go's own CPU profile over each step, `-pprof`, "
                "bench/pprof.py): the functions with the most samples of their own (self) and "
                "on the stack (inclusive), as shares of the step's samples.",
                "",
                "| offered /s | samples | top self | top inclusive |",
                "|---|---|---|---|",
            ]

            def cell(pairs: list) -> str:
                return ", ".join(f"`{fn.rsplit('/', 1)[-1]}` {v:.0%}" for fn, v in pairs[:6])

            for r in profiled:
                prof = r["p2pd_profile"]
                lines.append(
                    f"| {r['offered_rate']:,.0f} | {prof['samples']} | {cell(prof['self'])} | "
                    f"{cell(prof['inclusive'])} |"
                )
    if done.get("bytes"):
        lines += ["", "## Bytes per hop by part", ""]
        lines += ["| part | " + " | ".join(done["bytes"]) + " |"]
        lines += ["|---|" + "---|" * len(done["bytes"])]
        parts = list(next(iter(done["bytes"].values())))
        for part in parts:
            lines.append(
                f"| {part} | " + " | ".join(str(v[part]) for v in done["bytes"].values()) + " |"
            )
    if done.get("bytes"):
        lines += ["", FLOOR_NOTE]
    if done.get("reading"):
        lines += ["", "## Reading", "", done["reading"]]
    # Sections written by hand after the generated ones ("## After ...": the fast paths'
    # before/after, bench_accumulate.py) are kept.
    old = path.read_text() if path.exists() else ""
    kept = old[old.find("\n## After") :] if "\n## After" in old else ""
    path.write_text("\n".join(lines) + "\n" + kept)


FLOOR_NOTE = (
    "Per hop: the signed GossipSub message (its parts above; the public key is inside the "
    "38-byte peer id, so no `key` field), its RPC framing, and ~30 B of yamux (12 B header) "
    "and Noise (2 B length, 16 B tag) when each message is its own write (bench_network.py "
    "measured 35 B around the RPC at 192 B per hop for an 18-byte payload). Payloads here "
    "are an audited run's (held digest, 9 B) at rounds >= 128 (3-byte round). **The floor "
    "with the signature the ledger must keep:** inside GossipSub only the payload can shrink "
    "(its 4-byte run tag and version repeat what the topic says: ~6 B), so ~192 B at k = 1. "
    "With a wire format of our own that still lets any peer check a row offline, a row needs "
    "the 32-byte public key (the peer id's 6-byte prefix is constant), the 64-byte "
    "signature, the round (1-3 B), 2k B of scalars and the 8-byte held digest: about 108 B "
    "at k = 1 and 138 B at k = 16 with ~3 B of framing, plus the transport's ~30 B per "
    "write (shared when several messages go in one write); naming the sender by an index "
    "into a per-connection table of keys saves ~30 B more on the wire (the ledger keeps "
    "each key once). The signature is the floor's largest part: 64 of ~108 B."
)


def byte_table(run_id: str) -> dict:
    topic = topic_for(run_id)
    out = {}
    for k in (1, 16):
        data = encode_update(run_id, 1000, (0.5,) * k, (1 << 63) - 5)
        parts = rg.message_parts(len(data), topic)
        total = sum(parts.values())
        parts = {p: round(v, 1) for p, v in parts.items()}
        parts["signed message + RPC framing"] = round(total, 1)
        # yamux frame header 12 B + Noise record (2 B length, 16 B tag) per write, one
        # message per write: what bench_network.py measured as 35 B around the RPC
        parts["yamux + Noise (one message a write)"] = 30
        parts["per hop"] = round(total + 30, 1)
        out[f"k={k} (payload {len(data)} B)"] = parts
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--directions", type=int, nargs="+", default=[1])
    ap.add_argument("--identities", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 2000, 4000, 8000])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--pause", type=float, default=3.0)
    ap.add_argument("--idle-seconds", type=float, default=6.0)
    ap.add_argument("--round-interval", type=float, default=0.0)
    ap.add_argument("--no-stages", action="store_true", help="skip the stage benchmarks")
    ap.add_argument("--stages-only", action="store_true", help="only (re)run the stage benchmarks")
    ap.add_argument(
        "--bare", action="store_true", help="only the control: p2pd with a counting subscriber"
    )
    ap.add_argument("--out", default="ingest")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directories")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="record py-spy (GIL samples) on the daemon during each step into this folder",
    )
    ap.add_argument(
        "--p2pd-queues",
        type=int,
        default=None,
        help="p2pd's validation queue, subscription buffer, inbound and outbound queues "
        "(our p2pd build; the daemon gets them as SEEDFLOOD_* settings); default GossipSub's 32",
    )
    ap.add_argument(
        "--seen-ttl",
        type=float,
        default=120.0,
        help="s a message id stays seen in p2pd (our build; GossipSub's default 120)",
    )
    ap.add_argument(
        "--p2pd-profile",
        action="store_true",
        help="with --bare: p2pd's own CPU profile of each step (-pprof; bench/pprof.py)",
    )
    args = ap.parse_args()
    random.seed(0)
    out_json = OUT / f"{args.out}.json"
    if args.p2pd_queues is not None:
        for name in QUEUES:
            os.environ[f"SEEDFLOOD_{name.upper()}"] = str(args.p2pd_queues)
    done = json.loads(out_json.read_text()) if out_json.exists() else {"rows": {}}
    command = "PYTHONPATH=. python bench/bench_ingest.py " + " ".join(sys.argv[1:])
    done.pop("command", None)
    if command not in done.setdefault("commands", []):
        done["commands"].append(command)
    done["machine"] = f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    done["p2pd_queues"] = args.p2pd_queues or 32
    done["seen_ttl"] = args.seen_ttl
    os.environ["SEEDFLOOD_SEEN_TTL"] = str(args.seen_ttl)
    if done.get("verify_us") is None or args.stages_only:
        done["verify_us"] = verify_micro()
    if args.bare:
        for m in args.identities:
            done.setdefault("bare", {})[f"M{m}"] = asyncio.run(
                bare_p2pd(
                    args.rates,
                    args.seconds,
                    m,
                    queues=args.p2pd_queues or 32,
                    seen_ttl=args.seen_ttl,
                    profile=args.p2pd_profile,
                )
            )
        out_json.write_text(json.dumps(done, indent=1))
        write_md(done, out_json.with_suffix(".md"))
        return
    for k in args.directions:
        if not args.stages_only:
            asyncio.run(measure(args, args.model, k, args.identities, done, out_json))
        run_id = next(
            (
                r["run_id"]
                for r in done["rows"].values()
                if r["model"] == args.model and r["k"] == k
            ),
            None,
        )
        if not args.no_stages and run_id is not None:
            done.setdefault("stages", {})
            for m in args.identities:
                label = f"{args.model} k={k} M={m:,}"
                if label not in done["stages"] or args.force or args.stages_only:
                    print(f"stage benchmarks: {label}", flush=True)
                    done["stages"][label] = stage_micro(args.model, k, m, run_id)
        if not done.get("bytes"):
            any_row = next(iter(done["rows"].values()), None)
            if any_row:
                done["bytes"] = byte_table(any_row["run_id"])
        out_json.write_text(json.dumps(done, indent=1))
        write_md(done, out_json.with_suffix(".md"))


if __name__ == "__main__":
    main()
