"""Peer-to-peer training across separate network namespaces ("hosts" on a private bridge).

deploy/netns-testnet.sh builds 4 namespaced hosts on 10.77.0.0/24 (with a netem delay of
20 ms per host egress when the kernel has netem). A bootstrap node runs in h1, three peers
in h2..h4, each listening only on its host's address, so every byte between them crosses
a veth pair and the bridge instead of loopback. They train a tiny model for ROUNDS rounds
and every ledger (the three peers' and the bootstrap's) must end bit-identical.

Needs root and `ip netns` (skips, naming what is missing, otherwise). Everything is torn
down in a finally: processes are stopped by PID, then the namespaces are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from harness.cluster import peer_flags, run_toml
from harness.partition import NamespaceNet
from seedflood_p2p.apps.localnet import NodeProcess
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow

PREFIX = f"sft{os.getpid() % 100000}"  # unique per test process: never touches other testnets
SUBNET = "10.77.0"
NET = NamespaceNet(PREFIX, SUBNET)  # deploy/netns-testnet.sh
HOSTS = 4  # h1: bootstrap, h2..h4: peers
DELAY = "20ms"
ROUNDS = 12
BOOT_PORT = 31337
METRICS_PORT = 9100  # the same port on every host: each namespace has its own loopback
PEER_FLAGS = peer_flags(
    until_round=ROUNDS,
    round_interval=0.4,
    max_staleness=2,
    round_deadline=5,
    liveness_timeout=4,
    linger=6,
    min_peers=3,  # the bootstrap node and the two other peers
    startup_wait=30,
    threads=1,
)


def _requirements() -> tuple[str | None, bool, str]:
    """(reason to skip or None, netem available, check output)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux", False, ""
    if os.geteuid() != 0:
        return "needs root (creating network namespaces needs CAP_SYS_ADMIN)", False, ""
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install -y iproute2)", False, ""
    check = NET.net("check", check=False)
    report = (check.stdout + check.stderr).strip()
    if check.returncode != 0:
        missing = [line for line in report.splitlines() if line.endswith(": no")]
        return f"`ip netns` testnet unavailable ({'; '.join(missing) or report})", False, report
    return None, "netem: yes" in report, report


def _in_host(host: str, code: str, timeout: float = 30) -> str:
    """Run a Python snippet inside a host; return its stdout."""
    return NET.net("exec", host, sys.executable, "-c", code, timeout=timeout).stdout


_RTT_CODE = """
import socket, time
best = 1e9
for _ in range(5):
    s = socket.socket(); s.settimeout(5); t = time.perf_counter()
    try:
        s.connect(("{ip}", 9))  # closed port: the RST ends the round trip
    except OSError:
        pass
    best = min(best, time.perf_counter() - t); s.close()
print(best * 1000)
"""

_STATUS_CODE = """
import urllib.request
print(urllib.request.urlopen("http://127.0.0.1:{port}/status", timeout=5).read().decode())
"""


def test_training_across_namespaced_hosts(tmp_path):
    skip, netem, report = _requirements()
    if skip:
        pytest.skip(skip)
    started = time.monotonic()
    procs: list[NodeProcess] = []
    try:
        up = NET.net("--hosts", str(HOSTS), *(["--delay", DELAY] if netem else []), "up")
        print(up.stderr.strip())
        rtt_ms = float(_in_host("h2", _RTT_CODE.format(ip=f"{SUBNET}.3")))
        if netem:  # one delay per direction
            assert rtt_ms >= 2 * 20 * 0.9, f"netem delay not in effect: RTT {rtt_ms:.1f} ms"
        # The hosts have no route out of the testnet (checked without sending anything).
        route = NET.net("exec", "h2", "ip", "route", "get", "192.0.2.1", check=False)
        assert route.returncode != 0 and "unreachable" in route.stderr, route

        boot, address = NET.start_bootstrap(
            "h1",
            [
                "bootstrap",
                "--config",
                str(run_toml(tmp_path)),
                "--listen",
                f"/ip4/{SUBNET}.1/tcp/{BOOT_PORT}",
                "--data-dir",
                str(tmp_path / "bootstrap"),
                "--metrics-port",
                str(METRICS_PORT),
            ],
            tmp_path,
        )
        procs.append(boot)
        assert address.startswith(f"/ip4/{SUBNET}.1/tcp/{BOOT_PORT}/p2p/"), address

        peers = {}
        for i in range(2, HOSTS + 1):
            name = f"peer{i}"
            peers[name] = NET.process(
                f"h{i}",
                name,
                [
                    "peer",
                    "--bootstrap",
                    address,
                    "--listen",
                    f"/ip4/{SUBNET}.{i}/tcp/0",
                    "--data-dir",
                    str(tmp_path / name),
                    "--metrics-port",
                    str(METRICS_PORT),
                    *PEER_FLAGS,
                ],
                tmp_path,
            )
            procs.append(peers[name])

        peers["peer2"].wait_round(3, timeout=150)
        status = json.loads(_in_host("h2", _STATUS_CODE.format(port=METRICS_PORT)))
        assert status["peers_alive"] >= 2, status  # heard both other peers across the bridge

        codes = {n: p.wait_exit(timeout=120) for n, p in peers.items()}
        assert all(code == 0 for code in codes.values()), {
            n: (c, peers[n].tail()) for n, c in codes.items()
        }
        finals = {n: json.loads((tmp_path / n / "final_status.json").read_text()) for n in peers}
        boot.stop()
        with Ledger.open_existing(tmp_path / "bootstrap" / "ledger.sqlite") as ledger:
            boot_digest, boot_count = ledger.digest(), len(ledger)
            trained: dict[bytes, list[int]] = {}
            for m in ledger.messages():
                trained.setdefault(m.peer, []).append(m.round)
        digests = {n: f["ledger_digest"] for n, f in finals.items()}
        digests["bootstrap"] = boot_digest
        assert len(set(digests.values())) == 1, digests
        # Every peer trained every round from its first to the last, with no gap. A peer
        # that became ready a few seconds after another (--min-peers counts the connected
        # nodes of the run, loading ones too) starts at the round the run is in
        # (latejoin.start_round), so not every peer need start at round 0.
        assert len(trained) == HOSTS - 1, trained.keys()
        for rounds in trained.values():
            assert sorted(rounds) == list(range(min(rounds), ROUNDS)), rounds
        assert min(min(r) for r in trained.values()) == 0, trained
        assert all(f["round"] == ROUNDS for f in finals.values()), finals
        shaping = f"netem delay {DELAY}" if netem else "no netem"
        print(
            f"netns testnet: {HOSTS} hosts, {shaping}"
            f", RTT h2->h3 {rtt_ms:.2f} ms, {boot_count} messages, identical ledger digest "
            f"{boot_digest[:16]}, {time.monotonic() - started:.1f} s"
        )
        if not netem:
            print("netem unavailable here: " + report.replace("\n", "; "))
    finally:
        for p in procs:
            p.stop()
        down = NET.net("--kill", "down", check=False)
        assert down.returncode == 0, down.stderr


_UDP_RECV = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
s.bind(("{ip}", 40000)); s.settimeout({wait}); got = 0
print("ready", flush=True)
try:
    while True:
        s.recv(64); got += 1
except socket.timeout:
    pass
print(got)
"""

_UDP_SEND = """
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range({n}):
    s.sendto(b"x", ("{ip}", 40000)); time.sleep(0.0003)
"""


def _exec_prefix(net: NamespaceNet, host: str) -> list[str]:
    return [str(net.script), "--prefix", net.prefix, net.subnet_flag, net.subnet, "exec", host]


def test_loss_drops_that_share_of_the_packets_between_hosts():
    """`--loss 5%` loses about 5% of the packets from one host to another: by netem where
    the kernel has it, by the nftables rule otherwise (this machine's kernel lacks netem)."""
    skip, netem, report = _requirements()
    if skip:
        pytest.skip(skip)
    if not netem and "nft loss: yes" not in report:
        pytest.skip(f"neither netem nor nftables here: {report}")
    net = NamespaceNet(f"sfl{os.getpid() % 100000}", "10.76.0")
    n, ip = 10_000, "10.76.0.2"
    try:
        up = net.net("--hosts", "2", "--loss", "5%", "--require-netem", "up")
        assert ("netem" if netem else "nftables loss 5%") in up.stderr, up.stderr
        receiver = subprocess.Popen(
            [*_exec_prefix(net, "h2"), sys.executable, "-c", _UDP_RECV.format(ip=ip, wait=3)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert receiver.stdout.readline().strip() == "ready"
        net.net("exec", "h1", sys.executable, "-c", _UDP_SEND.format(n=n, ip=ip), timeout=60)
        got = int(receiver.communicate(timeout=30)[0].split()[-1])
        loss = 100 * (1 - got / n)
        # binomial SE at 5% of 10,000 is 0.22 points: these bounds are 7 SE away
        assert 3.5 <= loss <= 6.5, f"{got} of {n} arrived: {loss:.2f}% lost, not ~5%"
        how = "netem" if netem else "nftables"
        print(f"--loss 5%: {loss:.2f}% of {n} UDP packets lost ({how})")
    finally:
        net.net("down", "--kill", check=False)
