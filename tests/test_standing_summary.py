"""The standing summary (algorithm/standing_summary.py): the records below an audited link,
as few bytes as the standing reads. A joiner holding only the rows and records from the
link's round on, plus the summary, judges exactly as a peer holding the whole ledger,
on random ledgers with vouches, establishments, convictions, refuted accusations, an
auditor's two records for one update and records about rows nobody has."""

import random

import pytest

from seedflood_p2p.algorithm.probation import effective_round, standing
from seedflood_p2p.algorithm.standing_summary import StandingSummary, summarize
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.message import AuditRecord

ED25519_ID = b"\x00\x24\x08\x01\x12\x20"
AUDIT = AuditSettings(enabled=True, lag=1, quorum=2)
FOUNDERS = [ED25519_ID + bytes([1 + i]) * 32 for i in range(3)]
NEWCOMERS = [ED25519_ID + bytes([0x10 + i]) * 32 for i in range(5)]
PROBATION = ProbationSettings(founders=frozenset(FOUNDERS), vouches=2)
ROUNDS, BELOW = 50, 20
LATEST = 8  # rounds after the earliest an auditor may publish (honest: within MAX_REWIND)
HELD = BELOW + AUDIT.delay + LATEST  # every record about a row below BELOW took effect


def _ledger(seed: int, late: bool = False):
    """Random claims {(round, peer): scalars} and records. Newcomers start at random rounds
    and skip some; founders and newcomers audit newcomers (mostly matches), a few
    accusations are re-checked by others (some confirmed, some refuted), one auditor
    publishes two records for one update, one record audits a row nobody has. `late`: one
    more match about a row below BELOW, taking effect after HELD."""
    rng = random.Random(seed)
    claims = {}
    for peer in FOUNDERS + NEWCOMERS:
        start = 0 if peer in FOUNDERS else rng.randrange(0, 12)
        for t in range(start, ROUNDS):
            if peer in FOUNDERS or rng.random() > 0.1:
                claims[(t, peer)] = (round(rng.uniform(-2, 2), 2),)
    auditors = FOUNDERS + NEWCOMERS
    records = []

    def publish(accused, t, auditor, match):
        claim = claims.get((t, accused), (0.5,))
        scalars = claim if match else (claim[0] + 1.0,)
        at = t + AUDIT.delay + rng.randrange(LATEST)
        records.append(AuditRecord(accused, t, auditor, scalars, at))

    for (t, peer), _ in sorted(claims.items()):
        if rng.random() < (0.35 if peer in NEWCOMERS else 0.05):
            auditor = rng.choice([a for a in auditors if a != peer])
            match = rng.random() > 0.12
            publish(peer, t, auditor, match)
            if not match:  # re-checked by others: a conviction or a refutation
                verdict = rng.random() < 0.5
                for other in rng.sample([a for a in auditors if a not in (peer, auditor)], 3):
                    publish(peer, t, other, not verdict if rng.random() < 0.8 else verdict)
    t = rng.randrange(2, BELOW)
    accused = rng.choice([p for (r, p) in claims if r == t and p in NEWCOMERS])
    publish(accused, t, FOUNDERS[0], True)
    publish(accused, t, FOUNDERS[0], False)  # two records of one auditor: one is chosen
    missing = [(r, p) for r in range(BELOW) for p in NEWCOMERS if (r, p) not in claims]
    r, p = rng.choice(missing)
    publish(p, r, FOUNDERS[1], True)  # about a row nobody has: says nothing
    if late:
        r, p = rng.choice([(r, p) for (r, p) in claims if r < BELOW and p in NEWCOMERS])
        records.append(AuditRecord(p, r, FOUNDERS[2], claims[(r, p)], HELD + 1))
    return claims, records


def _joiner_standing(claims, records, summary: StandingSummary):
    """What a joiner holding the rows of rounds >= BELOW, the records about them and the
    summary judges."""
    own = {key: c for key, c in claims.items() if key[0] >= BELOW}
    held = [r for r in records if r.round >= BELOW]
    seen = {p for (t, p) in own}
    claims_in, records_in, seen_in = summary.inputs(own, held, seen)
    return standing(claims_in, records_in, AUDIT, PROBATION, seen=seen_in)


def _summary(claims, records):
    below = {p for (t, p) in claims if t < BELOW}
    audited = {(r.round, r.accused) for r in records}
    return summarize(
        {k: c for k, c in claims.items() if k in audited}, records, AUDIT, BELOW, HELD, below
    )


@pytest.mark.parametrize("seed", range(12))
def test_a_joiner_with_the_summary_judges_as_the_whole_ledger(seed):
    claims, records = _ledger(seed)
    assert all(effective_round(r, AUDIT) < HELD for r in records if r.round < BELOW)
    full = standing(claims, records, AUDIT, PROBATION)
    summary = _summary(claims, records)
    joiner = _joiner_standing(claims, records, summary)
    assert joiner == full
    # what the summary replaced: the records below, a few bytes each
    below = [r for r in records if r.round < BELOW]
    assert len(summary.matches) + sum(len(c) for _, c in summary.cases) < len(below)


def test_the_ledgers_met_convictions_refutations_and_vouches():
    """The random ledgers above hold what the summary must carry: both kinds of case below
    the link, and vouches that establish newcomers."""
    kinds = set()
    for seed in range(12):
        claims, records = _ledger(seed)
        full = standing(claims, records, AUDIT, PROBATION)
        kinds |= {c.outcome for c in full.judgement.cases if c.round < BELOW}
        kinds |= {"established"} if full.established - frozenset(FOUNDERS) else set()
        kinds |= {"cases below"} if _summary(claims, records).cases else set()
    assert {"confirmed", "refuted", "established", "cases below"} <= kinds


@pytest.mark.parametrize("seed", range(4))
def test_the_summary_is_a_function_of_its_prefix(seed):
    """Builders that hold more records than the prefix (about rows from BELOW on, or taking
    effect after HELD) write the same bytes: what `held` excludes is not read."""
    claims, records = _ledger(seed)
    prefix = [r for r in records if r.round < BELOW and effective_round(r, AUDIT) < HELD]
    _, later = _ledger(seed, late=True)
    assert _summary(claims, prefix).encode() == _summary(claims, later).encode()
    assert _summary(claims, records).encode() == _summary(claims, prefix).encode()


def test_a_late_record_below_the_link_is_what_the_summary_cannot_say():
    """A match about a row below the link that takes effect after HELD (a very late or a
    dishonest vouch) is not in the summary: a joiner judging without the history can differ
    from the whole ledger (the case the joiner must wait for the history in)."""
    differ = 0
    for seed in range(12):
        claims, records = _ledger(seed, late=True)
        full = standing(claims, records, AUDIT, PROBATION)
        joiner = _joiner_standing(claims, records, _summary(claims, records))
        differ += joiner != full
    assert differ


@pytest.mark.parametrize("seed", range(3))
def test_the_bytes_decode_to_the_summary(seed):
    claims, records = _ledger(seed)
    summary = _summary(claims, records)
    data = summary.encode()
    assert StandingSummary.decode(data) == summary
    assert StandingSummary.decode(data).encode() == data


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\xc1", "not a standing summary"),
        (b"\x93\x01\x02\x03", "not a standing summary"),  # too short
        (None, "format"),
        (b"", "not a standing summary"),
    ],
)
def test_bad_bytes_are_refused_with_the_reason(data, why):
    if data is None:  # another format number
        import msgpack

        data = msgpack.packb([9, 0, 0, [], [], [], []])
    with pytest.raises(ValueError, match=why):
        StandingSummary.decode(data)


def test_a_non_canonical_encoding_is_refused():
    """Peers agree on a summary by its bytes' hash: only one encoding may decode."""
    import msgpack

    claims, records = _ledger(0)
    fmt, below, held, peers, flat, cases, seen = msgpack.unpackb(
        _summary(claims, records).encode(), raw=False
    )
    shuffled = msgpack.packb([fmt, below, held, peers, flat, cases, seen[::-1]])
    assert len(seen) > 1
    with pytest.raises(ValueError, match="canonical"):
        StandingSummary.decode(shuffled)


def test_the_historys_own_records_do_not_end_a_joiners_stand_and_a_late_one_does():
    """While a joiner trusts a link, repair brings the history's records about rows below
    it: those of its prefix leave the stand as it is (a backdated one the summary lacks is
    the history check's to find); one taking effect after the prefix, which the summary
    cannot hold, ends it (peer/latejoin.py `_below_link`; a review found that every record
    below the link ended it, so any run with vouches lost the trust)."""
    import types

    from peer.latejoin import LateJoin

    claims, records = _ledger(0)
    summary = _summary(claims, records)
    join = LateJoin.__new__(LateJoin)  # what `_below_link` reads, and nothing else
    below = [r for r in records if r.round < BELOW]
    join.audits = types.SimpleNamespace(records_below=below, settings=AUDIT)
    # a run that ended at BELOW: nothing below the link changes after its prefix
    ended = standing({k: c for k, c in claims.items() if k[0] < BELOW}, below, AUDIT, PROBATION)
    in_link = frozenset(p for (t, p) in claims if t < BELOW)
    assert join._below_link(ended, summary, in_link) is None
    r, p = next((r, p) for (r, p) in sorted(claims) if r < BELOW and p in NEWCOMERS)
    late = AuditRecord(p, r, FOUNDERS[2], claims[(r, p)], HELD + 1)
    join.audits.records_below = [*below, late]
    assert "cannot hold" in join._below_link(ended, summary, in_link)
