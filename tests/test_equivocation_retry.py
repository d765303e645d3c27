"""An equivocation's losing copy, kept for audits (issue 45): the ledger's `replaced` table,
the admission that fills it, the auditor's retry with an equivocated row swapped back
(peer/state_rewind.py `swap_states`), and a replaced row drawn for audit again
(peer/audit_duty.py `on_accept`). In process: SQLite files and the tiny model; the daemon
scenario is tests/test_equivocation_daemon.py."""

import dataclasses

import numpy as np
import pytest
from test_admission import Peer, node  # noqa: F401  (the `node` fixture)

from peer.state_rewind import MAX_SWAP_SETS, MAX_SWAP_STATES, held_copy, swap_sets, swap_states
from seedflood_p2p.algorithm.audit_rules import recompute
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.algorithm.trainer import zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.network.gossip.admission import Outcome
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.storage.ledger import MAX_LOSING_COPIES, Ledger
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

CONFIG = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=4, batch_size=8)
A, B, C, X, Y, Z = (f"peer-{c}".encode() for c in "ABCXYZ")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _updates(rounds, peers, seed=0):
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1)))
        for t in range(rounds)
        for p in peers
    ]


def _twin(m: UpdateMessage) -> UpdateMessage:
    """harness/hooked_peer.py's second copy: below every value, so `keeps_new` keeps it."""
    return UpdateMessage(m.round, m.peer, quantize_scalars([-abs(s) - 1.0 for s in m.scalars]))


# -- the ledger's table ---------------------------------------------------------------


def test_replace_keeps_the_losing_copy_bounded_durable_and_out_of_the_digest(tmp_path):
    history = _updates(3, [B, X], seed=1)
    first = next(m for m in history if (m.peer, m.round) == (X, 1))
    twin = _twin(first)
    with Ledger(tmp_path / "a.sqlite", "run") as a, Ledger(tmp_path / "b.sqlite", "run") as b:
        a.add(history)
        assert a.losing_copies() == {}
        assert a.replace(twin, None) == first.scalars
        assert a.losing_copies() == {(X, 1): [first.scalars]}
        # a ledger that only ever saw the twin: the same rows, digests and messages
        b.add([twin if m == first else m for m in history])
        assert a.digest() == b.digest() and list(a.messages()) == list(b.messages())
        assert a.bucket_digests(64) == b.bucket_digests(64)
        # more copies of the same row: the first to lose is kept, and at most a few
        for k in range(2, 8):
            lower = UpdateMessage(1, X, (twin.scalars[0] - k,))
            a.replace(lower, None)
        assert a.keep_losing(UpdateMessage(1, X, (99.0,))) is False  # full
        kept = a.losing_copies()[(X, 1)]
        assert len(kept) == MAX_LOSING_COPIES and kept[:2] == [first.scalars, twin.scalars]
        assert a.losing_copies(2, 5) == {} and (X, 1) in a.losing_copies(1, 1)
    with Ledger(tmp_path / "a.sqlite", "run") as again:  # a restart keeps them
        assert again.losing_copies()[(X, 1)] == kept
        assert again.keep_losing(UpdateMessage(1, X, first.scalars)) is False  # held


async def test_the_admission_keeps_every_losing_copy_it_sees(node):  # noqa: F811
    alice, bob = Peer(), Peer()
    # within one gossip batch: the copies that lose to the smallest
    node.gossip([alice.gossip(2, (0.5,)), alice.gossip(2, (0.25,)), alice.gossip(2, (0.75,))])
    assert node.ledger.losing_copies() == {(alice.id, 2): [(0.5,), (0.75,)]}
    assert node.ledger.scalars_of(alice.id, 2) == (0.25,)
    node.gossip([bob.gossip(1, (0.5,))])
    (loser,) = node.gossip([bob.gossip(1, (0.75,))])  # larger: dropped, kept aside
    assert loser.outcome is Outcome.DROPPED
    assert node.ledger.losing_copies(1, 1) == {(bob.id, 1): [(0.75,)]}
    # relayed by repair (bob's gossip is banned now): smaller, replaces the held one
    (winner,) = await node.repair([bob.row(1, (0.25,))], server=Peer().id)
    assert winner.outcome is Outcome.REPLACED
    assert node.ledger.losing_copies(1, 1) == {(bob.id, 1): [(0.75,), (0.5,)]}
    # our own second update is never signed or sent: not a losing copy
    node.own(UpdateMessage(5, node.me.id, (0.125,)))
    node.own(UpdateMessage(5, node.me.id, (0.25,)))
    assert (node.me.id, 5) not in node.ledger.losing_copies()


# -- the states tried ---------------------------------------------------------------


def test_swap_states_swap_the_held_copy_back_newest_first_and_capped():
    first = UpdateMessage(1, X, (0.5,))
    twin = _twin(first)
    other = UpdateMessage(1, B, (0.25,))
    assert held_copy([first, first.negated(), twin]) == twin
    assert held_copy([first]) == first and held_copy([first, first.negated()]) is None
    state = [first, other, first.negated(), twin]
    assert swap_states(state, {}) == []
    assert swap_states(state, {(X, 1): [first.scalars]}) == [("swapped", [twin.negated(), first])]
    # a row the state does not hold, or holds as that copy: nothing to swap
    assert swap_states([other], {(X, 1): [first.scalars]}) == []
    assert swap_states([first], {(X, 1): [first.scalars]}) == []
    # many equivocated rows: newest rounds first, at most MAX_SWAP_STATES
    rows = [UpdateMessage(t, X, (-2.0,)) for t in range(6)]
    states = swap_states(rows, {(X, t): [(1.0,)] for t in range(6)})
    assert len(states) == MAX_SWAP_STATES
    assert [s[1][1].round for s in states] == [5, 4, 3, 2]


def _swapped_audit(
    tmp_path, cheat_sign: float, keep_losing: bool = True, equivocators: tuple = (X,)
):
    """Sender A trained round 3 (lag 0) on a state holding each equivocator's first copy
    of round 1; their twins replaced them at auditor C after A's update reached C (the
    late twin of tests/test_equivocation_daemon.py). Returns (record, mismatch, audits,
    the scalars recomputed on C's settled state, which holds the twins)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)  # one update moves the model visibly
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = _updates(3, [B, *equivocators], seed=5)
    firsts = [m for m in history if m.peer in equivocators and m.round == 1]
    twins = [_twin(m) for m in firsts]
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply(history)  # the sender's state: the first copies
    honest, _ = zo_step(live.engine, tokenizer, task, A, 3)
    live.load_weights(base)
    claim = UpdateMessage(3, A, quantize_scalars([cheat_sign * s for s in honest.scalars]))
    ledger.add(history + [claim])
    settings = AuditSettings(enabled=True, lag=0)
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    audits.round = 3
    audits.on_accept(history, 4)
    audits.on_accept([claim], 4)
    for first, twin in zip(firsts, twins):
        assert ledger.replace(twin, None) == first.scalars
    if not keep_losing:  # as before the `replaced` table: no losing copy to try
        audits.rewind.losing_copies = None
    audits.round = 5
    replacements = [m for f, t in zip(firsts, twins) for m in (f.negated(), t)]
    audits.on_accept(replacements, 4)  # as the admission hands replacements on
    audits.apply(history + replacements)  # C's settled state of round 3
    whole = recompute(live.engine, tokenizer, task, claim)
    audits.due[(A, 3)] = "recheck"
    jobs = audits.ready(6)
    assert {(j[0], j[2]) for j in jobs} == {(A, "recheck")} | {(p, "recheck") for p in equivocators}
    published = audits.audit(jobs, live.engine, tokenizer, task)
    ((record, mismatch),) = [(r, mm) for r, mm in published if r.accused == A]
    ledger.close()
    return record, mismatch, audits, whole


def test_an_honest_sender_that_trained_on_the_losing_copy_is_matched(tmp_path):
    """The late twin's false convictions: the auditor's state holds the twin, the sender's
    held the first copy. The first retry swaps the first copy back, and matches."""
    record, mismatch, audits, whole = _swapped_audit(tmp_path, cheat_sign=1.0)
    rule = AuditSettings(enabled=True).rule
    assert rule.mismatches(record.scalars, whole)  # the auditor's own state does not match
    assert not mismatch
    assert audits.late_matches == {"swapped": 1} and audits.counts["late_state_matches"] == 1
    assert audits.counts["late_state_retries"] == audits.counts["swap_retries"] == 1


def test_without_the_losing_copy_the_honest_sender_is_accused(tmp_path):
    """The finding this fixes: no state the auditor could build without the losing copy
    (S_t, the late states) matches."""
    (tmp_path / "x").mkdir()
    _, mismatch, audits, _ = _swapped_audit(tmp_path / "x", cheat_sign=1.0, keep_losing=False)
    assert mismatch and audits.counts["swap_retries"] == 0


def test_a_cheater_is_not_cleared_by_the_swapped_state(tmp_path):
    record, mismatch, audits, _ = _swapped_audit(tmp_path, cheat_sign=-1.0)  # sign flip
    assert mismatch and audits.counts["late_state_matches"] == 0
    assert audits.counts["swap_retries"] == 1  # one losing copy: one swapped state
    assert audits.counts["late_state_retries"] >= 1


def test_a_sender_that_held_several_losing_copies_is_matched_by_one_swapped_set(tmp_path):
    """Many equivocators at once (issue 45: 20 keys with late twins convicted all 4
    founders): the sender held three first copies where the auditor holds their twins, so
    no one swap explains its state. The set of rows whose winners reached us after the
    sender's update did, swapped back together, is tried first, and matches."""
    record, mismatch, audits, whole = _swapped_audit(
        tmp_path, cheat_sign=1.0, equivocators=(X, Y, Z)
    )
    assert AuditSettings(enabled=True).rule.mismatches(record.scalars, whole)
    assert not mismatch
    assert audits.late_matches == {"swapped": 1}
    assert audits.counts["swap_retries"] == 1  # the first state tried: the whole set


def test_a_witnessed_equivocator_is_rechecked_without_retries(tmp_path):
    """Its twin is audited by every witness (the replacement made it due) on one state
    only: a peer that signed two updates for a round gets no retry (no honest peer does)."""
    _, _, audits, _ = _swapped_audit(tmp_path, cheat_sign=1.0, equivocators=(X, Y))
    assert audits.counts["equivocator_audits"] == 2  # X's and Y's kept copies
    assert audits.counts["audits"] == 3 and audits.counts["mismatches"] == 2  # the twins
    assert audits.counts["swap_retries"] == 1  # A's swapped set only; none for X or Y


def test_a_cheater_is_not_cleared_by_a_swapped_set(tmp_path):
    _, mismatch, audits, _ = _swapped_audit(tmp_path, cheat_sign=-1.0, equivocators=(X, Y, Z))
    assert mismatch and audits.counts["late_state_matches"] == 0
    # the set (all three winners came after: one state) and each row alone
    assert audits.counts["swap_retries"] == 1 + 3


def test_swap_sets_follow_when_the_winning_copies_reached_us():
    firsts = [UpdateMessage(1, p, (0.5,)) for p in (X, Y, Z)]
    twins = [_twin(m) for m in firsts]
    state = [m for f, t in zip(firsts, twins) for m in (f, f.negated(), t)]
    losing = {(m.peer, 1): [m.scalars] for m in firsts}
    stamps = {(X, 1): (7, 0), (Y, 1): (6, 1), (Z, 1): (5, 2)}  # winners reached us then
    heard = (6, 9)  # the audited update reached us in our round 6

    def rows_of(state_):
        return {m.peer for m in state_[1] if m.scalars == (0.5,)}  # the swapped-back rows

    sets = swap_sets(state, losing, stamps.get, heard)
    # after round 6: X alone is one row (swap_states' job); from round 6 on: X, Y; all
    assert [rows_of(s) for s in sets] == [{X, Y}, {X, Y, Z}]
    assert all(kind == "swapped" for kind, _ in sets)
    # each row swapped back is (the held twin negated, the first copy), newest round first
    assert sets[1][1] == [m for f, t in zip(firsts, twins) for m in (t.negated(), f)]
    # no arrival known for the audited update: all at once only
    assert [rows_of(s) for s in swap_sets(state, losing, stamps.get, None)] == [{X, Y, Z}]
    # one equivocated row only: nothing here (swap_states has it)
    assert swap_sets(state[:3], {(X, 1): [firsts[0].scalars]}, stamps.get, heard) == []
    many = [UpdateMessage(1, bytes([i]), (0.5,)) for i in range(10)]
    big = [m for f in many for m in (f, f.negated(), _twin(f))]
    found = swap_sets(big, {(m.peer, 1): [m.scalars] for m in many}, lambda k: (9, 0), (1, 0))
    assert len(found) <= MAX_SWAP_SETS and len(found) == 1  # the three choices coincide


# -- a replacement is audited like a new update --------------------------------------


def test_a_replaced_row_is_drawn_for_audit_again(tmp_path):
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, _ = load_model("tiny-llama")
    ledger = Ledger(tmp_path / "l.sqlite", CONFIG.run_id)
    live = LiveModel(SubCGE(model, CONFIG), ledger)
    first = UpdateMessage(1, X, (0.5,))
    twin = _twin(first)
    ledger.add([first])
    every = AuditSettings(enabled=True, cpu_share=5.0)  # rate 1: every update drawn
    audits = PeerAudits(every, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    audits.on_accept([first], 2)
    assert audits.due == {(X, 1): "draw"}
    assert audits.ready(1 + audits.delay) == [(X, 1, "draw", first.scalars)]
    audits.done.add((X, 1))  # audited (`audit` marks it done)
    audits.on_accept([UpdateMessage(2, B, (0.25,))], 2)
    ledger.replace(twin, None)
    audits.on_accept([first.negated(), twin], 2)  # the replacement, as the admission hands it
    assert audits.due[(X, 1)] == "recheck" and audits.counts["replaced_rows"] == 1
    assert (X, 1, "recheck", twin.scalars) in audits.ready(1 + audits.delay)
    # witnessed, it is audited whatever the draw: every witness votes on the kept copy
    none = AuditSettings(enabled=True, cpu_share=0.0)
    quiet = PeerAudits(none, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    quiet.done.add((X, 1))
    quiet.on_accept([first.negated(), twin], 2)
    assert quiet.due == {(X, 1): "recheck"}
    ledger.close()
