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
from seedflood_p2p.protocol.message import UpdateMessage
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


# -- revocation -------------------------------------------------------------------------


def test_a_revocation_is_the_creators_and_a_bad_one_is_counted_and_dropped(tmp_path):
    """Codec and checks: a forged, foreign-run or foreign-creator revocation is refused
    with its reason, counted by reason when it comes from the network, and never kept."""
    from seedflood_p2p.network.peers.tickets import (
        Revocation,
        TicketExchange,
        check_revocation,
        decode_revocation,
        revoke,
    )

    key, creator, config = _ticketed(tmp_path)
    holder = Peer()
    good = revoke(key, config, holder.id, 7)
    assert decode_revocation(good.text()) == good and len(good.encode()) == 122
    assert check_revocation(good, config, creator) is None
    assert decode(issue(key, config, holder.id).encode()) != good  # distinct magic
    with pytest.raises(UserError, match="not a seedflood ticket revocation"):
        decode_revocation(issue(key, config, holder.id).encode())
    other_run = revoke(key, RunConfig(salt="another", extra=config.extra), holder.id, 7)
    moved = Revocation(good.run_tag, good.peer, 9, good.signature)  # round edited
    strangers = revoke(tmp_path / "someone.key", config, holder.id, 7)
    assert check_revocation(other_run, config, creator) == "for another run"
    assert check_revocation(moved, config, creator) == "not signed by the run creator"
    assert check_revocation(strangers, config, creator) == "not signed by the run creator"
    book = TicketBook(config)
    got = []

    async def on_revoked(new):
        got.extend(new)

    exchange = TicketExchange(None, config.run_id, book, None, on_revoked)
    raws = [x.encode() for x in (other_run, moved, strangers, good, good)] + [b"junk", 5]
    new = asyncio.run(exchange.take_revocations(raws))
    assert new == got == [good] and list(book.revocations.values()) == [good]
    assert exchange.revocations_dropped == {
        "for another run": 1,
        "not signed by the run creator": 2,
        "malformed": 2,
    }
    assert asyncio.run(exchange.take_revocations([good.encode()])) == []  # held: not new
    assert TicketBook(RunConfig()).revoke(good) == "the run is not ticketed"


def _rows(peers, rounds):
    return [UpdateMessage(t, p, (0.25 * (i + 1),)) for t in range(rounds) for i, p in
            enumerate(peers)]  # fmt: skip


def test_revoked_rounds_never_count_whatever_order_the_ledger_got_them(tmp_path):
    """The rule is a pure function of the ledger: the holder's rows of rounds >= R do not
    count (in the end and in every settled state), whether the revocation was logged
    before or after them; the earliest R of several wins; a forged one stops replay."""
    from seedflood_p2p.algorithm.probation import standing_of_ledger
    from seedflood_p2p.apps.local import check_revocations, counted_updates
    from seedflood_p2p.network.peers.tickets import revoke

    key, _, config = _ticketed(tmp_path)
    a, holder = Peer(), Peer()
    rows = _rows([a.id, holder.id], 10)
    late, early = revoke(key, config, holder.id, 6), revoke(key, config, holder.id, 4)
    counted = []
    for name, before in (("first", True), ("after", False)):
        ledger = Ledger(tmp_path / f"{name}.sqlite", config.run_id)
        ledger.claim(config, "use another dir")
        revocations = [(r.peer, r.round, r.encode()) for r in (late, early)]
        if before:
            assert ledger.add_revocations(revocations) == 2
        ledger.add(reversed(rows) if before else rows)
        if not before:
            assert ledger.add_revocations(revocations[::-1]) == 2
            assert ledger.add_revocations(revocations) == 0  # idempotent
        st = standing_of_ledger(ledger, config.audit, config.probation)
        assert st.revoked == {holder.id: 4}
        assert st.counts(holder.id, 3) and not st.counts(holder.id, 4)
        assert st.counts(a.id, 9) and not st.counts_in(holder.id, 5, 20)
        assert st.counts_in(holder.id, 3, 20)
        check_revocations(ledger, config)
        counted.append(counted_updates(ledger, config)[0])
        ledger.close()
    assert counted[0] == counted[1]
    assert {(m.peer, m.round) for m in counted[0]} == (
        {(a.id, t) for t in range(10)} | {(holder.id, t) for t in range(4)}
    )
    forged = revoke(tmp_path / "x.key", config, a.id, 0)
    with Ledger.open_existing(tmp_path / "first.sqlite") as ledger:
        ledger.add_revocations([(a.id, 0, forged.encode())])
        with pytest.raises(UserError, match="not signed by the run creator: the file was altered"):
            check_revocations(ledger, config)


def test_a_peer_that_applied_revoked_rows_takes_them_back(tmp_path):
    """The race: a peer applied the holder's rows of rounds >= R before the revocation
    reached it. Judging the ledger with it takes them back, so its weights equal those of a
    peer that had the revocation first (float32 rounding), and a row that arrives later is
    neither applied nor kept waiting."""
    import torch

    from peer.audit_duty import PeerAudits
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.core.extra_settings import AuditSettings
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake
    from seedflood_p2p.network.peers.tickets import revoke
    from seedflood_p2p.workload.models import load_model

    key, _, config = _ticketed(tmp_path)
    config = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=0.5, n_ref=4,
                       batch_size=8, extra=config.extra)  # fmt: skip
    a, holder, me = Peer(), Peer(), Peer()
    rows = _rows([a.id, holder.id], 6)
    rev = revoke(key, config, holder.id, 3)
    settings = AuditSettings(enabled=True, lag=0)
    weights = []
    for knew_first in (False, True):
        model, _ = load_model("tiny-llama")
        ledger = Ledger(tmp_path / f"{knew_first}.sqlite", config.run_id)
        live = LiveModel(SubCGE(model, config), ledger)
        audits = PeerAudits(settings, b"secret", me.id, ledger, live, AuditIntake(ledger, 1))
        audits.round = 10
        ledger.add(rows)
        if knew_first:
            ledger.add_revocations([(rev.peer, rev.round, rev.encode())])
        audits.set_standing(audits.judge())
        audits.apply(rows)
        if not knew_first:
            assert {(m.peer, m.round) for m in audits.applied} >= {(holder.id, 4)}
            ledger.add_revocations([(rev.peer, rev.round, rev.encode())])
            audits.set_standing(audits.judge())
        assert {(m.peer, m.round) for m in audits.applied if m.peer == holder.id} == {
            (holder.id, t) for t in range(3)
        }
        audits.apply([UpdateMessage(6, holder.id, (0.5,))])  # a later revoked row
        assert not audits.waiting and len(audits.applied) == 6 + 3
        weights.append({k: w.clone() for k, w in live.weights().items()})
        ledger.close()
    for name, w in weights[0].items():
        assert torch.allclose(w, weights[1][name], atol=1e-5), name


@pytest.mark.slow
def test_a_revoked_tickets_later_rows_count_nowhere_and_ledgers_agree(tmp_path):
    """Real daemons on 127.0.0.1: peers a and b hold tickets without end; a is handed the
    creator's revocation of b's ticket from round 6 (`seedflood ticket revoke`, then
    `--revoke`). It travels to every node (`seedflood.revocations`) and into every ledger;
    b's rows keep being admitted (ledgers stay identical) but those of rounds >= 6 count
    at no node, in the replay's judgement of every ledger alike."""
    import dataclasses
    import subprocess
    import sys

    from bootstrap.node import BootstrapSettings, resolve_manifest
    from harness.cluster import RUN
    from seedflood_p2p.apps.local import check_revocations, counted_updates
    from seedflood_p2p.apps.localnet import start_bootstrap, start_peer

    key = tmp_path / "creator.key"
    creator = base58.b58encode(load_or_create_identity(key).to_bytes()).decode()
    run = dataclasses.replace(RUN, extra={"join": {"mode": "ticketed", "creator": creator}})
    final = resolve_manifest(BootstrapSettings(data_dir=tmp_path / "scratch"), run)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(final.to_json())
    work = tmp_path / "work"
    ids = {}
    for name in "ab":
        (work / name).mkdir(parents=True)
        ids[name] = load_or_create_identity(work / name / "identity.key").to_bytes()
    tickets = {n: issue(key, final, ids[n]).text() for n in "ab"}
    b_id = base58.b58encode(ids["b"]).decode()
    cli = [sys.executable, "-m", "seedflood", "ticket", "revoke", "--manifest", str(manifest),
           "--key", str(key), "--peer", b_id]  # fmt: skip
    out = subprocess.run([*cli, "--from-round", "6"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    revocation = out.stdout.strip()
    missing = subprocess.run(cli, capture_output=True, text=True)
    assert missing.returncode != 0 and "needs --from-round" in missing.stderr
    flags = [
        *("--until-round", "14", "--round-interval", "0.5", "--min-peers", "2"),
        *("--round-deadline", "5", "--liveness-timeout", "8", "--linger", "4"),
        *("--repair-interval", "1", "--connect-retries", "20"),
    ]
    procs = []
    try:
        boot, address = start_bootstrap(work, run)
        procs.append(boot)
        a = start_peer(work, "a", address, [*flags, "--ticket", tickets["a"],
                                            "--revoke", revocation])  # fmt: skip
        b = start_peer(work, "b", address, [*flags, "--ticket", tickets["b"]])
        procs += [a, b]
        codes = {n: p.wait_exit(600) for n, p in (("a", a), ("b", b))}
        assert codes == {"a": 0, "b": 0}, {n: p.tail() for n, p in (("a", a), ("b", b))}
        logged = [e for e in b.events() if e.get("event") == "revocation_logged"]
        assert logged and logged[0]["round"] == 6, b.tail()  # b learned it from the network
    finally:
        for p in procs:
            p.stop()
    seen = {}
    for holder in ("a", "b", "bootstrap"):
        with Ledger.open_existing(work / holder / "ledger.sqlite") as ledger:
            assert [(p, r) for p, r, _ in ledger.revocations()] == [(ids["b"], 6)], holder
            check_revocations(ledger, ledger.config)
            rows = {(m.peer, m.round) for m in ledger.messages()}
            counted = {(m.peer, m.round) for m in counted_updates(ledger, ledger.config)[0]}
            seen[holder] = (ledger.digest(), counted)
        assert {r for p, r in rows if p == ids["b"]} >= set(range(6, 14)), holder  # admitted
        assert {r for p, r in counted if p == ids["b"]} == set(range(6)), holder  # not counted
        assert {r for p, r in counted if p == ids["a"]} == set(range(14)), holder
    assert seen["a"] == seen["bootstrap"]  # the same ledger, the same judgement
