"""Audits: who audits what, the recomputation, the verdict rule, verdicts in the
ledger and in replay. No processes: the tiny model and SQLite files."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.audit_rules import (
    audit_draw,
    audit_rate,
    judge,
    judge_ledger,
    judge_messages,
    p_audited,
    recompute,
    rounds_to_catch,
    selects,
    verdict_changes,
)
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.probation import standing_of_ledger
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.algorithm.trainer import zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import AuditRule, AuditSettings, ProbationSettings
from seedflood_p2p.protocol.audit_record import decode_audit, encode_audit
from seedflood_p2p.protocol.framing import Rejected
from seedflood_p2p.protocol.held_state import state_digest
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, quantize_scalars
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

SETTINGS = AuditSettings(enabled=True, quorum=3)
CONFIG = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=4, batch_size=8)
RUN_ID = CONFIG.run_id
A, B, C, D, E, X = (f"peer-{c}".encode() for c in "ABCDEX")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- who audits what ------------------------------------------------------------------


def test_audit_rate_keeps_cpu_share_and_states_the_probability():
    q = audit_rate(16, 0.10)
    assert q == pytest.approx(0.1 / 15)
    assert q * 15 == pytest.approx(0.10)  # audits per round = 10% of one training step
    assert p_audited(q, 15) == pytest.approx(1 - (1 - 0.1 / 15) ** 15)
    assert 0.09 < p_audited(q, 15) < 0.1
    assert rounds_to_catch(q, 15, 0.99) == 46  # ln(0.01) / ln(1 - 0.0953)
    assert audit_rate(2, 5.0) == 1.0  # a rate, never above 1


def test_selection_is_secret_and_near_the_rate():
    run = CONFIG.run_key
    draws = [audit_draw(b"secret-1", run, X, t) for t in range(20_000)]
    assert all(0 <= d < 1 for d in draws)
    share = np.mean([d < 0.05 for d in draws])
    assert 0.04 < share < 0.06
    other = [audit_draw(b"secret-2", run, X, t) for t in range(20_000)]
    # another secret draws another set: the sender cannot tell who will audit it
    chosen_1 = {t for t, d in enumerate(draws) if d < 0.05}
    chosen_2 = {t for t, d in enumerate(other) if d < 0.05}
    assert len(chosen_1 & chosen_2) < 0.2 * len(chosen_1)
    assert selects(b"secret-1", run, X, 3, 1.0) and not selects(b"secret-1", run, X, 3, 0.0)


def test_rule_tolerance():
    rule = AuditRule(relative=0.01, absolute=0.002)
    assert not rule.mismatches((1.0,), (1.0,))
    assert not rule.mismatches((1.0,), (1.0 + 2**-10,))  # one float16 ulp at 1.0
    assert rule.mismatches((1.0,), (-1.0,))  # sign flip
    assert rule.mismatches((3.0,), (1.0,))  # scaled
    assert not rule.mismatches((0.001,), (-0.0005,))  # both near zero: absolute floor
    assert rule.mismatches((1.0, 2.0), (1.0,))  # wrong k


def test_rule_spread_covers_cross_cpu_noise_at_the_update_s_scale():
    """Two honest CPUs differ by float32 noise of about 0.005 x the update's RMS in every
    scalar, small ones included (bench/results/audit-hardware.md): the run's rule
    (`spread`, 0.02 x the recomputation's RMS) lets that pass and still catches cheats."""
    honest = (1.5, -0.8, 0.05, -0.02)  # RMS 0.85; the small scalars sit under `relative`
    noisy = tuple(x + 0.004 for x in honest)  # 0.0047 x RMS: one CPU against another
    assert AuditRule(relative=0.01, absolute=0.002).mismatches(noisy, honest)  # the old rule
    rule = AuditSettings.of({}).rule
    assert rule.spread == 0.02 and not rule.mismatches(noisy, honest)
    assert rule.mismatches(tuple(-x for x in honest), honest)  # a sign flip
    assert rule.mismatches(tuple(3 * x for x in honest), honest)  # scaled
    assert rule.mismatches(honest[:2] + (0.05 + 0.05, -0.02), honest)  # one small scalar moved
    # the bound is the auditor's recomputation's scale: a claim cannot widen it
    inflated = honest[:3] + (100.0,)
    assert rule.mismatches(inflated, honest)
    assert AuditSettings.of({"audit": {"spread": 0.0}}).rule.mismatches(noisy, honest)


def test_settings_from_manifest_extra():
    # secure by default: a run that does not turn audits off has them, at the production rate
    default = AuditSettings.of({})
    assert default.enabled and default.cpu_share == 0.10 and default.lag == 3
    assert not AuditSettings.of({"audit": False}).enabled
    assert not AuditSettings.of({"audit": {"enabled": False}}).enabled
    assert AuditSettings.of({"audit": True}).enabled
    s = AuditSettings.of({"audit": {"quorum": 2, "lag": 1}})
    assert s.enabled and s.quorum == 2 and s.lag == 1
    with pytest.raises(UserError, match="unknown keys"):
        AuditSettings.of({"audit": {"qourum": 2}})
    with pytest.raises(UserError, match="quorum"):
        AuditSettings.of({"audit": {"quorum": 0}})


# -- the verdict rule -----------------------------------------------------------------


def _claims():
    return {(5, X): (1.0,), (5, A): (0.5,), (6, X): (2.0,)}


def _rec(auditor, scalars, accused=X, round_=5):
    return AuditRecord(accused, round_, auditor, scalars)


def test_quorum_of_mismatches_bans_the_accused():
    records = [_rec(A, (-1.0,)), _rec(B, (-1.0,)), _rec(C, (-0.99,))]
    j = judge(_claims(), records, SETTINGS)
    assert set(j.banned) == {X}
    assert j.cases[0].outcome == "confirmed"


def test_below_quorum_changes_nothing():
    j = judge(_claims(), [_rec(A, (-1.0,)), _rec(B, (-1.0,))], SETTINGS)
    assert j.banned == {} and j.cases[0].outcome == "open"


def test_refuted_accusation_bans_the_accuser():
    records = [_rec(A, (-1.0,)), _rec(B, (1.0,)), _rec(C, (1.0,)), _rec(D, (1.0,))]
    j = judge(_claims(), records, SETTINGS)
    assert set(j.banned) == {A}
    assert j.cases[0].outcome == "refuted"


def test_matches_alone_open_no_case_and_self_votes_do_not_count():
    assert judge(_claims(), [_rec(A, (1.0,))], SETTINGS).cases == []
    # the accused vouching for itself three times is not a vote
    records = [_rec(A, (-1.0,)), _rec(B, (-1.0,)), _rec(C, (-1.0,)), _rec(X, (1.0,))]
    records += [AuditRecord(X, 5, X, (1.0,))]
    assert set(judge(_claims(), records, SETTINGS).banned) == {X}


def test_one_vote_per_auditor_and_case():
    records = [_rec(A, (-1.0,)), _rec(A, (-2.0,)), _rec(A, (-3.0,)), _rec(B, (-1.0,))]
    assert judge(_claims(), records, SETTINGS).banned == {}


def test_no_claim_in_the_ledger_keeps_the_case_open():
    records = [_rec(a, (-1.0,), round_=9) for a in (A, B, C)]
    j = judge(_claims(), records, SETTINGS)
    assert j.banned == {}


def test_judgement_does_not_depend_on_arrival_order():
    records = [_rec(A, (-1.0,)), _rec(B, (-1.0,)), _rec(C, (-1.0,)), _rec(D, (1.0,))]
    records += [_rec(B, (9.0,), accused=A), _rec(C, (9.0,), accused=A)]
    records += [_rec(D, (-2.0,), round_=6), _rec(E, (2.0,), round_=6)]
    first = judge(_claims(), records, SETTINGS)
    for seed in range(10):
        shuffled = records[:]
        random.Random(seed).shuffle(shuffled)
        again = judge(_claims(), shuffled, SETTINGS)
        assert again.banned == first.banned
        assert [(c.accused, c.round, c.outcome) for c in again.cases] == [
            (c.accused, c.round, c.outcome) for c in first.cases
        ]


# -- wire -----------------------------------------------------------------------------


def test_audit_wire_round_trip_and_rejections():
    data = encode_audit(RUN_ID, X, 7, (0.25,))
    assert len(data) <= 64
    assert decode_audit(data, RUN_ID, A, 1) == AuditRecord(X, 7, A, (0.25,))
    with pytest.raises(Rejected) as exc:
        decode_audit(data, RUN_ID, X)
    assert exc.value.reason == "self_audit"
    other = RunConfig(model="tiny-llama", salt="other").run_id
    with pytest.raises(Rejected) as exc:
        decode_audit(data, other, A)
    assert exc.value.reason == "wrong_run"
    with pytest.raises(Rejected) as exc:
        decode_audit(data, RUN_ID, A, directions=2)
    assert exc.value.reason == "malformed"
    rng = random.Random(0)
    for _ in range(2000):  # garbage: Rejected, never anything else
        junk = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            junk[rng.randrange(len(junk))] = rng.randrange(256)
        try:
            decode_audit(bytes(junk[: rng.randint(0, len(junk))]), RUN_ID, A)
        except Rejected:
            pass


# -- ledger, live model, replay -------------------------------------------------------


def _updates(rounds, peers, seed=0):
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1)))
        for t in range(rounds)
        for p in peers
    ]


def test_ledger_keeps_audits_and_replay_voids_the_banned(tmp_path):
    updates = _updates(6, [A, B, C, D, X])
    claim = next(m for m in updates if m.peer == X and m.round == 3)
    wrong = (-claim.scalars[0] - 1.0,)
    records = [AuditRecord(X, 3, a, wrong) for a in (A, B, C)]
    ledger = Ledger(tmp_path / "l.sqlite", RUN_ID)
    ledger.add(updates)
    assert ledger.add_audits(records) == records
    assert ledger.add_audits(records) == []  # idempotent
    assert sorted(ledger.audits()) == sorted(records)
    counted, j = judge_ledger(ledger, SETTINGS)
    assert set(j.banned) == {X}
    assert counted == [m for m in updates if m.peer != X]

    model, _ = load_model("tiny-llama")
    replay(model, CONFIG, counted)
    reference = [p.detach().clone() for p in model.parameters()]
    # a live peer that applied everything, then the verdict arrived
    live_model, _ = load_model("tiny-llama")
    live = LiveModel(SubCGE(live_model, CONFIG))
    for t in range(6):
        live.apply([m for m in updates if m.round == t])
    live.apply(verdict_changes({}, j.banned, updates))
    for ref, got in zip(reference, live_model.parameters()):
        assert torch.allclose(ref, got, atol=1e-5)
    ledger.close()


def test_verdict_changes_take_back_and_restore():
    updates = _updates(2, [A, X])
    out = verdict_changes({}, {X: "cheat"}, updates)
    assert out == [m.negated() for m in updates if m.peer == X]
    assert verdict_changes({X: "cheat"}, {}, updates) == [m for m in updates if m.peer == X]
    assert verdict_changes({X: "a"}, {X: "b"}, updates) == []
    counted, _ = judge_messages(updates, [], SETTINGS)
    assert counted == updates


# -- the recomputation ----------------------------------------------------------------


def test_recompute_on_the_same_state_is_bitwise_and_catches_cheats():
    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    engine = SubCGE(model, CONFIG)
    live = LiveModel(engine)
    live.apply(_updates(3, [A, B]))
    rule = AuditSettings().rule
    for peer in (A, X):
        honest, _ = zo_step(engine, tokenizer, task, peer, 3)
        torch.set_num_threads(2)  # another thread count on the auditor's side
        again = recompute(engine, tokenizer, task, honest)
        torch.set_num_threads(1)
        assert again == honest.scalars
        assert not rule.mismatches(honest.scalars, again)
        g = honest.scalars[0]
        assert rule.mismatches((-g,), again) == (abs(g) > 0.001)
        assert rule.mismatches((3 * g,), again) == (abs(g) > 0.001)


# -- the simulator --------------------------------------------------------------------


@pytest.mark.slow
def test_simulated_cheaters_are_banned_and_honest_peers_never():
    from seedflood_p2p.sim.audit_sim import CheatConfig, simulate_cheaters

    run = RunConfig(model="tiny-llama", n_ref=6, batch_size=4, max_length=16, lr=1e-3)
    config = CheatConfig(
        peers=6,
        cheaters=3,
        rounds=4,
        settings=AuditSettings(enabled=True, cpu_share=5.0, lag=1),  # rate 1
        eval_every=0,
        eval_examples=8,
        run=run,
    )
    result = simulate_cheaters(config)
    assert set(result["banned"]) == set(result["cheaters"]) == {"sim-3", "sim-4", "sim-5"}
    assert result["false_bans"] == []
    assert result["counts"]["honest_audited"] == 3 * 4  # every honest update, every round
    assert result["counts"]["honest_mismatches"] == 0
    # sign flip and x3 are caught in their first round; the random scalar when it differs
    assert result["rounds_to_ban"]["sign-flip"] == 1
    assert result["rounds_to_ban"]["scale3"] == 1
    off = simulate_cheaters(dataclasses.replace(config, audits=False))
    assert off["banned"] == {} and off["counts"]["audits"] == 0


def test_take_settled_keeps_recent_rounds_pending():
    model, _ = load_model("tiny-llama")
    live = LiveModel(SubCGE(model, CONFIG))
    updates = _updates(6, [A, B])
    live.receive(updates)
    settled = live.take_settled(next_round=6, lag=2)  # rounds < 4
    assert settled == [m for m in updates if m.round < 4]
    assert live.take() == [m for m in updates if m.round >= 4]


def test_audit_intake_logs_new_records_and_counts_drops(tmp_path, caplog):
    from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.protocol.message import Envelope

    a, b, x = (ED25519_PEER_ID_PREFIX + bytes([i]) * 32 for i in (1, 2, 3))  # Ed25519 ids
    ledger = Ledger(tmp_path / "l.sqlite", RUN_ID)
    intake = AuditIntake(ledger, directions=1, clock=lambda: 0.0)
    good = Envelope(encode_audit(RUN_ID, x, 4, (0.5,)), b"seq", b"sig")
    junk = Envelope(b"\xc1junk", b"", b"")
    fresh = intake.admit([(a, good), (a, good), (x, good), (b, junk), (A, good)])
    assert fresh == [AuditRecord(x, 4, a, (0.5,))]
    assert ledger.audits() == fresh
    assert intake.admit([(a, good)]) == []
    assert intake.counts == {
        "accepted": 1,
        "duplicate": 2,
        "dropped:self_audit": 1,
        "dropped:malformed": 1,
        "dropped:bad_key": 1,  # an auditor whose key cannot sign (as for updates)
    }
    for _ in range(5):  # rate-limited: one line per reason and LOG_EVERY seconds
        intake.admit([(x, good)])
    assert sum("self_audit" in r.getMessage() for r in caplog.records) == 1
    assert intake.own(AuditRecord(B, 2, A, (1.0,))) and not intake.own(AuditRecord(B, 2, A, (1.0,)))
    ledger.close()


@pytest.mark.slow
def test_seedflood_replay_honours_verdicts(tmp_path):
    import subprocess
    import sys

    from seedflood_p2p.workload.models import weights_sha256

    model, _ = load_model("tiny-llama")
    config = CONFIG.replace(base_sha256=weights_sha256(model))
    updates = _updates(6, [A, B, C, D, X], seed=1)
    claim = next(m for m in updates if m.peer == X and m.round == 2)
    path = tmp_path / "ledger.sqlite"
    with Ledger(path, config.run_id) as ledger:
        ledger.claim(config, "")
        ledger.add(updates)
        ledger.add_audits([AuditRecord(X, 2, a, (claim.scalars[0] + 1.0,)) for a in (A, B, C)])

    def replayed(messages):
        fresh, _ = load_model("tiny-llama")
        replay(fresh, config, messages)
        return weights_sha256(fresh)

    out = subprocess.run(
        [sys.executable, "-m", "seedflood", "replay", "--ledger", str(path),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    digest = out.stdout.strip().splitlines()[-1]
    assert digest == replayed([m for m in updates if m.peer != X])
    assert digest != replayed(updates)
    assert "is banned" in out.stderr


# -- the tests' cheating peer: harness/hooked_peer.py --cheat ----------------------


def test_test_cheats_send_what_their_name_says(tmp_path):
    from harness.hooked_peer import cheated

    rule = SETTINGS.rule
    with Ledger(tmp_path / "l.sqlite", RUN_ID) as ledger:
        others = [UpdateMessage(r, p, quantize_scalars([0.5 + r + i])) for r in range(6)
                  for i, p in enumerate((A, B))]  # fmt: skip
        ledger.add(others)
        honest = UpdateMessage(6, X, quantize_scalars([0.75]))
        assert cheated("flip", honest, ledger).scalars == (-0.75,)
        assert cheated("x3", honest, ledger).scalars == (2.25,)
        random_claim = cheated("random", honest, ledger)
        recent = {m.scalars for m in others if m.round >= 2}
        assert random_claim.scalars in recent  # an honest size: someone's recent claim ...
        assert rule.mismatches(honest.scalars, random_claim.scalars)  # ... not its own
        assert cheated("random", honest, ledger) == random_claim  # seeded by (peer, round)
        assert all(cheated(h, honest, ledger).round == 6 for h in ("flip", "x3", "random"))


def test_only_the_hooked_peer_cheats(capsys, tmp_path):
    """`seedflood peer` has no flag that makes it cheat; harness/hooked_peer.py takes
    the peer's flags and its own."""
    from harness.hooked_peer import build_parser
    from seedflood.cli import main

    argv = ["peer", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/Qm", "--data-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--cheat", "random"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --cheat random" in capsys.readouterr().err
    args = build_parser().parse_args([*argv, "--cheat", "turn", "--until-round", "3"])
    assert (args.cheat, args.until_round, args.data_dir) == ("turn", 3, tmp_path)


def test_a_sender_between_two_bans_is_matched_on_its_state_with_no_retry(tmp_path):
    """Bans are timed: X2's verdict takes effect in S_7 (its records' effective round 4 <
    7), X1's only later (9). An honest sender training round 7 counted X1's updates and
    not X2's. An auditor that knows both bans recomputes S_7 exactly, X1's updates put back
    from its waiting ones, and matches with no retry. (Before, a verdict acted on arrival
    and the auditor retried each set of bans the sender may not have known; the bench's
    3-cheater run once accused every honest peer here.)"""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    X1, X2 = b"peer-X1", b"peer-X2"
    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)  # cheats that move the model visibly
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = _updates(3, [B, X1, X2], seed=3)
    claims = {(m.peer, m.round): m.scalars for m in history}
    settings = AuditSettings(enabled=True, lag=0)
    bans = [AuditRecord(X2, 0, a, (claims[(X2, 0)][0] + 1.0,), 4) for a in (A, B, D)]
    bans += [AuditRecord(X1, 1, a, (claims[(X1, 1)][0] + 1.0,), 9) for a in (A, B, D)]
    base = {k: w.clone() for k, w in live.weights().items()}
    # The sender's S_7: base + B's + X1's updates (X2 banned there, X1 not yet).
    live.apply([m for m in history if m.peer in (B, X1)])
    claim, _ = zo_step(live.engine, tokenizer, task, A, 7)
    live.load_weights(base)
    ledger.add(history + [claim])
    ledger.add_audits(bans)
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    audits.round = 10
    audits.set_standing(audits.judge())
    st = audits.standing
    assert set(audits.banned) == {X1, X2}
    assert st.banned_at(7) == {X2} and st.banned_at(10) == {X1, X2} and not st.banned_at(4)
    audits.apply(history)  # the auditor's state: base + B's only
    assert {m.peer for m in audits.applied} == {B}
    # The state with both bans (what the auditor holds) mismatches:
    whole = recompute(live.engine, tokenizer, task, claim)
    assert settings.rule.mismatches(claim.scalars, whole)
    audits.due[(A, 7)] = "recheck"
    ((record, mismatch),) = audits.audit(audits.ready(10), live.engine, tokenizer, task)
    assert not mismatch and not settings.rule.mismatches(claim.scalars, record.scalars)
    assert audits.counts["late_state_retries"] == 0
    ledger.close()


def _late_row_audit(tmp_path, cheat_sign: float, burst: bool = False, probation: bool = False):
    """Sender A trained round 3 before straggler X's round-2 update reached it; auditor C
    received that update in a later round than A's (`burst`: all in one round, as after
    the auditor slept). Returns (audit record, mismatch, audits, the scalars recomputed
    on C's whole settled state)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)  # one update moves the model visibly
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = _updates(3, [B, X], seed=5)
    late = next(m for m in history if m.peer == X and m.round == 2)
    on_time = [m for m in history if m is not late]
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply(on_time)  # the sender's state: everything but the late update
    honest, _ = zo_step(live.engine, tokenizer, task, A, 3)
    live.load_weights(base)
    claim = UpdateMessage(3, A, quantize_scalars([cheat_sign * s for s in honest.scalars]))
    ledger.add(history + [claim])
    settings = AuditSettings(enabled=True, lag=0)
    # with `probation`, A is new to a run founded by B, X and C: auditing it is paid work
    rules = ProbationSettings(frozenset([B, X, C]), vouches=2) if probation else None
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1), rules)
    if probation:
        audits.set_standing(audits.judge())
        assert A in audits.standing.probationers
        audits.tokens = 5.0  # capped to two rounds' worth when the round earns its share
    audits.round = 3
    audits.on_accept(on_time, 4)
    audits.round = 3 if burst else 4
    audits.on_accept([claim], 4)
    audits.round = 3 if burst else 5
    audits.on_accept([late], 4)  # reached the auditor after the sender's update
    audits.apply(history)  # the auditor's settled state of round 3: all of rounds < 3
    whole = recompute(live.engine, tokenizer, task, claim)
    audits.due[(A, 3)] = "recheck"
    ((record, mismatch),) = audits.audit(audits.ready(6), live.engine, tokenizer, task)
    ledger.close()
    return record, mismatch, audits, whole


def test_an_honest_sender_that_missed_a_late_update_is_matched(tmp_path):
    """The daemon bench's honest-only run once convicted three honest senders: they trained
    before a straggler's settled update reached them, and every auditor recomputed on a
    state holding it. The auditor now also tries the states without the updates that
    reached it last, and finds the sender's."""
    record, mismatch, audits, whole = _late_row_audit(tmp_path, cheat_sign=1.0)
    rule = AuditSettings(enabled=True).rule
    assert rule.mismatches(record.scalars, whole)  # the whole settled state does not match
    assert not mismatch  # the state without the late update does
    assert audits.counts["late_state_matches"] == 1 and audits.counts["late_state_retries"] == 1
    assert audits.late_matches == {"after": 1}  # it reached the auditor after the claim


def test_after_a_burst_the_late_update_is_found_among_the_tied_ones(tmp_path):
    record, mismatch, audits, whole = _late_row_audit(tmp_path, cheat_sign=1.0, burst=True)
    assert AuditSettings(enabled=True).rule.mismatches(record.scalars, whole)
    assert not mismatch and audits.counts["late_state_matches"] == 1
    assert 1 <= audits.counts["late_state_retries"] <= 8  # MAX_LATE_STATES
    assert sum(audits.late_matches.values()) == 1 and "after" not in audits.late_matches


def test_a_probationers_retries_are_few_and_paid_from_the_verification_budget(tmp_path):
    """Fresh keys are free, so a probationer's mismatch tries only PROBATION_LATE_STATES
    states, each paid from the budget like an audit (`share` then bounds the compute)."""
    from peer.audit_duty import PROBATION_LATE_STATES

    for name in "xyz":
        (tmp_path / name).mkdir()
    _, mismatch, audits, _ = _late_row_audit(tmp_path / "x", cheat_sign=-1.0, probation=True)
    assert mismatch and audits.counts["late_state_retries"] == PROBATION_LATE_STATES
    assert audits.counts["probation_retries"] == PROBATION_LATE_STATES
    # the round's budget (at most 1 saved up at share 0.25) paid the re-check; the retries
    # are a debt the next rounds repay before any other probation audit
    assert audits.tokens == 1.0 - 1 - PROBATION_LATE_STATES
    unpaid = _late_row_audit(tmp_path / "y", cheat_sign=-1.0, burst=True)[2]
    assert unpaid.counts["late_state_retries"] > PROBATION_LATE_STATES  # an established sender
    # an honest probationer that missed the late update: matched on the first retry
    _, mismatch, audits, _ = _late_row_audit(tmp_path / "z", cheat_sign=1.0, probation=True)
    assert not mismatch and audits.late_matches == {"after": 1}
    assert audits.tokens == 1.0 - 1 - 1


def test_a_cheater_is_not_cleared_by_the_late_update_states(tmp_path):
    from peer.audit_duty import MAX_LATE_STATES

    record, mismatch, audits, _ = _late_row_audit(tmp_path, cheat_sign=-1.0)  # sign flip
    assert mismatch
    assert audits.counts["late_state_matches"] == 0 and audits.counts["late_state_retries"] >= 1
    # we know when its update came: "after" first, then the newest-arrived states, every
    # one tried and none matched; at most MAX_LATE_STATES in all
    kinds = [kind for kind, _ in audits._late_states(A, 3)]
    assert kinds[0] == "after" and "newest" in kinds
    assert audits.counts["late_state_retries"] == len(kinds) <= MAX_LATE_STATES
    del audits.arrival[(A, 3)]  # without an arrival record: only the newest-arrived states
    without = [kind for kind, _ in audits._late_states(A, 3)]
    assert set(without) == {"newest"} and len(without) <= MAX_LATE_STATES


def test_arrival_stamps_are_kept_for_every_round_an_audit_can_ask_about(tmp_path):
    """A large swarm: more stamps a round than ARRIVALS_KEPT in all. Every stamp of our
    last ARRIVAL_ROUNDS + lag rounds stays (an audit at round t + lag + 3 reads the late
    rows of S_t); older rounds go, but never below ARRIVALS_KEPT stamps; a row stamped
    again later (its record came late) keeps its new stamp."""
    from peer import audit_duty as module
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    ledger = Ledger(tmp_path / "l.sqlite", RUN_ID)
    model, _ = load_model("tiny-llama")
    live = LiveModel(SubCGE(model, CONFIG), ledger)
    audits = module.PeerAudits(SETTINGS, b"s", C, ledger, live, AuditIntake(ledger, 1))
    per_round = module.ARRIVALS_KEPT // 8  # 8 of our rounds hold ARRIVALS_KEPT stamps
    horizon = module.ARRIVAL_ROUNDS + SETTINGS.lag
    last = horizon + 20
    peers = [bytes([i % 256, i // 256]) * 19 for i in range(per_round)]
    for our_round in range(last + 1):
        audits.round = our_round  # the round we train (take_settled sets it)
        audits.on_accept([UpdateMessage(our_round, p, (0.5,)) for p in peers], len(peers))
        if our_round == 5:
            audits.rewind.arrived_late((peers[0], 0), our_round)  # a late record: stamped now
    kept_rounds = {stamp[0] for stamp in audits.arrival.values()}
    assert kept_rounds == set(range(last - horizon, last + 1))  # the horizon, no more
    assert len(audits.arrival) == (horizon + 1) * per_round > 2 * module.ARRIVALS_KEPT
    assert (peers[0], 0) not in audits.arrival  # its new stamp (round 5) is old too by now
    newest = max(audits.arrival, key=audits.arrival.get)
    assert newest == (peers[-1], last)
    ledger.close()


def test_a_small_swarm_keeps_its_latest_arrival_stamps(tmp_path):
    """Few peers: the latest ARRIVALS_KEPT stamps stay though older than the horizon, and
    a re-stamped row is judged by its new stamp."""
    from peer import audit_duty as module
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    ledger = Ledger(tmp_path / "l.sqlite", RUN_ID)
    model, _ = load_model("tiny-llama")
    live = LiveModel(SubCGE(model, CONFIG), ledger)
    audits = module.PeerAudits(SETTINGS, b"s", C, ledger, live, AuditIntake(ledger, 1))
    rounds = 2 * module.ARRIVALS_KEPT  # two peers: 4 * ARRIVALS_KEPT updates
    for our_round in range(rounds):
        audits.round = our_round
        audits.on_accept([UpdateMessage(our_round, p, (0.5,)) for p in (B, D)], 2)
        if our_round == rounds - 10:
            audits.rewind.arrived_late((B, 0), our_round)  # round 0's row, stamped late
    assert module.ARRIVALS_KEPT <= len(audits.arrival) <= module.ARRIVALS_KEPT + 2
    assert (D, 0) not in audits.arrival and (D, rounds - 1) in audits.arrival
    assert audits.arrival[(B, 0)][0] == rounds - 10  # kept: its late stamp is recent
    ledger.close()


def test_a_sender_that_had_the_first_of_the_late_updates_is_matched(tmp_path):
    """Two updates reached the auditor after the sender's; the sender had got the first
    of them just before it trained, not the second."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = _updates(3, [B, X], seed=7)
    first = next(m for m in history if m.peer == X and m.round == 1)
    second = next(m for m in history if m.peer == X and m.round == 2)
    on_time = [m for m in history if m not in (first, second)]
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply(on_time + [first])  # the sender's state: all but the second late update
    claim, _ = zo_step(live.engine, tokenizer, task, A, 3)
    live.load_weights(base)
    ledger.add(history + [claim])
    settings = AuditSettings(enabled=True, lag=0)
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    for round_, batch in ((3, on_time), (4, [claim]), (5, [first]), (6, [second])):
        audits.round = round_
        audits.on_accept(batch, 4)
    audits.apply(history)
    audits.due[(A, 3)] = "recheck"
    ((record, mismatch),) = audits.audit(audits.ready(9), live.engine, tokenizer, task)
    assert not mismatch and audits.counts["late_state_matches"] == 1
    ledger.close()


def test_a_newcomer_that_had_not_seen_its_own_vouches_is_matched(tmp_path):
    """On probation a newcomer's own updates count only once vouched. Its round-3 update was
    trained before the vouches existed; the auditor had counted them (a late judgement at
    its round 6) before that update arrived, so arrival order alone does not point at them.
    The vouches were published at round 5: they take effect from S_6 (lag 0), so the audit
    of round 3 recomputes on S_3 without them and matches with no retry (this took a
    LATE_JUDGEMENTS retry before vouches had an effective round)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.core.extra_settings import ProbationSettings
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = _updates(3, [A, B], seed=11) + _updates(2, [D], seed=12)
    own = [m for m in history if m.peer == D]
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply([m for m in history if m.peer != D])  # the newcomer's state: no vouch seen
    claim, _ = zo_step(live.engine, tokenizer, task, D, 3)
    live.load_weights(base)
    ledger.add(history + [claim])
    settings = AuditSettings(enabled=True, lag=0)
    probation = ProbationSettings(founders=frozenset([A, B, C]), vouches=2)
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1), probation)
    audits.set_standing(audits.judge())
    audits.round = 3
    audits.on_accept(history, 4)
    audits.apply(history)  # the newcomer's rows wait: not vouched yet
    assert len(audits.waiting) == len(own)
    ledger.add_audits([AuditRecord(D, m.round, A, m.scalars, 5) for m in own])  # two vouches
    audits.round = 6
    audits.set_standing(audits.judge())  # ... so D is established: its rows count in S_6
    assert D in audits.standing.established and not audits.waiting
    assert not audits.standing.counts_in(D, 1, 5) and audits.standing.counts_in(D, 1, 6)
    whole = recompute(live.engine, tokenizer, task, claim)
    audits.round = 7
    audits.on_accept([claim], 4)  # it arrives after the vouches had been counted here
    audits.due[(D, 3)] = "recheck"
    ((record, mismatch),) = audits.audit(audits.ready(7), live.engine, tokenizer, task)
    assert settings.rule.mismatches(claim.scalars, whole)  # the whole settled state does not
    assert not mismatch and audits.counts["late_state_retries"] == 0
    assert record.at == 7
    ledger.close()


def test_turn_is_honest_on_probation_and_negates_once_established(tmp_path):
    """`--cheat turn` (harness/hooked_peer.py): the honest update while its ledger's
    standing has it on probation; negated from the first update once that standing has it
    established."""
    import base58

    from harness.hooked_peer import cheated
    from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX

    founders = [ED25519_PEER_ID_PREFIX + bytes([i]) * 32 for i in (1, 2)]
    turner = ED25519_PEER_ID_PREFIX + bytes([9]) * 32
    config = dataclasses.replace(
        CONFIG,
        extra={
            "audit": {"quorum": 2},
            "probation": {"founders": [base58.b58encode(f).decode() for f in founders],
                          "vouches": 2},
        },
    )  # fmt: skip
    with Ledger(tmp_path / "l.sqlite", config.run_id) as ledger:
        ledger.claim(config, "")
        mine = [UpdateMessage(r, turner, quantize_scalars([0.25 + r])) for r in range(4)]
        ledger.add(mine[:2])
        honest = UpdateMessage(2, turner, quantize_scalars([0.5]))
        assert cheated("turn", honest, ledger) == honest  # on probation: honest
        ledger.add_audits([AuditRecord(turner, 0, founders[0], mine[0].scalars)])
        assert cheated("turn", honest, ledger) == honest  # one vouch of two: still honest
        ledger.add_audits([AuditRecord(turner, 1, founders[1], mine[1].scalars)])
        assert cheated("turn", honest, ledger).scalars == (-0.5,)  # established: negates
        # ... for good: a later ban (or any later view) does not turn it back
        ledger.add_audits([AuditRecord(turner, 1, f, (-9.0,)) for f in founders])
        assert cheated("turn", honest, ledger).scalars == (-0.5,)
    # a peer of a run without founders (probation off) never turns
    with Ledger(tmp_path / "m.sqlite", CONFIG.run_id) as ledger:
        ledger.claim(CONFIG, "")
        other = UpdateMessage(2, X, quantize_scalars([0.5]))
        assert cheated("turn", other, ledger) == other


def _sleeper_audit(tmp_path, cheat_sign: float, with_held: bool = True, lied: bool = False):
    """Sender A trained round 14 while sleeper X's rounds 3-11 had not reached it (X slept
    after its round 2 and published them once awake: tests/test_audit_sleep.py), and the
    auditor C stamped X's rows before A's update reached it (as the sleeper, auditing, did
    with its own), so arrival order says nothing. A's update carries the digest of the rows
    it held (or none). `lied`: A trained on the whole settled state instead, and C's copy
    of its update carries a digest naming the state without X's late rows (a sender that
    sent two copies with different digests). Returns (A's claim, mismatch, audits, the
    scalars recomputed on C's whole settled state)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.protocol.message import Envelope
    from seedflood_p2p.protocol.update import encode_update

    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)  # one update moves the model visibly
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = [m for m in _updates(12, [B, X], seed=7) if m.peer == B or m.round <= 11]
    asleep = [m for m in history if m.peer == X and m.round >= 3]
    held_rows = [m for m in history if m not in asleep]
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply(history if lied else held_rows)  # the sender's state
    honest, _ = zo_step(live.engine, tokenizer, task, A, 14)
    live.load_weights(base)
    claim = UpdateMessage(14, A, quantize_scalars([cheat_sign * s for s in honest.scalars]))
    held = state_digest((m.peer, m.round) for m in held_rows)
    data = encode_update(config.run_id, 14, claim.scalars, held if with_held else None)
    ledger.add(history + [claim], [None] * len(history) + [Envelope(data, b"s", b"sig")])
    settings = AuditSettings(enabled=True, lag=2)
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    audits.round = 12
    audits.on_accept(history, 4)  # X's rows stamped before A's update came
    audits.on_accept([claim], 4)
    audits.apply(history)  # the auditor's settled state of round 14: all of rounds < 12
    whole = recompute(live.engine, tokenizer, task, claim)
    audits.due = {(A, 14): "recheck"}  # this audit only (not the draws among the others)
    ((record, mismatch),) = audits.audit(audits.ready(20), live.engine, tokenizer, task)
    assert (record.accused, record.round) == (A, 14)
    ledger.close()
    return claim, mismatch, audits, whole


def test_a_sender_that_lacked_a_sleepers_rounds_is_matched_by_its_held_state(tmp_path):
    """The held-state digest names the sleeper's 9 late rows: the first recomputation, on
    exactly the sender's state, matches. Without it, the guessed states miss them (the CI
    failure)."""
    claim, mismatch, audits, whole = _sleeper_audit(tmp_path, cheat_sign=1.0)
    assert AuditSettings(enabled=True).rule.mismatches(claim.scalars, whole)
    assert not mismatch
    assert audits.counts["held_found"] == 1 and audits.counts["late_state_retries"] == 0
    (tmp_path / "old").mkdir()
    _, mismatch, audits, _ = _sleeper_audit(tmp_path / "old", cheat_sign=1.0, with_held=False)
    assert mismatch and audits.counts["late_state_matches"] == 0  # guessing: accused


def test_a_digest_that_names_another_state_cannot_turn_an_audit_into_an_accusation(tmp_path):
    """A copy of an honest update whose digest names a state the sender did not train on
    mismatches there; the auditor then tries the settled state too and matches, as the
    peers holding the true copy do (else it would accuse, be refuted and banned)."""
    _, mismatch, audits, _ = _sleeper_audit(tmp_path, cheat_sign=1.0, lied=True)
    assert not mismatch
    assert audits.counts["held_found"] == 1 and audits.late_matches == {"settled": 1}


def test_a_cheater_is_not_cleared_by_its_held_state_or_the_guessed_ones(tmp_path):
    _, mismatch, audits, _ = _sleeper_audit(tmp_path, cheat_sign=-1.0)
    assert mismatch and audits.counts["held_found"] == 1
    assert audits.counts["late_state_matches"] == 0 and audits.counts["late_state_retries"] >= 1


def test_the_held_digest_follows_the_rows_applied(tmp_path):
    """What a sender sends: the digest of the rows its weights hold, kept up to date as
    rows are applied, counted once per (peer, round), summed again after a rebuild."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, _ = load_model("tiny-llama")
    ledger = Ledger(tmp_path / "l.sqlite", RUN_ID)
    live = LiveModel(SubCGE(model, CONFIG), ledger)
    audits = PeerAudits(SETTINGS, b"s", C, ledger, live, AuditIntake(ledger, 1))
    rows = _updates(4, [A, B])
    audits.apply(rows[:3])
    assert audits.timed_step(lambda: "step")[1] == state_digest((m.peer, m.round) for m in rows[:3])
    audits.apply(rows[3:] + [rows[0].negated()])  # a repeat of a key counts once
    assert audits.held_digest() == state_digest((m.peer, m.round) for m in rows)
    audits.applied = [m for m in audits.applied if m.peer == A]  # a ban took B's rows back
    assert audits.held_digest() == state_digest((m.peer, m.round) for m in rows if m.peer == A)
    ledger.close()


def test_a_judgement_reads_a_claim_again_after_its_row_is_replaced(tmp_path):
    """`PeerAudits.read_inputs` keeps the claims it read (a row's scalars change only by
    an equivocation's replacement): a replaced row's new scalars, and a row that arrives
    after a record about it, are what the next judgement reads, as a fresh read would."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, _ = load_model("tiny-llama")
    ledger = Ledger(tmp_path / "l.sqlite", CONFIG.run_id)
    live = LiveModel(SubCGE(model, CONFIG), ledger)
    settings = AuditSettings(enabled=True, lag=0, quorum=2)
    ledger.add([UpdateMessage(0, B, (0.5,)), UpdateMessage(0, A, (0.25,))])
    # two mismatches of B's 0.5, and a record about a row (D, 0) not yet in the ledger
    ledger.add_audits([AuditRecord(B, 0, q, (1.5,), 4) for q in (A, C)])
    ledger.add_audits([AuditRecord(D, 0, A, (2.0,), 4), AuditRecord(D, 0, C, (2.0,), 4)])
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    assert set(audits.judge().banned) == {B}
    ledger.replace(UpdateMessage(0, B, (1.5,)), None)  # the claim the records now match
    ledger.add([UpdateMessage(0, D, (-1.0,))])  # the row the other records mismatch
    cached = audits.judge()
    assert set(cached.banned) == {D}
    assert cached == standing_of_ledger(ledger, settings, audits.probation)
    ledger.close()
