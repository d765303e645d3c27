"""Join tickets (network/tickets.py): the run creator's key signs (identity, expiry); a
ticketed run's admission drops senders without a valid one. No processes."""

import asyncio

import base58
import pytest
from test_admission import RUN, Peer

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.admission import Admission
from seedflood_p2p.network.identity import load_or_create_identity
from seedflood_p2p.network.metrics import NodeMetrics
from seedflood_p2p.network.tickets import (
    Ticket,
    TicketBook,
    check,
    decode,
    issue,
    join_mode,
    ticket_creator,
)
from seedflood_p2p.storage.ledger import Ledger

NOW = 1_800_000_000


def _ticketed(tmp_path):
    key = tmp_path / "creator.key"
    creator = load_or_create_identity(key).to_bytes()
    config = RunConfig(
        extra={"join": {"mode": "ticketed", "creator": base58.b58encode(creator).decode()}}
    )
    return key, creator, config


def test_the_manifest_says_how_peers_join(tmp_path):
    _, creator, config = _ticketed(tmp_path)
    assert join_mode(RunConfig()) == "open" and ticket_creator(RunConfig()) is None
    assert join_mode(config) == "ticketed" and ticket_creator(config) == creator
    closed = RunConfig(allow_peers=[base58.b58encode(Peer().id).decode()])
    assert join_mode(closed) == "allow-listed"
    for bad in ({"mode": "ticketed"}, {"mode": "secret"}, {"mode": "open", "x": 1}, "yes"):
        with pytest.raises(UserError, match="extra.join"):
            ticket_creator(RunConfig(extra={"join": bad}))


def test_a_ticket_admits_its_holder_in_its_run_until_it_expires(tmp_path):
    key, creator, config = _ticketed(tmp_path)
    holder, other = Peer(), Peer()
    ticket = issue(key, config, holder.id, NOW + 60)
    assert decode(ticket.text()) == ticket and decode(ticket.encode()) == ticket
    assert check(ticket, config, creator, now=NOW) is None
    assert check(ticket, config, creator, now=NOW + 60) == "expired"
    assert check(ticket, RunConfig(salt="another"), creator, now=NOW) == "for another run"
    forged = Ticket(ticket.run_tag, other.id, ticket.expires, ticket.signature)  # passed on
    assert check(forged, config, creator, now=NOW) == "not signed by the run creator"
    self_signed = issue(tmp_path / "someone.key", config, other.id, NOW + 60)
    assert check(self_signed, config, creator, now=NOW) == "not signed by the run creator"
    with pytest.raises(UserError, match="not a seedflood join ticket"):
        decode(ticket.encode()[:-1])
    with pytest.raises(UserError, match="base58"):
        decode("0OIl")


def test_a_ticketed_run_drops_senders_without_a_valid_ticket(tmp_path):
    key, creator, config = _ticketed(tmp_path)
    holder, stranger, me = Peer(), Peer(), Peer()
    clock = [NOW]
    book = TicketBook(config, clock=lambda: clock[0])
    assert book.add(issue(key, config, holder.id, NOW + 100)) is None
    assert book.add(issue(tmp_path / "x.key", config, stranger.id, NOW + 100)) is not None
    ledger = Ledger(":memory:", RUN)
    admission = Admission(ledger, 1, me.id, NodeMetrics(), 50, tickets=book)
    verdicts = admission.gossip([holder.gossip(1, (0.5,)), stranger.gossip(1, (0.5,))])
    assert [v.reason or v.outcome.value for v in verdicts] == ["accepted", "no_ticket"]
    (r,) = asyncio.run(admission.repair([stranger.row(2, (0.5,))], server=holder.id))
    assert r.reason == "no_ticket" and len(ledger) == 1
    clock[0] = NOW + 100  # the ticket expired: the holder is a stranger now
    (v,) = admission.gossip([holder.gossip(3, (0.5,))])
    assert v.reason == "no_ticket"
    assert admission.metrics.drop_counts()["no_ticket"] == 3
    # an open run's book requires nothing
    assert Admission(Ledger(":memory:", RUN), 1, me.id, NodeMetrics(), 50,
                     tickets=TicketBook(RunConfig())).tickets is None  # fmt: skip
