"""GossipSub over the p2pd daemon's control socket (`create_p2p` in `transport/p2pd.py` starts it).

hivemind's Python bindings do not expose pubsub, so `PubSubClient` speaks the daemon's
control protocol itself. It connects to the daemon's unix control socket and exchanges
protobufs from ``hivemind/proto/p2pd.proto``, each prefixed by its length as an unsigned
varint::

    -> Request{type=PUBSUB, pubsub=PSRequest{type=PUBLISH|LIST_PEERS|GET_TOPICS, topic, data}}
    <- Response{type=OK|ERROR, error, pubsub=PSResponse{topics, peerIDs}}

Requests on one connection are answered in order. After a SUBSCRIBE request is answered
with OK, that connection carries only a stream of
``PSMessage{from, data, seqno, topicIDs, signature, key}``; closing the connection
unsubscribes.

GossipSub gives no delivery guarantee: an OK reply to PUBLISH means "queued", the daemon's
queues drop messages silently when flooded, messages above about 1 MiB are dropped, and
there is no ordering. Hence publishes are paced by a token bucket, and lost messages must be
repaired by the caller, e.g. with `serve_bytes` / `call_bytes` (unary calls over the same
daemon). The daemon delivers a peer's own publishes to its own subscriptions;
`PubSubClient.subscribe` filters them out unless ``include_own=True``.

Measured on loopback with Ed25519 identities (bench/bench_network.py, byte-counting proxy):
an 18-byte update on the 19-character topic ``sf/<16 hex>`` becomes a 157-byte signed
GossipSub message (`PubSubMessage.wire_size`: from 38 + seqno 8 + signature 64 + topic 19
+ payload 18, plus protobuf tags; the public key is inlined in the peer id) and 192 bytes
per hop on the TCP connection (35 bytes of RPC, yamux and security framing); the earlier
50-character topic cost 223. An RSA identity costs ~500 bytes more per hop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import base58
from hivemind.p2p import P2P, PeerID
from hivemind.proto import p2pd_pb2 as pb

from seedflood_p2p.network.transport.p2pd import TransportError, uvarint

logger = logging.getLogger(__name__)

MAX_PUBLISH_BYTES = (1 << 20) - 4096  # GossipSub drops RPCs above 1 MiB; keep room for headers
_MAX_FRAME = 8 << 20  # sanity limit for frames read from the control socket
_PS = pb.PSRequest
# p2pd answers a control request (publish, list peers) at once; one it never answers must
# not hold the shared connection, and every caller behind it, forever.
CONTROL_TIMEOUT = 30.0


async def _write_frame(writer: asyncio.StreamWriter, message) -> None:
    body = message.SerializeToString()
    writer.write(uvarint(len(body)) + body)
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, message_type):
    size = shift = 0
    while True:
        byte = (await reader.readexactly(1))[0]
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
        if shift > 63:
            raise TransportError("corrupt varint from the p2pd control socket")
    if size > _MAX_FRAME:
        raise TransportError(f"frame of {size} bytes from the p2pd control socket is too large")
    return message_type.FromString(await reader.readexactly(size))


@dataclass(frozen=True)
class PubSubMessage:
    """One message received on a topic. `sender` is the original publisher (signature checked).

    `sender_b58` and `wire_size` are computed when read, not per message: the receive path
    never reads them (about 9 us a message, measured in bench/results/ingest.md)."""

    sender: bytes  # peer id bytes
    data: bytes
    seqno: int  # publisher's counter; starts at the daemon's start time in ns, so it grows
    seqno_bytes: bytes  # as signed
    signature: bytes
    topic: str
    raw: Any = field(default=None, repr=False, compare=False)  # the daemon's PSMessage

    @property
    def sender_b58(self) -> str:
        return base58.b58encode(self.sender).decode()

    @property
    def wire_size(self) -> int:
        """Size of the signed GossipSub message (payload + from/seqno/sig/key/topic)."""
        wire = pb.PSMessage()
        wire.CopyFrom(self.raw)
        del wire.topicIDs[1:]  # the GossipSub message carries one topic
        return wire.ByteSize()


class TokenBucket:
    """At most `rate` events per second on average, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: float = 1.0):
        self.rate, self.burst = float(rate), float(max(burst, 1.0))
        self._tokens, self._stamp = self.burst, time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def acquire(self) -> None:
        self._refill()
        if self._tokens < 1.0:
            await asyncio.sleep((1.0 - self._tokens) / self.rate)
            self._refill()
        self._tokens -= 1.0


class Subscription:
    """Messages on one topic; iterate with ``async for``. Made by `PubSubClient.subscribe`.

    A background task drains the daemon's stream into a queue so a slow consumer does not
    make the daemon drop messages. If the stream breaks, it resubscribes (messages sent
    meanwhile are lost; `reconnects` counts this); if that fails, iteration raises
    TransportError. Iteration ends after `close()`.
    """

    def __init__(self, client: PubSubClient, topic: str, include_own: bool, max_queue: int):
        self.topic, self.reconnects, self.dropped = topic, 0, 0
        self._client, self._include_own = client, include_own
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_queue = max_queue
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    async def _open(self) -> asyncio.StreamReader:
        reader, writer = await self._client._connect()
        try:
            await self._client._request(reader, writer, _PS.SUBSCRIBE, self.topic)
        except (OSError, asyncio.IncompleteReadError) as e:
            writer.close()
            raise TransportError(f"p2pd connection lost while subscribing to {self.topic!r}") from e
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        return reader

    async def _pump(self, reader: asyncio.StreamReader) -> None:
        own = self._client.peer_id.to_bytes()
        try:
            while True:
                try:
                    m = await _read_frame(reader, pb.PSMessage)
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    reader = await self._resubscribe(e)
                    continue
                if getattr(m, "from") == own and not self._include_own:
                    continue
                if self._queue.qsize() >= self._max_queue:
                    if not self.dropped:
                        logger.warning("subscription %r: queue full, dropping messages", self.topic)
                    self.dropped += 1
                    continue
                self._queue.put_nowait(self._convert(m))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # hand the failure to the consumer
            self._queue.put_nowait(e if isinstance(e, TransportError) else TransportError(repr(e)))

    async def _resubscribe(self, cause: Exception) -> asyncio.StreamReader:
        self._close_writer()
        logger.warning("pubsub stream for %r broke (%r); resubscribing", self.topic, cause)
        for attempt in range(3):
            await asyncio.sleep(0.2 * 2**attempt)
            try:
                reader = await self._open()
            except (OSError, TransportError, asyncio.IncompleteReadError) as e:
                cause = e
                continue
            self.reconnects += 1
            return reader
        raise TransportError(
            f"lost the subscription to {self.topic!r} and could not resubscribe "
            f"(is the p2pd daemon still running?): {cause}"
        )

    def _convert(self, m) -> PubSubMessage:
        return PubSubMessage(
            sender=getattr(m, "from"),
            data=m.data,
            seqno=int.from_bytes(m.seqno, "big"),
            seqno_bytes=m.seqno,
            signature=m.signature,
            topic=m.topicIDs[0] if m.topicIDs else self.topic,
            raw=m,
        )

    @property
    def pending(self) -> int:
        """Messages received from the daemon and not yet taken by the consumer."""
        return self._queue.qsize()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> PubSubMessage:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self._queue.put_nowait(item)  # keep raising on later calls
            raise item
        return item

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def close(self) -> None:
        """Unsubscribe and stop the background task; pending iteration ends."""
        if self._closed:
            return
        self._closed = True
        self._client._subscriptions.discard(self)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._close_writer()
        self._queue.put_nowait(None)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class PubSubClient:
    """GossipSub publish/subscribe through a `PubSubP2P` daemon.

    `max_rate` (messages/s, None for unlimited) and `burst` pace `publish`: the daemon's
    queues drop silently when flooded.
    """

    def __init__(
        self,
        p2p: P2P,
        *,
        max_rate: float | None = 50.0,
        burst: float = 10.0,
        timeout: float = CONTROL_TIMEOUT,
    ):
        self.peer_id: PeerID = p2p.peer_id
        self._socket = p2p.daemon_listen_maddr["unix"]
        self._timeout = timeout
        self._bucket = TokenBucket(max_rate, burst) if max_rate else None
        self._lock = asyncio.Lock()
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._subscriptions: set[Subscription] = set()
        self._closed = False

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._closed:
            raise TransportError("PubSubClient is closed")
        try:
            return await asyncio.open_unix_connection(self._socket)
        except OSError as e:
            raise TransportError(f"cannot connect to p2pd at {self._socket}: {e}") from e

    @staticmethod
    async def _request(reader, writer, kind: int, topic: str, data: bytes | None = None):
        request = pb.Request(type=pb.Request.PUBSUB, pubsub=_PS(type=kind, topic=topic, data=data))
        await _write_frame(writer, request)
        response = await _read_frame(reader, pb.Response)
        if response.type != pb.Response.OK:
            raise TransportError(f"p2pd refused {_PS.Type.Name(kind)}: {response.error.msg}")
        return response.pubsub

    async def _call(self, kind: int, topic: str = "", data: bytes | None = None, pace=False):
        """One request on the shared connection (opened lazily, dropped after any failure)."""
        async with self._lock:
            if pace and self._bucket is not None:
                await self._bucket.acquire()
            if self._conn is None:
                self._conn = await self._connect()
            try:
                return await asyncio.wait_for(
                    self._request(*self._conn, kind, topic, data), self._timeout
                )
            except BaseException as e:  # incl. cancellation: an unread reply would desync
                self._conn[1].close()
                self._conn = None
                name = _PS.Type.Name(kind)
                if isinstance(e, TimeoutError):  # before OSError: it is one
                    raise TransportError(
                        f"p2pd did not answer {name} within {self._timeout:g} s"
                    ) from e
                if isinstance(e, OSError | asyncio.IncompleteReadError):
                    raise TransportError(f"p2pd connection lost during {name}") from e
                raise

    async def subscribe(
        self, topic: str, *, include_own: bool = False, max_queue: int = 100_000
    ) -> Subscription:
        """Subscribe to `topic`; returns once the daemon confirmed the subscription."""
        sub = Subscription(self, topic, include_own, max_queue)
        reader = await sub._open()
        sub._task = asyncio.create_task(sub._pump(reader), name=f"pubsub:{topic}")
        self._subscriptions.add(sub)
        return sub

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish `data` (paced); returns once the daemon accepted it, which proves no delivery."""
        if len(data) > MAX_PUBLISH_BYTES:
            raise ValueError(f"pubsub message of {len(data)} bytes exceeds {MAX_PUBLISH_BYTES}")
        await self._call(_PS.PUBLISH, topic, bytes(data), pace=True)

    async def list_peers(self, topic: str) -> list[str]:
        """Base58 ids of connected peers that are subscribed to `topic`."""
        response = await self._call(_PS.LIST_PEERS, topic)
        return [base58.b58encode(p).decode() for p in response.peerIDs]

    async def get_topics(self) -> list[str]:
        """Topics this daemon is subscribed to."""
        return list((await self._call(_PS.GET_TOPICS)).topics)

    async def close(self) -> None:
        """Close every subscription and the request connection. Safe to call twice."""
        self._closed = True
        for sub in list(self._subscriptions):
            await sub.close()
        async with self._lock:
            if self._conn is not None:
                self._conn[1].close()
                self._conn = None

    async def __aenter__(self) -> PubSubClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
