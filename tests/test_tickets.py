"""Join tickets (network/peers/tickets.py): the run creator's key signs (identity, expiry); a
ticketed run's admission drops senders without a valid one. No processes."""

import asyncio

import base58
import pytest
from test_admission import RUN, Peer

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.gossip.admission import Admission
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.tickets import (
    MAX_WANTED,
    Ticket,
    TicketBook,
    check,
    decode,
    issue,
    join_mode,
)
from seedflood_p2p.network.transport.identity import load_or_create_identity
from seedflood_p2p.storage.ledger import Ledger


def _ticketed(tmp_path):
    key = tmp_path / "creator.key"
    creator = load_or_create_identity(key).to_bytes()
    config = RunConfig(
        extra={"join": {"mode": "ticketed", "creator": base58.b58encode(creator).decode()}}
    )
    return key, creator, config


def test_the_manifest_says_how_peers_join(tmp_path):
    _, creator, config = _ticketed(tmp_path)
    assert join_mode(RunConfig()) == "open" and RunConfig().join.creator is None
    assert join_mode(config) == "ticketed" and config.join.creator == creator
    closed = RunConfig(allow_peers=[base58.b58encode(Peer().id).decode()])
    assert join_mode(closed) == "allow-listed"
    for bad in ({"mode": "ticketed"}, {"mode": "secret"}, {"mode": "open", "x": 1}, "yes"):
        with pytest.raises(UserError, match="extra.join"):
            RunConfig(extra={"join": bad})


def test_a_ticket_admits_its_holder_in_its_run_below_its_end_round(tmp_path):
    key, creator, config = _ticketed(tmp_path)
    holder, other = Peer(), Peer()
    ticket = issue(key, config, holder.id, 60)
    assert decode(ticket.text()) == ticket and decode(ticket.encode()) == ticket
    assert check(ticket, config, creator) is None
    assert check(ticket, RunConfig(salt="another"), creator) == "for another run"
    forged = Ticket(ticket.run_tag, other.id, ticket.expires, ticket.signature)  # passed on
    assert check(forged, config, creator) == "not signed by the run creator"
    self_signed = issue(tmp_path / "someone.key", config, other.id, 60)
    assert check(self_signed, config, creator) == "not signed by the run creator"
    longer = Ticket(ticket.run_tag, ticket.peer, 61, ticket.signature)  # end edited
    assert check(longer, config, creator) == "not signed by the run creator"
    book = TicketBook(config)
    assert book.add(ticket) is None
    assert book.admits(holder.id, 59) and not book.admits(holder.id, 60)
    assert book.add(issue(key, config, holder.id, 10)) is None  # the latest end is kept
    assert book.admits(holder.id, 59) and book.admits(holder.id) and not book.admits(other.id)
    with pytest.raises(UserError, match="not a seedflood join ticket"):
        decode(ticket.encode()[:-1])
    with pytest.raises(UserError, match="base58"):
        decode("0OIl")


def test_a_ticketed_run_drops_rows_without_a_ticket_for_their_round(tmp_path):
    """Rounds, not clock time: a row is admitted or not whenever it arrives, so every
    ledger holds the same rows; a dropped author's ticket is looked for, boundedly."""
    key, creator, config = _ticketed(tmp_path)
    holder, stranger, me = Peer(), Peer(), Peer()
    book = TicketBook(config)
    assert book.add(issue(key, config, holder.id, 3)) is None
    assert book.add(issue(tmp_path / "x.key", config, stranger.id)) is not None
    ledger = Ledger(":memory:", RUN)
    admission = Admission(ledger, 1, me.id, NodeMetrics(), 50, tickets=book)
    verdicts = admission.gossip([holder.gossip(1, (0.5,)), stranger.gossip(1, (0.5,))])
    assert [v.reason or v.outcome.value for v in verdicts] == ["accepted", "no_ticket"]
    assert list(book.wanted) == [stranger.id]  # looked for; the holder's is held
    (r,) = asyncio.run(admission.repair([stranger.row(2, (0.5,))], server=holder.id))
    assert r.reason == "no_ticket" and len(ledger) == 1
    (v,) = admission.gossip([holder.gossip(3, (0.5,))])  # round 3: past the ticket's end
    assert v.reason == "no_ticket"
    (r,) = asyncio.run(admission.repair([holder.row(2, (0.5,))], server=stranger.id))
    assert r.outcome.value == "accepted"  # a late row of a round below the end: admitted
    assert admission.metrics.drop_counts()["no_ticket"] == 3
    assert book.due(100.0, 10.0) == [stranger.id] and book.due(105.0, 10.0) == []
    for i in range(MAX_WANTED + 10):  # any key can send: the search is bounded
        book.want(bytes([i % 256, i // 256]) * 19)
    assert len(book.wanted) == MAX_WANTED
    # an open run's book requires nothing
    assert Admission(Ledger(":memory:", RUN), 1, me.id, NodeMetrics(), 50,
                     tickets=TicketBook(RunConfig())).tickets is None  # fmt: skip


@pytest.mark.slow
def test_ticketed_peers_find_each_others_tickets_and_strangers_stay_out(tmp_path):
    """Real daemons on 127.0.0.1: the run creator signs tickets for peers a (no end) and b
    (end round 5). Each starts with only its own ticket; the others fetch it when its rows
    are first dropped (`seedflood.tickets`) and repair brings the rows back, so every
    ledger ends with all of a's rows and b's rows of rounds < 5 (b stops there). A peer
    without a ticket, and one with another peer's, stop at start with one line."""
    import dataclasses

    from bootstrap.node import BootstrapSettings, resolve_manifest
    from harness.cluster import RUN
    from seedflood_p2p.apps.localnet import start_bootstrap, start_peer

    key = tmp_path / "creator.key"
    creator = base58.b58encode(load_or_create_identity(key).to_bytes()).decode()
    run = dataclasses.replace(RUN, extra={"join": {"mode": "ticketed", "creator": creator}})
    final = resolve_manifest(BootstrapSettings(data_dir=tmp_path / "scratch"), run)
    work = tmp_path / "work"
    ids = {}
    for name in "abcd":
        (work / name).mkdir(parents=True)
        ids[name] = load_or_create_identity(work / name / "identity.key").to_bytes()
    tickets = {
        "a": issue(key, final, ids["a"]).text(),
        "b": issue(key, final, ids["b"], 5).text(),
    }
    flags = [
        *("--until-round", "10", "--round-interval", "0.5", "--min-peers", "2"),
        *("--round-deadline", "5", "--liveness-timeout", "8", "--linger", "4"),
        *("--repair-interval", "1", "--connect-retries", "20"),
    ]
    procs = []
    try:
        boot, address = start_bootstrap(work, run)
        procs.append(boot)
        c = start_peer(work, "c", address, flags)  # no ticket
        d = start_peer(work, "d", address, [*flags, "--ticket", tickets["a"]])  # a's
        procs += [c, d]
        peers = {n: start_peer(work, n, address, [*flags, "--ticket", tickets[n]]) for n in "ab"}
        procs += peers.values()
        assert c.wait_exit() == 2 and d.wait_exit() == 2
        assert "is ticketed: ask its creator for a join ticket" in c.tail()
        assert "a ticket cannot be passed on" in d.tail()
        codes = {n: p.wait_exit(600) for n, p in peers.items()}
        assert codes == {"a": 0, "b": 0}, {n: p.tail() for n, p in peers.items()}
        fetched = [e for e in peers["a"].events() if e.get("event") == "ticket_fetched"]
        assert fetched, peers["a"].tail()  # a learned b's ticket from the network
    finally:
        for p in procs:
            p.stop()
    from seedflood_p2p.storage.ledger import Ledger

    for holder in ("a", "bootstrap"):
        with Ledger.open_existing(work / holder / "ledger.sqlite") as ledger:
            rows = {(m.peer, m.round) for m in ledger.messages()}
        assert {r for p, r in rows if p == ids["b"]} == set(range(5)), holder
        assert {r for p, r in rows if p == ids["a"]} == set(range(10)), holder
        assert {p for p, _ in rows} == {ids["a"], ids["b"]}, holder
