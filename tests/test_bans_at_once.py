"""Bans act at once, everywhere (issue 45): a peer banned by the ledger's audit verdicts or
by this peer's reputation is not waited for (Pacing), not asked for repair (sync passes,
anti-entropy, a joiner's source check and catch-up), not audited (queued jobs dropped),
and disconnected. No daemons: stub transports and SQLite files."""

import asyncio
import time
import types

from hivemind.p2p import PeerID
from test_admission import RUN, Peer

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.gossip.peer_table import PeerTable
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


def peer_table(states: dict) -> PeerTable:
    """A flood node's peer table holding {peer: (newest round, last heard)}."""
    table = PeerTable()
    for peer, (round_, heard) in states.items():
        table.heard(peer, round_, heard)
    return table


# -- Pacing ------------------------------------------------------------------------------


def _pacing(peers, banned: set):
    from peer.rounds import Pacing
    from peer.settings import PeerSettings

    settings = PeerSettings(round_deadline=3600.0, max_staleness=0)  # a wait: a hang
    return Pacing(settings, NodeMetrics(), lambda: peers, lambda: False, banned=banned.__contains__)


async def test_a_banned_peer_is_never_waited_for():
    slow, ok = b"s" * 38, b"o" * 38
    peers = peer_table({slow: (3, time.monotonic()), ok: (9, 1e18)})
    pacing = _pacing(peers, {slow})
    started = time.monotonic()
    await asyncio.wait_for(pacing.wait_ready(10), timeout=5)
    assert time.monotonic() - started < 1.0  # at once, not the deadline
    assert set(pacing.live(time.monotonic())) == {ok}
    assert pacing.laggards == set()  # not a laggard: it never counted


async def test_a_peer_banned_while_a_round_waits_for_it_ends_the_wait_at_once():
    """The issue: every honest peer waited the 30 s deadline for a peer banned 29 s in."""
    slow = b"s" * 38
    peers = peer_table({slow: (3, 1e18)})
    banned: set[bytes] = set()
    pacing = _pacing(peers, banned)
    waiting = asyncio.ensure_future(pacing.wait_ready(10))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # behind, live, not banned: waited for
    banned.add(slow)
    banned_at = time.monotonic()
    await asyncio.wait_for(waiting, timeout=5)
    assert time.monotonic() - banned_at < 1.0


# -- repair sources ------------------------------------------------------------------------


class _Id:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw


def _node(tmp_path, who: Peer, name: str, avoids=lambda peer: False) -> FloodNode:
    p2p = types.SimpleNamespace(peer_id=_Id(who.id), daemon_listen_maddr={"unix": "unused"})
    (tmp_path / name).mkdir()
    ledger = Ledger(tmp_path / name / "ledger.sqlite", RUN)
    return FloodNode(p2p, ledger, RunConfig(), NodeMetrics(), NodeSettings(), avoids=avoids)


def _servers(tmp_path, monkeypatch):
    """A client and three servers holding the same rows: `good`, `judged` (banned by the
    client's ledger verdicts: `avoids`) and `scored` (banned by its reputation). Returns
    (client, {name: PeerID-like}, the servers the client called, in order)."""
    from seedflood_p2p.network.gossip import repair

    author = Peer()
    ids = {name: Peer() for name in ("good", "judged", "scored")}
    client_id = Peer()
    client = _node(tmp_path, client_id, "client", avoids=lambda p: p == ids["judged"].id)
    client.reputation.ban(ids["scored"].id, "bad_page")
    servers = {}
    rows = [author.row(r, (0.5,)) for r in range(3)]
    for name, who in ids.items():
        servers[who.id] = _node(tmp_path, who, name)
        servers[who.id].ledger.add([m for m, _ in rows], [e for _, e in rows])
    called: list[bytes] = []

    async def call_bytes(p2p, peer_id, name, request, timeout, max_response=None):
        called.append(peer_id.to_bytes())
        return await servers[peer_id.to_bytes()].repair.handlers[name](_Id(client_id.id), request)

    monkeypatch.setattr(repair, "call_bytes", call_bytes)
    return client, {name: _Id(who.id) for name, who in ids.items()}, called


def test_a_sync_pass_asks_no_banned_peer(tmp_path, monkeypatch):
    client, ids, called = _servers(tmp_path, monkeypatch)
    peers = [ids["judged"], ids["scored"], ids["good"]]
    assert asyncio.run(client.sync_until_complete(peers)) == 3
    assert set(called) == {ids["good"].raw}
    check = asyncio.run(client.check_sources(peers))  # a joiner's cross-check too
    assert check.agree == [ids["good"].raw] and check.compared == 1


def test_anti_entropy_never_spends_a_pass_on_a_banned_peer(tmp_path, monkeypatch):
    client, ids, called = _servers(tmp_path, monkeypatch)

    async def peers():
        return [ids["judged"], ids["scored"], ids["good"]]

    client.repair.peers = peers
    for _ in range(12):  # a random choice among all three would miss `good` 1 - (1/3)^12
        asyncio.run(client.repair.anti_entropy_pass())
    assert set(called) == {ids["good"].raw}
    assert len(client.ledger) == 3


def test_catch_up_does_not_count_a_banned_peer_as_caught_up(tmp_path, monkeypatch):
    from seedflood_p2p.network.peers.reconnect import catch_up

    client, ids, called = _servers(tmp_path, monkeypatch)
    b58 = {name: PeerID(i.raw).to_base58() for name, i in ids.items()}
    reconnector = types.SimpleNamespace(
        connected={b58["judged"], b58["scored"]}, candidates=lambda: []
    )
    polls = []

    def stopping() -> bool:  # the banned ones only: it keeps waiting
        polls.append(1)
        return len(polls) > 2

    assert asyncio.run(catch_up(reconnector, client, ["x"], stopping)) == 0
    assert called == []
    reconnector.connected.add(b58["good"])
    assert asyncio.run(catch_up(reconnector, client, ["x"], lambda: False)) == 3
    assert set(called) == {ids["good"].raw}


# -- the audit queue and the mesh ----------------------------------------------------------


def test_a_verdict_drops_the_banned_peer_s_queued_audits_and_disconnects_it(tmp_path):
    from peer.audit_duty import DaemonAudits, PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    cheat, honest, me = b"peer-X", b"peer-H", b"peer-C"
    auditors = (b"peer-A", b"peer-B", b"peer-D")
    config = RunConfig()
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    ledger.add([UpdateMessage(r, p, (0.5,)) for r in range(4) for p in (cheat, honest)])
    live = types.SimpleNamespace(apply=lambda messages: None, config=config)  # nothing applied
    settings = AuditSettings(enabled=True, quorum=3, lag=0)
    audits = PeerAudits(settings, b"secret", me, ledger, live, AuditIntake(ledger, 1))
    banned: list[bytes] = []

    async def run(fn, *args):
        return fn(*args)

    daemon = DaemonAudits(audits, NodeMetrics(), run, lambda: 3, on_ban=banned.append)
    audits.due = {(cheat, 1): "draw", (cheat, 2): "recheck", (honest, 1): "draw"}
    jobs = [(cheat, 3, "draw", (0.5,))]  # handed out by `ready` before the verdict came
    ledger.add_audits([AuditRecord(cheat, 0, a, (1.5,), 1) for a in auditors])
    asyncio.run(daemon.judge())
    assert set(audits.banned) == {cheat} and banned == [cheat]
    assert audits.due == {(honest, 1): "draw"}  # the banned peer's queued audits: dropped
    assert audits.audit(jobs, None, None, None) == []  # ... and one already out: not run
    assert audits.counts["skipped"] == 3
    asyncio.run(daemon.judge())  # nothing new: not disconnected again
    assert banned == [cheat]
    ledger.close()


async def test_a_probationer_is_live_but_never_waited_for_until_established():
    """A fresh key buys no time: a probationer far behind does not hold the round (it is
    still live, counted in the peers gauge); once established it is waited for."""
    slow, ok = b"n" * 38, b"o" * 38
    peers = peer_table({slow: (3, 1e18), ok: (9, 1e18)})
    established: set[bytes] = {ok}
    pacing = _pacing(peers, set())
    pacing.probationer = lambda peer: peer not in established
    await asyncio.wait_for(pacing.wait_ready(10), timeout=5)  # not the 3600 s deadline
    assert set(pacing.live(time.monotonic())) == {slow, ok}
    assert set(pacing.waited(time.monotonic())) == {ok}
    established.add(slow)
    waiting = asyncio.ensure_future(pacing.wait_ready(10))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # established and behind: waited for now
    peers.heard(slow, 9, 1e18)
    await asyncio.wait_for(waiting, timeout=5)


async def test_records_arriving_during_a_judgement_are_judged_together_in_one_more_pass(
    tmp_path, monkeypatch
):
    """A burst of audit records (or a key that floods them) costs one pass over the ledger
    per judgement in flight, not one per record: `on_records` asks for a judgement without
    waiting, and those asked for during a pass share the next one, which sees them all."""
    from peer.audit_duty import DaemonAudits, PeerAudits
    from seedflood_p2p.network.gossip.audit_intake import AuditIntake

    cheat, me = b"peer-X", b"peer-C"
    auditors = (b"peer-A", b"peer-B", b"peer-D")
    config = RunConfig()
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    ledger.add([UpdateMessage(r, p, (0.5,)) for r in range(4) for p in (cheat, b"peer-H")])
    live = types.SimpleNamespace(apply=lambda messages: None, config=config)
    settings = AuditSettings(enabled=True, quorum=3, lag=0)
    audits = PeerAudits(settings, b"secret", me, ledger, live, AuditIntake(ledger, 1))
    passes = []
    judge = PeerAudits.judge
    monkeypatch.setattr(PeerAudits, "judge", lambda self: passes.append(1) or judge(self))

    async def run(fn, *args):
        await asyncio.sleep(0.05)  # the model thread is busy: each pass takes a while
        return fn(*args)

    banned: list[bytes] = []
    daemon = DaemonAudits(audits, NodeMetrics(), run, lambda: 3, on_ban=banned.append)
    first = AuditRecord(cheat, 0, auditors[0], (1.5,), 1)
    ledger.add_audits([first])
    await daemon.on_records([first])  # returns at once: the pass runs meanwhile
    await asyncio.sleep(0)
    later = [AuditRecord(cheat, r, a, (1.5,), r + 1) for r in range(3) for a in auditors]
    for record in later[1:]:  # ... eight more arrive while it runs
        ledger.add_audits([record])
        await daemon.on_records([record])
    await daemon.judge()  # waits for a pass that began after it was called
    assert banned == [cheat] and set(audits.banned) == {cheat}
    assert audits.standing.judgement.cases[-1].round == 2  # the last records were judged
    assert len(passes) <= 3  # not one pass per record (10)
    ledger.close()


async def test_a_revoked_ticket_holder_is_not_waited_for():
    """A holder whose ticket the creator revoked (in the ledger) leaves the round's wait as a
    banned peer does: the daemon's `banned` predicate that Pacing reads says so."""
    from peer.daemon import PeerDaemon

    holder, other = b"h" * 38, b"o" * 38
    revoked = types.SimpleNamespace(revoked={holder: 6})
    audits = types.SimpleNamespace(audits=types.SimpleNamespace(banned={}), standing=revoked)
    daemon = types.SimpleNamespace(audits=audits, host=None)
    for name in ("_ledger_bans", "_revoked"):
        setattr(daemon, name, types.MethodType(getattr(PeerDaemon, name), daemon))
    banned = types.MethodType(PeerDaemon._banned, daemon)
    assert banned(holder) and not banned(other)
    peers = peer_table({holder: (3, 1e18), other: (9, 1e18)})
    pacing = _pacing(peers, set())
    pacing.banned = banned
    await asyncio.wait_for(pacing.wait_ready(10), timeout=5)  # not the 3600 s deadline
    assert set(pacing.live(time.monotonic())) == {other}
