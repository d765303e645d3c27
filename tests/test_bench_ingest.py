"""The ingest benchmark's injector (bench/raw_gossip.py): hand-encoded GossipSub messages
must be exactly what go-libp2p-pubsub signs and what the daemon checks, so that a real
p2pd accepts them as the authors' own. No daemon here: fast."""

from __future__ import annotations

import sys
from pathlib import Path

from hivemind.proto import crypto_pb2
from hivemind.proto import p2pd_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import raw_gossip as rg  # noqa: E402

from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX  # noqa: E402
from seedflood_p2p.network.transport.identity import verify_pubsub_signature  # noqa: E402

TOPIC = "sf/0123456789abcdef"


def _read_varint(buf: bytes, at: int = 0) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def test_identities_are_ed25519_peer_ids_and_deterministic():
    a, b = rg.make_identities(3), rg.make_identities(3)
    assert [i.peer_id for i in a] == [i.peer_id for i in b]
    assert len({i.peer_id for i in a}) == 3
    for identity in a:
        assert len(identity.peer_id) == 38 and identity.peer_id.startswith(ED25519_PEER_ID_PREFIX)
        key = crypto_pb2.PublicKey.FromString(identity.peer_id[2:])
        assert key.key_type == crypto_pb2.Ed25519 and len(key.data) == 32


def test_signed_message_parses_as_pubsub_message_and_verifies():
    identity = rg.make_identities(1)[0]
    data = b"\x95\x03\xc4\x04abcd\x07\xc4\x02\x00<\xcf\x00\x00\x01\x00\x00\x00\x00\x00"
    raw = rg.signed_message(identity, data, 42, TOPIC)
    msg = pb.PSMessage.FromString(raw)  # same field numbers as pubsub's rpc.proto Message
    assert getattr(msg, "from") == identity.peer_id
    assert msg.data == data and msg.seqno == (42).to_bytes(8, "big")
    assert list(msg.topicIDs) == [TOPIC] and not msg.key
    # the signed body is byte for byte what protobuf marshals for {from, data, seqno, topic}
    body = pb.PSMessage(data=data, seqno=msg.seqno, topicIDs=[TOPIC])
    setattr(body, "from", identity.peer_id)
    assert raw.startswith(body.SerializeToString())
    assert verify_pubsub_signature(identity.peer_id, data, msg.seqno, TOPIC, msg.signature)
    # and a signature by one identity does not pass for another, nor for other bytes
    other = rg.make_identities(2)[1]
    assert not verify_pubsub_signature(other.peer_id, data, msg.seqno, TOPIC, msg.signature)
    assert not verify_pubsub_signature(
        identity.peer_id, data + b"x", msg.seqno, TOPIC, msg.signature
    )


def test_rpc_frame_is_length_prefixed_subscriptions_then_messages():
    ids = rg.make_identities(2)
    messages = [rg.signed_message(ids[i], b"u%d" % i, i, TOPIC) for i in range(2)]
    frame = rg.rpc(publish=messages, subscribe=[TOPIC])
    size, at = _read_varint(frame)
    assert size == len(frame) - at
    body = frame[at:]
    # field 1 (SubOpts{subscribe = true, topicid}), then field 2 per message
    assert body[0] == 0x0A
    sub_len, pos = _read_varint(body, 1)
    assert body[pos : pos + sub_len] == b"\x08\x01\x12" + bytes([len(TOPIC)]) + TOPIC.encode()
    pos += sub_len
    for message in messages:
        assert body[pos] == 0x12
        length, pos = _read_varint(body, pos + 1)
        assert body[pos : pos + length] == message
        pos += length
    assert pos == len(body)


def test_message_parts_add_up_to_the_encoded_size():
    identity = rg.make_identities(1)[0]
    data = bytes(24)
    parts = rg.message_parts(len(data), TOPIC)
    frame = rg.rpc(publish=[rg.signed_message(identity, data, 1, TOPIC)])
    assert sum(parts.values()) == len(frame)
    assert parts["signature"] == 64 and parts["from (peer id)"] == 38 and parts["seqno"] == 8


def test_the_profile_is_read_from_py_spy_collapsed_stacks(tmp_path):
    """`--profile`: py-spy's raw output (one "frame;frame;... count" line per stack) becomes
    each function's own and inclusive share of the samples, named "function file:line"."""
    import subprocess

    import bench_ingest

    raw = tmp_path / "p.txt"
    raw.write_text(
        "run (/x/asyncio/runners.py:118);_receive (/y/flood.py:445);add (/y/ledger.py:589) 6\n"
        "run (/x/asyncio/runners.py:118);_receive (/y/flood.py:445) 2\n"
        "<module> (<frozen runpy>:88);wait (threading.py:327) 2\n"
    )
    done = subprocess.Popen(["true"])
    got = bench_ingest.finish_profile((done, raw))
    assert got["samples"] == 10
    assert got["self"][0] == ["add ledger.py:589", 0.6]
    assert dict(map(tuple, got["inclusive"]))["_receive flood.py:445"] == 0.8
    assert "wait threading.py:327" in dict(map(tuple, got["self"]))
    assert bench_ingest._frame("<module> (<frozen runpy>:88)") == "<module> <frozen runpy>:88"


def _pb(field: int, value) -> bytes:
    """One protobuf field: an int (varint) or bytes (length-delimited)."""

    def varint(n: int) -> bytes:
        out = b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out

    if isinstance(value, int):
        return varint(field << 3) + varint(value)
    return varint(field << 3 | 2) + varint(len(value)) + value


def test_a_go_cpu_profile_is_read_into_self_and_inclusive_shares():
    """bench/pprof.py on a profile.proto made here: two functions, main.b calling main.a;
    3 samples in a (called from b), 1 in b itself."""
    import gzip

    import pprof

    strings = b"".join(_pb(6, s) for s in (b"", b"samples", b"count", b"main.a", b"main.b"))
    functions = _pb(5, _pb(1, 1) + _pb(2, 3)) + _pb(5, _pb(1, 2) + _pb(2, 4))
    locations = _pb(4, _pb(1, 1) + _pb(4, _pb(1, 1))) + _pb(4, _pb(1, 2) + _pb(4, _pb(1, 2)))
    samples = _pb(2, _pb(1, bytes([1, 2])) + _pb(2, 3)) + _pb(2, _pb(1, 2) + _pb(2, 1))
    got = pprof.top(gzip.compress(strings + functions + locations + samples))
    assert got["samples"] == 4
    assert got["self"] == [("main.a", 0.75), ("main.b", 0.25)]
    assert dict(got["inclusive"]) == {"main.b": 1.0, "main.a": 0.75}
