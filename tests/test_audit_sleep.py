"""Audits in the real peer daemon when an honest peer sleeps: four honest
tiny-model peers on 127.0.0.1, audits on, and peer d frozen (SIGSTOP, daemon and p2pd)
for 25 s after its round 6, like a laptop whose lid was closed.

The others go on without d after --round-deadline; d wakes up and publishes its rounds
late, so every update the others trained meanwhile was computed on a settled state that
lacked d's late updates, and d's own audits of those updates run after a burst of
buffered gossip. Before audits tried the states without the updates that reached the
auditor after the sender's (peer/audit_duty.py:_late_states), this run convicted 3 of the 4
honest peers (bench/results/archive/audit_daemon-pause-old.md); with those guesses the
sleeper still accused the others in 1 of 6 runs here (15 mismatch votes: it published its
late rounds before their updates reached it, so arrival order misled it). Since protocol
version 3 each update names the rows its sender held (protocol/held_state.py) and the
auditor rebuilds that state. Each test asserts one promise.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.cluster import RUN, start_peer
from harness.scenario import run_to_the_end
from seedflood_p2p.algorithm.audit_rules import judge_ledger
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow
ROUNDS = 36
AUDIT = {"lag": 2, "cpu_share": 1.5, "quorum": 2}  # each update audited by each peer w.p. 1/2
AUDITED_RUN = dataclasses.replace(RUN, extra={"audit": AUDIT})
PEER_FLAGS = [
    *("--until-round", str(ROUNDS), "--round-interval", "0.4", "--max-staleness", "1"),
    *("--round-deadline", "10", "--linger", "4", "--repair-interval", "1"),
    # never jump ahead (Rounds.catch_up at max_behind / 2): on a fast machine the others
    # reached the last round while d slept, d jumped there and published no late rounds
    *("--min-peers", "3", "--max-behind", "1000"),
]
PEERS = ["a", "b", "c", "d"]
SLEEPER, SLEEP_AFTER, SLEEP_SECONDS = "d", 6, 25.0


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    def start(address):
        return {n: start_peer(work, n, address, PEER_FLAGS) for n in PEERS}

    def sleep(peers, address):
        peers[SLEEPER].wait_round(SLEEP_AFTER, timeout=600)
        peers[SLEEPER].freeze(SLEEP_SECONDS)  # blocks while d sleeps

    work = tmp_path_factory.mktemp("audit_sleep")
    result = run_to_the_end(work, AUDITED_RUN, start, sleep)
    print(json.dumps({n: f.get("audits") for n, f in result["finals"].items()}, indent=1))
    return result


def _judged(scenario, name):
    with Ledger.open_existing(scenario["work"] / name / "ledger.sqlite") as ledger:
        config = ledger.config
        _, judgement = judge_ledger(ledger, config.audit)
        return judgement


def test_every_peer_finishes_and_the_others_went_on_without_the_sleeper(scenario):
    assert scenario["codes"] == {n: 0 for n in PEERS}, scenario["codes"]
    for name in PEERS:
        assert scenario["finals"][name]["round"] == ROUNDS
    waited = [
        e
        for n in PEERS
        if n != SLEEPER
        for e in scenario["peers"][n].events()
        if e.get("event") == "deadline"
    ]
    assert waited, "nobody went on without the sleeper: the scenario did not happen"


def test_audits_met_late_updates_and_rebuilt_the_senders_states(scenario):
    """The sleep made audits meet senders that lacked late updates (the scenario is real),
    and their held-state digests named the rows they lacked: the auditors rebuilt those
    states (and the last test shows every audit matched)."""
    held = [scenario["finals"][n]["audits"]["held_state"] for n in PEERS]
    assert sum(h["found"] for h in held) > 0, held


def test_no_honest_peer_is_accused_or_convicted(scenario):
    for name in PEERS:
        audits = scenario["finals"][name]["audits"]
        assert audits["mismatches"] == 0, (name, audits)
        judgement = _judged(scenario, name)
        assert judgement.banned == {} and judgement.accusations == 0, judgement
