"""Admission (network/gossip/admission.py) on an in-memory ledger: every outcome of every source,
what reaches the model, and what is counted. No daemons."""

import math

import msgpack
import pytest

from harness.signer import RUN, Peer  # other test files import them from here
from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.network.gossip.admission import Admission, Outcome, Source
from seedflood_p2p.network.monitoring.metrics import (
    OUTCOMES,
    SOURCES,
    NodeMetrics,
    histogram_totals,
)
from seedflood_p2p.protocol.framing import PROTOCOL_VERSION, Rejected, run_tag
from seedflood_p2p.protocol.message import Envelope, UpdateMessage, pack_scalars
from seedflood_p2p.storage.ledger import Ledger

PACK = msgpack.Packer(use_bin_type=True).pack


@pytest.fixture
def node():
    """An admission pipeline on an in-memory ledger, k = 1, window 50; `node.handed` is
    everything it passed on to the model."""
    me = Peer()
    ledger = Ledger(":memory:", RUN)
    handed = []
    admission = Admission(ledger, 1, me.id, NodeMetrics(), max_ahead=50, deliver=handed.extend)
    admission.me, admission.handed = me, handed
    yield admission
    ledger.close()


def _outcomes(verdicts) -> list[tuple[str, str]]:
    return [(v.outcome.value, v.reason) for v in verdicts]


def test_outcome_and_source_names_are_the_metric_labels():
    assert tuple(Source) == SOURCES and tuple(Outcome) == OUTCOMES


def test_gossip_new_then_duplicate(node):
    alice = Peer()
    (v,) = node.gossip([alice.gossip(3, (0.5,))])
    assert v.outcome is Outcome.ACCEPTED and v.message == UpdateMessage(3, alice.id, (0.5,))
    assert node.ledger.scalars_of(alice.id, 3) == (0.5,)
    assert node.handed == [v.message] and node.newest_round == 3
    (again,) = node.gossip([alice.gossip(3, (0.5,))])
    assert (again.outcome, again.reason) == (Outcome.DUPLICATE, "duplicate")
    assert node.handed == [v.message]  # applied once
    m = node.metrics
    assert m.accepted_counts()["gossip"] == 1 and m.drop_counts()["duplicate"] == 1
    assert m.admission_counts()["gossip"] == {
        "accepted": 1,
        "replaced": 0,
        "duplicate": 1,
        "echo": 0,
        "dropped": 0,
    }


def test_every_gossip_rule_drops_with_its_reason_and_nothing_reaches_the_ledger(node):
    tag, half, alice = run_tag(RUN), pack_scalars((0.5,)), Peer()
    payloads = {
        "oversized": PACK([PROTOCOL_VERSION, tag, 3, half]) + b"\0" * 100,
        "malformed": b"\xc1\xffnot msgpack",
        "bad_version": PACK([PROTOCOL_VERSION + 1, tag, 3, half]),
        "wrong_run": PACK([PROTOCOL_VERSION, b"\0\0\0\0", 3, half]),
        "non_finite": PACK([PROTOCOL_VERSION, tag, 3, pack_scalars((math.nan,))]),
        "out_of_window": PACK([PROTOCOL_VERSION, tag, MAX_ROUND + 1, half]),
    }
    node.own_round = 0  # the window: rounds -30 .. 50, as two other peers agree
    node.gossip([Peer().gossip(0, (0.5,)), Peer().gossip(0, (0.5,))])
    arrivals = [(alice.id, alice.envelope(3, (0.5,), data)) for data in payloads.values()]
    arrivals.append(alice.gossip(51, (0.5,)))  # past the window: own round 0, + 50
    arrivals.append(alice.gossip(4, (0.5, 0.25)))  # two scalars in a run of k = 1
    verdicts = node.gossip(arrivals)
    reasons = [*payloads, "out_of_window", "malformed"]
    assert _outcomes(verdicts) == [("dropped", r) for r in reasons]
    assert len(node.ledger) == 2 and len(node.handed) == 2  # the two others' only
    dropped = node.metrics.drop_counts()
    assert {r: dropped[r] for r in payloads} == {
        **{r: 1 for r in payloads},
        "out_of_window": 2,
        "malformed": 2,
    }
    assert node.metrics.admission_counts()["gossip"]["dropped"] == len(arrivals)


def test_gossip_ahead_of_a_syncing_node_is_its_lag_not_held_against_the_sender(node):
    alice, bob = Peer(), Peer()
    node.gossip([Peer().gossip(0, (0.5,)), Peer().gossip(0, (0.5,))])  # it knows round 0
    node.catching_up = True  # still syncing a long history: the run is far ahead
    ahead = [alice.gossip(r, (0.5,)) for r in range(100, 110)]  # (within its rate limit)
    assert {v.reason for v in node.gossip(ahead)} == {"out_of_window"}
    assert node.reputation.score(alice.id) == 0.0  # dropped, not penalized
    node.catching_up = False  # in step: the same is the sender's doing again
    node.gossip([bob.gossip(r, (0.5,)) for r in range(100, 110)])
    assert node.reputation.score(bob.id) < 0.0


def test_window_is_centred_on_the_own_round_with_both_bounds(node):
    alice = Peer()
    node.own_round = 40
    node.gossip([Peer().gossip(40, (0.5,)), Peer().gossip(40, (0.5,))])  # a quorum agrees
    verdicts = node.gossip([alice.gossip(r, (0.5,)) for r in (9, 10, 90, 91)])  # -30 .. +50
    assert _outcomes(verdicts) == [
        ("dropped", "out_of_window"),
        ("accepted", ""),
        ("accepted", ""),
        ("dropped", "out_of_window"),
    ]


def test_one_identity_cannot_move_the_reference_round(node):
    """A node that does not train (bootstrap) centres the window on the round a quorum of
    distinct peers reached: honest peers at 40, a walker claiming 5,000 is one vote."""
    bob, carol, mallory = Peer(), Peer(), Peer()
    node.gossip([bob.gossip(40, (0.5,)), carol.gossip(40, (0.5,))])
    walk = node.gossip([mallory.gossip(r, (9.0,)) for r in range(90, 5001, 50)])
    assert [v.outcome for v in walk][1:] == [Outcome.DROPPED] * (len(walk) - 1)
    assert node.reference_round() == 40 and node.claims[mallory.id] == 90  # refused: no vote
    assert node.ledger.max_round() == 90  # 40 + 50: the one step inside the window
    # Its rounds far behind the quorum are refused too (no backfilling closed rounds).
    (old,) = node.gossip([mallory.gossip(3, (9.0,))])
    assert (old.outcome, old.reason) == (Outcome.DROPPED, "out_of_window")
    # Honest peers moving on move the reference: the quorum, not the highest claim (a
    # jump past the window comes by repair, bounded by the peers' digest claims).
    node.gossip([bob.gossip(80, (0.5,)), carol.gossip(80, (0.5,))])
    assert node.reference_round() == 80


async def test_equivocation_keeps_the_smaller_update_whatever_the_order_and_bans(node):
    alice = Peer()
    node.gossip([alice.gossip(1, (0.5,))])
    (loser,) = node.gossip([alice.gossip(1, (0.75,))])  # larger: dropped
    assert (loser.outcome, loser.reason) == (Outcome.DROPPED, "equivocation")
    assert node.reputation.is_banned(alice.id)  # two signed updates for a round: proof
    (banned,) = node.gossip([alice.gossip(2, (0.5,))])
    assert (banned.outcome, banned.reason) == (Outcome.DROPPED, "banned")
    # A third copy, relayed by repair (a banned author's rows relayed by others still
    # follow the rules, so every honest ledger ends the same): smaller, replaces.
    (winner,) = await node.repair([alice.row(1, (0.25,))], server=Peer().id)
    assert (winner.outcome, winner.reason) == (Outcome.REPLACED, "equivocation")
    assert node.ledger.scalars_of(alice.id, 1) == (0.25,)
    first = UpdateMessage(1, alice.id, (0.5,))
    assert node.handed == [first, first.negated(), UpdateMessage(1, alice.id, (0.25,))]
    assert node.metrics.drop_counts()["equivocation"] == 2  # seen twice, as before
    assert node.metrics.admission_counts()["repair"]["replaced"] == 1
    assert node.metrics.ban_counts() == {"equivocation": 1}


def test_equivocation_inside_one_batch(node):
    alice = Peer()
    verdicts = node.gossip(
        [alice.gossip(2, (0.5,)), alice.gossip(2, (0.25,)), alice.gossip(2, (0.75,))]
    )
    assert _outcomes(verdicts) == [
        ("dropped", "equivocation"),
        ("accepted", ""),
        ("dropped", "equivocation"),
    ]
    assert node.handed == [UpdateMessage(2, alice.id, (0.25,))]  # never the others
    assert node.ledger.scalars_of(alice.id, 2) == (0.25,)


def test_own_update_is_logged_handed_on_and_its_echo_signs_it(node):
    own = UpdateMessage(5, node.me.id, (0.125,))
    verdict = node.own(own)
    assert verdict.outcome is Outcome.ACCEPTED and node.handed == [own]
    assert node.ledger.unsigned(node.me.id) == [own]  # logged before it is signed
    (echo,) = node.gossip([node.me.gossip(5, (0.125,))])
    assert (echo.outcome, echo.reason) == (Outcome.ECHO, "own")
    assert node.ledger.unsigned(node.me.id) == []  # the envelope is attached: repairable
    assert node.handed == [own]  # not applied twice
    m = node.metrics
    assert m.accepted_counts()["own"] == 1 and m.drop_counts()["own"] == 0  # not a drop
    assert m.admission_counts()["gossip"]["echo"] == 1
    again = node.own(own)  # a second update of ours for the round is never admitted
    assert (again.outcome, again.reason) == (Outcome.DUPLICATE, "duplicate")
    other = node.own(UpdateMessage(5, node.me.id, (0.25,)))
    assert (other.outcome, other.reason) == (Outcome.DROPPED, "equivocation")
    assert node.handed == [own] and node.ledger.scalars_of(node.me.id, 5) == (0.125,)


def test_own_signed_update_we_do_not_hold_is_admitted_like_anyone_s(node):
    (v,) = node.gossip([node.me.gossip(7, (0.5,))])  # e.g. our ledger was lost
    assert v.outcome is Outcome.ACCEPTED and len(node.ledger) == 1


async def test_repair_rows_are_verified_and_take_late_rows(node):
    alice, mallory = Peer(), Peer()
    node.own_round = 480
    good = alice.row(420, (0.5,))  # long before the gossip window: repair takes late rows
    forged = (UpdateMessage(6, alice.id, (0.25,)), mallory.envelope(6, (0.25,)))
    edited = (UpdateMessage(7, alice.id, (0.75,)), alice.envelope(7, (0.5,)))
    verdicts = await node.repair([good, forged, edited])
    assert _outcomes(verdicts) == [
        ("accepted", ""),
        ("dropped", "bad_signature"),
        ("dropped", "mismatch"),
    ]
    assert node.handed == [good[0]] and len(node.ledger) == 1
    assert node.ledger.signed_after(-1, b"", MAX_ROUND, 10) == [good]  # servable on
    m = node.metrics
    assert m.accepted_counts()["repair"] == 1
    assert m.drop_counts()["bad_signature"] == 1 and m.drop_counts()["mismatch"] == 1


async def test_repair_duplicates_skip_the_signature_check_and_are_not_drops(node):
    alice = Peer()
    node.gossip([alice.gossip(3, (0.5,))])
    checked = []
    node.verify = lambda *args: checked.append(args) or True
    (v,) = await node.repair([alice.row(3, (0.5,))])
    assert v.outcome is Outcome.DUPLICATE and checked == []
    assert node.metrics.drop_counts()["duplicate"] == 0  # expected overlap
    assert node.metrics.admission_counts()["repair"]["duplicate"] == 1


async def test_repair_brings_the_kept_copy_of_an_equivocation(node):
    alice = Peer()
    node.gossip([alice.gossip(1, (0.5,))])
    (v,) = await node.repair([alice.row(1, (0.25,))])
    assert v.outcome is Outcome.REPLACED
    assert node.handed[1:] == [
        UpdateMessage(1, alice.id, (-0.5,)),
        UpdateMessage(1, alice.id, (0.25,)),
    ]
    assert node.ledger.signed_after(-1, b"", 10, 10) == [alice.row(1, (0.25,))]


def test_a_bad_reply_is_counted_whole(node):
    node.drop_reply(Rejected("bad_reply", "not a list"), Peer().id)
    assert node.metrics.drop_counts()["bad_reply"] == 1
    assert sum(sum(c.values()) for c in node.metrics.admission_counts().values()) == 0


async def test_stage_histograms_count_each_decode_check_and_batch(node):
    alice, bob = Peer(), Peer()
    node.gossip(
        [alice.gossip(1, (0.5,)), bob.gossip(1, (0.25,)), (bob.id, Envelope(b"x", b"", b""))]
    )
    await node.repair([alice.row(2, (0.5,)), bob.row(2, (0.25,))])
    node.own(UpdateMessage(2, node.me.id, (0.125,)))
    m = node.metrics
    assert histogram_totals(m.decode_seconds)[""]["count"] == 3  # the bad payload too
    assert histogram_totals(m.verify_seconds)[""]["count"] == 2  # one per unseen repair row
    admits = histogram_totals(m.admit_seconds)
    assert {s: admits[s]["count"] for s in SOURCES} == {"gossip": 1, "repair": 1, "own": 1}
    assert all(admits[s]["sum_s"] > 0 for s in SOURCES)
