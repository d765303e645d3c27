"""Probation in time (algorithm/probation.py, "From which settled state"): a vouch and an
establishment take effect from the round their record fixes, so the counted set of each
settled state S_t is a function of what a sender training round t surely held (updates
of rounds < t - lag, records of effective rounds < t - lag), whatever order updates and
records arrived in. docs/ROADMAP.md: with many newcomers on real daemons the counted set
of S_t used to depend on when the records reached each peer, and audits convicted honest
senders. No processes: pure functions, a stand-in engine, the tiny model."""

import dataclasses
import random

import pytest
import torch

from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.probation import effective_round, standing
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.audit_record import decode_audit, encode_audit
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, quantize_scalars
from seedflood_p2p.storage.ledger import Ledger

LAG = 1
AUDIT = AuditSettings(enabled=True, lag=LAG, quorum=3)
DELAY = AUDIT.delay
F = [f"founder-{i}".encode() for i in range(3)]
NEWCOMERS = [f"newcomer-{i}".encode() for i in range(8)]
SYBILS = [f"sybil-{i}".encode() for i in range(3)]
PROBATION = ProbationSettings(founders=frozenset(F), vouches=2)
CONFIG = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=0.1, n_ref=4, batch_size=8)


def record(accused, round_, auditor, scalars, at) -> AuditRecord:
    return AuditRecord(accused, round_, auditor, scalars, at)


def _ledger_of(seed: int, rounds: int = 24):
    """Founders from round 0, eight newcomers joining at different rounds, three sybils that
    vouch for each other; vouches (matches) by founders and by newcomers, published at
    random rounds (some backdated or without `at`), and lone mismatches (no quorum, no
    ban). Returns (claims, records)."""
    rng = random.Random(seed)
    joins = {p: 0 for p in F} | {p: rng.randrange(0, rounds // 2) for p in NEWCOMERS + SYBILS}
    claims = {
        (t, p): (round(rng.uniform(-1, 1), 3),)
        for p, first in joins.items()
        for t in range(first, rounds)
    }
    records = []
    for (t, p), scalars in claims.items():
        if p in F:
            continue
        auditors = F + NEWCOMERS if p in NEWCOMERS else SYBILS
        for auditor in rng.sample([a for a in auditors if a != p], rng.choice([0, 0, 1, 2])):
            at = rng.choice([-1, t, t + DELAY + rng.randrange(0, 8), t + DELAY + 1])
            records.append(record(p, t, auditor, scalars, at))
        if rng.random() < 0.05:  # a lone accusation: one vote, the case stays open
            records.append(record(p, t, rng.choice(F), (scalars[0] + 1.0,), t + DELAY))
    return claims, records


def _prefix(claims, records, t):
    """What a sender training round t surely held: updates of rounds < t - lag, records of
    effective rounds < t - lag."""
    from seedflood_p2p.algorithm.probation import effective_round

    held = t - LAG
    return (
        {k: v for k, v in claims.items() if k[0] < held},
        [r for r in records if effective_round(r, AUDIT) < held],
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_counted_set_of_s_t_is_the_one_of_the_prefix_the_sender_held(seed):
    claims, records = _ledger_of(seed)
    full = standing(claims, records, AUDIT, PROBATION)
    assert not full.banned
    assert len(full.established) > len(F)  # some newcomers earned standing, at some round
    changed = 0
    previous = None
    for t in range(40):
        pre_claims, pre_records = _prefix(claims, records, t)
        pre = standing(pre_claims, pre_records, AUDIT, PROBATION)
        got = {(p, r) for (r, p) in claims if full.counts_in(p, r, t)}
        want = {(p, r) for (r, p) in pre_claims if pre.counts(p, r)}
        assert got == want, t
        assert got == {(p, r) for (r, p) in pre_claims if pre.counts_in(p, r, t)}
        changed += previous is not None and got - previous != {
            (p, t - LAG - 1) for p in F if (t - LAG - 1, p) in claims
        }
        previous = got
    assert changed  # rows started to count late (vouched after their round), as they do
    # in the end: the untimed rule
    assert {(p, r) for (r, p) in claims if full.counts_in(p, r, 10**6)} == {
        (p, r) for (r, p) in claims if full.counts(p, r)
    }


@pytest.mark.parametrize("seed", range(4))
def test_count_from_does_not_depend_on_the_order_of_records_or_updates(seed):
    claims, records = _ledger_of(seed)
    full = standing(claims, records, AUDIT, PROBATION)
    rng = random.Random(seed)
    shuffled_records = records[:]
    rng.shuffle(shuffled_records)
    items = list(claims.items())
    rng.shuffle(items)
    again = standing(dict(items), shuffled_records, AUDIT, PROBATION)
    for t, p in claims:
        assert full.count_from(p, t) == again.count_from(p, t)


def test_a_backdated_or_missing_at_counts_from_round_plus_delay():
    claims = {(t, p): (0.5,) for t in range(20) for p in F + NEWCOMERS[:1]}
    n = NEWCOMERS[0]
    records = [record(n, 2, F[0], (0.5,), 0), record(n, 3, F[1], (0.5,), -1)]
    records += [record(n, 4, F[2], (0.5,), 15)]
    st = standing(claims, records, AUDIT, PROBATION)
    assert st.count_from(n, 2) == 2 + DELAY  # backdated: read as early as an honest one
    assert st.count_from(n, 3) == 3 + DELAY  # an older record without `at`
    assert st.vouched_at[(n, 4)] == 15  # its own vouch is later than ...
    assert st.count_from(n, 4) == 3 + DELAY  # ... the establishment it counts by (4 > since)
    assert st.established_at[n] == 3 + DELAY  # its second vouch
    assert st.count_from(n, 9) == 3 + DELAY  # counts by establishment from then on
    assert st.count_from(n, 1) == st.count_from(n, 0) > 10**9  # never: unvouched, before
    assert not st.counts_in(n, 3, 3 + DELAY + LAG) and st.counts_in(n, 3, 3 + DELAY + LAG + 1)


def test_at_travels_on_the_wire_and_in_the_ledger(tmp_path):
    run_id = CONFIG.run_id
    data = encode_audit(run_id, F[1], 7, (0.25,), 12)
    assert decode_audit(data, run_id, F[0], 1) == AuditRecord(F[1], 7, F[0], (0.25,), 12)
    old = encode_audit(run_id, F[1], 7, (0.25,))  # an older record: 5 fields
    assert decode_audit(old, run_id, F[0], 1).at == -1
    import msgpack

    from seedflood_p2p.protocol.framing import Rejected

    body = msgpack.unpackb(data)
    for bad in ("7", -1, True):
        with pytest.raises(Rejected):
            decode_audit(msgpack.packb(body[:5] + [bad]), run_id, F[0], 1)
    ledger = Ledger(tmp_path / "l.sqlite", run_id)
    ledger.add_audits([AuditRecord(F[1], 7, F[0], (0.25,), 12), AuditRecord(F[1], 8, F[0], (1.0,))])
    assert [r.at for r in ledger.audits()] == [12, -1]
    ledger.close()


# ------------------------------------------------ a daemon's S_t, whatever the arrival order


class _Engine:
    """A stand-in for the estimator: the daemon's bookkeeping only (what is applied)."""

    config = CONFIG

    def accumulate(self, messages, sizes=None):
        return len(list(messages))

    def commit(self):
        pass


def _deliver(items, ledger, live, audits) -> None:
    """What reaches a daemon in one round: updates logged and received, records judged."""
    for kind, item in items:
        if kind == "u":
            ledger.add([item])
            live.receive([item])
            audits.on_accept([item], len(F) + len(NEWCOMERS))
        else:
            ledger.add_audits([item])
            audits.set_standing(audits.judge())


def _arrivals(claims, records, seed):
    """Each update of round r reaches the peer in one of rounds r .. r + lag, each record
    published at `at` in one of at .. at + lag (the lag rule's assumption), in a drawn
    order. -> {our round: [("u", message) | ("r", record), ...]}"""
    rng = random.Random(seed)
    out: dict[int, list] = {}
    for (t, p), scalars in claims.items():
        out.setdefault(t + rng.randint(0, LAG), []).append(("u", UpdateMessage(t, p, scalars)))
    for r in records:
        at = max(r.at, r.round)
        out.setdefault(at + rng.randint(0, LAG), []).append(("r", r))
    for events in out.values():
        rng.shuffle(events)
    return out


def _daemon_states(tmp_path, name, claims, records, seed, rounds, final=None):
    """A peer (peer/audit_duty.py) that trains rounds 0..rounds-1 and receives updates and
    records as `_arrivals` draws them, judging after each record; -> [counted set of S_t]
    (and with `final`, a list, the counted set after `apply_final` appended to it)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    ledger = Ledger(tmp_path / f"{name}.sqlite", CONFIG.run_id)
    live = LiveModel(_Engine(), ledger)
    audits = PeerAudits(AUDIT, b"secret", F[0], ledger, live, AuditIntake(ledger, 1), PROBATION)
    audits.set_standing(audits.judge())
    arrivals = _arrivals(claims, records, seed)
    states = []
    for t in range(rounds):
        audits.apply(audits.take_settled(t))
        states.append(frozenset((m.peer, m.round) for m in audits.applied))
        _deliver(arrivals.get(t, []), ledger, live, audits)
    if final is not None:
        audits.apply_final(live.take())
        final.append(frozenset((m.peer, m.round) for m in audits.applied))
    ledger.close()
    return states


def test_a_daemons_settled_states_do_not_depend_on_arrival_order(tmp_path):
    """Three peers receive the same updates and records in different orders (each within
    the lag rule's window): the settled state of every round counts the same rows on all,
    the rows the ledger prefix of that round counts. (Before vouches had an effective
    round, a row counted from whenever its vouch reached each peer.)"""
    claims, records = _ledger_of(0, rounds=20)
    records = [dataclasses.replace(r, at=max(r.at, r.round + DELAY)) for r in records]
    full = standing(claims, records, AUDIT, PROBATION)
    runs = [_daemon_states(tmp_path, f"p{seed}", claims, records, seed, 36) for seed in range(3)]
    assert runs[0] == runs[1] == runs[2]
    for t, state in enumerate(runs[0]):
        assert state == {(p, r) for (r, p) in claims if full.counts_in(p, r, t)}, t


def test_at_the_end_the_model_holds_every_update_that_counts(tmp_path):
    """The last rounds' vouches take effect after the last round trained: at the end
    (`apply_final`, before the checkpoint) they are applied, so the model is base + the
    counted ledger, what a replay applies."""
    n = NEWCOMERS[0]
    claims = {(t, p): (round(0.1 * t - 0.5, 3),) for t in range(20) for p in F + [n]}
    records = [record(n, 5, F[0], claims[(5, n)], 10)]  # one vouch: counts from S_12
    records.append(record(n, 9, F[1], claims[(9, n)], 20))  # reaches the peer by round 21
    full = standing(claims, records, AUDIT, PROBATION)
    final: list = []
    states = _daemon_states(tmp_path, "end", claims, records, 1, 22, final)
    counted = {(p, r) for (r, p) in claims if full.counts(p, r)}
    assert states[-1] != counted  # vouched after the last round: not in its state
    assert final == [counted]


# --------------------------------------- eight honest newcomers, every update re-computed


def test_eight_honest_newcomers_vouched_at_different_rounds_all_match(tmp_path, one_thread):
    """Three founders and eight honest newcomers joining at different rounds; founders
    vouch newcomers' updates at different rounds (two vouches establish). Every peer
    trains round t on S_t as the rule defines it. An auditor that received updates and
    records in its own order (within the lag rule's windows), holding the settled state
    a daemon holds, recomputes every update of the run: all match, with no retry."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.algorithm.audit_rules import recompute as recompute_on
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.algorithm.trainer import zo_step
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    task = load_task("synthetic-sentiment")
    rounds = 12
    joins = {p: 0 for p in F} | {n: i // 2 for i, n in enumerate(NEWCOMERS)}
    wait = {n: i % 4 for i, n in enumerate(NEWCOMERS)}  # extra rounds before a vouch
    claims: dict = {}
    records: list[AuditRecord] = []
    model, tokenizer = load_model("tiny-llama")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    for t in range(rounds):
        # S_t as the rule defines it, from the ledger so far (later records take effect
        # later): every honest peer trains on it
        st = standing(claims, records, AUDIT, PROBATION)
        counted = sorted(
            (UpdateMessage(r, p, g) for (r, p), g in claims.items() if st.counts_in(p, r, t)),
            key=lambda m: (m.round, m.peer),
        )
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
        replay(model, CONFIG, counted)
        engine = SubCGE(model, CONFIG)
        for p, first in joins.items():
            if t >= first:
                message, _ = zo_step(engine, tokenizer, task, p, t)
                claims[(t, p)] = message.scalars
        # founders vouch (their recomputation on S_r matches an honest claim: the claim)
        for i, n in enumerate(NEWCOMERS):
            r = t - DELAY - wait[n]
            if (r, n) in claims and n not in st.established:
                auditor = F[(t + i) % len(F)]
                records.append(AuditRecord(n, r, auditor, claims[(r, n)], t))
    final = standing(claims, records, AUDIT, PROBATION)
    assert set(NEWCOMERS) <= final.established
    assert len({final.established_at[n] for n in NEWCOMERS}) >= 3  # at different rounds
    # The auditor: founder F[0]'s daemon bookkeeping, on the tiny model.
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(base[n])
    ledger = Ledger(tmp_path / "auditor.sqlite", CONFIG.run_id)
    live = LiveModel(SubCGE(model, CONFIG), ledger)
    audits = PeerAudits(AUDIT, b"secret", F[0], ledger, live, AuditIntake(ledger, 1), PROBATION)
    audits.set_standing(audits.judge())
    arrivals = _arrivals(claims, records, seed=5)
    end = rounds + DELAY + 8
    for t in range(end):
        audits.apply(audits.take_settled(t))
        _deliver(arrivals.get(t, []), ledger, live, audits)
    jobs = []
    for (r, p), g in sorted(claims.items()):
        if p != F[0] and final.counts(p, r):
            jobs.append((p, r, "recheck", g))
    results = audits.audit(jobs, live.engine, tokenizer, task)

    bad = [(rec.accused, rec.round) for rec, mismatch in results if mismatch]
    assert not bad
    assert audits.counts["late_state_retries"] == 0
    # The test can tell: on the state that counts every row vouched by the end (what an
    # auditor recomputed on when vouches had no effective round), honest updates mismatch.
    wrong = 0
    for p, r, _, g in jobs:
        late = [
            UpdateMessage(q, peer, claims[(q, peer)])
            for (q, peer) in claims
            if q < r - LAG and final.counts(peer, q) and not final.counts_in(peer, q, r)
        ]
        if late:
            message = UpdateMessage(r, p, g)
            on = audits._on_settled(
                r, late, lambda m=message: recompute_on(live.engine, tokenizer, task, m)
            )
            wrong += AUDIT.rule.mismatches(g, on)
    assert wrong > 0, wrong
    # ... and the auditor's weights are the replay of the counted rows (float32 rounding)
    counted = sorted(final.counted(ledger.messages()), key=lambda m: (m.round, m.peer))
    reference, _ = load_model("tiny-llama")
    replay(reference, CONFIG, counted)
    got = dict(model.named_parameters())
    for n, p in reference.named_parameters():
        torch.testing.assert_close(got[n].detach(), p.detach(), atol=1e-5, rtol=0)
    ledger.close()


def test_a_sender_that_trained_before_a_ban_took_effect_is_matched_on_its_exact_state(
    tmp_path, one_thread
):
    """Founder D trained round 9 before the ban of X (an established key that turned) took
    effect: its S_9 held X's counted updates (rounds 1-8; not round 0, never vouched) and
    Y's round-3 update, vouched by X alone. The ban's records are of round 12, so S_9 of
    every peer still counts those rows; the auditor, who knows the ban, recomputes S_9
    exactly (X's and Y's rows put back from its waiting ones) and matches with no retry.
    (Before bans were timed, it retried the states without each set of unknown bans.)"""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.algorithm.audit_rules import recompute
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.algorithm.trainer import zo_step
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    settings = AuditSettings(enabled=True, lag=0, quorum=3)
    a, b, c, d = F[0], F[1], F[2], b"founder-3"
    x, y = NEWCOMERS[0], NEWCOMERS[1]
    probation = ProbationSettings(founders=frozenset([a, b, c, d]), vouches=2)
    rng = random.Random(3)
    history = [
        UpdateMessage(t, p, quantize_scalars([rng.uniform(-1, 1)]))
        for t in range(9)
        for p in (a, b, x)
    ] + [UpdateMessage(3, y, quantize_scalars([0.9]))]
    claims = {(m.round, m.peer): m.scalars for m in history}
    vouches = [AuditRecord(x, 1, a, claims[(1, x)], 3), AuditRecord(x, 2, b, claims[(2, x)], 4)]
    vouches += [AuditRecord(y, 3, x, claims[(3, y)], 6)]  # only X vouches for Y
    st = standing(claims, vouches, settings, probation)
    in_s9 = {(m.peer, m.round) for m in history if st.counts_in(m.peer, m.round, 9)}
    assert (x, 0) not in in_s9 and (x, 1) in in_s9 and (x, 8) in in_s9 and (y, 3) in in_s9
    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.3)
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply([m for m in history if (m.peer, m.round) in in_s9])  # D's S_9
    claim, _ = zo_step(live.engine, tokenizer, task, d, 9)
    live.load_weights(base)
    # X's round-7 update fails 3 founders' audits (published at round 12)
    bans = [AuditRecord(x, 7, f, (claims[(7, x)][0] + 2.0,), 12) for f in (a, b, c)]
    ledger.add(history + [claim])
    ledger.add_audits(vouches + bans)
    audits = PeerAudits(settings, b"secret", c, ledger, live, AuditIntake(ledger, 1), probation)
    audits.round = 13
    live.receive(history + [claim])
    audits.on_accept(history + [claim], 6)
    audits.set_standing(audits.judge())
    assert x in audits.banned and x in audits.standing.banned_at(13)
    assert not audits.standing.banned_at(12)  # records of effective round 12: from S_13
    audits.apply(audits.take_settled(13))
    assert not any(m.peer in (x, y) for m in audits.applied)  # X's and Y's rows wait
    whole = recompute(live.engine, tokenizer, task, claim)
    assert settings.rule.mismatches(claim.scalars, whole)  # without X's and Y's rows
    ((record, mismatch),) = audits.audit(
        [(d, 9, "recheck", claim.scalars)], live.engine, tokenizer, task
    )
    assert not mismatch and audits.counts["late_state_retries"] == 0
    ledger.close()


# ------------------------------------------- bans in time: S_t's banned set is the prefix's


def _ledger_with_bans(seed: int, rounds: int = 24):
    """`_ledger_of` plus two cases per seed: a cheater whose update fails the 3 founders'
    audits (published at different rounds) while a newcomer vouched for it (banned too,
    and the rows it vouched for with it), and a newcomer accused by three others that the
    founders refute later (a ban while only the accusers had voted, turned back: the
    accusers banned instead). Returns (claims, records)."""
    claims, records = _ledger_of(seed, rounds)
    rng = random.Random(100 + seed)
    cheater, voucher, accused, *accusers = rng.sample(NEWCOMERS, 6)
    r = rng.choice([t for (t, p) in claims if p == cheater and t >= rounds // 2])
    wrong = (claims[(r, cheater)][0] + 1.0,)
    records += [record(cheater, r, f, wrong, r + DELAY + rng.randrange(0, 6)) for f in F]
    records.append(record(cheater, r, voucher, claims[(r, cheater)], r + DELAY))
    r = rng.choice([t for (t, p) in claims if p == accused and t >= rounds // 2])
    wrong = (claims[(r, accused)][0] - 1.0,)
    records += [record(accused, r, q, wrong, r + DELAY + i) for i, q in enumerate(accusers)]
    records += [record(accused, r, f, claims[(r, accused)], r + DELAY + 6) for f in F]
    return claims, records


@pytest.mark.parametrize("seed", range(6))
def test_the_banned_set_of_s_t_is_the_one_of_the_prefix_the_sender_held(seed):
    """S_t's banned set, and so its counted set, is the judgement of the ledger prefix a
    sender training t held: a ban counts from the round its deciding records take effect,
    a case turned back lifts it from the turning record's. (Before, the whole ledger's bans
    applied to every S_t: a sender that trained before a verdict reached it counted the
    banned peer's rows and its auditors did not.)"""
    claims, records = _ledger_with_bans(seed)
    full = standing(claims, records, AUDIT, PROBATION)
    assert full.banned  # the cheater at least
    sets = []
    for t in range(48):
        pre_claims, pre_records = _prefix(claims, records, t)
        pre = standing(pre_claims, pre_records, AUDIT, PROBATION)
        assert full.banned_at(t) == set(pre.banned), t
        got = {(p, r) for (r, p) in claims if full.counts_in(p, r, t)}
        assert got == {(p, r) for (r, p) in pre_claims if pre.counts(p, r)}, t
        sets.append(full.banned_at(t))
    assert not sets[0] and sets[-1] == set(full.banned)  # nobody at first, the ledger's at last
    assert len(set(sets)) >= 2  # bans took effect at some round, not on arrival


def test_bans_took_effect_at_different_rounds_and_one_was_turned_back():
    """The cases of `_ledger_with_bans` do what they say on at least one seed: a ban that
    holds for some states and is lifted later (the founders refuted the accusers)."""
    turned = 0
    for seed in range(6):
        claims, records = _ledger_with_bans(seed)
        full = standing(claims, records, AUDIT, PROBATION)
        spans = [s.banned for s in full.bans]
        turned += any(p not in later for i, s in enumerate(spans) for p in s for later in spans[i:])
    assert turned


@pytest.mark.parametrize("seed", range(3))
def test_the_banned_set_of_s_t_does_not_depend_on_the_order_records_arrive_in(seed):
    claims, records = _ledger_with_bans(seed)
    full = standing(claims, records, AUDIT, PROBATION)
    rng = random.Random(seed)
    for _ in range(3):
        shuffled = records[:]
        rng.shuffle(shuffled)
        again = standing(claims, shuffled, AUDIT, PROBATION)
        assert again.bans == full.bans
        for t in range(48):
            assert again.banned_at(t) == full.banned_at(t)


def test_a_ban_record_that_arrives_late_does_not_change_the_banned_set_of_earlier_states():
    """A peer that trained S_t before the third founder's mismatch record reached it, and an
    auditor that holds every record: both compute the same S_t from their ledgers, for
    every t the first peer's ledger settles (records of effective round < t - lag)."""
    claims, records = _ledger_with_bans(1)
    full = standing(claims, records, AUDIT, PROBATION)
    first = min(s.start for s in full.bans if s.banned)  # the first ban's prefix
    early = [r for r in records if effective_round(r, AUDIT) < first - 1]
    sender = standing(claims, early, AUDIT, PROBATION)  # the deciding record not there yet
    for t in range(first + LAG):  # every S_t that prefix settles
        assert sender.banned_at(t) == full.banned_at(t), t
        assert {(p, r) for (r, p) in claims if sender.counts_in(p, r, t)} == {
            (p, r) for (r, p) in claims if full.counts_in(p, r, t)
        }, t
    assert full.banned_at(first + LAG) and not sender.banned_at(first + LAG)


def test_daemons_settled_states_with_bans_do_not_depend_on_arrival_order(tmp_path):
    """Three peers receive the same updates and records, bans included, in different orders
    (within the lag rule's windows): every S_t counts the same rows on all, the rows of
    that round's ledger prefix; a ban takes back its peer's applied rows at the round it
    takes effect; at the end the model holds what the ledger counts."""
    claims, records = _ledger_with_bans(0, rounds=20)
    records = [dataclasses.replace(r, at=max(r.at, r.round + DELAY)) for r in records]
    full = standing(claims, records, AUDIT, PROBATION)
    assert full.banned and F[0] not in full.banned
    finals: list = []
    runs = [
        _daemon_states(tmp_path, f"p{seed}", claims, records, seed, 40, finals) for seed in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]
    for t, state in enumerate(runs[0]):
        assert state == {(p, r) for (r, p) in claims if full.counts_in(p, r, t)}, t
    assert any(
        {p for p, _ in runs[0][t]} & set(full.banned)
        and not {p for p, _ in runs[0][t + 1]} & set(full.banned)
        for t in range(39)
    )  # rows of a peer banned in the end counted, then were taken back in time
    assert finals[0] == finals[1] == finals[2] == {(p, r) for (r, p) in claims if full.counts(p, r)}


# ------------------------------------ two copies of a record that differ only in `at`


def _audit_signer():
    """An Ed25519 key that signs audit payloads (with `at`) as go-libp2p-pubsub does."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.proto import p2pd_pb2 as pb

    from seedflood_p2p.protocol.audit_record import audit_topic_for
    from seedflood_p2p.protocol.message import Envelope

    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    peer = bytes.fromhex("002408011220") + public

    def sign(run_id: str, accused: bytes, round_: int, scalars: tuple, at: int):
        data, seqno = encode_audit(run_id, accused, round_, scalars, at), at.to_bytes(8, "big")
        body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[audit_topic_for(run_id)])
        setattr(body, "from", peer)
        signature = key.sign(b"libp2p-pubsub:" + body.SerializeToString())
        return AuditRecord(accused, round_, peer, scalars, at), Envelope(data, seqno, signature)

    return peer, sign


def test_of_two_copies_differing_only_in_at_every_ledger_keeps_the_smaller(tmp_path):
    """An auditor signs one record twice, published at rounds 9 and 5. Two ledgers that
    got the copies in opposite orders end with the same record (`at` 5) and the same
    repair digest, so the vouch takes effect from the same round on both; while they
    hold different copies their digests differ (repair compares them). A fetch row
    carries `at` only in its envelope: repair takes the smaller copy in (not a duplicate)
    and computes the server's digest from the envelopes."""
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.network.gossip.repair import AuditTable

    run_id = CONFIG.run_id
    n = NEWCOMERS[0]
    auditor, sign = _audit_signer()
    late, late_env = sign(run_id, n, 2, (0.5,), 9)
    early, early_env = sign(run_id, n, 2, (0.5,), 5)
    one = Ledger(tmp_path / "one.sqlite", run_id)
    two = Ledger(tmp_path / "two.sqlite", run_id)
    assert one.add_audits([late], [late_env]) == [late]
    assert two.add_audits([early], [early_env]) == [early]
    assert one.audit_bucket_digests(4) != two.audit_bucket_digests(4)  # repair sees it
    assert one.add_audits([early], [early_env]) == [early]  # replaces: new
    assert two.add_audits([late], [late_env]) == []  # larger: ignored
    assert one.audits() == two.audits() == [early]
    assert one.audit_bucket_digests(4) == two.audit_bucket_digests(4)
    assert [row[1] for row in one.signed_audits_after((-1, b"", b"", b""), 100, 10)] == [early_env]
    claims = {(t, p): (0.5,) for t in range(12) for p in F + [n]}
    by_auditor = ProbationSettings(founders=frozenset([auditor]), vouches=1)
    st = standing(claims, one.audits(), AUDIT, by_auditor)
    assert st.count_from(n, 2) == effective_round(early, AUDIT) < effective_round(late, AUDIT)
    # repair: a ledger holding the later copy takes the earlier one in from a fetch row
    # (which carries no `at` outside the envelope), and the digest of the served rows is
    # the server's
    three = Ledger(tmp_path / "three.sqlite", run_id)
    intake = AuditIntake(three, 1)
    three.add_audits([late], [late_env])
    row = (dataclasses.replace(early, at=-1), early_env)
    fresh, bad, dropped = intake.repair([row])
    assert fresh == [early] and not bad and not dropped
    assert three.audits() == [early]
    assert intake.repair([(dataclasses.replace(late, at=-1), late_env)])[0] == []
    assert (
        three.has_audit(early)
        and three.has_audit(late)
        and not three.has_audit(dataclasses.replace(early, at=4))
    )
    table = AuditTable(three, intake, on_new=None)
    (bucket,) = two.audit_bucket_digests(16).values()
    assert table.set_digest([row]) == bucket[1]
    for ledger in (one, two, three):
        ledger.close()


def test_a_newcomer_seen_after_the_last_judgement_is_put_on_probation(tmp_path, monkeypatch):
    """A founder judged its ledger before any newcomer had published (at its start), and no
    audit record arrives afterwards: the first update of a peer the standing does not know
    makes the next round judge again, so the newcomer is a probationer and its updates are
    due for probation audits. (Before, such a founder never audited anyone: records were
    the only prompt, and only probation audits make records.)"""
    import asyncio

    from peer.audit_duty import DaemonAudits, PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    ledger = Ledger(tmp_path / "l.sqlite", CONFIG.run_id)
    live = LiveModel(_Engine(), ledger)
    audits = PeerAudits(AUDIT, b"secret", F[0], ledger, live, AuditIntake(ledger, 1), PROBATION)
    founders = [UpdateMessage(0, p, (0.5,)) for p in F]
    ledger.add(founders)
    audits.on_accept(founders, 4)
    audits.set_standing(audits.judge())  # at start: only founders
    assert not audits.unknown_peers and not audits.standing.probationers

    async def run(f, *args):
        return f(*args)

    daemon = DaemonAudits(audits, None, run, lambda: 4)
    monkeypatch.setattr(DaemonAudits, "status", lambda self, records=None: {})
    newcomer = UpdateMessage(1, NEWCOMERS[0], (0.25,))
    ledger.add([newcomer])
    daemon.accept([newcomer])
    assert audits.unknown_peers
    asyncio.run(daemon.run_round(2, None, None, None, None))  # nothing due yet: no audit
    assert audits.standing.probationers == {NEWCOMERS[0]} and not audits.unknown_peers
    audits.tokens = 1.0
    assert [j[:3] for j in audits.probation_jobs(1 + DELAY)] == [(NEWCOMERS[0], 1, "probation")]
    ledger.close()
