"""A network partition between namespaced hosts, run for real: the scenario behind
tests/test_partition.py (short cut) and bench/bench_partition.py (long cut).

deploy/netns-testnet.sh builds HOSTS hosts on a bridge: h1 runs the bootstrap node,
h2..hN a peer each. Once the peers train, the CUT hosts' switch ports are moved to a
second bridge (iproute2 only, no firewall) and every TCP connection across the cut is
aborted (`ss -K`), as a long partition ends them; new dials across it fail. After
`partition_s` seconds the ports go back on one bridge: nothing but the nodes' own
redialling reconnects them. Needs root, `ip` and `ss` (`skip_reason` says what is
missing). Processes are stopped by PID and the namespaces deleted in a finally.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from seedflood_p2p.apps.localnet import NodeProcess
from seedflood_p2p.protocol.message import UpdateMessage, unpack_scalars
from seedflood_p2p.storage.digests import digest_of
from seedflood_p2p.storage.ledger import Ledger

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "netns-testnet.sh"
HOSTS = 5  # h1: bootstrap, h2..h5: peers; the cut: {h1, h2, h3} | {h4, h5}
CUT = (4, 5)
ROUND_INTERVAL = 0.4  # seconds: rounds can be slower, never faster
BOOT_PORT = 31337
METRICS_PORT = 9100  # each namespace has its own loopback
NODE_FLAGS = ["--redial-max", "3", "--summary-interval", "1", "--island-after", "5"]
PEER_FLAGS = [
    "--round-interval",
    str(ROUND_INTERVAL),
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
    str(HOSTS - 1),
    "--threads",
    "1",
    *NODE_FLAGS,
]


class NamespaceNet:
    """The namespaced hosts of one scenario (prefix unique per process), built by
    `script`: deploy/netns-testnet.sh here and in tests/test_netns.py, or
    deploy/netns-nat-testnet.sh (subnet_flag "--public-subnet") in tests/test_nat.py."""

    def __init__(
        self, prefix: str, subnet: str, script: Path = SCRIPT, subnet_flag: str = "--subnet"
    ) -> None:
        self.prefix, self.subnet = prefix, subnet
        self.script, self.subnet_flag = script, subnet_flag

    def net(self, *args: str, check: bool = True, timeout: float = 60):
        return subprocess.run(
            [str(self.script), "--prefix", self.prefix, self.subnet_flag, self.subnet, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def process(self, host: int | str, name: str, args: list[str], workdir: Path) -> NodeProcess:
        """A `seedflood` process in a host (N or "hN", "pubN", ...): `ip netns exec`
        execs python, so the PID is the node's."""
        host = _host(host)
        # What the script's `exec HOST` runs (both scripts name a host's namespace
        # PREFIX-HOST); spelled out so that the tests' fork launcher sees the namespace.
        prefix = ("ip", "netns", "exec", f"{self.prefix}-{host}")
        return NodeProcess(name, args, workdir, prefix=prefix)

    def start_bootstrap(
        self, host: int | str, args: list[str], workdir: Path, timeout: float = 120
    ) -> tuple[NodeProcess, str]:
        """A bootstrap node in a host (`args` start with "bootstrap" and hold --data-dir
        WORKDIR/bootstrap) and its address, once it wrote it; stopped if it never does."""
        boot = self.process(host, "bootstrap", args, workdir)
        address_file = workdir / "bootstrap" / "address.txt"
        deadline = time.monotonic() + timeout
        while not (address_file.exists() and address_file.read_text().split()):
            if not boot.alive or time.monotonic() > deadline:
                boot.stop()
                raise RuntimeError(f"bootstrap did not start:\n{boot.tail()}")
            time.sleep(0.2)
        return boot, address_file.read_text().split()[0]

    def status(self, host: int | str) -> dict:
        code = (
            "import urllib.request; print(urllib.request.urlopen("
            f"'http://127.0.0.1:{METRICS_PORT}/status', timeout=5).read().decode())"
        )
        return json.loads(self.net("exec", _host(host), sys.executable, "-c", code).stdout)

    def finish(self, host: int | str, after_round: int) -> int | None:
        """POST /finish?after_round=N to the node of host N from inside its namespace (what
        apps.demo.finish_all asks on loopback): the round it will stop after, or None."""
        code = (
            "import json, urllib.request; print(json.loads(urllib.request.urlopen("
            f"urllib.request.Request('http://127.0.0.1:{METRICS_PORT}/finish?after_round="
            f"{after_round}', method='POST'), timeout=5).read())['final_round'])"
        )
        done = self.net("exec", _host(host), sys.executable, "-c", code, check=False)
        return int(done.stdout) if done.returncode == 0 and done.stdout.strip() else None

    def finish_all(self, hosts: list[int | str], after_round: int) -> int | None:
        """Ask every host's node to stop after one common round (the largest any of them
        answers, as apps.demo.finish_all agrees); returns that round, None if none answered
        (they then run to their --until-round)."""
        replies = {h: self.finish(h, after_round) for h in hosts}
        last = max((r for r in replies.values() if r is not None), default=None)
        for h, reply in replies.items():
            if last is not None and reply != last:
                self.finish(h, last)
        return last

    def check(self) -> str:
        """The script's `check`: what this kernel supports, one `name: yes|no` per line."""
        check = self.net("check", check=False)
        return check.stdout + check.stderr

    def has_netem(self) -> bool:
        """Whether this kernel has netem; without it `up` has no delay (and applies --loss
        with nftables where it can: has_loss)."""
        return "netem: yes" in self.check()

    def has_loss(self) -> bool:
        """Whether `up --loss` can be applied: by netem, or by an nftables rule."""
        report = self.check()
        return "netem: yes" in report or "nft loss: yes" in report

    def cut(self, on: bool) -> None:
        """Move the CUT hosts' ports to bridge br1 (on) or back to br0 (off); on the way
        in, abort every TCP connection across the cut in every host."""
        sw = f"{self.prefix}-sw"
        for h in CUT:
            _ip("-n", sw, "link", "set", f"h{h}", "master", "br1" if on else "br0")
        if not on:
            return
        for h in range(1, HOSTS + 1):
            for other in (i for i in range(1, HOSTS + 1) if (i in CUT) != (h in CUT)):
                ns = f"{self.prefix}-h{h}"
                dst = f"{self.subnet}.{other}"
                subprocess.run(
                    ["ip", "netns", "exec", ns, "ss", "-K", "dst", dst],
                    capture_output=True,
                    timeout=30,
                )


def _host(host: int | str) -> str:
    """A host's name: N -> "hN"; a name ("h3", "pub1", "priv2") as it is."""
    return f"h{host}" if isinstance(host, int) else host


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def skip_reason(testnet: NamespaceNet) -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (creating network namespaces needs CAP_SYS_ADMIN)"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` (apt-get install -y iproute2)"
    check = testnet.net("check", check=False)
    if check.returncode != 0:
        return f"`ip netns` testnet unavailable ({(check.stdout + check.stderr).strip()})"
    return None


def ledger_prefix(path: Path, through_round: int) -> tuple[int, str] | None:
    """(rows, digest) of a running node's ledger file over rounds <= through_round, read
    through a read-only SQLite connection (WAL: the node keeps writing); None while the
    file is missing or busy. The digest is `Ledger.digest`'s, over that prefix."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            rows = db.execute(  # rows name their peer by number (storage/ledger.py)
                "SELECT m.round, p.peer, m.scalars FROM messages m JOIN peers p "
                "ON p.id = m.peer WHERE m.round <= ? ORDER BY m.round, p.peer",
                (through_round,),
            ).fetchall()
    except sqlite3.Error:
        return None
    messages = [UpdateMessage(r, bytes(p), unpack_scalars(s)) for r, p, s in rows]
    return len(messages), digest_of(messages)


def _first_after(proc: NodeProcess, event: str, after: float) -> float | None:
    times = [e["time"] for e in proc.events() if e.get("event") == event and e["time"] > after]
    return min(times, default=None)


def rounds_trained(proc: NodeProcess, rounds: int) -> dict:
    """How many of rounds 0..rounds-1 a peer trained, by its own log: all but those before
    its first round (a peer ready after the others' round 0 starts at round 1) and those a
    `catch_up` jump skipped (a peer more than max_behind / 2 behind the quorum round jumps
    to it: after a cut, one side may have fallen that far behind the other)."""
    events = proc.events()
    first = min((e["round"] for e in events if e.get("event") == "round"), default=rounds)
    jumps = [(e["from"], e["to"]) for e in events if e.get("event") == "catch_up"]
    skipped = sum(max(0, min(to, rounds) - start) for start, to in jumps)
    return {"first": first, "skipped": skipped, "trained": rounds - first - skipped}


def run_partition(
    workdir: Path, testnet: NamespaceNet, run_flags: list[str], partition_s: float
) -> dict:
    """Train, cut, heal, finish; returns what was observed (see the keys)."""
    warmup_rounds, after_heal_s = 8, 60.0
    # Rounds are never faster than ROUND_INTERVAL, so the run outlasts the cut by >= 60 s;
    # once every ledger holds every row through the heal round, the peers are told to
    # finish at one round (they need not train out the 60 s).
    rounds = warmup_rounds + int((partition_s + after_heal_s) / ROUND_INTERVAL)
    procs: list[NodeProcess] = []
    started = time.time()
    try:
        testnet.net("--hosts", str(HOSTS), "up")
        _ip("-n", f"{testnet.prefix}-sw", "link", "add", "br1", "type", "bridge")
        _ip("-n", f"{testnet.prefix}-sw", "link", "set", "br1", "up")
        boot_args = [
            "bootstrap",
            *run_flags,
            "--listen",
            f"/ip4/{testnet.subnet}.1/tcp/{BOOT_PORT}",
            "--data-dir",
            str(workdir / "bootstrap"),
            *NODE_FLAGS,
        ]
        boot, address = testnet.start_bootstrap(1, boot_args, workdir)
        procs.append(boot)
        peers = {}
        for i in range(2, HOSTS + 1):
            args = [
                "peer",
                *("--bootstrap", address),
                *("--listen", f"/ip4/{testnet.subnet}.{i}/tcp/0"),
                *("--data-dir", str(workdir / f"peer{i}")),
                *("--metrics-port", str(METRICS_PORT)),
                *("--until-round", str(rounds)),
                *PEER_FLAGS,
            ]
            peers[i] = testnet.process(i, f"peer{i}", args, workdir)
            procs.append(peers[i])
        peers[2].wait_round(warmup_rounds, timeout=180)
        peers[HOSTS].wait_round(warmup_rounds, timeout=60)

        rounds_at_cut = {h: p.last_round() for h, p in peers.items()}
        testnet.cut(True)
        cut_at = time.time()
        # host -> the status' network view when it first said so, with every peer it
        # named unreachable during the cut: each peer's dial fails on its own timer, so
        # the first view may name only some of the other side.
        partitioned_seen = {}
        while time.time() - cut_at < partition_s:
            for h in (2, HOSTS):
                network = testnet.status(h)["network"]
                if network["state"] != "partitioned":
                    continue
                seen = partitioned_seen.setdefault(
                    h, {**network, "after_s": time.time() - cut_at, "named": []}
                )
                seen["named"] = sorted(set(seen["named"]) | set(network["unreachable"]))
            time.sleep(1)
        rounds_at_heal = {h: p.last_round() for h, p in peers.items()}
        testnet.cut(False)
        healed_at = time.time()

        # Every row made before the heal has a round <= heal_round: poll each ledger's
        # prefix through it until all five agree (compared with the final ledgers below).
        heal_round = max(rounds_at_heal.values())
        ledger_files = {f"peer{h}": workdir / f"peer{h}" / "ledger.sqlite" for h in peers}
        ledger_files["bootstrap"] = workdir / "bootstrap" / "ledger.sqlite"
        prefix_polls = []  # (seconds after the heal, {node: (rows, digest)})
        while any(p.alive for p in peers.values()):
            now = time.time()
            seen = {node: ledger_prefix(path, heal_round) for node, path in ledger_files.items()}
            prefix_polls.append((round(now - healed_at, 2), seen))
            complete = (HOSTS - 1) * (heal_round + 1)  # one row per peer and round from 0
            if len(set(seen.values())) == 1 and None not in seen.values():
                if next(iter(seen.values()))[0] == complete:
                    break  # identical everywhere and complete (checked against the end below)
            time.sleep(max(0.0, 0.5 - (time.time() - now)))
        if all(p.alive for p in peers.values()):
            last = testnet.finish_all(list(peers), max(p.last_round() for p in peers.values()) + 1)
            rounds = rounds if last is None else last + 1  # rounds 0..last trained
        codes = {h: p.wait_exit(timeout=240 + partition_s) for h, p in peers.items()}
        # the bootstrap node stores the last rows it got (up to 15 s on a loaded machine)
        deadline = time.time() + 15
        while time.time() < deadline:
            stored = ledger_prefix(ledger_files["bootstrap"], rounds)
            if stored and stored[0] >= (HOSTS - 1) * rounds:
                break
            time.sleep(0.5)
        boot.stop()
        finals = {
            h: json.loads((workdir / f"peer{h}" / "final_status.json").read_text())
            for h in peers
            if (workdir / f"peer{h}" / "final_status.json").exists()
        }
        with Ledger.open_existing(workdir / "bootstrap" / "ledger.sqlite") as ledger:
            boot_digest, boot_rows = ledger.digest(), len(ledger)
        final_prefix = ledger_prefix(ledger_files["bootstrap"], heal_round)
        identical_at = next(
            (t for t, seen in prefix_polls if set(seen.values()) == {final_prefix}), None
        )
        digests = {f"peer{h}": f["ledger_digest"] for h, f in finals.items()}
        digests["bootstrap"] = boot_digest
        trained = {h: rounds_trained(p, rounds) for h, p in peers.items()}
        reconnected = {h: _first_after(p, "reconnected", healed_at) for h, p in peers.items()}
        heal = {h: None if t is None else round(t - healed_at, 2) for h, t in reconnected.items()}
        return {
            "hosts": HOSTS,
            "cut": {"side_a": [h for h in range(1, HOSTS + 1) if h not in CUT], "side_b": CUT},
            "partition_s": partition_s,
            "rounds": rounds,
            "exit_codes": codes,
            "tails": {h: peers[h].tail(15) for h, c in codes.items() if c != 0},
            "partitioned_seen": partitioned_seen,
            "peer_ids": {h: f["peer_id"] for h, f in finals.items()},
            "rounds_at_cut": rounds_at_cut,
            "rounds_at_heal": rounds_at_heal,
            "first_reconnection_after_heal_s": heal,
            "heal_round": heal_round,
            "final_prefix_rows": final_prefix[0] if final_prefix else None,
            "expected_prefix_rows": (HOSTS - 1) * (heal_round + 1),
            # seconds from the heal until all ledgers (4 peers + bootstrap) held the final
            # rows through heal_round; None: not seen before the peers exited
            "identical_through_heal_round_after_s": identical_at,
            "prefix_polls": len(prefix_polls),
            "prefix_poll_last": prefix_polls[-1] if prefix_polls else None,
            "ledger_digests": digests,
            "ledgers_identical": len(set(digests.values())) == 1 and len(finals) == HOSTS - 1,
            "bootstrap_rows": boot_rows,
            # every round each peer trained (its first round on, less catch_up jumps)
            "trained": trained,
            "expected_rows": sum(t["trained"] for t in trained.values()),
            "wall_s": round(time.time() - started, 1),
        }
    finally:
        for p in procs:
            p.stop()
        down = testnet.net("--kill", "down", check=False)
        if down.returncode != 0:
            print(down.stderr, file=sys.stderr)
