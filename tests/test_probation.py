"""Probation (algorithm/probation.py): which updates count, as a pure function of the
ledger's updates and audit records. No processes."""

import random

import base58
import pytest

from seedflood_p2p.algorithm.audit_rules import judge
from seedflood_p2p.algorithm.probation import standing, standing_of_ledger
from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.message import AuditRecord

AUDIT = AuditSettings(enabled=True, quorum=3)
F = [f"founder-{i}".encode() for i in range(4)]
N = b"newcomer"
SYBILS = [f"sybil-{i:02d}".encode() for i in range(20)]
PROBATION = ProbationSettings(founders=frozenset(F), vouches=3)
ROUNDS = 10
LIVE_CONFIG = RunConfig(
    model="tiny-llama", rank=4, refresh_period=5, lr=0.05, n_ref=4, batch_size=8
)


def claim(peer: bytes, round_: int) -> tuple[float, ...]:
    return (round(0.1 + 0.01 * round_ + 0.001 * (sum(peer) % 7), 3),)


def claims_of(peers) -> dict:
    return {(t, p): claim(p, t) for p in peers for t in range(ROUNDS)}


def match(accused: bytes, round_: int, auditor: bytes) -> AuditRecord:
    return AuditRecord(accused, round_, auditor, claim(accused, round_))


def mismatch(accused: bytes, round_: int, auditor: bytes) -> AuditRecord:
    return AuditRecord(accused, round_, auditor, tuple(-x for x in claim(accused, round_)))


def counted_keys(st, claims) -> set:
    return {(p, t) for (t, p) in claims if st.counts(p, t)}


def test_founders_count_and_a_newcomer_counts_only_where_vouched_until_established():
    claims = claims_of(F + [N])
    st = standing(claims, [], AUDIT, PROBATION)
    assert st.established == frozenset(F)
    assert all(st.counts(f, t) for f in F for t in range(ROUNDS))
    assert not any(st.counts(N, t) for t in range(ROUNDS))  # kept in the ledger, not counted
    assert N in st.probationers
    # two vouched updates: those two count, nothing else; not established yet
    records = [match(N, 2, F[0]), match(N, 4, F[1])]
    st = standing(claims, records, AUDIT, PROBATION)
    assert [t for t in range(ROUNDS) if st.counts(N, t)] == [2, 4]
    assert N not in st.established
    # the third vouched update (round 6) makes it established: later rounds count unvouched,
    # its earlier unvouched ones (0, 1, 3, 5) never do
    st = standing(claims, records + [match(N, 6, F[2])], AUDIT, PROBATION)
    assert N in st.established and st.since[N] == 6
    assert [t for t in range(ROUNDS) if st.counts(N, t)] == [2, 4, 6, 7, 8, 9]


def test_a_cartel_of_probationers_cannot_vouch_for_itself():
    claims = claims_of(F + SYBILS)
    # every sybil matches every other sybil's every update: 20 * 19 * 10 vouches
    records = [match(s, t, v) for s in SYBILS for v in SYBILS if v != s for t in range(ROUNDS)]
    st = standing(claims, records, AUDIT, PROBATION)
    assert st.established == frozenset(F)
    assert not any(st.counts(s, t) for s in SYBILS for t in range(ROUNDS))
    assert st.probationers == frozenset(SYBILS)


def test_probationers_cannot_outvote_established_auditors():
    claims = claims_of(F + SYBILS)
    # 20 sybils accuse an honest founder's update; one founder re-checks and matches
    records = [mismatch(F[0], 3, s) for s in SYBILS] + [match(F[0], 3, F[1])]
    assert F[0] in judge(claims, records, AUDIT).banned  # without probation: banned
    st = standing(claims, records, AUDIT, PROBATION)
    assert not st.banned and all(st.counts(F[0], t) for t in range(ROUNDS))
    # ... and a sybil's cheat confirmed by 3 founders bans it, whatever the sybils vote
    records = [mismatch(SYBILS[0], 1, f) for f in F[:3]]
    records += [match(SYBILS[0], 1, s) for s in SYBILS[1:]]
    st = standing(claims, records, AUDIT, PROBATION)
    assert SYBILS[0] in st.banned


def test_trust_is_transitive_only_through_established_auditors():
    claims = claims_of(F + [N, b"second"])
    records = [match(N, t, F[t % 4]) for t in (0, 1, 2)]  # N established by founders
    records += [match(b"second", t, N) for t in (3, 4, 5)]  # N vouches for "second"
    st = standing(claims, records, AUDIT, PROBATION)
    assert {N, b"second"} <= st.established
    # without N's own vouches, N's vouches count for nothing
    st = standing(claims, records[3:], AUDIT, PROBATION)
    assert st.established == frozenset(F)


def test_a_banned_peer_takes_its_vouches_with_it():
    claims = claims_of(F + [N, b"friend"])
    records = [match(N, t, F[0]) for t in (0, 1, 2)]
    records += [match(b"friend", t, N) for t in (3, 4, 5)]
    records += [mismatch(N, 7, f) for f in F[:3]]  # N cheats once established: banned
    st = standing(claims, records, AUDIT, PROBATION)
    assert N in st.banned and not any(st.counts(N, t) for t in range(ROUNDS))
    assert b"friend" not in st.established
    assert not any(st.counts(b"friend", t) for t in range(ROUNDS))


@pytest.mark.parametrize("seed", range(5))
def test_standing_does_not_depend_on_arrival_order(seed):
    rng = random.Random(seed)
    peers = F + [N, b"second"] + SYBILS[:5]
    claims = claims_of(peers)
    records = [match(N, t, F[rng.randrange(4)]) for t in range(ROUNDS) if rng.random() < 0.6]
    records += [match(b"second", t, N) for t in range(ROUNDS) if rng.random() < 0.5]
    records += [match(s, t, v) for s in SYBILS[:5] for v in SYBILS[:5] for t in (1, 2, 3)]
    records += [mismatch(SYBILS[0], 4, f) for f in F[:3]]
    records += [mismatch(F[1], 5, s) for s in SYBILS[:5]]
    records += [AuditRecord(N, 8, F[3], (9.0,)), match(N, 8, F[3])]  # an equivocating auditor
    reference = standing(claims, records, AUDIT, PROBATION)
    for _ in range(5):
        rng.shuffle(records)
        items = list(claims.items())
        rng.shuffle(items)
        st = standing(dict(items), records, AUDIT, PROBATION)
        assert st.established == reference.established
        assert st.banned == reference.banned
        assert st.since == reference.since
        assert counted_keys(st, claims) == counted_keys(reference, claims)
    # a record set that grows only ever adds counted updates of unbanned peers
    st = standing(claims, records[: len(records) // 2], AUDIT, PROBATION)
    unbanned = {(p, t) for (p, t) in counted_keys(st, claims) if p not in reference.banned}
    assert unbanned <= counted_keys(reference, claims)


@pytest.mark.parametrize("seed", range(3))
def test_judging_reads_only_the_audited_rows_and_who_has_rows(seed, tmp_path):
    """A peer judges its ledger from the rows the records audit and the set of peers with
    rows (`seen`), not its whole history: the same standing as from every row, and
    `standing_of_ledger` gives it from a real ledger."""
    from seedflood_p2p.protocol.message import UpdateMessage
    from seedflood_p2p.storage.ledger import Ledger

    rng = random.Random(seed)
    peers = F + [N, b"second", b"silent"] + SYBILS[:4]
    claims = claims_of(peers)
    records = [match(N, t, F[rng.randrange(4)]) for t in range(ROUNDS) if rng.random() < 0.6]
    records += [match(b"second", t, N) for t in range(ROUNDS) if rng.random() < 0.5]
    records += [mismatch(SYBILS[0], 4, f) for f in F[:3]] + [match(SYBILS[1], 2, F[0])]
    records += [mismatch(F[1], 5, s) for s in SYBILS[:4]]
    records += [match(b"gone", 3, F[2])]  # audits a row the ledger does not hold
    full = standing(claims, records, AUDIT, PROBATION)
    audited = {key: claims[key] for key in {(r.round, r.accused) for r in records} if key in claims}
    assert len(audited) < len(claims) / 2  # most rows are not read
    partial = standing(audited, records, AUDIT, PROBATION, seen={p for _, p in claims})
    assert partial == full
    assert b"silent" in full.probationers  # known from `seen` alone: no record names it
    # without `seen`, the audited rows alone would miss the silent peer
    assert b"silent" not in standing(audited, records, AUDIT, PROBATION).probationers
    run = RunConfig(extra={"probation": {"founders": [_peer_id(i) for i in range(2)]}})
    ledger = Ledger(tmp_path / "l.sqlite", run.run_id)
    ledger.add([UpdateMessage(t, p, scalars) for (t, p), scalars in claims.items()])
    ledger.add_audits(records)
    stored = {(m.round, m.peer): m.scalars for m in ledger.messages()}  # float16 scalars
    every_row = standing(stored, ledger.audits(), AUDIT, PROBATION)
    assert standing_of_ledger(ledger, AUDIT, PROBATION) == every_row
    assert every_row.banned == full.banned and every_row.established == full.established
    ledger.close()


def _peer_id(i: int) -> str:
    return base58.b58encode(ED25519_PEER_ID_PREFIX + bytes([i]) * 32).decode()


def test_settings_seed_from_founders_or_the_allow_list():
    assert not RunConfig().probation.enabled  # no founders: nobody could vouch
    founders = [_peer_id(1), _peer_id(2)]
    st = RunConfig(extra={"probation": {"founders": founders}}).probation
    assert st.enabled and st.vouches == 3 and st.share == 0.25
    assert st.founders == {base58.b58decode(f) for f in founders}
    closed = RunConfig(allow_peers=[_peer_id(3)]).probation
    assert closed.founders == {base58.b58decode(_peer_id(3))}
    off = RunConfig(extra={"probation": False}, allow_peers=[_peer_id(3)])
    assert not off.probation.enabled
    for bad, why in [
        ({"founders": ["nope"]}, "not a base58 Ed25519"),
        ({"founders": founders, "vouches": 0}, "vouches"),
        ({"founders": founders, "share": float("inf")}, None),  # extra refuses non-finite
        ({"founders": founders, "share": -1}, "share"),
        ({"founders": founders, "other": 1}, "unknown keys"),
        ("yes", "must be false or a table"),
    ]:
        with pytest.raises(UserError, match=why):
            RunConfig(extra={"probation": bad})


def test_without_founders_everything_unbanned_counts():
    claims = claims_of(F + SYBILS)
    records = [mismatch(SYBILS[0], 1, f) for f in F[:3]]
    st = standing(claims, records, AUDIT, ProbationSettings())
    assert not st.enabled and SYBILS[0] in st.banned
    assert counted_keys(st, claims) == {(p, t) for (t, p) in claims if p != SYBILS[0]}


# ---------------------------------------------------------------- live peer against replay


def _live_run(tmp_path, name, updates, records, probation, seed):
    """A daemon's audit state (peer/audit_duty.py) fed `updates` and `records` in an order drawn
    from `seed`, judging after every arrival; returns (ledger, live weights)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    rng = random.Random(seed)
    model, _ = load_model("tiny-llama")
    ledger = Ledger(tmp_path / f"{name}.sqlite", LIVE_CONFIG.run_id)
    live = LiveModel(SubCGE(model, LIVE_CONFIG), ledger)
    audits = PeerAudits(AUDIT, b"secret", F[0], ledger, live, AuditIntake(ledger, 1), probation)
    audits.round = ROUNDS + 100  # a peer far past these rounds: every vouch in effect
    events = [("u", m) for m in updates] + [("r", r) for r in records]
    rng.shuffle(events)
    for i in range(0, len(events), 5):
        batch = events[i : i + 5]
        ledger.add([m for kind, m in batch if kind == "u"])
        ledger.add_audits([r for kind, r in batch if kind == "r"])
        audits.apply([m for kind, m in batch if kind == "u"])  # what take_settled hands on
        audits.set_standing(audits.judge())
    return ledger, audits


@pytest.mark.slow
def test_a_live_peer_ends_where_the_replay_of_the_counted_updates_is(tmp_path):
    """Updates and audit records arrive in three different orders; each live peer judges
    after every arrival, keeps what does not count yet and applies it when it starts to
    count (as a late row). The counted set is the same every time, its replay is bitwise
    the same, and each live model equals it to float32 rounding."""
    import numpy as np
    import torch

    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
    from seedflood_p2p.workload.models import load_model, weights_sha256

    rng = np.random.default_rng(0)
    peers = F[:3] + [N, b"second", SYBILS[0], SYBILS[1]]
    updates = [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1))) for t in range(8) for p in peers
    ]
    claims = {(m.round, m.peer): m.scalars for m in updates}

    def rec(accused, round_, auditor, ok=True):
        (c,) = claims[(round_, accused)]
        return AuditRecord(accused, round_, auditor, (c,) if ok else (-c - 1.0,))

    records = [rec(N, t, F[t % 3]) for t in (1, 2, 3)]  # N established, since round 3
    records += [rec(b"second", 5, N)]  # one vouched update by an earned member
    records += [rec(SYBILS[0], t, SYBILS[1]) for t in range(8)]  # the cartel's vouches
    records += [rec(SYBILS[1], 2, f, ok=False) for f in F[:3]]  # a sybil's cheat, confirmed
    probation = ProbationSettings(founders=frozenset(F[:3]), vouches=3)
    expected = standing(claims, records, AUDIT, probation)
    counted = sorted(expected.counted(updates), key=lambda m: (m.round, m.peer))
    assert {(m.peer, m.round) for m in counted if m.peer == N} == {(N, t) for t in (1, 2, 3)} | {
        (N, t) for t in range(4, 8)
    }
    assert [m.round for m in counted if m.peer == b"second"] == [5]
    assert not any(m.peer in SYBILS[:2] for m in counted)
    model, _ = load_model("tiny-llama")
    replay(model, LIVE_CONFIG, counted)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    hashes = set()
    for seed in range(3):
        ledger, audits = _live_run(tmp_path, f"l{seed}", updates, records, probation, seed)
        judged = standing_of_ledger(ledger, AUDIT, probation)
        again = sorted(judged.counted(ledger.messages()), key=lambda m: (m.round, m.peer))
        assert again == counted
        replayed, _ = load_model("tiny-llama")
        replay(replayed, LIVE_CONFIG, again)
        hashes.add(weights_sha256(replayed))
        got = dict(audits.live.model.named_parameters())
        for name, tensor in reference.items():
            torch.testing.assert_close(got[name].detach(), tensor, atol=1e-5, rtol=0)
        assert {(m.peer, m.round) for m in audits.waiting} == {
            (m.peer, m.round) for m in updates
        } - {(m.peer, m.round) for m in counted}
        ledger.close()
    assert len(hashes) == 1


def test_probation_audits_stay_within_the_budget_and_the_rest_waits(tmp_path):
    """An established peer spends at most `share` audits a round on probationers' updates
    (re-checks of their updates included), served fairly: the least served probationer
    first, so each is served before any is served twice, and a late newcomer behind 5 keys
    that came earlier is served in the first pass; what it cannot audit is kept and
    reported as backlog; a peer on probation audits nobody."""
    import numpy as np

    from peer.audit_duty import PeerAudits
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    rng = np.random.default_rng(1)
    late = b"late-newcomer"
    newcomers = SYBILS[:5] + [late]
    rows = [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1)))
        for t in range(30)
        for p in F[:3] + newcomers
        if not (p == late and t < 6)  # the newcomer came six rounds after the 5 keys
    ]
    model, _ = load_model("tiny-llama")
    ledger = Ledger(tmp_path / "l.sqlite", LIVE_CONFIG.run_id)
    ledger.add(rows)
    live = LiveModel(SubCGE(model, LIVE_CONFIG), ledger)
    probation = ProbationSettings(founders=frozenset(F[:3]), vouches=3, share=0.5)
    settings = AuditSettings(enabled=True, lag=0)
    audits = PeerAudits(settings, b"secret", F[0], ledger, live, AuditIntake(ledger, 1), probation)
    audits.set_standing(audits.judge())
    assert audits.standing.probationers == frozenset(newcomers)
    audits.due[(SYBILS[3], 5)] = "recheck"  # a re-check of a probationer: budgeted too
    jobs = []
    for round_ in range(10, 30):
        jobs += [j for j in audits.ready(round_) if j[2] in ("probation", "recheck")]
    assert len(jobs) <= 0.5 * 20 + 1  # the budget (plus one saved-up round)
    assert len(jobs) > len(newcomers) and len({(j[0], j[1]) for j in jobs}) == len(jobs)
    served = {p: 0 for p in newcomers}
    for peer, *_ in jobs:  # round-robin: nobody is served twice before all once
        served[peer] += 1
        assert max(served.values()) - min(served.values()) <= 1, served
    first_pass = [j[0] for j in jobs[: len(newcomers)]]
    assert set(first_pass) == set(newcomers)  # the late newcomer included
    status = audits.probation_status()
    assert status["backlog"] > 0 and status["backlog_peers"] == len(newcomers)
    assert status["we_are"] == "established" and status["on_probation"] == len(newcomers)
    # another auditor (another secret) breaks the ties in another order
    other_audits = PeerAudits(
        settings, b"second", F[1], ledger, live, AuditIntake(ledger, 1), probation
    )
    other_audits.set_standing(other_audits.judge())
    orders = {tuple(j[0] for j in jobs[: len(newcomers)])}
    for secret in (b"second", b"third", b"fourth"):
        other_audits.secret, other_audits.tokens, other_audits.done = secret, 6.0, set()
        other_audits.served.clear()
        orders.add(tuple(j[0] for j in other_audits.probation_jobs(20)))
    assert len(orders) > 1
    # a peer on probation does no probation audits
    other = PeerAudits(
        settings, b"other", newcomers[1], ledger, live, AuditIntake(ledger, 1), probation
    )
    other.set_standing(other.judge())
    assert not any(j[2] == "probation" for r in range(10, 30) for j in other.ready(r))
    ledger.close()


def test_identities_that_earned_standing_cannot_outvote_the_founders():
    """Five sybils train honestly through probation (established by founders' vouches),
    then one negates and the others vouch for it and accuse an honest newcomer."""
    cartel = SYBILS[:5]
    claims = claims_of(F + cartel + [N])
    records = [match(s, t, F[t % 4]) for s in cartel + [N] for t in (0, 1, 2)]
    assert standing(claims, records, AUDIT, PROBATION).established == frozenset(F + cartel + [N])
    turned = records + [mismatch(cartel[0], 8, f) for f in F[:3]]  # the founders re-check
    turned += [match(cartel[0], 8, s) for s in cartel[1:]]  # the cartel vouches: 4 votes
    turned += [mismatch(N, 8, s) for s in cartel]  # ... and accuses an honest peer: 5 votes
    turned += [match(N, 8, f) for f in F[:3]]
    # plain majority voting: the cheat is refuted (its accusers banned), the honest convicted
    open_vote = judge(claims, turned, AUDIT, voters=frozenset(F + cartel + [N]))
    assert set(F[:3]) <= set(open_vote.banned) and N in open_vote.banned
    st = standing(claims, turned, AUDIT, PROBATION)
    assert set(st.banned) == set(cartel)  # the cheat and every vouch / false accusation
    assert N not in st.banned and N in st.established
    assert not any(st.counts(s, t) for s in cartel for t in range(ROUNDS))
    assert all(st.counts(N, t) for t in range(3, ROUNDS))


def test_status_shows_probation_vouches_and_the_backlog():
    from seedflood_p2p.apps.status import format_status

    audits = {"done": 7, "mismatches": 1, "published": 3, "verdicts": 1, "banned": []}
    probation = {
        "we_are": "established",
        "established": 5,
        "founders": 4,
        "on_probation": 20,
        "vouched_updates": 6,
        "waiting_updates": 180,
        "backlog": 57,
        "backlog_peers": 19,
        "share": 0.25,
    }
    text = format_status({"banned": [], "audits": {**audits, "probation": probation}})
    (line,) = [x for x in text.splitlines() if x.startswith("probation")]
    assert "established 5 (4 founders)" in line and "on probation 20" in line
    assert "vouched updates 6" in line and "backlog 57 update(s) of 19 peer(s)" in line
    assert not any(
        x.startswith("probation")
        for x in format_status({"banned": [], "audits": {**audits, "probation": None}}).splitlines()
    )


def _timed_by_passes(founders, matches, vouches, banned):
    """`probation._timed` as it was until the twentieth session: passes over every match
    until no time moves (the reference its Dijkstra order must equal)."""
    from collections import defaultdict

    from seedflood_p2p.algorithm.probation import ALWAYS

    banned = frozenset(banned)
    est = {p: ALWAYS for p in founders - banned}
    while True:
        vouched, per_peer = {}, defaultdict(list)
        for key, auditors in matches.items():
            if key[0] in banned or key[0] in founders:
                continue
            times = [max(e, est[q]) for q, e in auditors.items() if q in est]
            if times:
                vouched[key] = min(times)
                per_peer[key[0]].append(vouched[key])
        after = dict(est)
        for peer, times in per_peer.items():
            if len(times) >= vouches:
                after[peer] = sorted(times)[vouches - 1]
        if after == est:
            return vouched, est
        est = after


@pytest.mark.parametrize("seed", range(40))
def test_the_times_settled_in_order_are_those_of_repeated_passes(seed):
    """`_timed` (members settled in the order of their times) gives exactly the vouch and
    establishment times of the passes it replaced, on random chains of vouches: newcomers
    vouching for newcomers, several auditors an update, banned peers, founders audited."""
    from seedflood_p2p.algorithm.probation import _by_auditor, _timed

    rng = random.Random(seed)
    peers = [bytes([i]) * 4 for i in range(rng.randrange(3, 30))]
    founders = frozenset(rng.sample(peers, rng.randrange(1, 4)))
    matches = {}
    for _ in range(rng.randrange(0, 400)):
        accused, t = rng.choice(peers), rng.randrange(60)
        auditors = matches.setdefault((accused, t), {})
        for q in rng.sample(peers, rng.randrange(1, 4)):
            if q != accused:
                auditors[q] = t + 4 + rng.randrange(0, 30)
    banned = frozenset(rng.sample(peers, rng.randrange(0, 3)))
    vouches = rng.randrange(1, 4)
    reference = _timed_by_passes(founders, matches, vouches, banned)
    assert _timed(founders, matches, vouches, banned) == reference
    index = _by_auditor(founders, matches)  # made once for every span's times
    assert _timed(founders, matches, vouches, banned, index) == reference


@pytest.mark.parametrize("seed", range(8))
def test_judging_only_the_accused_updates_gives_the_standing_of_all_records(seed, monkeypatch):
    """`standing` hands `judge` and `ban_spans` only the records of updates some record
    mismatches (`_accusations`): the same standing as with every record, on random
    ledgers with convictions, refutations, an auditor's two records for one update and a
    record about a row nobody has (tests/test_standing_summary.py's)."""
    from test_standing_summary import AUDIT as SETTINGS
    from test_standing_summary import PROBATION as SEEDS
    from test_standing_summary import _ledger

    import seedflood_p2p.algorithm.probation as probation

    claims, records = _ledger(seed)
    for settings in (SEEDS, ProbationSettings()):  # probation on and off
        fast = standing(claims, records, SETTINGS, settings)
        with monkeypatch.context() as m:
            m.setattr(probation, "_accusations", lambda claims, records, settings: records)
            every = standing(claims, records, SETTINGS, settings)
        assert fast == every
        assert len(probation._accusations(claims, records, SETTINGS)) < len(records)
    assert fast.judgement.cases  # (there were cases to judge)


def test_the_times_after_fresh_keys_bans_are_those_made_anew(monkeypatch):
    """A settled prefix whose bans add only peers that were never established (fresh keys
    convicted: each ban a new prefix's ban set) gets its times from the prefix before by
    leaving those peers' updates out (`_timing_after`), not by a `_timed` over every
    match: the same standing as making every span's times anew."""
    import seedflood_p2p.algorithm.probation as probation

    founders = [bytes([1, i]) * 4 for i in range(3)]
    earned = [bytes([2, i]) * 4 for i in range(3)]  # vouched by founders, established
    fresh = [bytes([3, i]) * 4 for i in range(6)]  # convicted one after another
    settings = AuditSettings(enabled=True, lag=1, quorum=2)
    seeds = ProbationSettings(founders=frozenset(founders), vouches=2)
    claims, records = {}, []
    for t in range(40):
        for p in founders + earned + fresh:
            claims[(t, p)] = (0.25 + t / 64,)
    for i, p in enumerate(earned):  # vouched: matches by founders
        for t in (1, 2, 3):
            records.append(AuditRecord(p, t, founders[t % 3], claims[(t, p)], t + 4 + i))
    for i, p in enumerate(fresh):  # one cheat each, convicted by two founders, in turn
        t = 5 + 4 * i
        wrong = (claims[(t, p)][0] + 1.0,)
        records += [AuditRecord(p, t, q, wrong, t + 4 + i) for q in founders[:2]]
        records.append(AuditRecord(p, t + 1, earned[0], claims[(t + 1, p)], t + 6))  # a vouch
    derived = []
    real = probation._timing_after

    def counted(timings, banned):
        out = real(timings, banned)
        derived.append(out is not None)
        return out

    monkeypatch.setattr(probation, "_timing_after", counted)
    fast = standing(claims, records, settings, seeds)
    monkeypatch.setattr(probation, "_timing_after", lambda timings, banned: None)
    anew = standing(claims, records, settings, seeds)
    assert fast == anew
    assert set(fast.banned) == set(fresh) and len(fast.bans) == len(fresh) + 1
    assert sum(derived) == len(fresh)  # every later span's times derived
