"""A whole run on 127.0.0.1 to its end, for the module-scoped scenarios of the daemon tests
(tests/test_audit_daemon.py, test_audit_sleep.py, test_probation_daemon.py,
test_round_mean_daemon.py): a bootstrap node of the run, its peers, whatever the scenario
does while they train, then every peer's exit code and final status.

A scenario may be open-ended (`finish_when`): its peers' --until-round is only an upper
bound, and the run is finished at one common round (POST /finish, as the demo does) as
soon as what the test is after has been shown, so it costs the rounds it needs, not a
fixed number guessed for the slowest machine.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from seedflood_p2p.apps.demo import finish_all
from seedflood_p2p.apps.localnet import NodeProcess, start_bootstrap
from seedflood_p2p.core.config import RunConfig

# A peer flag open-ended scenarios need: the status port `finish_when` reads and posts to.
STATUS_PORT = ("--metrics-port", "0")


def run_to_the_end(
    work: Path,
    run: RunConfig,
    start: Callable[[str], dict[str, NodeProcess]],
    during: Callable[[dict[str, NodeProcess], str], None] | None = None,
    exit_timeout: float = 900,
) -> dict:
    """Start a bootstrap node of `run` in `work`, then the peers `start(address)` returns;
    `during(peers, address)` runs while they train (it may add peers to the dict). Waits
    for every peer to exit and returns {"work", "codes", "finals" (of the peers that
    exited with 0), "peers", "bootstrap"}; every process is stopped on the way out."""
    procs: list[NodeProcess] = []
    peers: dict[str, NodeProcess] = {}
    try:
        boot, address = start_bootstrap(work, run)
        procs.append(boot)
        peers.update(start(address))
        if during is not None:
            during(peers, address)
        codes = {n: p.wait_exit(exit_timeout) for n, p in peers.items()}
        finals = {
            n: json.loads((work / n / "final_status.json").read_text())
            for n, code in codes.items()
            if code == 0
        }
        return {"work": work, "codes": codes, "finals": finals, "peers": peers, "bootstrap": boot}
    finally:
        for p in [*procs, *peers.values()]:
            p.stop()


def peer_status(work: Path, name: str) -> dict | None:
    """Peer NAME's /status page (None while it has none: starting, or gone)."""
    try:
        port = int((work / name / "status_port").read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def audits_of(status: dict) -> dict:
    """A /status page's audit section ({} while the peer has none yet: still joining)."""
    return status.get("audits") or {}


def finish_when(
    peers: dict[str, NodeProcess],
    work: Path,
    shown: Callable[[dict[str, dict]], bool],
    timeout: float = 600,
    poll: float = 0.5,
) -> int | None:
    """Once `shown(statuses)` holds (statuses: every live peer's /status page, by name;
    a section may be missing or None while a peer starts, see `audits_of`),
    ask every peer to stop after one common round, so all end with the same ledger
    (`demo.finish_all`); returns that round. Started with `STATUS_PORT` among their flags.

    Returns None, asking nothing, if `timeout` seconds pass or a peer exits first: the
    peers then run to their --until-round (the upper bound), and the test's assertions
    say what is missing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not all(p.alive for p in peers.values()):
            return None
        statuses = {n: peer_status(work, n) for n in peers}
        if all(statuses.values()) and shown(statuses):
            return finish_all(peers, work)
        time.sleep(poll)
    return None
