"""Hostile identities against real daemons: a bootstrap node and three honest
tiny-model peers on 127.0.0.1, a late joiner, and three attackers (harness/hostile.py), each
one identity on its own p2pd:

    M1  floods 400 valid signed updates of +-100 on fresh rounds, walks the round window
        100 steps of +50, then equivocates
    M2  answers repair as a tarpit: 2,000 claimed buckets, 8 s replies, bad-signature pages
    M3  stays live with a round a few behind the run (the liveness stall)

One scenario per module (starting processes is the slow part); each test asserts one
promise of the issue.
"""

from __future__ import annotations

import json
import time

import base58
import pytest

from harness.cluster import peer_flags, start_bootstrap, start_peer
from harness.hostile import Hostile
from harness.open_run import events, wait_event
from seedflood_p2p.apps.demo import finish_all
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow
# Open-ended: once the late joiner trains and every founding peer banned the tarpit, the
# peers are told to finish at one round (apps.demo.finish_all); ROUNDS is only a cap.
ROUNDS = 120
TAIL_ROUNDS = 6  # rounds trained after that, the staller still live among them
ROUND_DEADLINE = 3.0
MAX_AHEAD, MAX_BEHIND = 10, 30  # NodeSettings' defaults
PEER_FLAGS = peer_flags(
    until_round=ROUNDS,
    metrics_port=0,  # the status port, for finish_all
    # long enough a run for the late joiner to start: seconds forked (tests/conftest.py),
    # ~50 s as a new interpreter under load (the ROUNDS cap leaves room for that)
    round_interval=0.75,
    max_staleness=2,
    round_deadline=ROUND_DEADLINE,
    liveness_timeout=20,
    min_peers=2,
)
HONEST = ["a", "b", "c", "e"]
TARPIT_REASONS = ("bad_page", "repair_timeout")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile")
    procs, attackers = [], {}
    try:
        boot, address = start_bootstrap(work)
        procs.append(boot)
        peers = {n: start_peer(work, n, address, PEER_FLAGS) for n in ("a", "b", "c")}
        procs += peers.values()
        peers["a"].wait_round(3)
        run_id = Ledger.open_existing(work / "bootstrap" / "ledger.sqlite").run_id
        for name, phases, seed in [
            ("m1", ["flood", "walk", "equivocate"], 1),
            ("m2", ["tarpit"], 2),
            ("m3", ["stall"], 3),
        ]:
            attackers[name] = Hostile(address, run_id, phases, seed=seed)
            attackers[name].start()
        for attacker in attackers.values():
            assert attacker.ready.wait(120) and attacker.error is None, attacker.error
        assert attackers["m1"].finished.wait(120) and attackers["m1"].error is None
        peers["a"].wait_round(8)
        peers["e"] = start_peer(work, "e", address, PEER_FLAGS)  # a late joiner among them
        procs.append(peers["e"])
        ready = wait_event(peers["e"], "ready", timeout=300)
        for name in ("a", "b", "c"):  # the tarpit's ban (a test below checks its reason)
            _wait_ban(peers[name], attackers["m2"].peer_id)
        peers["e"].wait_round(ready["round"] + TAIL_ROUNDS)
        rounds = finish_all(peers, work) + 1  # rounds 0..final trained
        codes = {n: p.wait_exit(300) for n, p in peers.items()}
        summary = {  # what the run looked like, for a failing assertion's reader
            n: {
                k: v
                for k, v in json.loads((work / n / "final_status.json").read_text()).items()
                if k in ("round", "dropped", "banned", "ledger_messages")
            }
            for n, code in codes.items()
            if code == 0
        }
        print(json.dumps(summary, indent=1))
        for attacker in attackers.values():
            attacker.done.set()
        for attacker in attackers.values():
            attacker.join(60)
        yield {
            "work": work,
            "peers": peers,
            "codes": codes,
            "attackers": attackers,
            "rounds": rounds,
        }
    finally:
        for attacker in attackers.values():
            attacker.done.set()
        for p in procs:
            p.stop()


def _wait_ban(peer, banned: bytes, timeout: float = 240) -> None:
    """Until `peer` logged that it banned `banned` (or `timeout` s pass: the tests then say
    whom it banned, and why)."""
    short = base58.b58encode(banned).decode()[-8:]  # as the log names a peer
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and peer.alive:
        if any(short in e.get("message", "") for e in events(peer, "ban")):
            return
        time.sleep(0.5)


def _final(scenario, name) -> dict:
    return json.loads((scenario["work"] / name / "final_status.json").read_text())


def _rows_by(scenario, name: str) -> dict[bytes, int]:
    with Ledger.open_existing(scenario["work"] / name / "ledger.sqlite") as ledger:
        counts: dict[bytes, int] = {}
        for m in ledger.messages():
            counts[m.peer] = counts.get(m.peer, 0) + 1
        return counts


def test_honest_peers_finish_with_identical_ledgers(scenario):
    assert all(code == 0 for code in scenario["codes"].values()), scenario["codes"]
    digests = {n: _final(scenario, n)["ledger_digest"] for n in HONEST}
    assert len(set(digests.values())) == 1, digests
    assert all(_final(scenario, n)["round"] == scenario["rounds"] for n in HONEST)


def test_the_flooder_holds_at_most_one_window_of_rows(scenario):
    m1 = scenario["attackers"]["m1"]
    assert m1.report["published"] >= 300  # 200+ flood, 100 walk, 2 equivocation
    rows = _rows_by(scenario, "a")
    held = rows.get(m1.peer_id, 0)
    honest = [rows[base58.b58decode(_final(scenario, n)["peer_id"])] for n in ("a", "b", "c")]
    assert held <= MAX_AHEAD + MAX_BEHIND + 1, (held, honest)  # before: 2,104 of 2,635 rows
    with Ledger.open_existing(scenario["work"] / "a" / "ledger.sqlite") as ledger:
        assert ledger.max_round() <= scenario["rounds"] + MAX_AHEAD  # the walk moved nothing
    assert _final(scenario, "a")["dropped"]["out_of_window"] >= 100


def test_the_late_joiner_starts_at_the_run_s_round_and_is_not_blocked(scenario):
    ready = [e for e in scenario["peers"]["e"].events() if e.get("event") == "ready"]
    assert ready and 8 <= ready[0]["round"] < scenario["rounds"]  # not 5,000 rounds ahead
    assert _final(scenario, "e")["ledger_digest"] == _final(scenario, "a")["ledger_digest"]


def _banned(scenario, name: str) -> dict[str, str]:
    return {b["peer"]: b["reason"] for b in _final(scenario, name)["banned"]}


def test_the_flooder_and_the_tarpit_are_banned(scenario):
    m1 = base58.b58encode(scenario["attackers"]["m1"].peer_id).decode()
    m2 = base58.b58encode(scenario["attackers"]["m2"].peer_id).decode()
    for name in ("a", "b", "c"):
        banned = _banned(scenario, name)
        assert m1 in banned, (name, banned)
        assert banned.get(m2) in TARPIT_REASONS, (name, banned)
    assert scenario["attackers"]["m2"].report["fetch_requests"] >= 1
    with Ledger.open_existing(scenario["work"] / "a" / "ledger.sqlite") as ledger:
        assert not any(m.peer == scenario["attackers"]["m2"].peer_id for m in ledger.messages())


def test_a_peer_that_never_keeps_pace_costs_one_deadline_in_all(scenario):
    m3 = base58.b58encode(scenario["attackers"]["m3"].peer_id).decode()
    assert scenario["attackers"]["m3"].report["published"] >= 3
    for name in HONEST:
        waits = [e for e in scenario["peers"][name].events() if e.get("event") == "deadline"]
        for_m3 = [e for e in waits if m3 in e["slow"]]
        # Once in all: a laggard is waited for again only once it is in step with us,
        # which a staller a few rounds behind never is (the looser rule, "back inside
        # the staleness bound", cost a peer two deadlines in bench_hostile's stall row).
        assert len(for_m3) <= 1, (name, for_m3)
        assert len(waits) <= 3, (name, waits)  # before: one 30 s wait every round
