"""An equivocation's losing copy, kept for audits (issue 45): the ledger's `replaced` table,
the admission that fills it, the auditor's retry with an equivocated row swapped back
(peer/state_rewind.py `swap_states`), and a replaced row drawn for audit again
(peer/audit_duty.py `on_accept`). In process: SQLite files and the tiny model; the daemon
scenario is tests/test_equivocation_daemon.py."""

import dataclasses

import numpy as np
import pytest
from test_admission import Peer, node  # noqa: F401  (the `node` fixture)

from peer.state_rewind import MAX_SWAP_STATES, held_copy, swap_states
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
A, B, C, X = (f"peer-{c}".encode() for c in "ABCX")


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


def _swapped_audit(tmp_path, cheat_sign: float, keep_losing: bool = True):
    """Sender A trained round 3 (lag 0) on a state holding X's first copy of round 1; X's
    twin replaced it at auditor C after A's update reached C (the late twin of
    tests/test_equivocation_daemon.py). Returns (record, mismatch, audits, the scalars
    recomputed on C's settled state, which holds the twin)."""
    from peer.audit_duty import PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    model, tokenizer = load_model("tiny-llama")
    task = load_task("synthetic-sentiment")
    config = dataclasses.replace(CONFIG, lr=0.5)  # one update moves the model visibly
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    live = LiveModel(SubCGE(model, config), ledger)
    history = _updates(3, [B, X], seed=5)
    first = next(m for m in history if (m.peer, m.round) == (X, 1))
    twin = _twin(first)
    base = {k: w.clone() for k, w in live.weights().items()}
    live.apply(history)  # the sender's state: X's first copy
    honest, _ = zo_step(live.engine, tokenizer, task, A, 3)
    live.load_weights(base)
    claim = UpdateMessage(3, A, quantize_scalars([cheat_sign * s for s in honest.scalars]))
    ledger.add(history + [claim])
    settings = AuditSettings(enabled=True, lag=0)
    audits = PeerAudits(settings, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    audits.round = 3
    audits.on_accept(history, 4)
    audits.on_accept([claim], 4)
    assert ledger.replace(twin, None) == first.scalars
    if not keep_losing:  # as before the `replaced` table: no losing copy to try
        audits.rewind.losing_copies = None
    audits.round = 5
    audits.on_accept([first.negated(), twin], 4)  # as the admission hands a replacement on
    audits.apply(history + [first.negated(), twin])  # C's settled state of round 3
    whole = recompute(live.engine, tokenizer, task, claim)
    audits.due[(A, 3)] = "recheck"
    ((record, mismatch),) = audits.audit(audits.ready(6), live.engine, tokenizer, task)
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
    assert audits.due[(X, 1)] == "draw" and audits.counts["replaced_rows"] == 1
    assert (X, 1, "draw", twin.scalars) in audits.ready(1 + audits.delay)
    # not drawn: a replacement is not audited either (the draw is per (peer, round))
    none = AuditSettings(enabled=True, cpu_share=0.0)
    quiet = PeerAudits(none, b"secret", C, ledger, live, AuditIntake(ledger, 1))
    quiet.done.add((X, 1))
    quiet.on_accept([first.negated(), twin], 2)
    assert not quiet.due and (X, 1) not in quiet.done
    ledger.close()
