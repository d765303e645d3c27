"""Audits in the real peer daemon: a bootstrap node, three honest tiny-model
peers and one cheater on 127.0.0.1, each its own process and p2pd, and a fourth honest
peer that joins late (after the cheater's first rounds were audited, so the records of
its case reach the joiner only by repair). The run's manifest enables audits
(`extra.audit`); the cheater is harness/hooked_peer.py with `--cheat flip` (it
publishes every update with its scalars negated, and audits honestly).

One scenario for the module (starting processes is the slow part), open-ended: the run is
finished at one common round once every honest peer, the late joiner included, bans the
cheater and the joiner has trained JOINER_ROUNDS rounds with the others (ROUNDS is only
the upper bound). Each test asserts one promise: the cheater is banned by every honest
peer, its updates are void in their ledgers' judgement and their live models, the honest
peers agree on the voided ledger's replay, no verdict falls on an honest peer, and the late
joiner ends with the others' audit table and verdicts.
"""

from __future__ import annotations

import json
import time

import base58
import pytest

from harness.cluster import AUDITED_RUN, audited_peer_flags, start_hooked_peer, start_peer
from harness.replay_check import replay_equals_live
from harness.scenario import STATUS_PORT, audits_of, finish_when, peer_status, run_to_the_end
from seedflood_p2p.algorithm.audit_rules import judge_ledger
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow
ROUNDS = 80  # the upper bound: the run is finished once the bans show (`finish_when`)
PEER_FLAGS = audited_peer_flags(ROUNDS, *STATUS_PORT)  # AUDITED_RUN: harness/cluster.py
HONEST = ["a", "b", "c", "d"]  # d joins late
JOIN_AFTER = 8  # d starts when a has trained this round
JOINER_ROUNDS = 3  # rounds d trains with the others before the run is finished


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    def start(address):
        peers = {n: start_peer(work, n, address, PEER_FLAGS) for n in HONEST[:3]}
        peers["x"] = start_hooked_peer(work, "x", address, [*PEER_FLAGS, "--cheat", "flip"])
        return peers

    def join_late(peers, address):
        peers["a"].wait_round(JOIN_AFTER, timeout=600)
        # At least one record exists before d starts, and GossipSub's message cache (the
        # IHAVE window, `gossip_history` heartbeats of 1 s) has let it go: only repair can
        # bring it to d.
        deadline = time.monotonic() + 600
        while not _records_seen(peer_status(work, "a")) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(NodeSettings().gossip_history + 3)
        peers["d"] = start_peer(work, "d", address, PEER_FLAGS)

        def shown(statuses):
            trained = [e["round"] for e in peers["d"].events() if e.get("event") == "round"]
            bans = {tuple(audits_of(statuses[n]).get("banned", ())) for n in HONEST}
            return len(trained) >= JOINER_ROUNDS and len(bans) == 1 and len(bans.pop()) == 1

        finished["round"] = finish_when(peers, work, shown)

    work = tmp_path_factory.mktemp("audit_daemon")
    finished = {}
    result = run_to_the_end(work, AUDITED_RUN, start, join_late)
    result["final_round"] = finished.get("round")  # None: ran to ROUNDS
    print(json.dumps({n: f.get("audits") for n, f in result["finals"].items()}, indent=1))
    return result


def _records_seen(status: dict | None) -> bool:
    records = audits_of(status or {}).get("records", {})
    return records.get("own", 0) + records.get("accepted", 0) > 0


def _cheater(scenario) -> str:
    return scenario["finals"]["x"]["peer_id"]


def _judged(scenario, name):
    """(counted updates, judgement) of NAME's ledger, as `seedflood replay` judges it."""
    with Ledger.open_existing(scenario["work"] / name / "ledger.sqlite") as ledger:
        config = ledger.config
        counted, judgement = judge_ledger(ledger, config.audit)
        return config, counted, judgement, list(ledger.messages())


def test_every_peer_finishes(scenario):
    assert all(code == 0 for code in scenario["codes"].values()), {
        n: scenario["peers"][n].tail() for n, c in scenario["codes"].items() if c
    }
    last = scenario["final_round"]
    for name in HONEST:  # all at the round the run was finished at (or the upper bound)
        assert scenario["finals"][name]["round"] == (ROUNDS if last is None else last + 1)


def test_the_cheater_is_banned_by_every_honest_peer(scenario):
    cheater = _cheater(scenario)
    for name in HONEST:
        final = scenario["finals"][name]
        assert final["audits"]["banned"] == [cheater], (name, final["audits"])
        # Void in the model, not refused at the door: its updates are still logged.
        assert cheater not in {b["peer"] for b in final["banned"]}, (name, final["banned"])
        assert final["audits"]["done"] > 0 and final["audits"]["verdicts"] >= 1


def test_no_verdict_against_an_honest_peer(scenario):
    cheater = base58.b58decode(_cheater(scenario))
    for name in HONEST:
        _, _, judgement, _ = _judged(scenario, name)
        assert set(judgement.banned) == {cheater}, (name, judgement.banned)
        decided = [c for c in judgement.cases if c.outcome != "open"]
        assert decided and all(c.accused == cheater for c in decided), decided
        assert all(c.outcome == "confirmed" for c in decided), decided


def test_the_cheater_s_updates_are_void_and_honest_replays_agree(scenario):
    cheater = base58.b58decode(_cheater(scenario))
    hashes = {}
    for name in HONEST:
        config, counted, _, messages = _judged(scenario, name)
        assert any(m.peer == cheater for m in messages)  # it did reach the ledger ...
        assert not any(m.peer == cheater for m in counted)  # ... and counts for nothing
        # The live model took the cheater's updates back: it equals the voided replay.
        hashes[name], _ = replay_equals_live(scenario["work"] / name, config, counted)
    # The peers there from the start end with one ledger; the late joiner, finishing last,
    # may hold its own last update alone (others stopped first): its live model was
    # compared with its own ledger's replay above.
    assert len({hashes[n] for n in HONEST[:3]}) == 1, hashes


def test_the_late_joiner_ends_with_the_others_audit_table_and_verdicts(scenario):
    tables, banned = {}, {}
    for name in HONEST:
        with Ledger.open_existing(scenario["work"] / name / "ledger.sqlite") as ledger:
            tables[name] = ledger.audits()
        banned[name] = scenario["finals"][name]["audits"]["banned"]
    cheater = _cheater(scenario)
    # Records of the cheater's case were published before d started: repair brought them.
    joiner = base58.b58decode(scenario["finals"]["d"]["peer_id"])
    with Ledger.open_existing(scenario["work"] / "d" / "ledger.sqlite") as ledger:
        first_d_round = min(m.round for m in ledger.messages() if m.peer == joiner)
    early = [r for r in tables["a"] if r.round < first_d_round - 3]
    assert early and all(r in tables["d"] for r in early)
    assert scenario["finals"]["d"]["audits"]["records"].get("repair:accepted", 0) > 0
    for name in HONEST:
        assert tables[name] == tables["a"], name
        assert banned[name] == [cheater], name
    _, _, judgement_d, _ = _judged(scenario, "d")
    _, _, judgement_a, _ = _judged(scenario, "a")
    assert judgement_d.banned == judgement_a.banned
