"""Join through any live peer after the bootstrap node is gone, with real daemons on 127.0.0.1.

Shared by tests/test_join_any_peer.py (asserts) and bench/bench_join.py (times):

    bootstrap + A, B, C train; the bootstrap node is SIGKILLed; D starts with the TOML
    list `bootstrap = [<dead bootstrap>, <A>]` only, gets the manifest from A, finds B
    and C through the signed "peer" records in the DHT (network/peers/discovery.py), dials
    them, trains; every peer then finishes at the same round and writes its final status.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from seedflood_p2p.apps.demo import finish_all
from seedflood_p2p.apps.localnet import NodeProcess

from .cluster import start_bootstrap, start_peer
from .open_run import NODE_FLAGS as BASE_NODE_FLAGS
from .open_run import PEER_FLAGS as BASE_PEER_FLAGS
from .open_run import events, wait_event

PEER_FLAGS = [*BASE_PEER_FLAGS, "--discovery-interval", "2"]
NODE_FLAGS = [*BASE_NODE_FLAGS, "--discovery-interval", "2"]


def full_address(proc: NodeProcess) -> str:
    """The peer's own (loopback) address with its peer id, as another peer's --bootstrap."""
    peer_id = wait_event(proc, "join")["peer_id"]
    addrs = wait_event(proc, "own_addrs")["addrs"]
    local = next(a for a in addrs if a.startswith("/ip4/127.0.0.1/"))
    return f"{local}/p2p/{peer_id}"


def _first_time(proc: NodeProcess, event: str, peer: str, since: float) -> float | None:
    times = [e["time"] for e in events(proc, event) if e.get("peer") == peer]
    return round(min(times) - since, 2) if times else None


def run_join_any_peer(
    work: Path,
    rounds_before_kill: int = 4,
    rounds_after_join: int = 4,
    discovery: bool = True,
    connect_timeout: float = 180,
) -> dict:
    """Run the scenario in `work`; returns what happened (times in seconds). `discovery`
    False runs every node with --no-discovery (the control: no DHT records), and a peer D
    never connects to within `connect_timeout` s is reported as None, not an error."""
    procs: list[NodeProcess] = []
    switch = [] if discovery else ["--no-discovery"]
    try:
        boot, address = start_bootstrap(work, [*NODE_FLAGS, *switch])
        procs.append(boot)
        peers = {}
        for name in "abc":
            flags = [*PEER_FLAGS, *switch, "--min-peers", "3"]
            peers[name] = start_peer(work, name, address, flags)
            procs.append(peers[name])
        for name in "abc":
            peers[name].wait_round(rounds_before_kill)
        ids = {name: wait_event(p, "join")["peer_id"] for name, p in peers.items()}
        entry = full_address(peers["a"])
        os.kill(boot.proc.pid, signal.SIGKILL)
        boot.proc.wait()
        run_round_at_join = peers["a"].last_round()
        started, started_wall = time.monotonic(), time.time()
        # D's bootstrap list is a TOML list: the dead bootstrap node first, then A.
        d_toml = work / "d.toml"
        d_toml.write_text(f"bootstrap = {json.dumps([address, entry])}\n")
        d = NodeProcess(
            "d",
            [
                "peer",
                "--config",
                str(d_toml),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--data-dir",
                str(work / "d"),
                "--threads",
                "1",
                *PEER_FLAGS,
                *switch,
            ],
            work,
            1,
        )
        procs.append(d)
        peers["d"] = d
        ready = wait_event(d, "ready")
        ready_s = time.monotonic() - started
        connected = {}
        for name in "bc":  # peers D was not given: found through discovery
            try:
                wait_event(d, "connected", connect_timeout, peer=ids[name])
                connected[name] = round(time.monotonic() - started, 2)
            except AssertionError:
                connected[name] = None
        d.wait_round(ready["round"] + rounds_after_join)
        first_rounds = [e for e in events(d, "round")]
        trained_s = time.monotonic() - started
        finish_all(peers, work)
        codes = {name: p.wait_exit() for name, p in peers.items()}
        finals = {
            name: json.loads((work / name / "final_status.json").read_text()) for name in peers
        }
        return {
            "ids": ids,
            "entry": entry,
            "bootstrap": address,
            "codes": codes,
            "run_round_at_join": run_round_at_join,
            "ready": ready,
            "ready_s": round(ready_s, 2),
            "discovery": discovery,
            "connected_s": connected,
            "trained_rounds_s": round(trained_s, 2),
            "first_round": first_rounds[0]["round"] if first_rounds else None,
            "discovered": events(d, "discovered"),
            # seconds after D's start of its phases: daemon up, manifest in hand, flood node
            # attached, first sync done, ready
            "phases": {
                event: round(min(e["time"] for e in found) - started_wall, 2)
                for event in ("http", "join", "own_addrs", "caught_up", "ready")
                if (found := events(d, event))
            },
            # seconds after D's start, from D's log: when it first saw each peer connected,
            # and when it first heard of it (source "dht": signed records; "summary": a peer)
            "timeline": {
                name: {
                    "connected": _first_time(d, "connected", ids[name], started_wall),
                    "heard_of": _first_time(d, "discovered", ids[name], started_wall),
                    "heard_from": next(
                        (e["source"] for e in events(d, "discovered") if e["peer"] == ids[name]),
                        None,
                    ),
                }
                for name in "abc"
            },
            "d_connected": [e["peer"] for e in events(d, "connected")],
            "finals": finals,
        }
    finally:
        for p in procs:
            p.stop()
