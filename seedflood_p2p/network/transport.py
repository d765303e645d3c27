"""Network transport: GossipSub flooding and small request/response calls over libp2p.

Everything runs through the go-libp2p daemon (``p2pd``) that ships inside hivemind.
`create_p2p` starts it with GossipSub switched on and a persistent Ed25519 identity
(`network/identity.py`: the key file, and the signature check of a received message).

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
import contextlib
import contextvars
import errno
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import base58
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
from hivemind.proto import p2pd_pb2 as pb
from hivemind.utils.multiaddr import Multiaddr

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.identity import load_or_create_identity

logger = logging.getLogger(__name__)

MAX_PUBLISH_BYTES = (1 << 20) - 4096  # GossipSub drops RPCs above 1 MiB; keep room for headers
DEFAULT_RPC_LIMIT = 1 << 20  # request/response size limit for serve_bytes / call_bytes
_MAX_FRAME = 8 << 20  # sanity limit for frames read from the control socket
_PS = pb.PSRequest


class TransportError(Exception):
    """The daemon connection failed or the daemon refused a request."""


class RemoteCallError(TransportError):
    """A `call_bytes` request failed: peer unreachable, timeout, handler error or size limit."""


# ---------------------------------------------------------------------------------------------
# Daemon startup

# Per-launch settings for PubSubP2P._make_process_args, which hivemind calls inside create().
_launch: contextvars.ContextVar[dict] = contextvars.ContextVar("p2pd_launch")


_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


class PubSubP2P(P2P):
    """hivemind's P2P with GossipSub enabled in the daemon; start it with `create_p2p`."""

    def _make_process_args(self, *args, **kwargs) -> list[str]:
        kwargs.update(pubsub=True, pubsubRouter="gossipsub", pubsubSign=True, pubsubSignStrict=True)
        launch = _launch.get({})
        kwargs.update(launch.get("flags", {}))
        launch["p2p"] = self  # lets create_p2p clean up if the daemon fails to start
        argv = P2P._make_process_args(*args, **kwargs)
        # If our process is SIGKILLed, take the daemon down too: an orphaned p2pd would keep
        # our identity (and a stale socket) alive next to the restarted peer.
        if _SETPRIV is not None:
            argv = [_SETPRIV, "--pdeathsig", "TERM", *argv]
        return argv


def probe_listen_addrs(host_maddrs: Sequence[str]) -> None:
    """Fail early if a listen address is taken: go-libp2p binds with SO_REUSEPORT, so a second
    daemon on the same port would start without error and share (split) the connections."""
    for maddr in host_maddrs:
        m = re.match(r"/(ip4|ip6)/([^/]+)/(tcp|udp)/(\d+)", str(maddr))
        if not m:
            continue
        family = socket.AF_INET if m.group(1) == "ip4" else socket.AF_INET6
        kind = socket.SOCK_STREAM if m.group(3) == "tcp" else socket.SOCK_DGRAM
        try:
            with socket.socket(family, kind) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT
                probe.bind((m.group(2), int(m.group(4))))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(
                    f"cannot listen on {maddr}: the port is already in use; pick another port "
                    "(tcp/0 picks a free one) or stop the process using it (`ss -ltnp`)"
                ) from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise UserError(
                    f"cannot listen on {maddr}: {m.group(2)} is not an address of this machine; "
                    "listen on 0.0.0.0 and give the public address in announce_maddrs"
                ) from None
            if e.errno == errno.EACCES:
                raise UserError(
                    f"cannot listen on {maddr}: ports below 1024 need root; use a port >= 1024"
                ) from None
            raise UserError(f"cannot listen on {maddr}: {e.strerror}; fix the address") from None


def _check_ports(maddrs: Sequence[str], role: str, allow_any: bool) -> None:
    """Every tcp/udp port in `maddrs` within 1..65535 (0, "any free port", where allowed)."""
    for maddr in maddrs:
        for port in re.findall(r"/(?:tcp|udp)/([^/]*)", str(maddr)):
            low = 0 if allow_any else 1
            if not (
                port.isascii() and port.isdigit() and len(port) <= 5 and low <= int(port) <= 65535
            ):
                hint = " (0: any free port)" if allow_any else ""
                raise UserError(
                    f"{role} {maddr} has port {port[:20]!r}, outside {low}..65535{hint}; "
                    "fix the address"
                )


def host_port(maddr: str) -> str:
    """HOST and PORT of a multiaddr, for `nc -vz HOST PORT` in error messages."""
    m = re.match(r"/(?:ip4|ip6|dns|dns4|dns6)/([^/]+)/(?:tcp|udp)/(\d+)", maddr)
    return f"{m.group(1)} {m.group(2)}" if m else "HOST PORT"


async def create_p2p(
    *,
    identity_path: Path | None,
    host_maddrs: Sequence[str],
    initial_peers: Sequence[str] = (),
    announce_maddrs: Sequence[str] | None = None,
    heartbeat_interval: float | None = None,
    startup_timeout: float = 15.0,
    nat_port_map: bool = False,
    bootstrap_addrs: Sequence[str] = (),
    use_auto_relay: bool = False,
    reachability: str = "auto",
    **p2p_kwargs,
) -> PubSubP2P:
    """Start a p2pd daemon with GossipSub (signed, strict) and return hivemind's P2P for it.

    `identity_path`: libp2p key file; created (Ed25519, mode 0600) if missing, so a restarted
    peer keeps its peer id. None means a fresh random Ed25519 identity (the daemon's default),
    lost on restart. A key file must be Ed25519 (RSA, hivemind's format, would add ~500
    bytes to every signed message, and repair verifies Ed25519 senders only), consistent
    (its public half matches), and private to its owner (mode 0600): else a UserError.
    `initial_peers`: full bootstrap multiaddrs ``/ip4/H/tcp/P/p2p/<peer id>``; startup fails
    with a UserError if none of them can be reached.
    `bootstrap_addrs`: full multiaddrs checked like `initial_peers` but not handed to the
    daemon: the caller dials them itself (network/reconnect.py), with retries.
    `use_auto_relay`: behind NAT, reserve a slot on a circuit relay and announce the
    relay address; the relays are the bootstrap addresses (p2pd's static "trusted relays":
    every p2pd serves as a relay by default, and we hand the daemon no bootstrap peers of
    its own, so without this it would know of no relay). `reachability` ("auto", "private",
    "public") overrides AutoNAT's verdict, which gates auto-relay.
    `heartbeat_interval`: GossipSub heartbeat in seconds (daemon default 1 s); shorter forms
    the mesh faster. Other keyword arguments go to `hivemind.P2P.create`.
    Failures a user can fix (port in use, unreachable bootstrap, bad key file) raise UserError.
    """
    _check_ports([*initial_peers, *bootstrap_addrs], "bootstrap address", allow_any=False)
    _check_ports(host_maddrs, "listen address", allow_any=True)
    _check_ports(announce_maddrs or (), "announce address", allow_any=False)
    for addr in [*initial_peers, *bootstrap_addrs]:
        try:
            ok = "p2p" in Multiaddr(addr)
        except Exception:
            ok = False
        if not ok:
            raise UserError(
                f"bootstrap address {addr!r} is not a full multiaddr ending in /p2p/<peer id>; "
                "copy the address the bootstrap node prints at startup"
            )
    probe_listen_addrs(host_maddrs)
    if identity_path is not None:
        load_or_create_identity(Path(identity_path))
    flags = {}
    if heartbeat_interval is not None:
        flags["gossipsubHeartbeatInterval"] = f"{max(1, round(heartbeat_interval * 1000))}ms"
    launch = {"flags": flags}
    token = _launch.set(launch)
    try:
        return await PubSubP2P.create(
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
            identity_path=None if identity_path is None else str(identity_path),
            # hivemind's check spawns a second daemon and only understands RSA keys
            check_if_identity_free=False,
            startup_timeout=startup_timeout,
            nat_port_map=nat_port_map,
            use_auto_relay=use_auto_relay,
            trusted_relays=[*initial_peers, *bootstrap_addrs] if use_auto_relay else None,
            force_reachability=None if reachability == "auto" else reachability,
            **p2p_kwargs,
        )
    except P2PDaemonError as e:
        if (failed := launch.get("p2p")) is not None:
            await failed.shutdown()
            with contextlib.suppress(OSError, KeyError):  # a daemon that exited leaves its socket
                os.remove(failed.daemon_listen_maddr["unix"])
        raise _daemon_user_error(str(e), host_maddrs, initial_peers) from e
    finally:
        _launch.reset(token)


def _daemon_user_error(msg: str, host_maddrs: Sequence[str], initial_peers: Sequence[str]):
    if "failed to connect to bootstrap peers" in msg:
        tried = ", ".join(initial_peers)
        check = host_port(initial_peers[0]) if initial_peers else "HOST PORT"
        return UserError(
            f"could not reach any bootstrap peer (tried: {tried}); at least one must be running "
            f"and reachable from this machine (check with `nc -vz {check}`, and open or forward "
            "its port if it is behind a firewall or NAT)"
        )
    if "listen unix" in msg and "address already in use" in msg:
        return UserError(
            f"the daemon's control socket already exists ({msg.rsplit('listen unix ', 1)[-1]}); "
            "a crashed daemon left it behind: delete the file and retry"
        )
    if "address already in use" in msg:
        return UserError(
            f"cannot listen on {', '.join(host_maddrs)}: the port is already in use; pick another "
            "port (tcp/0 picks a free one) or stop the process using it (`ss -ltnp`)"
        )
    if "permission denied" in msg:
        return UserError(f"the libp2p daemon could not listen ({msg}); use a port >= 1024")
    if "failed to start in" in msg:
        return UserError(
            f"the libp2p daemon did not start in time ({msg}); retry or raise the timeout"
        )
    return UserError(f"the libp2p daemon failed to start ({msg}); check the addresses and flags")


def remove_stale_sockets(directory: str = "/tmp", min_age: float = 60.0) -> list[str]:
    """Delete hivemind control sockets in `directory` that nothing listens on any more.

    SIGKILLed daemons leave ``hivemind-p2p*.sock`` files behind. Sockets younger than
    `min_age` seconds are kept (a daemon that is starting may not be listening yet).
    """
    removed = []
    for entry in Path(directory).glob("hivemind-p2p*.sock"):
        try:
            if time.time() - entry.lstat().st_mtime < min_age:
                continue
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(entry))
        except ConnectionRefusedError:
            entry.unlink(missing_ok=True)
            removed.append(str(entry))
        except OSError:
            pass
    return removed


async def connect_peer(p2p: P2P, peer_id: PeerID, addrs: Sequence[str], timeout: float) -> None:
    """Dial `peer_id` at `addrs` (multiaddrs without /p2p/...): RemoteCallError if it fails.

    hivemind's P2P does not expose the daemon's CONNECT request; its client does."""
    try:
        maddrs = [Multiaddr(a) for a in addrs]
    except Exception as e:
        raise RemoteCallError(f"bad address for {peer_id}: {e}") from e
    try:
        await asyncio.wait_for(p2p._client.connect(peer_id, maddrs), timeout)
    except TimeoutError as e:
        raise RemoteCallError(f"no answer within {timeout:g} s") from e
    except Exception as e:
        raise RemoteCallError(str(e).strip().splitlines()[0][:200] or type(e).__name__) from e


async def peer_connections(p2p: P2P) -> dict[str, list[str]]:
    """Base58 id -> the remote addresses of the daemon's connections to that peer. A relayed
    connection's address contains ``/p2p-circuit`` (see `is_relayed`)."""
    return {
        info.peer_id.to_base58(): [str(a) for a in info.addrs] for info in await p2p.list_peers()
    }


def is_relayed(addr: str) -> bool:
    """Whether a connection address goes through a circuit relay (not a direct connection)."""
    return "/p2p-circuit" in addr


# ---------------------------------------------------------------------------------------------
# PubSub over the control socket


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


async def _write_frame(writer: asyncio.StreamWriter, message) -> None:
    body = message.SerializeToString()
    writer.write(_varint(len(body)) + body)
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
    """One message received on a topic. `sender` is the original publisher (signature checked)."""

    sender: bytes  # peer id bytes
    sender_b58: str
    data: bytes
    seqno: int  # publisher's counter; starts at the daemon's start time in ns, so it grows
    seqno_bytes: bytes  # as signed
    signature: bytes
    topic: str
    wire_size: int  # size of the signed GossipSub message (payload + from/seqno/sig/key/topic)


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
        sender = getattr(m, "from")
        wire = pb.PSMessage()
        wire.CopyFrom(m)
        del wire.topicIDs[1:]  # the GossipSub message carries one topic
        return PubSubMessage(
            sender=sender,
            sender_b58=base58.b58encode(sender).decode(),
            data=m.data,
            seqno=int.from_bytes(m.seqno, "big"),
            seqno_bytes=m.seqno,
            signature=m.signature,
            topic=m.topicIDs[0] if m.topicIDs else self.topic,
            wire_size=wire.ByteSize(),
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

    def __init__(self, p2p: P2P, *, max_rate: float | None = 50.0, burst: float = 10.0):
        self.peer_id: PeerID = p2p.peer_id
        self._socket = p2p.daemon_listen_maddr["unix"]
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
                return await self._request(*self._conn, kind, topic, data)
            except BaseException as e:  # incl. cancellation: an unread reply would desync
                self._conn[1].close()
                self._conn = None
                if isinstance(e, OSError | asyncio.IncompleteReadError):
                    name = _PS.Type.Name(kind)
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


# ---------------------------------------------------------------------------------------------
# Request/response (unary calls multiplexed over hivemind's persistent daemon connection)


async def serve_bytes(
    p2p: P2P,
    name: str,
    handler: Callable[[PeerID, bytes], Awaitable[bytes]],
    *,
    max_request: int = DEFAULT_RPC_LIMIT,
    max_response: int = DEFAULT_RPC_LIMIT,
) -> None:
    """Answer `call_bytes(..., name, ...)` from other peers with ``await handler(peer, request)``.

    Oversized requests are rejected without calling the handler; an exception in the handler
    or an oversized response reaches the caller as RemoteCallError.
    """

    async def unary(request: BytesValue, context: P2PContext) -> BytesValue:
        if len(request.value) > max_request:
            raise ValueError(f"request of {len(request.value)} bytes exceeds {max_request}")
        response = await handler(context.remote_id, request.value)
        if len(response) > max_response:
            raise ValueError(f"response of {len(response)} bytes exceeds {max_response}")
        return BytesValue(value=bytes(response))

    await p2p.add_protobuf_handler(name, unary, BytesValue)


async def call_bytes(
    p2p: P2P,
    peer_id: PeerID | str,
    name: str,
    request: bytes,
    timeout: float,
    *,
    max_request: int = DEFAULT_RPC_LIMIT,
    max_response: int = DEFAULT_RPC_LIMIT,
) -> bytes:
    """Send `request` to handler `name` on `peer_id`, return its response bytes.

    Raises ValueError for an oversized request and RemoteCallError for everything that can go
    wrong on the way (unreachable peer, no such handler, handler error, timeout, size limit).
    """
    if isinstance(peer_id, str):
        peer_id = PeerID.from_base58(peer_id)
    if len(request) > max_request:
        raise ValueError(f"request of {len(request)} bytes exceeds {max_request}")
    try:
        call = p2p.call_protobuf_handler(peer_id, name, BytesValue(value=request), BytesValue)
        response = (await asyncio.wait_for(call, timeout)).value
    except TimeoutError as e:
        raise RemoteCallError(f"call {name!r} to {peer_id} timed out after {timeout} s") from e
    except Exception as e:
        raise RemoteCallError(f"call {name!r} to {peer_id} failed: {e}") from e
    if len(response) > max_response:
        raise RemoteCallError(f"response of {len(response)} bytes from {peer_id} exceeds limit")
    return response
