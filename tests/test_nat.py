"""Peers behind NAT, in network namespaces with nftables masquerade: a relayed link between
two NATed peers, then a direct one after a hole punch, and training with identical ledgers.

deploy/netns-nat-testnet.sh builds the hosts: pubN on a public bridge, with public-looking
addresses (libp2p announces circuit addresses only through a relay's public addresses,
and AutoNAT ignores private ones), and priv1, priv2, each behind its own NAT router (nat1,
nat2: masquerade, which keeps the source port; no port forwarding; unsolicited packets
dropped). The two NATed hosts cannot reach each other directly (checked with TCP
connects). Every node runs with the default settings: the bootstrap node serves a relay
(`relay_service = "auto"`), the NATed peers reserve on it once AutoNAT calls them private.

1. `test_two_nated_peers_relay_then_hole_punch`: the bootstrap node, a public peer and two
   bare p2pd relays (pub3, pub4: public peers that opted in to relaying, given to the NATed
   peers with --relays). go-libp2p trusts its own observed public address only once 4
   peers reported it, and starts DCUtR only then, so the NATed peers need 4 public
   contacts. Asserted: each NATed peer announces a /p2p-circuit address; the two connect
   through a relay within RELAYED_WITHIN s of both being ready; they get a direct
   connection (hole punch) within DIRECT_WITHIN s of the relayed one; the bootstrap node
   (their main relay) is then stopped and training goes on (ROUNDS_AFTER_STOP rounds, then
   every peer finishes at one round); every peer ledger identical.
2. `test_nated_peers_that_reach_only_the_relay_train_together`: the bootstrap node is the
   only public host. The NATed peers connect through it (one observer: no hole punch) and
   all three ledgers end identical.

Needs root, `ip netns` and nftables (`apt-get install -y nftables`, done by .ci/run):
skips only if network namespaces cannot be created at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cluster import run_toml
from harness.partition import METRICS_PORT, NamespaceNet
from seedflood_p2p.apps.localnet import NodeProcess
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "netns-nat-testnet.sh"
RELAY_NODE = ROOT / "bench" / "bench_nat.py"  # `node relay ...`: a bare p2pd relay
PREFIX = f"sfn{os.getpid() % 100000}"  # unique per test process
PUBLIC = "11.78.0"  # public-looking: see deploy/netns-nat-testnet.sh
NET = NamespaceNet(PREFIX, PUBLIC, SCRIPT, "--public-subnet")
BOOT_PORT = 31337
NAT_PEER_PORT = 4001  # fixed, so the "cannot reach each other" check knows where to knock
CIRCUIT_WITHIN = 60.0  # seconds after round 1 for a NATed peer to announce a relay address
RELAYED_WITHIN = 30.0  # seconds after both NATed peers are ready
DIRECT_WITHIN = 90.0  # seconds after the relayed link (hole-punch redials start at 20 s)
ROUNDS_AFTER_STOP = 10  # rounds the NATed peers train on after their main relay stopped


def _peer_flags(rounds: int, interval: float) -> list[str]:
    return [
        "--until-round",
        str(rounds),
        "--round-interval",
        str(interval),
        "--max-staleness",
        "2",
        "--round-deadline",
        "5",
        "--liveness-timeout",
        "6",
        "--linger",
        "8",
        "--repair-interval",
        "1",
        "--min-peers",
        "1",
        "--startup-wait",
        "30",
        "--threads",
        "1",
        "--metrics-port",  # each namespace has its own loopback: NamespaceNet.finish
        str(METRICS_PORT),
    ]


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (creating network namespaces needs CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install -y iproute2)"
    probe = subprocess.run(
        ["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True)
    return None


_CONNECT_CODE = """
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("{ip}", {port})); print("connected")
except OSError as e:
    print(type(e).__name__)
"""


def _tcp_from(host: str, ip: str, port: int) -> str:
    """Try a TCP connection from `host` to ip:port: "connected" or the error's name."""
    code = _CONNECT_CODE.format(ip=ip, port=port)
    return NET.net("exec", host, sys.executable, "-c", code, timeout=30).stdout.strip()


def _b58(peer: bytes) -> str:
    import base58

    return base58.b58encode(peer).decode()


def _events(proc: NodeProcess, name: str, **match) -> list[dict]:
    return [
        e
        for e in proc.events()
        if e.get("event") == name and all(e.get(k) == v for k, v in match.items())
    ]


class _BareRelay:
    """A bare p2pd relay (`RelayLimits`, reachability public) in a namespaced host."""

    def __init__(self, host: str, ip: str, workdir: Path) -> None:
        self.log = workdir / f"relay-{host}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    str(SCRIPT),
                    "--prefix",
                    PREFIX,
                    "exec",
                    host,
                    sys.executable,
                    str(RELAY_NODE),
                    "node",
                    "relay",
                    f"/ip4/{ip}/tcp/4001",
                    str(workdir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        deadline = time.monotonic() + 120
        while True:
            for line in self.log.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("event") == "started":
                    self.address = f"/ip4/{ip}/tcp/4001/p2p/{json.loads(line)['peer_id']}"
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"relay in {host} did not start:\n{self.log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_bootstrap(tmp_path: Path, procs: list) -> tuple[NodeProcess, str]:
    boot, address = NET.start_bootstrap(
        "pub1",
        [
            "bootstrap",
            "--config",
            str(run_toml(tmp_path)),
            "--listen",
            f"/ip4/{PUBLIC}.1/tcp/{BOOT_PORT}",
            "--data-dir",
            str(tmp_path / "bootstrap"),
        ],
        tmp_path,
    )
    procs.append(boot)
    return boot, address


def _start_peer(tmp_path, procs, host, name, listen, address, flags) -> NodeProcess:
    p = NET.process(
        host,
        name,
        [
            "peer",
            "--bootstrap",
            address,
            "--listen",
            listen,
            "--data-dir",
            str(tmp_path / name),
            *flags,
        ],
        tmp_path,
    )
    procs.append(p)
    return p


def _check_isolation() -> None:
    """The NATed hosts reach the public side but not each other, nor are reachable."""
    assert _tcp_from("priv1", f"{PUBLIC}.1", BOOT_PORT) == "connected"
    for ip in ("192.168.2.2", f"{PUBLIC}.102"):
        result = _tcp_from("priv1", ip, NAT_PEER_PORT)
        assert result != "connected", f"priv1 reached {ip}:{NAT_PEER_PORT} directly"
    assert _tcp_from("pub1", "192.168.1.2", NAT_PEER_PORT) != "connected"


def _links(a: NodeProcess, b_id: str) -> tuple[list[dict], list[dict]]:
    """`a`'s relayed connections to b, and its direct links to b (new or hole-punched)."""
    connected = _events(a, "connected", peer=b_id)
    relayed = [e for e in connected if e.get("relayed")]
    direct = [e for e in connected if not e.get("relayed")] + _events(a, "hole_punched", peer=b_id)
    return relayed, direct


def _wait(predicate, timeout: float, what: str, procs) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} not within {timeout:.0f} s:\n"
                + "\n".join(p.tail() for p in procs if hasattr(p, "tail"))
            )
        time.sleep(0.5)
    return time.time()


def _ready_time(p: NodeProcess) -> float:
    return _events(p, "ready")[0]["time"]


def _final(tmp_path: Path, names) -> dict:
    return {n: json.loads((tmp_path / n / "final_status.json").read_text()) for n in names}


def test_two_nated_peers_relay_then_hole_punch(tmp_path):
    skip = _skip_reason()
    if skip:
        pytest.skip(skip)
    assert shutil.which("nft"), "nftables is missing: apt-get install -y nftables (.ci/run does)"
    started = time.monotonic()
    procs: list = []
    try:
        print(NET.net("--public", "4", "--private", "2", "up").stderr.strip())
        relays = [_BareRelay(f"pub{i}", f"{PUBLIC}.{i}", tmp_path) for i in (3, 4)]
        procs.extend(relays)
        boot, address = _start_bootstrap(tmp_path, procs)
        flags = _peer_flags(rounds=200, interval=0.5)
        extra = [x for r in relays for x in ("--relays", r.address)]
        peers = {
            "public": _start_peer(
                tmp_path, procs, "pub2", "public", f"/ip4/{PUBLIC}.2/tcp/0", address, flags
            ),
            "nat1": _start_peer(
                tmp_path,
                procs,
                "priv1",
                "nat1",
                f"/ip4/192.168.1.2/tcp/{NAT_PEER_PORT}",
                address,
                flags + extra,
            ),
            "nat2": _start_peer(
                tmp_path,
                procs,
                "priv2",
                "nat2",
                f"/ip4/192.168.2.2/tcp/{NAT_PEER_PORT}",
                address,
                flags + extra,
            ),
        }
        _check_isolation()
        for p in peers.values():
            p.wait_round(1, timeout=180)
        nat1, nat2 = peers["nat1"], peers["nat2"]
        id1, id2 = _own_id(nat1), _own_id(nat2)
        both_ready = max(_ready_time(nat1), _ready_time(nat2))
        for p in (nat1, nat2):  # AutoNAT needs ~15 s from the daemon's start to say private
            _wait(
                lambda p=p: any(
                    "/p2p-circuit" in a for e in _events(p, "own_addrs") for a in e["addrs"]
                ),
                CIRCUIT_WITHIN,
                f"{p.name}'s relay address",
                procs,
            )
        relayed_at = _wait(
            lambda: _links(nat1, id2)[0] or _links(nat2, id1)[0] or _links(nat1, id2)[1],
            RELAYED_WITHIN + max(0.0, both_ready - time.time()),
            "a relayed link",
            procs,
        )
        first_link = min(
            e["time"]
            for e in _links(nat1, id2)[0]
            + _links(nat2, id1)[0]
            + _links(nat1, id2)[1]
            + _links(nat2, id1)[1]
        )
        direct_at = _wait(
            lambda: _links(nat1, id2)[1] or _links(nat2, id1)[1],
            DIRECT_WITHIN,
            "a direct link (hole punch)",
            procs,
        )
        direct = min(e["time"] for e in _links(nat1, id2)[1] + _links(nat2, id1)[1])
        direct_addrs = [e.get("addrs") for e in _links(nat1, id2)[1] + _links(nat2, id1)[1]]
        assert any(f"{PUBLIC}.10" in str(a) for a in direct_addrs), direct_addrs
        del relayed_at, direct_at
        # The main relay (the bootstrap node) dies mid-run: the NATed peers keep training
        # over their direct link and the public peer; nothing is lost.
        round_at_stop = nat1.last_round()
        boot.stop()
        # Once both have trained ROUNDS_AFTER_STOP rounds more, every peer finishes at one
        # round (--until-round 200 is only the upper bound).
        for p in (nat1, nat2):
            p.wait_round(round_at_stop + ROUNDS_AFTER_STOP, timeout=120)
        after = max(p.last_round() for p in peers.values()) + 1
        last = NET.finish_all(["pub2", "priv1", "priv2"], after)
        codes = {n: p.wait_exit(timeout=300) for n, p in peers.items()}
        assert all(c == 0 for c in codes.values()), {
            n: (c, peers[n].tail()) for n, c in codes.items()
        }
        final = _final(tmp_path, peers)
        digests = {n: f["ledger_digest"] for n, f in final.items()}
        assert len(set(digests.values())) == 1, digests
        # rounds 0..last trained (or 0..199 if no peer answered the finish)
        assert all(f["round"] == (200 if last is None else last + 1) for f in final.values())
        assert all(f["round"] > round_at_stop + ROUNDS_AFTER_STOP for f in final.values())
        with Ledger.open_existing(tmp_path / "nat1" / "ledger.sqlite") as ledger:
            authors = {_b58(p) for p in ledger.peers()}
            count = len(ledger)
        assert {f["peer_id"] for f in final.values()} <= authors, authors
        print(
            f"NAT testnet: NATed peers ready {both_ready - _ready_time(peers['public']):+.1f} s"
            f" after the public peer; relayed link {first_link - both_ready:+.1f} s after both"
            f" were ready; direct link (hole punch) {direct - first_link:.1f} s after the relayed"
            f" one, at {direct_addrs[0]}; bootstrap stopped at round {round_at_stop}; {count}"
            f" messages, identical digest {digests['nat1'][:16]}; "
            f"{time.monotonic() - started:.0f} s in all"
        )
    finally:
        for p in procs:
            p.stop()
        down = NET.net("--kill", "down", check=False)
        assert down.returncode == 0, down.stderr


def _own_id(p: NodeProcess) -> str:
    for e in p.events():
        if e.get("peer_id"):
            return e["peer_id"]
    raise AssertionError(f"{p.name}: no peer id in its log")


def test_nated_peers_that_reach_only_the_relay_train_together(tmp_path):
    skip = _skip_reason()
    if skip:
        pytest.skip(skip)
    assert shutil.which("nft"), "nftables is missing: apt-get install -y nftables (.ci/run does)"
    started = time.monotonic()
    procs: list = []
    try:
        print(NET.net("--public", "1", "--private", "2", "up").stderr.strip())
        boot, address = _start_bootstrap(tmp_path, procs)
        flags = _peer_flags(rounds=20, interval=0.5)
        peers = {
            f"nat{i}": _start_peer(
                tmp_path,
                procs,
                f"priv{i}",
                f"nat{i}",
                f"/ip4/192.168.{i}.2/tcp/{NAT_PEER_PORT}",
                address,
                flags,
            )
            for i in (1, 2)
        }
        _check_isolation()
        codes = {n: p.wait_exit(timeout=300) for n, p in peers.items()}
        assert all(c == 0 for c in codes.values()), {
            n: (c, peers[n].tail()) for n, c in codes.items()
        }
        final = _final(tmp_path, peers)
        id1, id2 = final["nat1"]["peer_id"], final["nat2"]["peer_id"]
        relayed = _links(peers["nat1"], id2)[0] + _links(peers["nat2"], id1)[0]
        assert relayed, "the NATed peers never connected through the relay"
        first = min(e["time"] for e in relayed) - max(_ready_time(p) for p in peers.values())
        # one more `relay_service` line from the bootstrap node (every 10 s)
        lines = len(_events(boot, "relay_service"))
        deadline = time.monotonic() + 15
        while len(_events(boot, "relay_service")) == lines and time.monotonic() < deadline:
            time.sleep(0.5)
        served = _events(boot, "relay_service")
        counted_nothing = bool(served) and not any(
            v for k, v in served[-1].items() if k != "event" and isinstance(v, int)
        )
        if not counted_nothing:
            assert served and served[-1]["circuits_opened"] >= 1, served
        relayed_bytes = served[-1]["bytes_relayed"] if served else 0
        boot.stop()
        with Ledger.open_existing(tmp_path / "bootstrap" / "ledger.sqlite") as ledger:
            boot_digest = ledger.digest()
        digests = {n: f["ledger_digest"] for n, f in final.items()}
        digests["bootstrap"] = boot_digest
        assert len(set(digests.values())) == 1, digests
        print(
            f"relay-only NAT testnet: relayed link {first:+.1f} s after both were ready; "
            f"the relay carried {relayed_bytes} bytes ({relayed_bytes / 20:.0f} per round); "
            f"identical digest {boot_digest[:16]}; {time.monotonic() - started:.0f} s in all"
        )
        if counted_nothing:  # only after the training and ledger assertions above
            pytest.xfail(
                "the relay's p2pd metrics endpoint answered but counted nothing: the bundled "
                "p2pd also starts an unmetered relay with go-libp2p's defaults (EnableRelayV2) "
                "and it served this circuit (docs/ROADMAP.md)"
            )
    finally:
        for p in procs:
            p.stop()
        down = NET.net("--kill", "down", check=False)
        assert down.returncode == 0, down.stderr
