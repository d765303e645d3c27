"""A late joiner of an audited run (audits on, the default) restores its settled state from
a link of the run's chain that peers offer: real bootstrap and peer daemons on 127.0.0.1
(tiny model), each with its own p2pd. An audited run's link holds the rows that count in
a settled prefix (algorithm/chain.py `SettledCount`).

    honest: A and B train, audit and serve links; J joins late with --checkpoint-fetch
            always: it restores from the link both offer, recomputes A's and B's recent
            updates on that model before it trains (`PeerAudits.self_check`; the offerers'
            own, since nobody else's can be checked: they match),
            later rebuilds the link from its rows (the same tensors), and ends with the
            others' ledger and a live model equal to the replay of it; nobody is convicted.
    far:    A and B offer the same forged link (a quorum; harness/hooked_peer.py
            --checkpoint forge-far: every tensor shifted), C is honest. J restores from it,
            recomputes C's update (not the offerers'), finds it does not match, names A
            and B, and replays instead: it is never convicted for updates trained on weights the run
            does not have, and ends as the others do.
    near:   ... --checkpoint forge: one tensor shifted by 0.01, too little for an audit to
            tell the updates apart (the self-check passes, and J's updates pass the others'
            audits). J's rebuild of the link from its rows finds the forgery, names A and
            B, and moves its model by what the link was off by: it ends as the others do.

With --history-sync background (J trusts the link and its standing summary before the
history, algorithm/standing_summary.py):

    trusting:     A and B honest: J is ready with no row below the link, trains, and its
                  history and the link check out.
    trusting_far: A and B offer a forged link: J's self-check refuses it, J syncs the
                  history and replays.
    paused:       X honest until after J joined, then cheating: convicted while J's
                  history is still coming (J repairs every 20 s). J stops training until the
                  history is in, then rebuilds its settled state; it is never convicted.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_checkpoint_fetch import _ends_equal, _final, _ready, _run

from harness.cluster import AUDIT, AUDITED_RUN, peer_flags
from seedflood_p2p.algorithm.chain import SETTLED_MARGIN, STANDING
from seedflood_p2p.algorithm.standing_summary import StandingSummary
from seedflood_p2p.storage.checkpoint import read_checkpoint_tensor

pytestmark = pytest.mark.slow
ROUNDS = 240  # a cap: the run is finished once the joiner showed what the tests assert
# link 8 of an audited run: built at round 8 + SETTLED_MARGIN + settle 4, then served
JOIN_ROUND = 8 + SETTLED_MARGIN + 4 + 1
AUDITED_CHAIN_RUN = dataclasses.replace(
    AUDITED_RUN, extra={"audit": AUDIT, "checkpoint_every": 8}, salt="audited-chain"
)
# lag 2 (AUDIT) holds with peers at most one round apart
FLAGS = peer_flags(
    until_round=ROUNDS,
    metrics_port=0,
    round_interval=0.6,
    max_staleness=1,
    round_deadline=3,
    liveness_timeout=20,
    min_peers=1,
    checkpoint_settle=4,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The honest and the two forged runs, and both trusting ones, at once, each on its own
    bootstrap node."""
    background = ["--history-sync", "background"]
    cheat = ["--cheat", "flip", "--cheat-from", str(JOIN_ROUND + 8)]
    with ThreadPoolExecutor(6) as pool:
        return {
            "paused": pool.submit(
                _run,
                tmp_path_factory.mktemp("audited-paused"),
                dataclasses.replace(AUDITED_CHAIN_RUN, salt="audited-chain-paused"),
                {"a": [], "b": [], "c": [], "x": cheat},
                0,
                # the history comes by repair every 20 s: the verdict on X comes first
                joiner=[*background, "--repair-interval", "20"],
                flags=FLAGS,
                wait_for="rebuilt",
                join_round=JOIN_ROUND,
            ),
            "trusting": pool.submit(
                _run,
                tmp_path_factory.mktemp("audited-trusting"),
                dataclasses.replace(AUDITED_CHAIN_RUN, salt="audited-chain-trusting"),
                {"a": [], "b": []},
                1,
                joiner=background,
                flags=FLAGS,
                wait_for="link_checked",
                join_round=JOIN_ROUND,
            ),
            "trusting_far": pool.submit(
                _run,
                tmp_path_factory.mktemp("audited-trusting-far"),
                dataclasses.replace(AUDITED_CHAIN_RUN, salt="audited-chain-trusting-far"),
                {"a": ["--checkpoint", "forge-far"], "b": ["--checkpoint", "forge-far"], "c": []},
                0,
                joiner=background,
                flags=FLAGS,
                wait_for="link_self_check",
                join_round=JOIN_ROUND,
            ),
            "honest": pool.submit(
                _run,
                tmp_path_factory.mktemp("audited-honest"),
                AUDITED_CHAIN_RUN,
                {"a": [], "b": []},
                1,  # one link of its own, after the fetched one was rebuilt and matched
                flags=FLAGS,
                wait_for="link_checked",
                join_round=JOIN_ROUND,
            ),
            **{
                kind: pool.submit(
                    _run,
                    tmp_path_factory.mktemp(f"audited-{kind}"),
                    dataclasses.replace(AUDITED_CHAIN_RUN, salt=f"audited-chain-{kind}"),
                    {"a": ["--checkpoint", how], "b": ["--checkpoint", how], "c": []},
                    0,
                    flags=FLAGS,
                    wait_for=event,
                    join_round=JOIN_ROUND,
                )
                for kind, how, event in (
                    ("far", "forge-far", "link_self_check"),
                    ("near", "forge", "link_checked"),
                )
            },
        }


@pytest.fixture(scope="module")
def paused(runs):
    return runs["paused"].result()


@pytest.fixture(scope="module")
def trusting(runs):
    return runs["trusting"].result()


@pytest.fixture(scope="module")
def trusting_far(runs):
    return runs["trusting_far"].result()


@pytest.fixture(scope="module")
def honest(runs):
    return runs["honest"].result()


@pytest.fixture(scope="module")
def far(runs):
    return runs["far"].result()


@pytest.fixture(scope="module")
def near(runs):
    return runs["near"].result()


def _event(run, name: str, event: str) -> dict:
    return next(e for e in run["peers"][name].events() if e.get("event") == event)


def _verdicts(run, name: str) -> list:
    return _final(run, name).get("audits", {}).get("banned", {})


def test_an_audited_joiner_restores_its_settled_state_from_the_link_two_peers_offer(honest):
    ready = _ready(honest, "j")
    source = ready["source"]
    assert source.startswith("fetched checkpoint of round") and "settled state of round" in source
    assert source.endswith("from 2 peers"), ready
    check = _event(honest, "j", "link_self_check")
    # A's and B's updates: the offerers' own, as nobody else's can be checked
    assert check["checked"] == 2 and check["matched"] == 2, check
    assert _final(honest, "j")["checkpoint"]["self_check"]["matched"] == 2  # in its status
    rebuilt = _event(honest, "j", "link_checked")
    assert rebuilt["match"] is True, rebuilt
    assert _final(honest, "j")["checkpoint"]["refused"] == {}
    # the link carries what a joiner trusting it will need (algorithm/standing_summary.py):
    # the standing summary, inside the file the quorum agreed on, and the held digest
    link = json.loads((honest["work"] / "j" / "chain" / "checkpoint.json").read_text())
    assert link["standing_summary"]["peers"] >= 2 and len(link["held_digest"]) == 16, link
    summary = read_checkpoint_tensor(honest["work"] / "j" / "chain", STANDING)
    assert StandingSummary.decode(summary.numpy().tobytes()).below == link["round"]
    _ends_equal(honest, ["a", "b", "j"])
    for name in ("a", "b", "j"):
        assert not _verdicts(honest, name), name


def test_a_forged_settled_link_is_found_before_the_joiner_trains(far):
    check = _event(far, "j", "link_self_check")
    assert check["checked"] == 1 and check["matched"] == 0, check  # C's: not the offerers'

    a, b = (_final(far, n)["peer_id"] for n in ("a", "b"))
    assert set(check["offered_by"]) == {a, b}
    ready = _ready(far, "j")
    assert ready["source"].startswith("replay of") and "was refused" in ready["source"], ready
    assert _final(far, "j")["checkpoint"]["refused"].get("forged_weights") == 1
    # the refused link left J's chain dir: J never builds on it nor serves it
    forged = json.loads((far["work"] / "a" / "chain" / "forged" / "checkpoint.json").read_text())
    kept = far["work"] / "j" / "chain" / "checkpoint.json"
    assert not kept.exists() or (
        json.loads(kept.read_text())["weights_sha256"] != forged["weights_sha256"]
    )
    _ends_equal(far, ["a", "b", "c", "j"])
    for name in ("a", "b", "c", "j"):  # J's updates were never trained on the forged link
        assert not _verdicts(far, name), name


def test_a_link_forged_within_the_audit_bound_is_found_by_its_rebuild_and_undone(near):
    check = _event(near, "j", "link_self_check")
    assert check["checked"] == 1 and check["matched"] == 1, check  # C's: too near to tell
    ready = _ready(near, "j")
    assert ready["source"].startswith("fetched checkpoint of round"), ready
    rebuilt = _event(near, "j", "link_checked")
    assert rebuilt["match"] is False, rebuilt
    a, b = (_final(near, n)["peer_id"] for n in ("a", "b"))
    assert set(rebuilt["offered_by"]) == {a, b}
    assert _final(near, "j")["checkpoint"]["refused"].get("forged_weights") == 1
    _ends_equal(near, ["a", "b", "c", "j"])  # the model moved back onto the run's
    for name in ("a", "b", "c", "j"):
        assert not _verdicts(near, name), name


def _events(run, name: str, *events: str) -> list[dict]:
    return [e for e in run["peers"][name].events() if e.get("event") in events]


def test_an_audited_joiner_trusts_the_link_and_its_summary_before_the_history(trusting):
    """`--history-sync background` in an audited run: J syncs only the rows and records
    from the link's round on, judges with the link's standing summary below it, restores
    its settled state from the link and trains; the history arrives, digests as the link
    says and its records make the same summary; J ends as the others do."""
    ready = _ready(trusting, "j")
    assert ready["source"].startswith("fetched trusted checkpoint of round"), ready
    assert "settled state of round" in ready["source"], ready
    history = _final(trusting, "j")["checkpoint"]["history"]
    assert history["held_at_ready"] == 0 < history["rows"], history  # no row of the link
    assert history["standing_summary"]["peers"] >= 2, history
    check = _event(trusting, "j", "link_self_check")
    assert check["checked"] == 2 and check["matched"] == 2, check
    assert _event(trusting, "j", "history_checked")["match"] is True
    assert _event(trusting, "j", "link_checked")["match"] is True
    assert not _events(trusting, "j", "trust_refused", "trust_paused", "rebuilt")
    _ends_equal(trusting, ["a", "b", "j"])
    for name in ("a", "b", "j"):
        assert not _verdicts(trusting, name), name


def test_a_forged_link_is_not_trusted_and_the_joiner_syncs_and_replays(trusting_far):
    """A and B offer the same forged link (every tensor shifted) to a joiner that would
    trust it: its self-check on C's update fails, the link is removed, and J syncs the
    whole history and replays, trains, and ends as the others do."""
    check = _event(trusting_far, "j", "link_self_check")
    assert check["matched"] == 0 < check["checked"], check
    (refused,) = _events(trusting_far, "j", "trust_refused")
    assert "recent updates recomputed" in refused["why"], refused
    ready = _ready(trusting_far, "j")
    assert ready["source"].startswith("replay"), ready
    assert _final(trusting_far, "j")["checkpoint"]["refused"].get("forged_weights") == 1
    # the refused link left J's chain dir (a link there now is one J built itself)
    work = trusting_far["work"]
    forged = json.loads((work / "a" / "chain" / "forged" / "checkpoint.json").read_text())
    kept = work / "j" / "chain" / "checkpoint.json"
    assert not kept.exists() or (
        json.loads(kept.read_text())["weights_sha256"] != forged["weights_sha256"]
    )
    _ends_equal(trusting_far, ["a", "b", "c", "j"])
    for name in ("a", "b", "c", "j"):  # J's updates were never trained on the forged link
        assert not _verdicts(trusting_far, name), name


def test_a_verdict_on_a_peer_in_the_trusted_link_stops_the_joiner_until_its_history(paused):
    """X trains honestly, so its rows are in the link J trusts, then cheats from a round
    after J joined and is convicted while J's history is still coming. The link's state
    holds X's rows, which J cannot take back without them: J stops training as soon as
    the verdict is known (before the state it bans X in), and once the history is in,
    rebuilds its settled state and trains on. J is never convicted; X is, everywhere."""
    ready = _ready(paused, "j")
    assert ready["source"].startswith("fetched trusted checkpoint of round"), ready
    (stop,) = _events(paused, "j", "trust_paused")
    assert "changed since its settled prefix" in stop["why"], stop
    rebuilt = _event(paused, "j", "rebuilt")
    assert _event(paused, "j", "history_checked")["match"] is True
    # it stopped: at most the round in progress when the verdict came ends after it
    between = [
        e["round"]
        for e in _events(paused, "j", "round")
        if stop["time"] < e["time"] < rebuilt["time"]
    ]
    assert len(between) <= 1, between
    x = _final(paused, "x")["peer_id"]
    for name in ("a", "b", "c", "j"):
        assert _verdicts(paused, name) == [x], name
    _ends_equal(paused, ["a", "b", "c", "j"])
