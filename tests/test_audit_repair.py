"""Audit records are repaired like updates: FloodNodes on real p2pd daemons
(127.0.0.1), a run whose manifest has audits. A node that missed the records' gossip (it
joined later) ends with the same audit table, signed; a server that hands out a forged
record is treated like one that hands out a forged update. The whole daemon, with a late
joiner's verdicts, is tests/test_audit_daemon.py."""

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip import repair
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
from seedflood_p2p.protocol.framing import Rejected
from seedflood_p2p.protocol.message import AuditRecord, pack_scalars
from seedflood_p2p.storage.ledger import Ledger

CONFIG = RunConfig(salt="test-audit-repair", extra={"audit": {"lag": 0}})
SETTINGS = NodeSettings(repair_interval=0.3)


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


async def _publish_records(node: FloodNode, accused: bytes, rounds: range) -> list[AuditRecord]:
    """`node`'s own audit records, logged then published, as the peer daemon does."""
    # published at round t + 10: the repaired copy carries it (from the signed payload)
    records = [AuditRecord(accused, t, node.peer_id, (0.5 + t,), t + 10) for t in rounds]
    for record in records:
        node.audits.own(record)
        data = encode_audit(node.run_id, record.accused, record.round, record.scalars, record.at)
        await node.publish_on(audit_topic_for(node.run_id), data)
    return records


def _table(ledger: Ledger) -> list[AuditRecord]:
    return ledger.audits()


@pytest.mark.slow
async def test_a_late_joiner_repairs_the_audit_table(spawn, tmp_path, monkeypatch):
    monkeypatch.setattr(repair.AuditTable, "page_rows", 2)  # several pages, cursors followed
    a = await spawn()
    b = await spawn(initial_peers=[str((await a.get_visible_maddrs())[0])])
    ledgers = {n: Ledger(tmp_path / f"{n}.sqlite", CONFIG.run_id) for n in "abc"}
    for ledger in ledgers.values():
        ledger.claim(CONFIG, "")
    nodes = {
        n: FloodNode(p2p, ledgers[n], CONFIG, NodeMetrics(), SETTINGS)
        for n, p2p in (("a", a), ("b", b))
    }
    heard: list[AuditRecord] = []

    async def note(fresh):
        heard.extend(fresh)

    try:
        for node in nodes.values():
            assert node.audits is not None  # the manifest has audits
            node.admission.own_round = 70  # peers training round 70: records up to 80 admitted
            await node.start()
        for node in nodes.values():
            deadline = time.monotonic() + 60
            while not await node.connected_peers():
                assert time.monotonic() < deadline, "the nodes never saw each other's topic"
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the audit topic's mesh
        accused = b.peer_id.to_bytes()
        records = await _publish_records(nodes["a"], accused, range(5))
        records += await _publish_records(nodes["b"], a.peer_id.to_bytes(), range(70, 72))
        await _until(lambda: len(_table(ledgers["a"])) == len(_table(ledgers["b"])) == 7)
        # Their echoes signed a's and b's own rows: now anyone can serve them.
        await _until(lambda: not ledgers["a"].unsigned_audits(a.peer_id.to_bytes()))
        await _until(lambda: not ledgers["b"].unsigned_audits(b.peer_id.to_bytes()))

        c = await spawn(initial_peers=[str((await a.get_visible_maddrs())[0])])
        nodes["c"] = FloodNode(
            c, ledgers["c"], CONFIG, NodeMetrics(), SETTINGS, on_audit_records=note
        )
        nodes["c"].admission.own_round = 70
        await nodes["c"].start()
        # c heard none of the gossip: repair alone brings the records, in two buckets.
        await _until(lambda: _table(ledgers["c"]) == _table(ledgers["a"]), timeout=60)
        assert sorted(heard, key=lambda r: (r.round, r.auditor)) == sorted(
            records, key=lambda r: (r.round, r.auditor)
        )  # each handed to the daemon's callback once
        assert ledgers["c"].audit_bucket_digests(64) == ledgers["a"].audit_bucket_digests(64)
        check = ledgers["c"].verify(verify_pubsub_signature, "FIX", CONFIG.directions)
        assert (check.audits_signed, check.audits_unsigned) == (7, 0)
        assert nodes["c"].audits.counts["repair:accepted"] == 7
    finally:
        for node in nodes.values():
            await node.stop()
        for ledger in ledgers.values():
            ledger.close()


@pytest.mark.slow
async def test_a_server_of_a_forged_audit_record_is_banned(spawn, tmp_path):
    a = await spawn()
    ledgers = {n: Ledger(tmp_path / f"{n}.sqlite", CONFIG.run_id) for n in "ab"}
    nodes = {"a": FloodNode(a, ledgers["a"], CONFIG, NodeMetrics(), SETTINGS)}
    try:
        await nodes["a"].start()
        b = await spawn(initial_peers=[str((await a.get_visible_maddrs())[0])])
        await asyncio.sleep(1.0)
        (record,) = await _publish_records(nodes["a"], b.peer_id.to_bytes(), range(1))
        await _until(lambda: not ledgers["a"].unsigned_audits(a.peer_id.to_bytes()))
        # a's stored record now says something its signature does not.
        ledgers["a"]._db.execute("UPDATE audits SET scalars = ?", (pack_scalars((-9.0,)),))
        nodes["b"] = FloodNode(b, ledgers["b"], CONFIG, NodeMetrics(), SETTINGS)
        await nodes["b"].start()
        await _until(lambda: nodes["b"].audits.counts["dropped:mismatch"] >= 1)
        assert ledgers["b"].audits() == []  # nothing of it logged
        assert nodes["b"].reputation.is_banned(a.peer_id.to_bytes())  # bad_page: at once
    finally:
        for node in nodes.values():
            await node.stop()
        for ledger in ledgers.values():
            ledger.close()


def test_audit_repair_messages_round_trip():
    from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
    from seedflood_p2p.protocol.message import Envelope
    from seedflood_p2p.protocol.repair import AUDIT_ROWS as K

    a, x = (ED25519_PEER_ID_PREFIX + bytes([i]) * 32 for i in (1, 2))
    rows = [
        (AuditRecord(x, t, a, (0.5, -1.0)), Envelope(b"d" * 60, b"s" * 8, b"g" * 64))
        for t in (64, 65)
    ]
    assert K.decode_rows(K.encode_rows(rows), 2) == rows
    K.check_rows_follow(rows, K.first_cursor(64), 127)
    with pytest.raises(Rejected, match="bad_reply"):
        K.check_rows_follow(rows[::-1], K.first_cursor(64), 127)  # not ascending
    with pytest.raises(Rejected, match="bad_reply"):
        K.check_rows_follow(rows, K.key(rows[0][0]), 127)  # not after the cursor
    with pytest.raises(Rejected, match="bad_reply"):
        K.decode_rows(K.encode_rows(rows), 1)  # more rows than asked for
    request = K.encode_fetch_request("run", K.key(rows[0][0]), 127, 5)
    assert K.decode_fetch_request(request) == ("run", K.key(rows[0][0]), 127, 5)
    too_many = K.encode_fetch_request("run", K.first_cursor(0), 127, 5000)
    assert K.decode_fetch_request(too_many) is None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600), st.integers(1, 8))
def test_audit_repair_decoders_on_any_bytes(data, max_rows):
    """Whatever the bytes: Rejected (or None for a request), never another exception."""
    from seedflood_p2p.protocol.repair import AUDIT_ROWS as K

    try:
        rows = K.decode_rows(data, max_rows)
        assert isinstance(rows, list) and len(rows) <= max_rows
    except Rejected:
        pass
    request = K.decode_fetch_request(data)
    assert request is None or (isinstance(request, tuple) and len(request) == 4)
