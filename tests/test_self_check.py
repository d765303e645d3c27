"""Whose updates a joiner recomputes on a model restored from a fetched chain link before
it trains (peer/audit_duty.py `choose_self_checks`, `PeerAudits.self_check`): not the
link's offerers' while anyone else's can be checked (colluders could publish updates made
on their own forged weights), never a skipped (accused, banned, own) peer's, under
probation only established peers', founders first, the rest in an order the joiner's own
randomness draws (fresh keys cannot arrange to be the ones checked)."""

import random

from peer.audit_duty import choose_self_checks
from seedflood_p2p.algorithm.probation import standing
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage

AUDIT = AuditSettings(enabled=True, lag=1, quorum=2)
P = [bytes([i]) * 38 for i in range(1, 11)]  # ten peers
ROUNDS = 12


def _recent(peers=P) -> list[UpdateMessage]:
    """Every peer's update of each round, newest rounds first (as `self_check` reads)."""
    return [UpdateMessage(t, p, (0.5,)) for t in reversed(range(ROUNDS)) for p in peers]


def _open_standing(rows):
    claims = {(m.round, m.peer): m.scalars for m in rows}
    return standing(claims, [], AUDIT, ProbationSettings())


def test_the_offerers_are_left_out_while_anyone_else_can_be_checked():
    rows = _recent()
    offerers = frozenset(P[:2])
    jobs = choose_self_checks(rows, _open_standing(rows), set(), offerers, 5, random.Random(0))
    assert len(jobs) == 5 and not {m.peer for m in jobs} & offerers
    assert all(m.round == ROUNDS - 1 for m in jobs)  # each peer's newest update
    # only the offerers sent anything: theirs are all there is to check
    only = _recent(P[:2])
    jobs = choose_self_checks(only, _open_standing(only), set(), offerers, 5, random.Random(0))
    assert {m.peer for m in jobs} == offerers


def test_skipped_peers_are_never_checked_and_nothing_left_is_nothing_checked():
    rows = _recent()
    skip = set(P[2:])
    jobs = choose_self_checks(rows, _open_standing(rows), skip, frozenset(), 5, random.Random(1))
    assert {m.peer for m in jobs} == set(P[:2])
    assert choose_self_checks([], None, set(), frozenset(), 5, random.Random(1)) == []


def test_the_draw_is_the_joiner_s_own_not_the_order_of_arrival():
    rows = _recent()
    st = _open_standing(rows)
    picks = {
        frozenset(m.peer for m in choose_self_checks(rows, st, set(), frozenset(), 3, rng))
        for rng in (random.Random(seed) for seed in range(20))
    }
    assert len(picks) > 5  # other draws, other peers: no fixed set a few keys could take
    assert all(len(p) == 3 for p in picks)


def test_under_probation_only_established_peers_founders_first():
    founders, newcomers = P[:2], P[2:]
    rows = _recent()
    claims = {(m.round, m.peer): m.scalars for m in rows}
    # P[2] earns standing: two of its updates matched by founders; the rest never do
    records = [AuditRecord(P[2], t, founders[0], (0.5,), t + AUDIT.delay) for t in (1, 2)]
    probation = ProbationSettings(founders=frozenset(founders), vouches=2)
    st = standing(claims, records, AUDIT, probation)
    assert P[2] in st.established and not set(newcomers[1:]) & st.established
    for seed in range(5):
        jobs = choose_self_checks(rows, st, set(), frozenset(), 5, random.Random(seed))
        assert {m.peer for m in jobs[:2]} == set(founders)
        assert [m.peer for m in jobs[2:]] == [P[2]]
