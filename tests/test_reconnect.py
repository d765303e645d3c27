"""No silent forks, on loopback with real daemons: a run whose bootstrap node dies and
comes back stays one run.

One scenario, each test asserting one behaviour of it:

    bootstrap + A, B, C train; the bootstrap node and C are SIGKILLed; C restarts with
    its data dir and the same (dead) --bootstrap and rejoins from its peer book; the
    bootstrap node restarts on its port and syncs before it serves joiners; D joins
    through it and starts near the run's round, not from the stale copy; every ledger
    ends identical. Then A restarts alone: its ledger names others, none is reachable,
    so it waits and says why (log and /status) instead of training.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from harness.cluster import run_toml, start_bootstrap, start_peer
from harness.open_run import NODE_FLAGS as OPEN_NODE_FLAGS
from harness.open_run import PEER_FLAGS as OPEN_PEER_FLAGS
from harness.open_run import events as _events
from harness.open_run import wait_event, wait_ledger_digest
from seedflood_p2p.apps.demo import finish_all
from seedflood_p2p.apps.localnet import NodeProcess
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow
PEER_FLAGS = [*OPEN_PEER_FLAGS, "--island-after", "5"]
NODE_FLAGS = [*OPEN_NODE_FLAGS, "--repair-interval", "1"]


def _kill(proc: NodeProcess) -> None:
    os.kill(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("reconnect")
    procs: list[NodeProcess] = []
    try:
        boot, address = start_bootstrap(work, NODE_FLAGS)
        procs.append(boot)
        port = address.split("/tcp/")[1].split("/")[0]
        peers = {}
        for name in "abc":
            peers[name] = start_peer(work, name, address, [*PEER_FLAGS, "--min-peers", "3"])
            procs.append(peers[name])
        peers["a"].wait_round(6)
        peers["c"].wait_round(6)
        _kill(boot)
        _kill(peers["c"])
        killed_at = peers["a"].last_round()
        peers["c2"] = start_peer(work, "c", address, PEER_FLAGS, "c_restarted")
        procs.append(peers["c2"])
        peers["c2"].wait_round(killed_at + 4)
        # The bootstrap node comes back on its port, with its (now stale) ledger.
        (work / "bootstrap" / "address.txt").unlink()
        boot2 = NodeProcess(
            "bootstrap_restarted",
            [
                "bootstrap",
                "--config",
                str(run_toml(work)),
                "--listen",
                f"/ip4/127.0.0.1/tcp/{port}",
                "--data-dir",
                str(work / "bootstrap"),
                *NODE_FLAGS,
            ],
            work,
        )
        procs.append(boot2)
        wait_event(boot2, "caught_up", timeout=120)
        run_round_at_join = peers["a"].last_round()
        peers["d"] = start_peer(work, "d", address, PEER_FLAGS)
        procs.append(peers["d"])
        peers["d"].wait_round(wait_event(peers["d"], "ready", timeout=180)["round"] + 5)
        running = {"a": peers["a"], "b": peers["b"], "c": peers["c2"], "d": peers["d"]}
        finish_all(running, work)
        codes = {n: p.wait_exit() for n, p in peers.items() if n != "c"}
        # the bootstrap node stores the stragglers' last rows
        final_a = json.loads((work / "a" / "final_status.json").read_text())
        wait_ledger_digest(work / "bootstrap" / "ledger.sqlite", final_a["ledger_digest"])
        boot2.stop()
        # A alone: its ledger names B, C, D and the bootstrap node, none of them runs.
        alone = start_peer(work, "a", address, [*PEER_FLAGS, "--metrics-port", "0"], "a_alone")
        procs.append(alone)
        waiting = wait_event(alone, "waiting", timeout=90)
        status_port = (work / "a" / "status_port").read_text()
        with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/status", timeout=5) as r:
            alone_status = json.loads(r.read())
        alone.stop()
        yield {
            "work": work,
            "peers": peers,
            "codes": codes,
            "boot2": boot2,
            "run_round_at_join": run_round_at_join,
            "alone": alone,
            "alone_waiting": waiting,
            "alone_status": alone_status,
        }
    finally:
        for p in procs:
            p.stop()


def _final(scenario, name) -> dict:
    return json.loads((scenario["work"] / name / "final_status.json").read_text())


def test_killed_peer_restarted_with_the_bootstrap_dead_rejoins(scenario):
    restarted = scenario["peers"]["c2"]
    ready = _events(restarted, "ready")
    assert ready and ready[0]["round"] >= 6, restarted.tail()
    assert scenario["codes"]["c2"] == 0
    assert (scenario["work"] / "c" / "peers.json").exists()


def test_restarted_bootstrap_catches_up_before_serving_joiners(scenario):
    boot2 = scenario["boot2"]
    messages = [e.get("message", "") for e in boot2.events()]
    caught = next(i for i, m in enumerate(messages) if m.startswith("caught up"))
    serving = next(i for i, m in enumerate(messages) if m.startswith("serving joiners"))
    assert caught < serving
    # It had missed rows while down, and fetched them (on connecting, or in the catch-up
    # pass) before it served anyone.
    fetched = [e.get("count", 0) for e in boot2.events()[:serving] if e.get("count")]
    assert sum(fetched) > 0


def test_joiner_through_the_restarted_bootstrap_starts_with_the_run(scenario):
    ready = _events(scenario["peers"]["d"], "ready")[0]
    assert ready["round"] >= scenario["run_round_at_join"] - 1


def test_all_ledgers_end_identical(scenario):
    assert all(code == 0 for code in scenario["codes"].values()), scenario["codes"]
    digests = {n: _final(scenario, n)["ledger_digest"] for n in "abcd"}
    with Ledger.open_existing(scenario["work"] / "bootstrap" / "ledger.sqlite") as ledger:
        digests["bootstrap"] = ledger.digest()
    assert len(set(digests.values())) == 1, digests


def test_a_node_with_no_reachable_peer_but_a_ledger_naming_others_waits_and_says_why(
    scenario,
):
    alone = scenario["alone"]
    assert "not training alone" in scenario["alone_waiting"]["message"]
    assert scenario["alone_status"]["state"].startswith("waiting")
    assert not _events(alone, "round")  # it never trained
    assert not _events(alone, "ready")
