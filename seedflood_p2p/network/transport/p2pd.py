"""The go-libp2p daemon (``p2pd``, shipped inside hivemind): start it, dial, list connections.

`create_p2p` starts the daemon with GossipSub switched on and a persistent Ed25519
identity (`network/transport/identity.py`: the key file, and the signature check of a received
message). Pubsub over the daemon is `network/transport/pubsub.py`; request/response is
`network/transport/rpc.py`.
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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.transport.identity import load_or_create_identity
from seedflood_p2p.network.transport.p2pd_build import BuildError, MeshSettings, build

logger = logging.getLogger(__name__)


class TransportError(Exception):
    """The daemon connection failed or the daemon refused a request."""


class RemoteCallError(TransportError):
    """A call to another peer failed: unreachable, timeout, handler error or size limit."""


@dataclass(frozen=True)
class RelayLimits:
    """What a relay-serving node grants each circuit and peer (p2pd's -relay* flags; they
    become go-libp2p's circuit v2 `relay.Resources`, with the per-peer, per-IP and per-ASN
    reservation caps all set to `max_reservations`)."""

    time_limit: float = 3600.0  # seconds a relayed connection lives before the relay resets it
    data_limit: int = 1 << 32  # bytes relayed per circuit and direction before a reset
    max_circuits: int = 16  # open relayed connections per peer
    max_reservations: int = 128  # reserved slots in all (and per peer, IP, ASN)
    buffer_size: int = 1 << 16  # copy buffer per relayed connection and direction, bytes

    def flags(self) -> dict[str, object]:
        return {
            "relayService": True,
            "relayTimeLimit": f"{max(1, round(self.time_limit))}s",
            "relayDataLimit": int(self.data_limit),
            "relayMaxCircuits": int(self.max_circuits),
            "relayMaxReservations": int(self.max_reservations),
            "relayBufferSize": int(self.buffer_size),
        }


# Per-launch settings for PubSubP2P._make_process_args, which hivemind calls inside create().
_launch: contextvars.ContextVar[dict] = contextvars.ContextVar("p2pd_launch")


_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


class PubSubP2P(P2P):
    """hivemind's P2P with GossipSub enabled in the daemon; start it with `create_p2p`."""

    def __init__(self) -> None:
        super().__init__()
        # p2pd's last lines: hivemind reports only the very last one when the daemon exits,
        # and a DHT goroutine's warning may land after the fatal line that says why.
        self.output_tail: deque[str] = deque(maxlen=64)

    def _log_p2pd_message(self, line: str) -> None:
        self.output_tail.append(line)
        P2P._log_p2pd_message(line)

    def _make_process_args(self, *args, **kwargs) -> list[str]:
        kwargs.update(pubsub=True, pubsubRouter="gossipsub", pubsubSign=True, pubsubSignStrict=True)
        launch = _launch.get({})
        kwargs.update(launch.get("flags", {}))
        if launch.get("binary") is not None:  # our build instead of the bundled p2pd
            args = (str(launch["binary"]), *args[1:])
        launch["p2p"] = self  # lets create_p2p clean up if the daemon fails to start
        argv = P2P._make_process_args(*args, **kwargs)
        # If our process is SIGKILLed, take the daemon down too: an orphaned p2pd would keep
        # our identity (and a stale socket) alive next to the restarted peer.
        if _SETPRIV is not None:
            argv = [_SETPRIV, "--pdeathsig", "TERM", *argv]
        return argv


def bundled_p2pd() -> Path:
    """hivemind's own p2pd binary."""
    import hivemind

    return Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"


_builds: dict[MeshSettings, Path | None] = {}
DEFAULT_MESH = MeshSettings()


async def daemon_binary(mesh: MeshSettings | None) -> Path | None:
    """Our p2pd build for `mesh` (network/transport/p2pd_build.py: the relay fix and the
    GossipSub settings), made once per machine; None: run the bundled p2pd as it is (asked
    for, or the build failed: said once, with why)."""
    if mesh is None:
        return None
    if mesh not in _builds:
        try:
            _builds[mesh] = await asyncio.to_thread(build, bundled_p2pd(), mesh)
        except (BuildError, OSError) as exc:
            logger.warning(
                "running hivemind's bundled p2pd as it is: every peer serves a relay with "
                "go-libp2p's default limits and GossipSub runs at its defaults (%s)",
                exc,
            )
            _builds[mesh] = None
    return _builds[mesh]


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
    relays: Sequence[str] = (),
    relay_service: RelayLimits | None = None,
    daemon_metrics: str | None = None,
    mesh: MeshSettings | None = DEFAULT_MESH,
    extra_flags: dict[str, object] | None = None,
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
    daemon: the caller dials them itself (network/peers/reconnect.py), with retries.
    `use_auto_relay`: when AutoNAT says this node is not reachable (or `reachability` is
    "private"), reserve a slot on a circuit relay and announce the relay address. The relays
    are the bootstrap addresses plus `relays`, given to p2pd as static relays with relay
    discovery off (`-relayDiscovery=0`): with discovery on, go-libp2p waits for 4 candidate
    relays or 3 minutes before it reserves. Without any relay address auto-relay stays off.
    `reachability` ("auto", "private", "public") overrides AutoNAT's verdict.
    `relay_service`: serve as a circuit relay for NATed peers under these limits (forces
    reachability "public": go-libp2p starts the relay service only on a node that counts
    itself public); None: serve no relay (`-relayService=0`).
    `daemon_metrics`: HOST:PORT where p2pd serves go-libp2p's own Prometheus metrics
    (`-metricsAddr`: relay service bytes and circuits, hole punches, resource manager).
    `heartbeat_interval`: GossipSub heartbeat in seconds (daemon default 1 s); shorter forms
    the mesh faster. `mesh`: run our p2pd build with these GossipSub settings (`daemon_binary`;
    None: hivemind's bundled p2pd as it is). `extra_flags`: more p2pd flags, name -> value
    (benchmarks: `{"pprof": True, "pprofPort": 6060}`). Other keyword arguments go to
    `hivemind.P2P.create`.
    Failures a user can fix (port in use, unreachable bootstrap, bad key file) raise UserError.
    """
    _check_ports([*initial_peers, *bootstrap_addrs], "bootstrap address", allow_any=False)
    _check_ports(relays, "relay address", allow_any=False)
    _check_ports(host_maddrs, "listen address", allow_any=True)
    _check_ports(announce_maddrs or (), "announce address", allow_any=False)
    for addr in [*initial_peers, *bootstrap_addrs, *relays]:
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
    flags: dict[str, object] = {}
    static_relays = list(dict.fromkeys([*initial_peers, *bootstrap_addrs, *relays]))
    use_auto_relay = use_auto_relay and bool(static_relays)
    if use_auto_relay:
        flags["relayDiscovery"] = False  # static relays: reserve at once
    if relay_service is not None:
        flags.update(relay_service.flags())
        reachability = "public"
    else:
        flags["relayService"] = False
    if relay_service is not None and daemon_metrics is None:
        daemon_metrics = f"127.0.0.1:{_free_port()}"  # to read what the relay carried
    if daemon_metrics:
        flags["metricsAddr"] = daemon_metrics
    if heartbeat_interval is not None:
        flags["gossipsubHeartbeatInterval"] = f"{max(1, round(heartbeat_interval * 1000))}ms"
    flags.update(extra_flags or {})
    launch = {"flags": flags, "binary": await daemon_binary(mesh)}
    token = _launch.set(launch)
    try:
        p2p = await PubSubP2P.create(
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
            identity_path=None if identity_path is None else str(identity_path),
            # hivemind's check spawns a second daemon and only understands RSA keys
            check_if_identity_free=False,
            startup_timeout=startup_timeout,
            nat_port_map=nat_port_map,
            use_auto_relay=use_auto_relay,
            trusted_relays=static_relays if use_auto_relay else None,
            force_reachability=None if reachability == "auto" else reachability,
            **p2p_kwargs,
        )
        p2p.daemon_metrics = daemon_metrics
        return p2p
    except P2PDaemonError as e:
        msg = str(e)
        if (failed := launch.get("p2p")) is not None:
            await failed.shutdown()
            with contextlib.suppress(OSError, KeyError):  # a daemon that exited leaves its socket
                os.remove(failed.daemon_listen_maddr["unix"])
            if (fatal := fatal_line(failed.output_tail)) is not None:
                msg = f"Daemon failed to start: {fatal}"
        raise _daemon_user_error(msg, host_maddrs, initial_peers) from e
    finally:
        _launch.reset(token)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


RELAY_COUNTERS = {
    "libp2p_relaysvc_data_transferred_bytes_total": "bytes_relayed",
    'libp2p_relaysvc_reservations_total{type="opened"}': "reservations_opened",
    'libp2p_relaysvc_reservations_total{type="closed"}': "reservations_closed",
    'libp2p_relaysvc_connections_total{type="opened"}': "circuits_opened",
    'libp2p_relaysvc_connections_total{type="closed"}': "circuits_closed",
}


async def relay_counters(p2p: P2P, timeout: float = 5.0) -> dict[str, int] | None:
    """What this node's relay service carried, from p2pd's own Prometheus endpoint
    (`daemon_metrics`): bytes relayed (both directions, all circuits), reservations and
    circuits opened and closed. None if the node serves no relay or the endpoint is down."""
    addr = getattr(p2p, "daemon_metrics", None)
    if not addr:
        return None

    def fetch() -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as reply:
            return reply.read().decode(errors="replace")

    try:
        text = await asyncio.to_thread(fetch)
    except OSError:
        return None
    out = dict.fromkeys(RELAY_COUNTERS.values(), 0)
    for line in text.splitlines():
        name, _, number = line.rpartition(" ")
        if name in RELAY_COUNTERS:
            with contextlib.suppress(ValueError):
                out[RELAY_COUNTERS[name]] = int(float(number))
    return out


def fatal_line(lines: Sequence[str]) -> str | None:
    """The line p2pd died with: its last plain-text line (Go's `log.Fatal`), not the JSON
    log records its goroutines may still print around it; None if it printed none."""
    for line in reversed(lines):
        if line and not line.startswith("{"):
            return line
    return None


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


_P2P_CODE = 421  # multicodec of /p2p/ (formerly /ipfs/)


def uvarint(n: int) -> bytes:
    """An unsigned varint (protobuf, multiaddr, the control socket's frame lengths)."""
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def maddr_bytes(addr: str) -> bytes:
    """The binary multiaddr the Go daemon parses, with each ``/p2p/<id>`` as a plain multihash.

    hivemind's `Multiaddr` encodes a peer id as a CIDv1 (libp2p-key); go-multiaddr expects
    the bare multihash and rejects the CID form ("length greater than remaining number of
    bytes in buffer"), so a circuit address ``.../p2p/<relay>/p2p-circuit`` could not be
    dialled through hivemind's client. Other components are encoded by hivemind."""
    import base58

    out = b""
    parts = re.split(r"/(?:p2p|ipfs)/([^/]+)", addr)
    for i, part in enumerate(parts):
        if i % 2:  # a peer id
            digest = base58.b58decode(part)
            out += uvarint(_P2P_CODE) + uvarint(len(digest)) + digest
        elif part:
            out += Multiaddr(part).to_bytes()
    return out


class RawMaddr:
    """A multiaddr handed to hivemind's daemon client as ready-made bytes (`maddr_bytes`)."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.raw = maddr_bytes(addr)

    def to_bytes(self) -> bytes:
        return self.raw

    def __str__(self) -> str:
        return self.addr


async def connect_peer(p2p: P2P, peer_id: PeerID, addrs: Sequence[str], timeout: float) -> None:
    """Dial `peer_id` at `addrs` (multiaddrs without a trailing /p2p/<peer_id>; a circuit
    address ``/ip4/R/tcp/P/p2p/<relay>/p2p-circuit`` dials through that relay):
    RemoteCallError if it fails.

    hivemind's P2P does not expose the daemon's CONNECT request; its client does. The
    addresses go as `RawMaddr` bytes, never through hivemind's CID encoding of /p2p/."""
    try:
        maddrs = [RawMaddr(a) for a in addrs]
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
