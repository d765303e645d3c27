"""Repair after a long partition: few round trips, no set fetched in vain, no
row's signature checked twice, and the hostile-peer bounds kept. FloodNodes on ledger
files, repair calls routed to the server's handlers (no daemons); the same code the
partition benchmarks run (bench/bench_repair_heal.py, bench/bench_partition.py)."""

import asyncio
import dataclasses
import types

from test_admission import RUN, Peer

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip import repair
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.storage.ledger import Ledger


class _Id:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw


def _node(tmp_path, who: Peer, name: str, own_round: int = -1) -> FloodNode:
    p2p = types.SimpleNamespace(peer_id=_Id(who.id), daemon_listen_maddr={"unix": "unused"})
    (tmp_path / name).mkdir()
    node = FloodNode(
        p2p,
        Ledger(tmp_path / name / "ledger.sqlite", RUN),
        RunConfig(extra={"audit": False}),  # update repair only: no audit digests
        NodeMetrics(),
        NodeSettings(),
    )
    node.admission.own_round = own_round
    return node


def _route(monkeypatch, nodes: dict[bytes, FloodNode], calls: list) -> None:
    """Repair calls go to the server node's handlers; `calls` records (server, name)."""

    async def call_bytes(p2p, peer_id, name, request, timeout, max_response=None):
        server = nodes[peer_id.to_bytes()]
        calls.append((peer_id.to_bytes(), name.split(".")[1]))
        await asyncio.sleep(0)
        return await server.repair.handlers[name](p2p.peer_id, request)

    monkeypatch.setattr(repair, "call_bytes", call_bytes)


def _add(node: FloodNode, rows) -> None:
    node.ledger.add([m for m, _ in rows], [e for _, e in rows])


def test_a_long_partition_s_buckets_come_in_a_few_pages_not_one_each(tmp_path, monkeypatch):
    """40 buckets that differ, 2 rows each: one exchange, one fetch page (each bucket was
    a page of its own, 32 at most an exchange: 32 round trips and a second exchange)."""
    alice, bob, server_id, client_id = Peer(), Peer(), Peer(), Peer()
    server, client = _node(tmp_path, server_id, "server"), _node(tmp_path, client_id, "client")
    rounds = range(0, 40 * BUCKET_ROUNDS, BUCKET_ROUNDS // 2)
    _add(server, [p.row(r, (0.5,)) for r in rounds for p in (alice, bob)][::2])
    calls = []
    _route(monkeypatch, {server_id.id: server, client_id.id: client}, calls)
    new = asyncio.run(client.sync_with(_Id(server_id.id)))
    assert new == 80 and client.behind == set()
    assert [name for _, name in calls] == ["digest", "fetch"]
    assert client.ledger.digest() == server.ledger.digest()


def test_the_next_page_is_asked_for_while_this_one_is_checked_and_written(tmp_path, monkeypatch):
    """A page's signatures and writes took ~70% of a page's time while the next page waited
    to be asked for: it is asked for as soon as this one is decoded. The same pages, the
    same rows; none asked past the last one."""
    alice, server_id, client_id = Peer(), Peer(), Peer()
    server, client = _node(tmp_path, server_id, "server"), _node(tmp_path, client_id, "client")
    _add(server, [alice.row(r, (0.5,)) for r in range(40)])
    calls = []
    _route(monkeypatch, {server_id.id: server, client_id.id: client}, calls)
    table = client.repair.tables[0]
    table.page_rows = 8  # five pages
    fetched_by_insert_end = []
    insert = table.insert

    async def insert_and_count(rows, who, sole):
        intake = await insert(rows, who, sole)
        fetched_by_insert_end.append(sum(name == "fetch" for _, name in calls))
        return intake

    table.insert = insert_and_count
    assert asyncio.run(client.sync_with(_Id(server_id.id))) == 40
    assert fetched_by_insert_end == [2, 3, 4, 5, 5]
    assert [name for _, name in calls] == ["digest"] + ["fetch"] * 5
    assert client.ledger.digest() == server.ledger.digest()


def test_a_set_taken_in_is_not_fetched_again_from_anyone(tmp_path, monkeypatch):
    """After a partition each node's buckets differ from the other side's in rows it already
    holds: a bucket set fetched whole and taken in is skipped until the server's bucket
    changes, from that server and from any other serving the same set (every exchange
    used to start again at the oldest differing buckets and fetch them in vain)."""
    alice, bob, carol, dave = Peer(), Peer(), Peer(), Peer()
    one, two, client_id = Peer(), Peer(), Peer()
    nodes = {
        one.id: _node(tmp_path, one, "one"),
        two.id: _node(tmp_path, two, "two"),
        client_id.id: _node(tmp_path, client_id, "client"),
    }
    side_a = [p.row(r, (0.25,)) for r in range(3 * BUCKET_ROUNDS) for p in (alice, bob)]
    side_b = [p.row(r, (0.5,)) for r in range(3 * BUCKET_ROUNDS) for p in (carol, dave)]
    _add(nodes[one.id], side_a)
    _add(nodes[two.id], side_a)
    client = nodes[client_id.id]
    _add(client, side_b)
    calls = []
    _route(monkeypatch, nodes, calls)

    async def exchanges() -> list[int]:
        return [
            await client.sync_with(_Id(one.id), sole_server=False),
            await client.sync_with(_Id(one.id), sole_server=False),
            await client.sync_with(_Id(two.id), sole_server=False),
        ]

    assert asyncio.run(exchanges()) == [len(side_a), 0, 0]
    assert [name for _, name in calls] == ["digest", "fetch", "digest", "digest"]
    # The server's bucket changes (it repairs too): fetched again, once.
    _add(nodes[two.id], side_b[:2])
    calls.clear()
    assert asyncio.run(client.sync_with(_Id(two.id), sole_server=False)) == 0
    assert [name for _, name in calls] == ["digest", "fetch"]
    assert len(client.ledger) == len(side_a) + len(side_b)


def test_rows_refused_from_their_author_are_fetched_again_when_it_is_the_only_server(
    tmp_path, monkeypatch
):
    """A set some of whose rows were refused as `own_backfill` (old rows served by their
    author while others could be asked) is skipped only for that server and only while
    it is not the sole server: then the same rows are admitted (the old-row rule)."""
    alice, server_id, client_id = Peer(), Peer(), Peer()
    server = _node(tmp_path, server_id, "server")
    client = _node(tmp_path, client_id, "client", own_round=4 * BUCKET_ROUNDS)
    old = [p.row(r, (0.5,)) for r in range(BUCKET_ROUNDS) for p in (alice, server_id)]
    _add(server, old)
    calls = []
    _route(monkeypatch, {server_id.id: server, client_id.id: client}, calls)
    assert asyncio.run(client.sync_with(_Id(server_id.id), sole_server=False)) == BUCKET_ROUNDS
    calls.clear()
    assert asyncio.run(client.sync_with(_Id(server_id.id), sole_server=False)) == 0
    assert [name for _, name in calls] == ["digest"]  # the refused rows: not again
    assert asyncio.run(client.sync_with(_Id(server_id.id), sole_server=True)) == BUCKET_ROUNDS
    assert client.ledger.digest() == server.ledger.digest()


def test_exchanges_started_side_by_side_fetch_and_check_each_row_once(tmp_path, monkeypatch):
    """Peers serving the same rows, asked at once (a joiner's catch-up, newly connected
    peers after a partition): the exchanges run one after another, so the rows are fetched
    from one server only and each signature is checked once; the other exchange finds its
    buckets equal after one digest call. Anti-entropy is not held behind them."""
    alice, bob, one, two, client_id = Peer(), Peer(), Peer(), Peer(), Peer()
    nodes = {p.id: _node(tmp_path, p, name) for p, name in ((one, "one"), (two, "two"))}
    rows = [p.row(r, (0.5,)) for r in range(2 * BUCKET_ROUNDS) for p in (alice, bob)]
    for node in nodes.values():
        _add(node, rows)
    client = nodes[client_id.id] = _node(tmp_path, client_id, "client")
    checked = []
    verify = client.admission.verify
    client.admission.verify = lambda *args: checked.append(args[0]) or verify(*args)
    calls = []
    _route(monkeypatch, nodes, calls)

    async def side_by_side() -> list[int]:
        return await asyncio.gather(client.sync_with(_Id(one.id)), client.sync_with(_Id(two.id)))

    assert sorted(asyncio.run(side_by_side())) == [0, len(rows)]
    assert len(checked) == len(rows)
    fetched_from = {server for server, name in calls if name == "fetch"}
    assert len(fetched_from) == 1
    assert [name for server, name in calls if server not in fetched_from] == ["digest"]
    assert client.ledger.digest() == nodes[one.id].ledger.digest()

    # The lock is the exchanges' only: anti-entropy runs while one holds it.
    async def anti_entropy_beside_a_held_exchange() -> int:
        async with client.repair._one_at_a_time:
            _add(nodes[two.id], [alice.row(2 * BUCKET_ROUNDS, (0.5,))])
            client.repair.peers = lambda: asyncio.sleep(0, [_Id(two.id)])
            return await asyncio.wait_for(client.repair.anti_entropy_pass(), 10)

    assert asyncio.run(anti_entropy_beside_a_held_exchange()) == 1


def test_a_joiner_s_catch_up_fetches_the_history_from_one_peer_and_skips_a_gone_one(
    tmp_path, monkeypatch
):
    """catch_up asks the connected peers one after another and stops at the first whole
    pass: the history is fetched once, not once per peer (side by side, a joiner of
    100,000 rows and 3 servers did 3x the work). A peer that is gone (its call fails) only
    moves the catch-up on to the next; anti-entropy does not run while the node syncs."""
    from hivemind.p2p import PeerID

    from seedflood_p2p.network.peers.reconnect import catch_up
    from seedflood_p2p.network.transport.p2pd import RemoteCallError

    alice, gone, one, two, client_id = Peer(), Peer(), Peer(), Peer(), Peer()
    nodes = {p.id: _node(tmp_path, p, name) for p, name in ((one, "one"), (two, "two"))}
    rows = [alice.row(r, (0.5,)) for r in range(3 * BUCKET_ROUNDS)]
    for node in nodes.values():
        _add(node, rows)
    client = _node(tmp_path, client_id, "client")
    client.settings = dataclasses.replace(client.settings, repair_interval=0.01)
    calls = []

    async def call_bytes(p2p, peer_id, name, request, timeout, max_response=None):
        calls.append((peer_id.to_bytes(), name.split(".")[1]))
        if peer_id.to_bytes() == gone.id:
            raise RemoteCallError("no route to the peer")
        return await nodes[peer_id.to_bytes()].repair.handlers[name](_Id(client_id.id), request)

    monkeypatch.setattr(repair, "call_bytes", call_bytes)
    b58 = [PeerID(p.id).to_base58() for p in (gone, one, two)]
    reconnector = types.SimpleNamespace(connected=set(b58), candidates=lambda: [])

    async def join() -> int:
        client.not_ready = "starting: syncing with the run first"
        client.repair.peers = lambda: asyncio.sleep(0, [PeerID(p.id) for p in (one, two)])
        loop = asyncio.create_task(client._anti_entropy_loop())
        try:
            await asyncio.sleep(0.1)  # anti-entropy's turns pass while the node syncs
            return await catch_up(reconnector, client, b58, lambda: False)
        finally:
            loop.cancel()

    assert asyncio.run(join()) == len(rows)
    fetched_from = {server for server, name in calls if name == "fetch"}
    assert len(fetched_from) == 1 and gone.id not in fetched_from
    assert [server for server, _ in calls if server not in fetched_from] in ([gone.id], [])
    assert client.ledger.digest() == nodes[one.id].ledger.digest()


def test_a_node_still_syncing_answers_no_digest_so_nobody_fetches_its_partial_copy(
    tmp_path, monkeypatch
):
    """A joiner's ledger, while it syncs, is a partial copy of the others': its buckets
    differ from theirs, and their anti-entropy fetched their own rows back from it (a
    third of each founder's CPU while a joiner synced a million rows). Until it is ready it
    answers digests with no buckets; then it serves as any node."""
    alice, bob, founder_id, joiner_id = Peer(), Peer(), Peer(), Peer()
    founder = _node(tmp_path, founder_id, "founder")
    joiner = _node(tmp_path, joiner_id, "joiner")
    rows = [alice.row(r, (0.5,)) for r in range(2 * BUCKET_ROUNDS)]
    _add(founder, rows)
    _add(joiner, [*rows[: BUCKET_ROUNDS // 2], bob.row(3, (0.25,))])  # and a row of its own
    calls = []
    _route(monkeypatch, {founder_id.id: founder, joiner_id.id: joiner}, calls)
    joiner.not_ready = "starting: syncing with the run first"
    assert asyncio.run(founder.sync_with(_Id(joiner_id.id), sole_server=False)) == 0
    assert [name for _, name in calls] == ["digest"]
    joiner.not_ready = None
    assert asyncio.run(founder.sync_with(_Id(joiner_id.id), sole_server=False)) == 1
    assert founder.ledger.scalars_of(bob.id, 3) == (0.25,)


def test_a_bad_row_in_a_multi_bucket_page_still_bans_its_server(tmp_path, monkeypatch):
    """The page budget and penalties hold for pages across buckets: one row whose
    signature does not verify ends the exchange, bans the server, admits nothing more."""
    alice, server_id, client_id = Peer(), Peer(), Peer()
    server, client = _node(tmp_path, server_id, "server"), _node(tmp_path, client_id, "client")
    rows = [alice.row(r, (0.5,)) for r in range(3 * BUCKET_ROUNDS)]
    message, envelope = rows[BUCKET_ROUNDS + 1]
    rows[BUCKET_ROUNDS + 1] = (message, type(envelope)(envelope.data, envelope.seqno, b"x" * 64))
    _add(server, rows)
    _route(monkeypatch, {server_id.id: server, client_id.id: client}, [])
    asyncio.run(client.sync_with(_Id(server_id.id)))
    assert client.bans.is_banned(server_id.id)
    assert len(client.ledger) < len(rows)
    assert asyncio.run(client.sync_with(_Id(server_id.id))) == 0  # not asked again


def test_a_server_naming_another_set_s_digest_does_not_make_us_skip_that_set(tmp_path, monkeypatch):
    """A hostile server claims an honest peer's (count, digest) for its bucket and serves
    as many valid rows, other ones: what we took in is not that set, so the honest set is
    still fetched (else the rows we lack in it would be skipped for good: a fork)."""
    alice, bob, liar, honest, client_id = Peer(), Peer(), Peer(), Peer(), Peer()
    nodes = {p.id: _node(tmp_path, p, name) for p, name in ((liar, "liar"), (honest, "honest"))}
    client = nodes[client_id.id] = _node(tmp_path, client_id, "client")
    rows = {r: [p.row(r, (0.5,)) for p in (alice, bob)] for r in range(12)}
    _add(nodes[honest.id], [row for r in range(8) for row in rows[r]])
    _add(nodes[liar.id], [row for r in (0, 1, 2, 3, 8, 9, 10, 11) for row in rows[r]])
    _add(client, [row for r in range(4) for row in rows[r]])
    real = nodes[liar.id].ledger.bucket_digests

    def forged(bucket_rounds):  # the liar's digest names the honest bucket's set
        out = real(bucket_rounds)
        out[0] = nodes[honest.id].ledger.bucket_digests(bucket_rounds)[0]
        return out

    nodes[liar.id].ledger.bucket_digests = forged
    _route(monkeypatch, nodes, [])
    assert asyncio.run(client.sync_with(_Id(liar.id), sole_server=False)) == 8
    assert asyncio.run(client.sync_with(_Id(honest.id), sole_server=False)) == 8
    assert len(client.ledger) == 24


def test_an_exchange_waiting_on_a_cancelled_check_checks_its_rows_itself():
    """The exchange whose check another waits on is cancelled (the node stops, or its
    task ends): the waiting one checks its rows itself, and is not cancelled with it."""
    import threading

    from seedflood_p2p.network.gossip.admission import Admission

    alice, me = Peer(), Peer()
    admission = Admission(Ledger(":memory:", RUN), 1, me.id, NodeMetrics(), max_ahead=50)
    gate, real = threading.Event(), admission.verify
    admission.verify = lambda *args: gate.wait(10) and real(*args)
    rows = [alice.row(r, (0.5,)) for r in range(4)]

    async def scenario():
        first = asyncio.create_task(admission._verify_once(rows))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(admission._verify_once(rows))
        await asyncio.sleep(0.05)
        first.cancel()
        gate.set()
        return await second, admission._verifying

    assert asyncio.run(scenario()) == ([None] * 4, {})


def _audit_row(auditor: Peer, accused: Peer, round_: int, scalars: tuple):
    """An audit record with `auditor`'s signed envelope on the run's audit topic."""
    from hivemind.proto import p2pd_pb2 as pb

    from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
    from seedflood_p2p.protocol.message import AuditRecord, Envelope

    data = encode_audit(RUN, accused.id, round_, scalars)
    seqno = (1 << 40 | round_).to_bytes(8, "big")
    body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[audit_topic_for(RUN)])
    setattr(body, "from", auditor.id)
    signature = auditor.key.sign(b"libp2p-pubsub:" + body.SerializeToString())
    return AuditRecord(accused.id, round_, auditor.id, scalars), Envelope(data, seqno, signature)


def test_audit_records_are_repaired_by_the_same_code_as_updates(tmp_path, monkeypatch):
    """The audit table is the second instance of the repair table interface: its
    differing buckets come as one run (one page for three buckets), a set taken in whole
    is not fetched again, and a forged record bans its server (bad_page)."""
    alice, bob, server_id, client_id = Peer(), Peer(), Peer(), Peer()
    with_audits = RunConfig(extra={"audit": {"lag": 0}})
    nodes = {}
    for who, name in ((server_id, "server"), (client_id, "client")):
        p2p = types.SimpleNamespace(peer_id=_Id(who.id), daemon_listen_maddr={"unix": "unused"})
        (tmp_path / name).mkdir()
        ledger = Ledger(tmp_path / name / "ledger.sqlite", RUN)
        nodes[who.id] = FloodNode(p2p, ledger, with_audits, NodeMetrics(), NodeSettings())
        nodes[who.id].admission.own_round = 4 * BUCKET_ROUNDS
    server, client = nodes[server_id.id], nodes[client_id.id]
    assert server.audits is not None and len(server.repair.tables) == 2
    rows = [_audit_row(bob, alice, r, (0.5,)) for r in range(0, 3 * BUCKET_ROUNDS, 16)]
    server.ledger.add_audits([r for r, _ in rows], [e for _, e in rows])
    heard = []

    async def note(fresh):
        heard.extend(fresh)

    client.on_audit_records = note
    calls = []
    _route(monkeypatch, nodes, calls)
    assert asyncio.run(client.sync_with(_Id(server_id.id))) == 0  # no updates: audits only
    assert [name for _, name in calls] == ["digest", "audit_digest", "audit_fetch"]
    assert client.ledger.audits() == server.ledger.audits() and len(heard) == len(rows)
    calls.clear()
    asyncio.run(client.sync_with(_Id(server_id.id)))
    assert [name for _, name in calls] == ["digest", "audit_digest"]  # the sets: taken in
    # A record whose stored scalars differ from its signature: the server is banned.
    record, envelope = _audit_row(bob, alice, 3 * BUCKET_ROUNDS + 1, (0.25,))
    forged = type(record)(record.accused, record.round, record.auditor, (-9.0,))
    server.ledger.add_audits([forged], [envelope])
    asyncio.run(client.sync_with(_Id(server_id.id)))
    assert client.bans.is_banned(server_id.id)
    assert forged not in client.ledger.audits()


def test_rows_checked_at_once_by_two_callers_each_get_their_own_answer(tmp_path):
    """`Admission._verify_once` with two callers whose rows overlap, in other orders: each
    row is checked once, and every caller gets each row's own answer, a forged one among
    them (the waiter reads its rows' answers from the first caller's batch by place)."""
    import threading
    import time

    from seedflood_p2p.protocol.message import Envelope

    alice, bob, me = Peer(), Peer(), Peer()
    node = _node(tmp_path, me, "me")
    good = [p.row(r, (0.5,)) for r in range(6) for p in (alice, bob)]
    message, envelope = good[5]
    forged = (message, Envelope(envelope.data, envelope.seqno, bytes(64)))
    first = good[:5] + [forged] + good[6:9]
    second = [good[8], forged, good[1], good[10], good[11], good[0]]
    checked, started = [], threading.Event()
    verify = node.admission.verify

    def slow_verify(*args):
        checked.append(args)
        started.set()
        time.sleep(0.01)  # long enough that the second caller finds the rows in check
        return verify(*args)

    node.admission.verify = slow_verify

    async def both():
        one = asyncio.create_task(node.admission._verify_once(first))
        await asyncio.to_thread(started.wait)
        two = asyncio.create_task(node.admission._verify_once(second))
        return await one, await two

    answers_first, answers_second = asyncio.run(both())
    assert [a is None for a in answers_first] == [True] * 5 + [False] + [True] * 3
    assert [a is None for a in answers_second] == [True, False, True, True, True, True]
    assert answers_second[1].reason == answers_first[5].reason == "bad_signature"
    # each distinct row once: the 9 of the first call, and the second's 2 it did not hold
    assert len(checked) == len(first) + 2
    assert node.admission._verifying == {}
