"""Open-ended runs on 127.0.0.1 (no --until-round): the peers are told to finish at one
round (apps.demo.finish_all) once the scenario is over, so the run outlives restarts and
late joins however slow process start-up is (10-30 s on 2 busy cores).

Shared by tests/test_reconnect.py and harness/join_any_peer.py (test and bench).
"""

from __future__ import annotations

import time
from pathlib import Path

from seedflood_p2p.apps.localnet import NodeProcess

from .partition import ledger_prefix

# Fast rounds, short deadlines, quick repair and redial: a peer flag set for open-ended runs.
PEER_FLAGS = [
    *("--metrics-port", "0", "--round-interval", "0.4", "--max-staleness", "2"),
    *("--round-deadline", "3", "--liveness-timeout", "10", "--linger", "4"),
    *("--repair-interval", "1", "--redial-max", "3", "--summary-interval", "1"),
]
NODE_FLAGS = ["--redial-max", "3", "--summary-interval", "1"]  # the bootstrap node's


def events(proc: NodeProcess, event: str) -> list[dict]:
    return [e for e in proc.events() if e.get("event") == event]


def wait_events(proc: NodeProcess, event: str, count: int, timeout: float = 180) -> list[dict]:
    """The first `count` `event` records of `proc`, once it logged that many; AssertionError
    (with the log's tail) if `proc` exits or `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    while len(found := events(proc, event)) < count:
        if not proc.alive or time.monotonic() > deadline:
            raise AssertionError(
                f"{proc.name}: {len(found)} of {count} {event!r} events:\n{proc.tail()}"
            )
        time.sleep(0.2)
    return found[:count]


def wait_event(proc: NodeProcess, event: str, timeout: float = 180, **match) -> dict:
    """The first `event` record of `proc` whose fields equal `match`; AssertionError (with
    the log's tail) if `proc` exits or `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in events(proc, event) if all(e.get(k) == v for k, v in match.items())]
        if found:
            return found[0]
        if not proc.alive or time.monotonic() > deadline:
            raise AssertionError(f"{proc.name}: no {event!r} event {match}:\n{proc.tail()}")
        time.sleep(0.2)


def wait_ledger_digest(path: Path, digest: str, timeout: float = 15) -> None:
    """Until the (running) node's ledger file at `path` has `digest` (`Ledger.digest`), or
    `timeout` s pass: the caller's own check then says how they differ."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = ledger_prefix(path, 2**62)
        if held is not None and held[1] == digest:
            return
        time.sleep(0.5)
