"""Inject GossipSub messages authored by many Ed25519 identities into one p2pd.

A GossipSub peer forwards messages authored by others unchanged, and with strict signing
each message's `from` must be its author with a valid signature by that author's key.
So a publisher that holds M keys can hand a target daemon M authors' updates: it opens a
raw libp2p stream with protocol "/meshsub/1.1.0" to the target (through its own p2pd,
`stream_open`) and writes length-prefixed protobuf `RPC`s, as a GossipSub router would
(go-libp2p-pubsub pb/rpc.proto):

    RPC     {repeated SubOpts subscriptions = 1; repeated Message publish = 2}
    SubOpts {bool subscribe = 1; string topicid = 2}
    Message {bytes from = 1; bytes data = 2; bytes seqno = 3; string topic = 4;
             bytes signature = 5; bytes key = 6}

Each Message is signed as go-libp2p-pubsub signs it: Ed25519 over
b"libp2p-pubsub:" + the marshalled Message{from, data, seqno, topic}
(`seedflood_p2p.network.transport.identity.verify_pubsub_signature` checks the same
bytes). An Ed25519 peer id inlines its public key, so `key` is left out, as p2pd does.

Protobuf is encoded by hand here (fields in number order, as Go marshals them), so the
byte counts per part are explicit (`message_parts`). Used by bench/bench_ingest.py and
tests/test_bench_ingest.py; nothing in the product imports it.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedflood_p2p.network.transport.p2pd import uvarint

SIGN_PREFIX = b"libp2p-pubsub:"
MESHSUB = ("/meshsub/1.1.0", "/meshsub/1.0.0")


def _field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return uvarint(number << 3 | 2) + uvarint(len(value)) + value


def ed25519_peer_id(public: bytes) -> bytes:
    """The libp2p peer id bytes of an Ed25519 public key: the identity multihash of the
    protobuf PublicKey{Type = Ed25519 (1), Data = key} (38 bytes)."""
    encoded = bytes([0x08, 0x01]) + _field(2, public)
    return bytes([0x00, len(encoded)]) + encoded


@dataclass(frozen=True)
class Identity:
    key: Ed25519PrivateKey
    peer_id: bytes  # 38 bytes


def make_identities(count: int, seed: str = "bench-ingest") -> list[Identity]:
    """`count` Ed25519 identities, the same for the same seed."""
    out = []
    for i in range(count):
        key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest())
        public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        out.append(Identity(key, ed25519_peer_id(public)))
    return out


def message_body(sender: bytes, data: bytes, seqno: bytes, topic: str) -> bytes:
    """Message{from, data, seqno, topic}: the signed part."""
    return _field(1, sender) + _field(2, data) + _field(3, seqno) + _field(4, topic.encode())


def signed_message(identity: Identity, data: bytes, seqno: int, topic: str) -> bytes:
    """A marshalled Message with its signature (no `key`: Ed25519 ids inline it)."""
    seq = seqno.to_bytes(8, "big")
    body = message_body(identity.peer_id, data, seq, topic)
    return body + _field(5, identity.key.sign(SIGN_PREFIX + body))


def rpc(publish: list[bytes] = (), subscribe: list[str] = ()) -> bytes:
    """One varint-length-prefixed RPC frame: subscriptions, then messages."""
    body = b"".join(_field(1, b"\x08\x01" + _field(2, t.encode())) for t in subscribe)
    body += b"".join(_field(2, m) for m in publish)
    return uvarint(len(body)) + body


def message_parts(data_len: int, topic: str, batch: int = 1) -> dict[str, float]:
    """Bytes of one signed GossipSub message by part, as it crosses one hop inside an RPC
    carrying `batch` messages (the RPC's own length prefix shared among them). The tag and
    length bytes of each field count as "protobuf framing"."""
    topic_len = len(topic.encode())
    parts = {"signature": 64, "from (peer id)": 38, "seqno": 8, "topic": topic_len}
    parts["payload"] = data_len
    framing = sum(1 + len(uvarint(n)) for n in (64, 38, 8, topic_len, data_len))
    message_len = sum(parts.values()) + framing
    framing += 1 + len(uvarint(message_len))  # the RPC's `publish` field around it
    rpc_len = (message_len + 1 + len(uvarint(message_len))) * batch
    framing += len(uvarint(rpc_len)) / batch  # the RPC's varint length prefix
    parts["protobuf framing"] = framing
    return parts


class RawStream:
    """A raw GossipSub stream from the publisher's p2pd to the target: frames out only.
    The target's replies (if any) are drained and discarded."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.bytes_sent = 0
        self._drain = asyncio.create_task(self._discard())

    async def _discard(self) -> None:
        try:
            while await self.reader.read(1 << 16):
                pass
        except (ConnectionError, asyncio.CancelledError):
            pass

    async def send(self, frame: bytes) -> None:
        self.writer.write(frame)
        self.bytes_sent += len(frame)
        await self.writer.drain()

    async def close(self) -> None:
        self._drain.cancel()
        self.writer.close()


async def open_raw_stream(p2p, target_peer_id, topic: str) -> RawStream:
    """Open "/meshsub/1.1.0" from `p2p` (a hivemind P2P connected to the target) to
    `target_peer_id` and announce a subscription to `topic` on it."""
    _, reader, writer = await p2p._client.stream_open(target_peer_id, MESHSUB)
    stream = RawStream(reader, writer)
    await stream.send(rpc(subscribe=[topic]))
    return stream
