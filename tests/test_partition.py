"""A network partition between namespaced hosts heals by itself to one ledger.

deploy/netns-testnet.sh builds 5 hosts on a bridge: h1 runs the bootstrap node, h2..h5
a peer each. Mid-run, h4 and h5 are moved to a second bridge (iproute2 only, no
firewall needed) and every TCP connection across the cut is aborted (`ss -K`), as a
long partition ends them; new dials across it fail. Both sides keep training and say
"partitioned" (status and log). After PARTITION seconds the hosts go back on one bridge:
nothing but the nodes' own redialling reconnects them, repair starts on the new
connections, and every ledger (4 peers and the bootstrap node) ends bit-identical with
every peer's every round. The heal time (cut removed -> first repair across it) is
printed; bench/ would hold the long (180 s) measurement.

Needs root, `ip netns` and `ss` (iproute2); skips naming what is missing otherwise.
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

from seedflood_p2p.apps.localnet import NodeProcess
from seedflood_p2p.storage.ledger import Ledger

from cluster import RUN_FLAGS

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "netns-testnet.sh"
PREFIX = f"sfp{os.getpid() % 100000}"
SUBNET = "10.78.0"
HOSTS = 5  # h1: bootstrap, h2..h5: peers; the cut: {h1, h2, h3} | {h4, h5}
CUT = (4, 5)
PARTITION = 30.0  # seconds
ROUNDS = 160  # the run must outlast the cut by well over a minute
BOOT_PORT = 31337
METRICS_PORT = 9100
NODE_FLAGS = ["--redial-max", "3", "--summary-interval", "1", "--island-after", "5"]
PEER_FLAGS = [
    "--until-round",
    str(ROUNDS),
    "--round-interval",
    "0.4",
    "--max-staleness",
    "2",
    "--round-deadline",
    "3",
    "--liveness-timeout",
    "4",
    "--linger",
    "6",
    "--repair-interval",
    "1",
    "--min-peers",
    "4",
    "--threads",
    "1",
    *NODE_FLAGS,
]


def _net(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), "--prefix", PREFIX, "--subnet", SUBNET, *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
    )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (creating network namespaces needs CAP_SYS_ADMIN)"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` (apt-get install -y iproute2)"
    check = _net("check", check=False)
    if check.returncode != 0:
        return f"`ip netns` testnet unavailable ({(check.stdout + check.stderr).strip()})"
    return None


def _ns_proc(host: int, name: str, args: list[str], workdir: Path) -> NodeProcess:
    return NodeProcess(
        name, args, workdir, prefix=(str(SCRIPT), "--prefix", PREFIX, "exec", f"h{host}")
    )


def _status(host: int) -> dict:
    code = (
        "import urllib.request; print(urllib.request.urlopen("
        f"'http://127.0.0.1:{METRICS_PORT}/status', timeout=5).read().decode())"
    )
    return json.loads(_net("exec", f"h{host}", sys.executable, "-c", code).stdout)


def _cut(on: bool) -> None:
    """Move the CUT hosts' switch ports to bridge br1 (on) or back to br0 (off); on the
    way in, abort every TCP connection across the cut in every host."""
    sw = f"{PREFIX}-sw"
    for h in CUT:
        _ip("-n", sw, "link", "set", f"h{h}", "master", "br1" if on else "br0")
    if on:
        for h in range(1, HOSTS + 1):
            others = [i for i in range(1, HOSTS + 1) if (i in CUT) != (h in CUT)]
            for o in others:
                subprocess.run(
                    ["ip", "netns", "exec", f"{PREFIX}-h{h}", "ss", "-K", "dst", f"{SUBNET}.{o}"],
                    capture_output=True,
                    timeout=30,
                )


def _first_after(proc: NodeProcess, event: str, after: float) -> float | None:
    times = [e["time"] for e in proc.events() if e.get("event") == event and e["time"] > after]
    return min(times, default=None)


def test_partition_heals_to_one_ledger(tmp_path):
    skip = _skip_reason()
    if skip:
        pytest.skip(skip)
    procs: list[NodeProcess] = []
    try:
        _net("--hosts", str(HOSTS), "up")
        _ip("-n", f"{PREFIX}-sw", "link", "add", "br1", "type", "bridge")
        _ip("-n", f"{PREFIX}-sw", "link", "set", "br1", "up")
        boot = _ns_proc(
            1,
            "bootstrap",
            [
                "bootstrap",
                *RUN_FLAGS,
                "--listen",
                f"/ip4/{SUBNET}.1/tcp/{BOOT_PORT}",
                "--data-dir",
                str(tmp_path / "bootstrap"),
                *NODE_FLAGS,
            ],
            tmp_path,
        )
        procs.append(boot)
        address_file = tmp_path / "bootstrap" / "address.txt"
        deadline = time.monotonic() + 120
        while not address_file.exists():
            if boot.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"bootstrap did not start:\n{boot.tail()}")
            time.sleep(0.2)
        address = address_file.read_text().split()[0]
        peers = {}
        for i in range(2, HOSTS + 1):
            name = f"peer{i}"
            peers[i] = _ns_proc(
                i,
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
            procs.append(peers[i])
        peers[2].wait_round(8, timeout=180)
        peers[5].wait_round(8, timeout=60)

        _cut(True)
        cut_at = time.time()
        seen_partitioned = {}
        while time.time() - cut_at < PARTITION:
            for h in (2, 5):
                if h not in seen_partitioned:
                    network = _status(h)["network"]
                    if network["state"] == "partitioned":
                        seen_partitioned[h] = network
            time.sleep(1)
        rounds_in_cut = {h: p.last_round() for h, p in peers.items()}
        _cut(False)
        healed_at = time.time()

        codes = {h: p.wait_exit(timeout=240) for h, p in peers.items()}
        time.sleep(3)
        boot.stop()
        assert all(c == 0 for c in codes.values()), {h: peers[h].tail() for h in codes}

        # Both sides knew they were cut off, and said so.
        assert set(seen_partitioned) == {2, 5}, seen_partitioned
        peer2_id = json.loads((tmp_path / "peer2" / "final_status.json").read_text())["peer_id"]
        assert peer2_id in seen_partitioned[5]["unreachable"], seen_partitioned[5]
        # Both sides trained on through the cut.
        assert all(r > 8 for r in rounds_in_cut.values()), rounds_in_cut

        finals = {
            h: json.loads((tmp_path / f"peer{h}" / "final_status.json").read_text()) for h in peers
        }
        with Ledger.open_existing(tmp_path / "bootstrap" / "ledger.sqlite") as ledger:
            boot_digest, boot_rows = ledger.digest(), len(ledger)
        digests = {f"peer{h}": f["ledger_digest"] for h, f in finals.items()}
        digests["bootstrap"] = boot_digest
        assert len(set(digests.values())) == 1, digests
        assert boot_rows == (HOSTS - 1) * ROUNDS, boot_rows

        # Heal time: cut removed -> first repair across it, per side (from the logs).
        repaired = {h: _first_after(peers[h], "reconnected", healed_at) for h in peers}
        heal = [t - healed_at for t in repaired.values() if t is not None]
        assert heal, "no node logged a reconnection after the cut was removed"
        print(
            f"partition of {PARTITION:.0f} s between {{h1,h2,h3}} and {{h4,h5}}: first "
            f"reconnection {min(heal):.1f} s after the heal, last {max(heal):.1f} s; "
            f"{boot_rows} rows, one ledger digest {boot_digest[:16]}"
        )
    finally:
        for p in procs:
            p.stop()
        down = _net("--kill", "down", check=False)
        assert down.returncode == 0, down.stderr
