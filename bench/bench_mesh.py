#!/usr/bin/env python
"""GossipSub's mesh settings against N: p2pd alone, N nodes, one topic, a steady flood.

    python bench/bench_mesh.py [--peers 32,64,128] [--degree 4,6,8] [--history 5]
        [--heartbeat 1] [--links all|K] [--netns [--loss 5]] [--rate 30] [--seconds 20]
        [--out mesh]

What a daemon's GossipSub costs and how fast it delivers depends on the mesh settings
(degree D, history, heartbeat) and on the topology (how many peers each node is
connected to), and the settings' defaults were GossipSub's, not measured here at any N.
This bench takes the daemons' Python side out: N p2pd processes of our build
(network/transport/p2pd_build.py, one build per setting), started with a peer's flags,
each subscribed to the topic by this one process through its control socket. With
--netns each node is a host of deploy/netns-testnet.sh (its own namespace and address on
one bridge; --loss drops that share of the packets arriving at each host, by nftables
where the kernel has no netem, so TCP retransmits it: loss shows as latency). Per
setting, on the same running network of N hosts:

1. N daemons start (our build for the setting) and each dials --links others: every other
   node ("all": what a peer's reconnect loop does with every peer it hears of) or K at
   random (a sparse topology, as a link budget would keep).
2. mesh ready: from the last dial, node 0 publishes a probe every 0.25 s; the time until
   a probe reaches all N - 1 others (the heartbeat grafts the mesh).
3. idle: --idle seconds of nothing: p2pd CPU and bytes received per node per second
   (heartbeats, gossip, the DHT).
4. load: --rate messages a second, each from a node in turn, for --seconds, then --drain
   seconds. Per message: the share of the N - 1 others it reached, the latency from
   publish to each delivery (this process stamps both: one clock), and, beyond the idle
   rates, p2pd CPU and bytes received per node (with --netns: each host's eth0, frames
   with their headers). Bytes over one hop's bytes on the wire (a 2-node row measured
   first on the same network: one message, its framing and its ACK) estimate the copies
   a node takes in, gossip's IHAVE/IWANT included.

Writes bench/results/OUT.json after each setting (a rerun skips the settings it holds),
OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results"

from bench_ingest import cpu_seconds, rss_mib  # noqa: E402 (this folder's /proc readers)
from hivemind.proto import p2pd_pb2 as pb  # noqa: E402
from hivemind.utils.multiaddr import Multiaddr  # noqa: E402

from seedflood_p2p.network.transport.p2pd import bundled_p2pd, uvarint  # noqa: E402
from seedflood_p2p.network.transport.p2pd_build import MeshSettings, build  # noqa: E402
from seedflood_p2p.network.transport.pubsub import _read_frame as read_frame  # noqa: E402

TOPIC = "sf/0123456789abcdef"  # a run's topic is sf/<16 hex>
PAYLOAD = 40  # bytes: an update with a few scalars (13-52 B, DESIGN.md)
NETNS = ROOT / "deploy" / "netns-testnet.sh"
PREFIX, SUBNET = "sfmesh", "10.78.0"
PORT = 4001


@dataclass(frozen=True)
class Setting:
    peers: int
    degree: int
    history: int
    heartbeat: float
    links: str  # "all" or a count
    loss: float
    gossip_factor: float = 0.25  # GossipSub's

    @property
    def key(self) -> str:
        factor = "" if self.gossip_factor == 0.25 else f"-gf{self.gossip_factor:g}"
        return (
            f"n{self.peers}-d{self.degree}-h{self.history}-hb{self.heartbeat:g}"
            f"-l{self.links}-loss{self.loss:g}{factor}"
        )


# --- the control socket --------------------------------------------------------------------


class Node:
    """One p2pd process and this bench's two connections to it (requests, subscription)."""

    def __init__(self, index: int, socket_path: str, proc: subprocess.Popen, ip: str) -> None:
        self.index, self.socket, self.proc, self.ip = index, socket_path, proc, ip
        self.peer_id = b""
        self.addr = ""
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._sub: asyncio.StreamWriter | None = None

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, request: pb.Request) -> None:
        body = request.SerializeToString()
        writer.write(uvarint(len(body)) + body)
        await writer.drain()

    async def request(self, request: pb.Request, timeout: float = 30.0) -> pb.Response:
        async with self._lock:
            if self._conn is None:
                self._conn = await asyncio.open_unix_connection(self.socket)
            reader, writer = self._conn
            await self._send(writer, request)
            response = await asyncio.wait_for(read_frame(reader, pb.Response), timeout)
        if response.type != pb.Response.OK:
            raise RuntimeError(f"node {self.index}: p2pd refused: {response.error.msg}")
        return response

    async def identify(self) -> None:
        response = await self.request(pb.Request(type=pb.Request.IDENTIFY))
        self.peer_id = response.identify.id
        self.addr = f"/ip4/{self.ip}/tcp/{PORT}" if self.ip != "127.0.0.1" else ""
        if not self.addr:  # loopback: the port the daemon picked
            self.addr = next(
                str(a) for a in map(Multiaddr, response.identify.addrs) if "127.0.0.1" in str(a)
            )

    async def connect(self, other: Node) -> None:
        connect = pb.ConnectRequest(
            peer=other.peer_id, addrs=[Multiaddr(other.addr).to_bytes()], timeout=20
        )
        await self.request(pb.Request(type=pb.Request.CONNECT, connect=connect), timeout=40)

    async def publish(self, data: bytes) -> None:
        ps = pb.PSRequest(type=pb.PSRequest.PUBLISH, topic=TOPIC, data=data)
        await self.request(pb.Request(type=pb.Request.PUBSUB, pubsub=ps))

    async def connections(self) -> int:
        """Peers this daemon has a connection to (its own dials, ours, the DHT's)."""
        response = await self.request(pb.Request(type=pb.Request.LIST_PEERS))
        return len(response.peers)

    async def mesh_peers(self) -> int:
        ps = pb.PSRequest(type=pb.PSRequest.LIST_PEERS, topic=TOPIC)
        response = await self.request(pb.Request(type=pb.Request.PUBSUB, pubsub=ps))
        return len(response.pubsub.peerIDs)

    async def subscribe(self, on_message) -> asyncio.Task:
        reader, writer = await asyncio.open_unix_connection(self.socket)
        ps = pb.PSRequest(type=pb.PSRequest.SUBSCRIBE, topic=TOPIC)
        await self._send(writer, pb.Request(type=pb.Request.PUBSUB, pubsub=ps))
        response = await read_frame(reader, pb.Response)
        if response.type != pb.Response.OK:
            raise RuntimeError(f"node {self.index}: subscribe refused: {response.error.msg}")
        self._sub = writer

        async def pump() -> None:
            while True:
                message = await read_frame(reader, pb.PSMessage)
                on_message(self.index, message.data, time.monotonic())

        return asyncio.create_task(pump())

    def close(self) -> None:
        for writer in (self._sub, self._conn[1] if self._conn else None):
            if writer is not None:
                writer.close()


# --- processes and hosts -------------------------------------------------------------------


def host_rx_bytes(hosts: int) -> list[int] | None:
    """Bytes received on the eth0 of hosts 1..`hosts` (None on loopback): Ethernet frames,
    so headers and the ACKs of what a host sent count too."""
    if not hosts:
        return None
    out = []
    for i in range(1, hosts + 1):
        text = subprocess.run(
            ["ip", "-n", f"{PREFIX}-h{i}", "-s", "-j", "link", "show", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        out.append(json.loads(text)[0]["stats64"]["rx"]["bytes"])
    return out


def netns(*args: str, timeout: float = 900) -> str:
    done = subprocess.run(
        [str(NETNS), "--prefix", PREFIX, "--subnet", SUBNET, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        raise RuntimeError(f"netns-testnet.sh {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def start_daemons(binary: Path, setting: Setting, work: Path, hosts: int) -> list[Node]:
    """N p2pd with a peer's flags (`create_p2p`), heartbeat as set; in hosts 1..N or on
    loopback."""
    nodes = []
    for i in range(setting.peers):
        sock = str(work / f"p{i}.sock")
        ip = f"{SUBNET}.{i + 1}" if hosts else "127.0.0.1"
        argv = [
            str(binary),
            "-autoRelay=0",
            "-autonat=1",
            "-b=0",
            "-connManager=1",
            f"-listen=/unix{sock}",
            "-natPortMap=0",
            "-relay=1",
            "-relayHopLimit=0",
            "-tls=1",
            "-dhtServer=1",
            f"-hostAddrs=/ip4/{ip}/tcp/{PORT if hosts else 0}",
            "-pubsub=1",
            "-pubsubRouter=gossipsub",
            "-pubsubSign=1",
            "-pubsubSignStrict=1",
            "-relayService=0",
            f"-gossipsubHeartbeatInterval={max(1, round(setting.heartbeat * 1000))}ms",
        ]
        if hosts:
            argv = ["ip", "netns", "exec", f"{PREFIX}-h{i + 1}", *argv]
        log = open(work / f"p{i}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        nodes.append(Node(i, sock, proc, ip))
    return nodes


async def wait_sockets(nodes: list[Node], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for node in nodes:
        while not os.path.exists(node.socket):
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"p2pd {node.index} did not start (see its .log)")
            await asyncio.sleep(0.05)
    for node in nodes:
        for _ in range(100):
            try:
                await node.identify()
                break
            except OSError:
                await asyncio.sleep(0.1)


def stop_daemons(nodes: list[Node]) -> None:
    for node in nodes:
        node.close()
        if node.proc.poll() is None:
            node.proc.terminate()
    for node in nodes:
        try:
            node.proc.wait(10)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


def topology(n: int, links: str, rng: random.Random) -> list[tuple[int, int]]:
    """Pairs to dial: every pair, or each node dialling `links` others at random (so a
    node has about 2 x links connections)."""
    if links == "all":
        return [(i, j) for i in range(n) for j in range(i + 1, n)]
    k = min(int(links), n - 1)
    pairs = set()
    for i in range(n):
        for j in rng.sample([x for x in range(n) if x != i], k):
            pairs.add((min(i, j), max(i, j)))
    return sorted(pairs)


# --- one setting ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(setting: Setting, args, hosts: int) -> dict:
    mesh = MeshSettings(
        degree=setting.degree,
        history=setting.history,
        history_gossip=min(3, setting.history),
        gossip_factor=setting.gossip_factor,
    )
    binary = build(bundled_p2pd(), mesh)
    work = Path(tempfile.mkdtemp(prefix="mesh-", dir="/tmp"))
    rng = random.Random(f"{setting.key}")
    hosts = setting.peers if hosts else 0  # nodes 1..N of the network's hosts
    nodes = start_daemons(binary, setting, work, hosts)
    arrivals: dict[int, dict[int, float]] = {}  # message -> node -> arrival time
    sent: dict[int, tuple[int, float]] = {}  # message -> (publisher, publish time)

    def on_message(node: int, data: bytes, now: float) -> None:
        (number,) = struct.unpack_from(">q", data)
        arrivals.setdefault(number, {}).setdefault(node, now)

    pumps: list[asyncio.Task] = []
    try:
        t0 = time.monotonic()
        await wait_sockets(nodes)
        started = time.monotonic() - t0
        for node in nodes:
            pumps.append(await node.subscribe(on_message))
        pairs = topology(setting.peers, setting.links, rng)
        gate = asyncio.Semaphore(16)

        failures: list[str] = []

        async def dial(i: int, j: int) -> None:
            # A dial can fail on a lost SYN or handshake packet; libp2p then backs the
            # address off for 5 s, so the other side tries, then this one again.
            for attempt, (a, b) in enumerate([(i, j), (j, i), (i, j), (j, i)]):
                async with gate:
                    try:
                        await nodes[a].connect(nodes[b])
                        return
                    except (RuntimeError, TimeoutError) as exc:
                        failures.append(str(exc).splitlines()[0][:200])
                if attempt == 1:
                    await asyncio.sleep(6.0)
            raise RuntimeError(f"nodes {i} and {j} could not connect: {failures[-1]}")

        t0 = time.monotonic()
        await asyncio.gather(*(dial(i, j) for i, j in pairs))
        dialled = time.monotonic() - t0

        # mesh ready: probes from node 0 until one reaches everyone
        counter = iter(range(-1, -(10**9), -1))
        ready = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.ready_timeout:
            number = next(counter)
            sent[number] = (0, time.monotonic())
            await nodes[0].publish(struct.pack(">qd", number, 0.0).ljust(PAYLOAD, b"\0"))
            await asyncio.sleep(0.25)
            done = [m for m in sent if m < 0 and len(arrivals.get(m, {})) >= setting.peers - 1]
            if done:
                ready = sent[max(done)][1] - t0  # the latest-numbered (first sent) full one
                break
        mesh_sizes = [await node.mesh_peers() for node in nodes]
        await asyncio.sleep(max(2.0, 2 * setting.heartbeat))

        pids = [node.proc.pid for node in nodes]
        cpu0, rx0, t0 = sum(map(cpu_seconds, pids)), host_rx_bytes(hosts), time.monotonic()
        await asyncio.sleep(args.idle)
        cpu1, rx1, t1 = sum(map(cpu_seconds, pids)), host_rx_bytes(hosts), time.monotonic()
        idle_cpu_per_s = (cpu1 - cpu0) / (t1 - t0)  # all nodes
        idle_rx_per_s = None if rx0 is None else (sum(rx1) - sum(rx0)) / (t1 - t0)

        count = int(args.rate * args.seconds)
        order = [rng.randrange(setting.peers) for _ in range(count)]
        t_start = time.monotonic()
        publishes = []
        for number in range(count):
            due = t_start + number / args.rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            publisher = order[number]
            sent[number] = (publisher, time.monotonic())
            data = struct.pack(">qd", number, sent[number][1]).ljust(PAYLOAD, b"\0")
            publishes.append(asyncio.create_task(nodes[publisher].publish(data)))
        await asyncio.gather(*publishes)
        await asyncio.sleep(args.drain)
        cpu2, rx2, t2 = sum(map(cpu_seconds, pids)), host_rx_bytes(hosts), time.monotonic()
        rss = [rss_mib(p) for p in pids]
        conns = [await node.connections() for node in nodes]

        lat, reached = [], []
        for number in range(count):
            publisher, at = sent[number]
            got = {n: t for n, t in arrivals.get(number, {}).items() if n != publisher}
            reached.append(len(got) / (setting.peers - 1))
            lat.extend((t - at) * 1000 for t in got.values())
        span = t2 - t1
        load_cpu = (cpu2 - cpu1) - idle_cpu_per_s * span
        row = {
            "setting": asdict(setting),
            "started_s": round(started, 1),
            "dialled_s": round(dialled, 1),
            "dialled_per_node": round(2 * len(pairs) / setting.peers, 1),
            # what the daemons hold at the end: the kad DHT's refresh dials peers too
            "connections_per_node": round(statistics.mean(conns), 1),
            "dial_failures": len(failures),
            "mesh_ready_s": None if ready is None else round(ready, 2),
            "topic_peers_mean": round(statistics.mean(mesh_sizes), 1),
            "rate": args.rate,
            "messages": count,
            "delivered": round(sum(reached) / count, 5),
            "full_messages": round(sum(r >= 1.0 for r in reached) / count, 4),
            "latency_ms": {
                q: None if (v := percentile(lat, p)) is None else round(v, 1)
                for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
            },
            "idle_cpu_ms_per_node_s": round(1000 * idle_cpu_per_s / setting.peers, 2),
            "cpu_us_per_message_node": round(1e6 * load_cpu / (count * setting.peers), 1),
            "rss_mib_mean": round(statistics.mean(rss), 1),
        }
        if rx0 is not None:
            load_rx = (sum(rx2) - sum(rx1)) - idle_rx_per_s * span
            per = load_rx / (count * setting.peers)
            row["idle_rx_bytes_per_node_s"] = round(idle_rx_per_s / setting.peers, 1)
            row["rx_bytes_per_message_node"] = round(per, 1)
        return row
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        stop_daemons(nodes)
        shutil.rmtree(work, ignore_errors=True)


# --- report --------------------------------------------------------------------------------


def write_md(rows: dict, path: Path, note: str) -> None:
    lines = [
        "# GossipSub's mesh settings against N (p2pd alone)",
        "",
        note,
        "",
        "| N | D | history | gossip factor | heartbeat s | links dialled/node "
        "| connections/node | loss % "
        "| msgs/s | mesh ready s "
        "| delivered "
        "| p50 ms | p99 ms | max ms | bytes in /msg/node | hops in /msg/node "
        "| CPU us /msg/node | idle CPU ms/s/node | idle bytes/s/node | p2pd RSS MiB |",
        "|" + "---:|" * 20,
    ]
    for row in rows.values():
        s, lat = row["setting"], row["latency_ms"]
        lines.append(
            f"| {s['peers']} | {s['degree']} | {s['history']} "
            f"| {s.get('gossip_factor', 0.25):g} | {s['heartbeat']:g} "
            f"| {row.get('dialled_per_node', row['connections_per_node'])} "
            f"| {row['connections_per_node'] if 'dialled_per_node' in row else '-'} "
            f"| {s['loss']:g} | {row.get('rate', '-')} "
            f"| {row['mesh_ready_s']} "
            f"| {row['delivered']:.4f} | {lat['p50']} | {lat['p99']} | {lat['max']} "
            f"| {row.get('rx_bytes_per_message_node', '-')} "
            f"| {row.get('hops_in_per_message_node', '-')} "
            f"| {row['cpu_us_per_message_node']} | {row['idle_cpu_ms_per_node_s']} "
            f"| {row.get('idle_rx_bytes_per_node_s', '-')} | {row['rss_mib_mean']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(rows: dict, path: Path) -> None:
    """p99 latency, hops taken in and p2pd CPU per message per node: against D (a line per
    N and setting), and against N (a line per D and setting), where a series has 2+ rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    measures = (
        ("p99 latency (ms)", lambda r: r["latency_ms"]["p99"]),
        ("hops taken in per message per node", lambda r: r.get("hops_in_per_message_node")),
        ("p2pd CPU us per message per node", lambda r: r["cpu_us_per_message_node"]),
    )
    for line, (x_name, label_of) in enumerate(
        (
            ("degree", lambda s: f"N={s['peers']} links={s['links']}"),
            ("peers", lambda s: f"D={s['degree']}"),
        )
    ):
        series: dict[str, list] = {}
        for row in rows.values():
            s = row["setting"]
            if s["peers"] < 4:
                continue  # the calibration
            label = (
                f"{label_of(s)} gossip factor={s.get('gossip_factor', 0.25):g} "
                f"hb={s['heartbeat']:g}"
            )
            series.setdefault(label, []).append(row)
        for label, group in sorted(series.items()):
            if len(group) < 2:
                continue
            group.sort(key=lambda r: r["setting"][x_name])
            x = [r["setting"][x_name] for r in group]
            for ax, (_, value) in zip(axes[line], measures, strict=True):
                ax.plot(x, [value(r) for r in group], "o-", label=label)
        for ax, (title, _) in zip(axes[line], measures, strict=True):
            ax.set_xlabel("GossipSub degree D" if x_name == "degree" else "nodes N")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        if axes[line][0].lines:
            axes[line][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def calibration(loss: float) -> Setting:
    """Two nodes: each message crosses one TCP hop (and its ACK comes back), so the bytes
    both hosts receive per message are one hop's on the wire, the unit of `hops_in`."""
    return Setting(2, 6, 5, 1.0, "all", loss)


def add_hops(rows: dict) -> None:
    """Hops taken in per message per node: bytes over the calibration's bytes per message
    (both hosts), at the same loss."""
    for row in rows.values():
        s = row["setting"]
        unit = rows.get(calibration(s["loss"]).key, {}).get("rx_bytes_per_message_node")
        if unit and "rx_bytes_per_message_node" in row:
            row["hop_bytes"] = round(2 * unit, 1)
            row["hops_in_per_message_node"] = round(
                row["rx_bytes_per_message_node"] / (2 * unit), 2
            )


def parse_list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=parse_list(int), default=[32, 64])
    parser.add_argument("--degree", type=parse_list(int), default=[4, 6, 8])
    parser.add_argument("--history", type=parse_list(int), default=[5])
    parser.add_argument("--heartbeat", type=parse_list(float), default=[1.0])
    parser.add_argument("--links", type=parse_list(str), default=["all"], help="all or K")
    parser.add_argument(
        "--gossip-factor", type=parse_list(float), default=[0.25], help="GossipSub's: 0.25"
    )
    parser.add_argument("--netns", action="store_true", help="a host per node (root)")
    parser.add_argument("--loss", type=float, default=0.0, help="%% dropped per host, --netns")
    parser.add_argument("--rate", type=float, default=30.0, help="messages/s, all nodes")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--drain", type=float, default=5.0)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument("--setting-timeout", type=float, default=1200.0, help="s per setting")
    parser.add_argument("--out", default="mesh")
    parser.add_argument("--results", type=Path, default=OUT, help="folder of OUT.*")
    parser.add_argument("--summarize", action="store_true", help="only redo .md/.png")
    args = parser.parse_args()
    for links in args.links:
        if links != "all" and not links.isdigit():
            parser.error(f"--links {links!r}: give 'all' or a number of peers")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root (network namespaces)")
    if args.loss and not args.netns:
        parser.error("--loss needs --netns (loopback drops nothing)")
    if args.netns and max(args.peers) > 200:
        parser.error("--netns: at most 200 hosts (deploy/netns-testnet.sh)")
    results = args.results
    results.mkdir(parents=True, exist_ok=True)
    out_json = results / f"{args.out}.json"
    data = json.loads(out_json.read_text()) if out_json.exists() else {"rows": {}}
    rows = data["rows"]
    note = (
        f"`python bench/bench_mesh.py` (this file's docstring says what each column is); "
        f"{os.cpu_count()} cores; messages of {PAYLOAD} B on one topic; hops = bytes over one "
        "hop's bytes on the wire (the 2-node row at the same loss: message, framing, ACK)."
    )
    if not args.summarize:
        for n in args.peers:
            hosts = n if args.netns else 0
            todo = [
                Setting(n, d, h, hb, links, args.loss if args.netns else 0.0, gf)
                for gf in args.gossip_factor
                for links in args.links
                for hb in args.heartbeat
                for h in args.history
                for d in args.degree
            ]
            if args.netns:  # one hop's bytes, measured first: 2 nodes, each message 1 hop
                todo.insert(0, calibration(args.loss))
            todo = [s for s in todo if s.key not in rows]
            if not todo:
                continue
            if hosts:
                netns("down", "--kill")
                up = ["--hosts", str(hosts)] + (["--loss", f"{args.loss:g}%"] if args.loss else [])
                netns(*up, "up")
            try:
                for setting in todo:
                    print(f"{setting.key}: running", flush=True)
                    row = asyncio.run(
                        asyncio.wait_for(measure(setting, args, hosts), args.setting_timeout)
                    )
                    rows[setting.key] = row
                    add_hops(rows)
                    out_json.write_text(json.dumps(data, indent=1))
                    lat = row["latency_ms"]
                    print(
                        f"{setting.key}: delivered {row['delivered']:.4f}, ready "
                        f"{row['mesh_ready_s']} s, p50/p99 {lat['p50']}/{lat['p99']} ms, "
                        f"hops in {row.get('hops_in_per_message_node', '-')}, CPU "
                        f"{row['cpu_us_per_message_node']} us/msg/node",
                        flush=True,
                    )
            finally:
                if hosts:
                    netns("down", "--kill")
    add_hops(rows)
    write_md(rows, results / f"{args.out}.md", note)
    plot(rows, results / f"{args.out}.png")
    print(f"wrote {results / args.out}.json, .md, .png")


if __name__ == "__main__":
    main()
