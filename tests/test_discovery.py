"""Discovery records (network/peers/discovery.py): the signature rule, then real hivemind DHT
nodes on
real p2pd daemons on 127.0.0.1, with a hostile node that stores forged, unsigned and
re-dated records."""

from __future__ import annotations

import time
import types

import pytest

from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.discovery import (
    RECORD_TTL,
    BadRecord,
    Discovery,
    check_record,
    dht_key,
    encode_record,
)
from seedflood_p2p.network.transport.identity import load_signing_key
from seedflood_p2p.network.transport.p2pd import connect_peer

RUN = "ab" * 32
OTHER_RUN = "cd" * 32
PEER_BODY = {"addrs": ["/ip4/127.0.0.1/tcp/4001"], "round": 7}


def _writer(tmp_path, name):
    from seedflood_p2p.network.transport.identity import load_or_create_identity

    path = tmp_path / f"{name}.key"
    peer = load_or_create_identity(path)
    return load_signing_key(path), peer.to_bytes()


def _reason(value, **kw) -> str:
    kw.setdefault("subkey", None)
    kw.setdefault("dht_expiration", None)
    kw.setdefault("now", time.time())
    with pytest.raises(BadRecord) as caught:
        check_record(value, **kw)
    return caught.value.reason


def test_a_signed_record_holds_and_every_tampering_is_refused(tmp_path):
    key, writer = _writer(tmp_path, "a")
    _, other = _writer(tmp_path, "b")
    now = time.time()
    expires = now + 60
    good = encode_record(key, writer, "peer", RUN, expires, PEER_BODY)
    record = check_record(good, subkey=writer, dht_expiration=expires, now=now)
    assert (record.kind, record.run_id, record.writer, record.body) == (
        "peer",
        RUN,
        writer,
        PEER_BODY,
    )
    # Signed by a, claiming to be b's record: forged.
    forged = encode_record(key, other, "peer", RUN, expires, PEER_BODY)
    assert _reason(forged) == "bad_signature"
    import msgpack

    payload, _ = msgpack.unpackb(good)
    assert _reason(msgpack.packb([payload, b""])) == "unsigned"
    assert _reason(good, subkey=other) == "wrong_writer"
    assert _reason(good, dht_expiration=expires + 3600) == "expiry_mismatch"
    assert _reason(good, now=expires + 1) == "expired"
    far = encode_record(key, writer, "peer", RUN, now + 10 * 86400, PEER_BODY)
    assert _reason(far) == "too_long"
    assert _reason(b"\x93garbage") == "malformed"
    assert _reason(encode_record(key, writer, "peer", RUN, expires, {"round": 1})) == "malformed"


def test_a_signature_checked_once_is_not_checked_again_and_the_cache_admits_no_forgery(
    tmp_path, monkeypatch
):
    """Every lookup returns every writer's records again: a signature that held is kept
    (bounded) and not verified again. Keyed on the framed key, signature and data, so no
    shift of bytes between signature and data, and no other data, rides on a kept one."""
    from seedflood_p2p.network.peers import discovery

    key, writer = _writer(tmp_path, "a")
    now = time.time()
    good = encode_record(key, writer, "peer", RUN, now + 60, PEER_BODY)
    import msgpack

    payload, signature = msgpack.unpackb(good)
    data = discovery.SIGNING_CONTEXT + payload
    public = writer[6:]
    monkeypatch.setattr(discovery, "_verified", discovery.OrderedDict())
    assert discovery._verify(public, data, signature)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    calls = []
    real = Ed25519PublicKey.from_public_bytes
    monkeypatch.setattr(Ed25519PublicKey, "from_public_bytes", lambda b: calls.append(b) or real(b))
    assert discovery._verify(public, data, signature) and calls == []  # kept: not checked
    assert not discovery._verify(public, data[1:], signature + data[:1])  # shifted bytes
    assert not discovery._verify(public, data + b"x", signature)
    assert len(calls) == 2  # each one checked, and refused
    monkeypatch.setattr(discovery, "VERIFIED_CACHE", 1)
    other = encode_record(key, writer, "peer", RUN, now + 61, PEER_BODY)
    o_payload, o_signature = msgpack.unpackb(other)
    assert discovery._verify(public, discovery.SIGNING_CONTEXT + o_payload, o_signature)
    assert len(discovery._verified) == 1  # bounded: the oldest went


async def _joined(spawn, tmp_path, name, metrics=None):
    p2p = await spawn(identity_path=tmp_path / f"{name}.key")
    discovery = Discovery(p2p, tmp_path / f"{name}.key", metrics, wait_timeout=2.0)
    await discovery.start()
    return p2p, discovery


async def _connect(a, b):
    addrs = [str(m).split("/p2p/")[0] for m in await b.get_visible_maddrs()]
    await connect_peer(a, b.peer_id, addrs, 10.0)


@pytest.mark.slow
async def test_records_travel_between_real_nodes_and_hostile_ones_are_counted_and_dropped(
    spawn, tmp_path
):
    from hivemind.dht.node import DHTNode

    metrics = {name: NodeMetrics() for name in ("h1", "h2")}
    h1, d1 = await _joined(spawn, tmp_path, "h1", metrics["h1"])
    h2, d2 = await _joined(spawn, tmp_path, "h2", metrics["h2"])
    # The hostile node runs hivemind's DHT without the check, so it stores what it likes.
    x = await spawn(identity_path=tmp_path / "x.key")
    x_key, x_id = load_signing_key(tmp_path / "x.key"), x.peer_id.to_bytes()
    hostile = await DHTNode.create(p2p=x, wait_timeout=2.0, ensure_bootstrap_success=False)
    try:
        await _connect(h2, h1)
        await _connect(x, h1)
        await _connect(x, h2)
        assert await d1.add_peers([h2.peer_id.to_base58(), x.peer_id.to_base58()]) == 2
        assert await d2.add_peers([h1.peer_id.to_base58(), x.peer_id.to_base58()]) == 2
        await hostile.protocol.call_ping(h1.peer_id)

        assert await d1.publish(RUN, "peer", PEER_BODY)
        assert await d2.publish(RUN, "peer", {**PEER_BODY, "round": 9})
        assert await d2.publish(OTHER_RUN, "peer", PEER_BODY)  # another run: not listed

        now = time.time()
        expires = now + RECORD_TTL["peer"]
        h2_id = h2.peer_id.to_bytes()
        # forged: signed by x, claiming to be h2's record, under h2's subkey
        forged = encode_record(x_key, h2_id, "peer", RUN, expires, PEER_BODY)
        import msgpack

        payload, _ = msgpack.unpackb(encode_record(x_key, x_id, "peer", RUN, expires, PEER_BODY))
        unsigned = msgpack.packb([payload, b""])
        # expired: signed to expire a minute ago, stored as if it lived on (re-dated)
        stale = encode_record(x_key, x_id, "peer", RUN, now - 60, PEER_BODY)
        for value, subkey in ((forged, h2_id), (unsigned, x_id), (stale, x_id)):
            await hostile.store(dht_key(RUN, "peer"), value, expires, subkey=subkey)

        found = await d1.lookup(RUN, "peer")
        assert set(found) == {h1.peer_id.to_bytes(), h2_id}
        assert found[h2_id].body["round"] == 9  # h2's own record, not the forgery
        assert found[h2_id].body == (await d2.lookup(RUN, "peer"))[h2_id].body
        rejected: dict[str, int] = {}
        for m in metrics.values():
            for reason, n in m.discovery_rejected_counts().items():
                rejected[reason] = rejected.get(reason, 0) + n
        assert rejected.get("bad_signature", 0) >= 1, rejected
        assert rejected.get("unsigned", 0) >= 1, rejected
        assert rejected.get("expiry_mismatch", 0) >= 1, rejected
        assert d1.status()["writers_found"]["peer"] == 2
    finally:
        await hostile.shutdown()
        await d1.stop()
        await d2.stop()


@pytest.mark.slow
async def test_a_syncing_nodes_reply_names_its_run_and_the_manifest_comes_from_the_dht(
    spawn, tmp_path
):
    """A real node's not-ready `seedflood.manifest` reply goes through the joiner's decoder
    (`Joiner.ask_manifest`), and the joiner reads the manifest from the DHT instead."""
    from harness.cluster import RUN
    from peer.join import Joiner, NotReady
    from peer.settings import PeerSettings
    from seedflood_p2p.network.gossip.flood import FloodNode
    from seedflood_p2p.network.peers.discovery import node_records
    from seedflood_p2p.network.settings import NodeSettings
    from seedflood_p2p.storage.ledger import Ledger

    server, server_discovery = await _joined(spawn, tmp_path, "server")
    node = FloodNode(
        server,
        Ledger(tmp_path / "server.sqlite", RUN.run_id),
        RUN,
        NodeMetrics(),
        NodeSettings(),
    )
    node.not_ready = "restarted: syncing with the run's other nodes first"
    joiner, joiner_discovery = await _joined(spawn, tmp_path, "joiner")
    host = types.SimpleNamespace(p2p=joiner, discovery=joiner_discovery)  # a NetworkHost's
    daemon = Joiner(
        PeerSettings(data_dir=tmp_path / "joiner"), host, lambda: False, lambda state: None
    )
    try:
        await node.start()
        records = node_records(node, [], 0)
        assert await server_discovery.publish(RUN.run_id, "manifest", records["manifest"])
        await _connect(joiner, server)
        server_id = server.peer_id.to_base58()
        with pytest.raises(NotReady) as caught:
            await daemon.ask_manifest(server_id)
        assert caught.value.run_id == RUN.run_id
        config = await daemon.manifest_from_dht(RUN.run_id, [server_id])
        assert config is not None and config.to_json() == RUN.to_json()
        assert await daemon.manifest_from_dht(OTHER_RUN, [server_id]) is None
        node.not_ready = None  # in step: the reply is the manifest itself
        assert (await daemon.ask_manifest(server_id)).run_id == RUN.run_id
    finally:
        await node.stop()
        await server_discovery.stop()
        await joiner_discovery.stop()
