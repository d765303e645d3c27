"""A whole run on 127.0.0.1 to its end, for the module-scoped scenarios of the daemon tests
(tests/test_audit_daemon.py, test_audit_sleep.py, test_probation_daemon.py,
test_round_mean_daemon.py): a bootstrap node of the run, its peers, whatever the scenario
does while they train, then every peer's exit code and final status.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from seedflood_p2p.apps.localnet import NodeProcess, start_bootstrap
from seedflood_p2p.core.config import RunConfig


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
