"""Finding the others again: the peer book, redialling with backoff, summaries, islands.

GossipSub and repair only reach peers this node has a connection to. A connection
lost in a partition, or a restart with the bootstrap node gone, is not re-made by
libp2p on its own: measured on main before this module, a 180 s partition never healed
(two ledgers for good), and a restarted peer with its bootstrap dead could not join.
So every node:

- keeps the peers it has met (`PeerBook`: peer id -> the addresses it dials them at,
  DATA_DIR/peers.json, written atomically), learnt from summaries (below);
- redials every known peer it is not connected to, and its bootstrap list, on a
  backoff schedule (redial_min doubling to redial_max, jittered) for as long as it
  runs, logging each failure with what it tried (`Reconnector.run`);
- on every new connection, runs a repair pass with that peer at once, so a healed
  partition repairs by itself (the flood node's own anti-entropy would get there
  too, a random peer every few seconds);
- exchanges summaries (`seedflood.summary`, protocol/wire.py) with connected peers
  every summary_interval: their newest round, ledger size, newest bucket digests,
  own addresses and the peers they are connected to (with addresses: peer exchange,
  so a node learns of peers it never met and dials them);
- probes a peer's TCP addresses itself before each dial and asks the daemon to dial
  only once one answers (`tcp_answers`): libp2p's swarm backs off a
  peer's addresses after each failed dial (5 s + tries^2 s, up to 5 minutes) and p2pd's
  control protocol cannot clear that, so redialling through the daemon during a
  30-minute partition left every node in a 5-minute "dial backoff": measured, the
  first reconnection came ~3 minutes after the heal. Probed, the daemon's backoff never
  grows while the peer is away;
- says "partitioned" (`IslandView`: log, /status, metrics) when peers it met in the
  last ISLAND_WINDOW seconds, or that its connected peers name, cannot be dialled
  for island_after seconds, or when a connected peer's settled ledger buckets
  differ from ours for island_after seconds (repair should have closed them).

Summaries travel over libp2p request/response: the secure channel (Noise/TLS)
authenticates the answering peer id, which is what a direct summary needs. They are
not signed for forwarding; a summary is never relayed, only its addresses are tried.
A node cannot tell a partition from peers that stopped: the status says both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from seedflood_p2p.core.config import ED25519_PEER_ID_PREFIX, RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.transport.p2pd import (
    connect_peer,
    is_relayed,
    peer_connections,
    relay_counters,
)
from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes, serve_bytes
from seedflood_p2p.protocol.wire import (
    BUCKET_ROUNDS,
    MAX_ADDRS,
    MAX_SUMMARY_PEERS,
    Rejected,
    Summary,
    decode_summary,
    decode_summary_request,
    encode_summary,
    encode_summary_request,
)

log = logging.getLogger("seedflood.reconnect")

BOOK_FILE = "peers.json"
MAX_BOOK = 256  # peers kept in the book (the most recently met)
MAX_HINTS = 256  # peers heard of (from summaries) but not met: dialled, not persisted
FORGET_AFTER = 7 * 86400.0  # a book entry not met for a week is dropped
ISLAND_WINDOW = 600.0  # peers met this recently and now unreachable count as "cut off"
SAVE_EVERY = 10.0  # seconds between writes of a changed book
LOOP_TICK = 1.0  # seconds between passes of the reconnect loop


_TCP_ADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/tcp/(\d+)$")
PROBE_TIMEOUT = 3.0  # seconds for a TCP probe of one address


async def tcp_answers(addrs: Iterable[str], timeout: float = PROBE_TIMEOUT) -> bool | None:
    """Whether any of `addrs` accepts a TCP connection (closed at once, nothing sent);
    None when some address is not plain /ip4|ip6/.../tcp/N (relayed, DNS, QUIC): then
    only the daemon can tell, and the caller dials through it."""
    targets = []
    for addr in addrs:
        match = _TCP_ADDR.match(addr)
        if match is None:
            return None
        targets.append((match.group(2), int(match.group(3))))
    if not targets:
        return None

    async def answers(host: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    return any(await asyncio.gather(*(answers(h, p) for h, p in targets)))


def split_full_addr(addr: str) -> tuple[str, str]:
    """(peer id, address without /p2p/...) of a full multiaddr `.../p2p/<peer id>`."""
    base, _, peer = addr.rpartition("/p2p/")
    return peer, base


def _dialable(addrs: Iterable[str], peer: str) -> list[str]:
    """Addresses as the daemon dials them: a trailing /p2p/<peer> stripped, no duplicates,
    bounded. A relay address ``/ip4/R/tcp/P/p2p/<relay>/p2p-circuit`` is kept whole: it is
    how a peer behind NAT is reached (through its reservation on the relay)."""
    out: list[str] = []
    for a in addrs:
        head, circuit, _ = a.partition("/p2p-circuit")
        if circuit:  # relay address: keep the relay's /p2p/<id>, drop what follows the circuit
            a = head + circuit
            if "/p2p/" not in head:
                continue  # a circuit needs to name its relay
        elif "/p2p/" in a:
            a = a.split("/p2p/")[0]
        if a and a not in out:
            out.append(a)
    return out[:MAX_ADDRS]


class PeerBook:
    """Peers this node has met: base58 peer id -> {"addrs": [...], "met": unix time}.

    Kept in DATA_DIR/peers.json, written to a temporary file, fsynced, then renamed, so
    a crash leaves the old book or the new one. A damaged file is moved aside with one
    warning (the node still has its bootstrap list), never a crash."""

    def __init__(self, data_dir: Path, own_id: str) -> None:
        self.path = Path(data_dir) / BOOK_FILE
        self.own_id = own_id
        self.entries: dict[str, dict] = {}
        self._dirty = self._urgent = False
        self._saved_at = 0.0
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            raw = json.loads(self.path.read_text())
            entries = {
                str(peer): {"addrs": _dialable(e["addrs"], peer), "met": float(e["met"])}
                for peer, e in raw["peers"].items()
                if isinstance(e.get("addrs"), list) and all(isinstance(a, str) for a in e["addrs"])
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self.path.with_suffix(".damaged")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.warning("peer book %s is damaged (%r): moved to %s", self.path, exc, aside)
            return
        entries.pop(self.own_id, None)
        self.entries = entries

    def met(self, peer: str, addrs: Iterable[str]) -> None:
        """`peer` is connected and reachable at `addrs` (its own word, or what we dialled).
        A peer met for the first time is written at the next `save`, unthrottled: a node
        killed seconds after joining must still find it on restart."""
        if peer == self.own_id:
            return
        addrs = _dialable(addrs, peer)
        entry = self.entries.get(peer)
        if entry is None or (addrs and entry["addrs"] != addrs):
            self._urgent = True
        if self._urgent or time.time() - entry["met"] > 60:
            old = (entry or {}).get("addrs", [])
            self.entries[peer] = {"addrs": addrs or old, "met": time.time()}
            self._dirty = True

    def others(self) -> list[str]:
        return [p for p in self.entries if p != self.own_id]

    def save(self, force: bool = False) -> None:
        throttled = time.monotonic() - self._saved_at < SAVE_EVERY
        if not self._dirty or (throttled and not force and not self._urgent):
            return
        now = time.time()
        keep = sorted(
            (e["met"], p) for p, e in self.entries.items() if now - e["met"] < FORGET_AFTER
        )[-MAX_BOOK:]
        self.entries = {p: self.entries[p] for _, p in keep}
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"version": 1, "peers": self.entries}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:  # a full disk must not stop the node: the book is a hint
            log.warning("cannot write the peer book %s: %s", self.path, exc)
            return
        self._dirty = self._urgent = False
        self._saved_at = time.monotonic()


@dataclass
class Backoff:
    """When to dial a peer next: redial_min, doubling per failure up to redial_max."""

    failures: int = 0
    next_try: float = 0.0
    failing_since: float | None = None
    last_error: str = ""


@dataclass
class IslandView:
    """What this node knows about the others it cannot reach (see the module docstring)."""

    connected: int = 0
    known: int = 0
    unreachable: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    partitioned: bool = False
    since: float | None = None  # monotonic time the current verdict began

    def as_status(self) -> dict:
        return {
            "state": "partitioned" if self.partitioned else "connected",
            "connected_peers": self.connected,
            "known_peers": self.known,
            "unreachable": self.unreachable[:16],
            "diverged": self.diverged[:16],
            "for_s": None if self.since is None else round(time.monotonic() - self.since, 1),
        }

    def describe(self) -> str:
        parts = []
        if self.unreachable:
            parts.append(
                f"{len(self.unreachable)} peer(s) met recently or named by others cannot be "
                f"reached ({', '.join(p[-8:] for p in self.unreachable[:6])}): a partition, or "
                "they stopped"
            )
        if self.diverged:
            parts.append(
                f"the ledger differs from {len(self.diverged)} connected peer(s)' "
                f"({', '.join(p[-8:] for p in self.diverged[:6])}) and repair has not closed it"
            )
        return "; ".join(parts) or "every known peer reachable"


def run_founders(manifest_json: str) -> frozenset[str]:
    """The base58 ids of a run's founders (`extra.probation.founders` and its allow-list);
    empty for an open run without them."""
    import base58

    from seedflood_p2p.algorithm.probation import ProbationSettings

    probation = ProbationSettings.of(RunConfig.from_json(manifest_json))
    return frozenset(base58.b58encode(p).decode() for p in probation.founders)


class Reconnector:
    """Dials the bootstrap list, the peer book and peers heard of, with backoff, forever.

    Works before the run is known (the peer daemon's first contact, `dial_due`); once a
    flood node is attached (`attach`) it also serves and exchanges summaries, repairs
    with every new connection and keeps the island view."""

    def __init__(self, p2p, data_dir: Path, bootstrap: list[str], settings, metrics: NodeMetrics):
        self.p2p = p2p
        self.own_id = p2p.peer_id.to_base58()
        self.book = PeerBook(data_dir, self.own_id)
        self.bootstrap = {}
        for addr in bootstrap:
            peer, base = split_full_addr(addr)
            self.bootstrap[peer] = [base]
        self.s = settings
        self.metrics = metrics
        self.hints: dict[str, list[str]] = {}  # heard of in summaries, not (yet) met
        # The run's founders (base58; `attach`): fresh keys are free, so a hint list that
        # many identities of one attacker filled still takes a founder (`add_hints`).
        self.founders: frozenset[str] = frozenset()
        self.hinted_at: dict[str, float] = {}  # when a summary last named each hint
        self.learned_from: dict[str, str] = {}  # hint -> where we first heard of it
        self.backoff: dict[str, Backoff] = {}
        self.connected: set[str] = set()
        self.summaries: dict[str, tuple[float, Summary]] = {}  # peer -> (when, summary)
        self.differs_since: dict[str, float] = {}
        self.view = IslandView()
        self.flood = None
        self.own_addrs: list[str] = []
        self.links: dict[str, str] = {}  # connected peer -> "direct" or "relayed"
        self.relayed_via: dict[str, str] = {}  # relayed-only peer -> the relay's id
        self.hole_punches = 0
        self.relay_service: dict[str, int] | None = None
        self._logged_relay: dict[str, int] | None = None
        self._last_relay_log = -math.inf
        # relayed-only peer -> (monotonic time first seen relayed-only, redials made)
        self._relayed_since: dict[str, tuple[float, int]] = {}
        self._relayed_addr: dict[str, str] = {}  # relayed-only peer -> its circuit address
        self._on_connect: list[Callable[[str], None]] = []
        self._task: asyncio.Task | None = None
        self._dialling = asyncio.Lock()  # one dial pass at a time (the loop, first contact)
        self._last_summary = 0.0
        self._last_island_log = 0.0

    # -- candidates and dialling ---------------------------------------------------
    def candidates(self) -> dict[str, list[str]]:
        """Every peer to keep a connection to, with the addresses to dial it at."""
        out: dict[str, list[str]] = {}
        for source in (self.hints, {p: e["addrs"] for p, e in self.book.entries.items()}):
            for peer, addrs in source.items():
                out[peer] = addrs
        for peer, addrs in self.bootstrap.items():  # the operator's word comes first
            out[peer] = _dialable([*addrs, *out.get(peer, [])], peer)
        out.pop(self.own_id, None)
        return {p: a for p, a in out.items() if a}

    def others_known(self) -> list[str]:
        """Peers this node knows exist besides itself: the book and the bootstrap list."""
        return sorted(set(self.book.others()) | (set(self.bootstrap) - {self.own_id}))

    async def refresh_connected(self) -> set[str]:
        try:
            connections = await peer_connections(self.p2p)
        except Exception as exc:  # the daemon is gone: the flood node will say so
            log.debug("list_peers failed: %r", exc)
            return self.connected
        now_connected = set(connections)
        self._track_links(connections)
        for peer in sorted(now_connected - self.connected):
            addrs = connections[peer]
            relayed = bool(addrs) and all(is_relayed(a) for a in addrs)
            self.metrics.new_links.labels("relayed" if relayed else "direct").inc()
            log.info(
                "connected to %s at %s%s",
                peer,
                ", ".join(addrs) or "?",
                " (through a relay)" if relayed else "",
                extra={
                    "fields": {
                        "event": "connected",
                        "peer": peer,
                        "addrs": addrs,
                        "relayed": relayed,
                    }
                },
            )
            state = self.backoff.pop(peer, None)
            if state is not None and state.failures:
                log.info(
                    "reconnected to %s after %d failed dial(s)",
                    peer,
                    state.failures,
                    extra={"fields": {"event": "reconnected", "peer": peer}},
                )
            for callback in self._on_connect:
                callback(peer)
        for peer in sorted(self.connected - now_connected):
            log.info(
                "lost the connection to %s",
                peer,
                extra={"fields": {"event": "disconnected", "peer": peer}},
            )
        self.connected = now_connected
        self.metrics.connected.set(len(now_connected))
        return now_connected

    def _track_links(self, connections: dict[str, list[str]]) -> None:
        """How each connected peer is reached: "direct", or "relayed" (only through a circuit
        relay, named in `relayed_via`). A peer that was relayed-only and now also has a
        direct connection was hole-punched (DCUtR) or became directly dialable: logged as
        `hole_punched` and counted."""
        links: dict[str, str] = {}
        for peer, addrs in connections.items():
            relayed = bool(addrs) and all(is_relayed(a) for a in addrs)
            links[peer] = "relayed" if relayed else "direct"
            if relayed:
                self.relayed_via[peer] = _relay_of(addrs[0])
                self._relayed_addr[peer] = addrs[0].split("/p2p-circuit")[0] + "/p2p-circuit"
            elif self.links.get(peer) == "relayed":
                self.hole_punches += 1
                self.metrics.hole_punches.inc()
                log.info(
                    "direct connection to %s at %s, reached through relay %s until now",
                    peer,
                    ", ".join(addrs),
                    self.relayed_via.get(peer, "?"),
                    extra={
                        "fields": {
                            "event": "hole_punched",
                            "peer": peer,
                            "addrs": addrs,
                            "relay": self.relayed_via.get(peer),
                        }
                    },
                )
        for peer in [p for p in self.relayed_via if links.get(p) != "relayed"]:
            del self.relayed_via[peer]
        self.links = links
        for kind in ("direct", "relayed"):
            self.metrics.links.labels(kind).set(sum(1 for k in links.values() if k == kind))

    async def retry_hole_punches(self) -> None:
        """Redial, through its relay, a peer reached only through a relay for a while, so
        that a hole punch is tried again. go-libp2p tries DCUtR once, when an inbound relayed
        connection opens, and only once its hole-punch service runs (after the node has seen
        its own public address from 4 peers): a relayed connection made earlier is never
        upgraded. The side with the smaller peer id closes it and dials the same circuit
        address; the other side then punches. At most HOLE_PUNCH_TRIES times per peer,
        HOLE_PUNCH_EVERY seconds apart; gossip resumes on the new connection and repair
        fetches what was missed."""
        from hivemind.p2p import PeerID

        now = time.monotonic()
        for peer in [p for p in self._relayed_since if self.links.get(p) != "relayed"]:
            del self._relayed_since[peer]
        for peer, kind in sorted(self.links.items()):
            if kind != "relayed" or peer in self.bootstrap:
                continue
            since, tries = self._relayed_since.setdefault(peer, (now, 0))
            if self.own_id > peer or tries >= HOLE_PUNCH_TRIES:
                continue
            if now - since < HOLE_PUNCH_EVERY * (tries + 1):
                continue
            self._relayed_since[peer] = (since, tries + 1)
            via = self.relayed_via.get(peer)
            known = self.candidates().get(peer, [])
            addrs = [a for a in known if is_relayed(a) and via and via in a] or [
                self._relayed_addr[peer]
            ]
            if not addrs:
                continue
            log.info(
                "redialling %s through relay %s for a hole punch (try %d)",
                peer,
                via,
                tries + 1,
                extra={"fields": {"event": "hole_punch_retry", "peer": peer, "try": tries + 1}},
            )
            try:
                await self.p2p._client.disconnect(PeerID.from_base58(peer))
                await connect_peer(self.p2p, PeerID.from_base58(peer), addrs, self.s.call_timeout)
            except Exception as exc:  # the regular dial loop reconnects it
                log.info("redial of %s for a hole punch failed: %s", peer, exc)

    async def _refresh_relay_counters(self) -> None:
        counters = await relay_counters(self.p2p)
        if counters is None:
            return
        now = time.monotonic()
        # Compared with the last counters LOGGED, not the last read: a change that came within
        # RELAY_LOG_EVERY of the previous line is still logged once the interval is over.
        if counters != self._logged_relay and now - self._last_relay_log >= RELAY_LOG_EVERY:
            self._last_relay_log, self._logged_relay = now, counters
            log.info(
                "relayed for others: %d bytes, %d reservations, %d circuits opened",
                counters["bytes_relayed"],
                counters["reservations_opened"],
                counters["circuits_opened"],
                extra={"fields": {"event": "relay_service", **counters}},
            )
        self.relay_service = counters
        self.metrics.relayed_bytes.set(counters["bytes_relayed"])

    def nat_status(self) -> dict:
        """How this node is reached, for /status and `seedflood status`: "direct" (it
        announces a public address), "relay" (only through the relays it holds reservations
        on), or "unknown" (private addresses only, no reservation: AutoNAT has not decided,
        or no relay accepted it); its links by kind, and the hole punches seen."""
        public = [a for a in self.own_addrs if not is_relayed(a) and _is_public(a)]
        relays = sorted({_relay_of(a) for a in self.own_addrs if is_relayed(a)})
        return {
            "reachable": "direct" if public else "relay" if relays else "unknown",
            "public_addrs": public,
            "relays": relays,
            "direct_peers": sum(1 for k in self.links.values() if k == "direct"),
            "relayed_peers": sum(1 for k in self.links.values() if k == "relayed"),
            "relayed_via": dict(sorted(self.relayed_via.items())),
            "hole_punches": self.hole_punches,
            "relay_service": self.relay_service,  # what we relay for others, if we serve
        }

    async def dial_due(self, force: bool = False) -> dict[str, str]:
        """Dial every candidate that is not connected and whose backoff has passed (all of
        them with `force`), at once. Returns {peer: error} of the dials that failed."""
        async with self._dialling:
            return await self._dial_due(force)

    async def _dial_due(self, force: bool) -> dict[str, str]:
        connected = await self.refresh_connected()
        now = time.monotonic()
        due = {
            p: a
            for p, a in self.candidates().items()
            if p not in connected and (force or self.backoff.get(p, Backoff()).next_try <= now)
        }
        if not due:
            return {}
        results = await asyncio.gather(*(self._dial(p, a) for p, a in due.items()))
        await self.refresh_connected()
        return {p: err for p, err in zip(due, results, strict=True) if err}

    async def _dial(self, peer: str, addrs: list[str]) -> str:
        from hivemind.p2p import PeerID

        try:
            if await tcp_answers(addrs) is False:
                # Not through the daemon while nothing answers: each failed daemon dial
                # grows its own backoff, which would outlast a partition (docstring).
                raise RemoteCallError("no TCP answer at any address (probed, not dialled)")
            await connect_peer(self.p2p, PeerID.from_base58(peer), addrs, self.s.call_timeout)
        except (RemoteCallError, ValueError) as exc:
            state = self.backoff.setdefault(peer, Backoff())
            state.failures += 1
            now = time.monotonic()
            if state.failing_since is None:
                state.failing_since = now
            delay = min(self.s.redial_max, self.s.redial_min * 2 ** (state.failures - 1))
            delay *= random.uniform(0.8, 1.2)
            state.next_try = now + delay
            state.last_error = str(exc)
            self.metrics.redials.labels("failed").inc()
            log.info(
                "cannot reach %s at %s (attempt %d): %s; next try in %.0f s",
                peer,
                ", ".join(addrs),
                state.failures,
                exc,
                delay,
                extra={"fields": {"event": "dial_failed", "peer": peer, "attempt": state.failures}},
            )
            return str(exc) or type(exc).__name__
        self.metrics.redials.labels("connected").inc()
        return ""

    # -- with a run: summaries, repair on connect, the island view --------------------------
    async def attach(self, flood) -> None:
        """Serve summaries for `flood`'s run, repair on every new connection, and start the
        loop. Peers already connected get a summary exchange in the first pass."""
        self.flood = flood
        self.founders = run_founders(flood.manifest_json)
        await self._refresh_own_addrs()
        await serve_bytes(self.p2p, "seedflood.summary", self._serve_summary)
        self._on_connect.append(self._repair_new_connection)
        self.start()

    async def _refresh_own_addrs(self) -> None:
        """Our addresses as the daemon announces them. Re-read every summary pass: behind
        NAT, a relay address appears only once AutoNAT says "private" and auto-relay has a
        reservation, tens of seconds after start."""
        try:
            visible = await self.p2p.get_visible_maddrs(latest=True)
            addrs = _dialable((str(a) for a in visible), self.own_id)
        except Exception as exc:
            log.debug("no visible addresses yet: %r", exc)
            return
        if addrs != self.own_addrs:
            self.metrics.relay_reservations.set(len({_relay_of(a) for a in addrs if is_relayed(a)}))
            log.info(
                "own addresses: %s",
                ", ".join(addrs),
                extra={"fields": {"event": "own_addrs", "addrs": addrs}},
            )
        self.own_addrs = addrs

    def on_connect(self, callback: Callable[[str], None]) -> None:
        """Call `callback(peer id)` on every new connection (from the loop's pass)."""
        self._on_connect.append(callback)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="reconnect")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self.book.save(force=True)

    def _repair_new_connection(self, peer: str) -> None:
        if self.flood is None:
            return
        from hivemind.p2p import PeerID

        async def repair() -> None:
            new = await self.flood.repair_new_peer(PeerID.from_base58(peer))
            if new:
                log.info(
                    "repair with newly connected %s: fetched %d missing messages",
                    peer,
                    new,
                    extra={"fields": {"event": "repair", "count": new, "peer": peer}},
                )
            await self._exchange(peer)

        task = asyncio.create_task(repair(), name=f"repair-on-connect:{peer[-8:]}")
        task.add_done_callback(_log_task_failure)

    def own_summary(self) -> Summary:
        flood = self.flood
        peers = {}
        for peer in sorted(
            self.connected, key=lambda p: -self.book.entries.get(p, {}).get("met", 0)
        ):
            addrs = self.book.entries.get(peer, {}).get("addrs") or self.hints.get(peer)
            if addrs:
                peers[_peer_bytes(peer)] = addrs
            if len(peers) >= MAX_SUMMARY_PEERS:
                break
        live = sum(
            1 for st in flood.peers.values() if time.monotonic() - st.last_seen < ISLAND_WINDOW
        )
        return Summary(
            round=flood.ledger.max_round(),
            rows=len(flood.ledger),
            live=live,
            digests=flood.ledger.bucket_digests(BUCKET_ROUNDS),
            addrs=self.own_addrs,
            peers=peers,
        )

    async def _serve_summary(self, peer, request: bytes) -> bytes:
        decoded = decode_summary_request(request)
        if decoded is None or self.flood is None or decoded[0] != self.flood.run_id:
            return b""
        caller = peer.to_base58()
        if decoded[1]:
            self.book.met(caller, decoded[1])  # connected to us, and says where it listens
        return encode_summary(self.own_summary())

    async def _exchange(self, peer: str) -> None:
        """Ask `peer` for its summary; learn its addresses and the peers it names."""
        from hivemind.p2p import PeerID

        request = encode_summary_request(self.flood.run_id, self.own_addrs)
        try:
            reply = await call_bytes(
                self.p2p,
                PeerID.from_base58(peer),
                "seedflood.summary",
                request,
                self.s.call_timeout,
            )
        except RemoteCallError as exc:
            log.debug("summary from %s failed: %s", peer, exc)
            return
        if not reply:  # not on this run (or not started yet)
            return
        try:
            summary = decode_summary(reply)
        except Rejected as exc:
            self.flood.admission.drop_reply(exc, _peer_bytes(peer))
            return
        self.summaries[peer] = (time.monotonic(), summary)
        self.book.met(peer, summary.addrs)
        named_peers = {}
        for named, addrs in summary.peers.items():
            if not (len(named) == 38 and named.startswith(ED25519_PEER_ID_PREFIX)):
                continue  # seedflood peers are Ed25519 identities only
            if name := _peer_name(named):
                named_peers[name] = addrs
        self.add_hints(named_peers, "summary")

    def add_hints(self, peers: dict[str, list[str]], source: str) -> None:
        """Peers heard of (base58 id -> addresses) from `source` ("summary": a connected
        peer's word; "dht": signed discovery records): dialled by the loop, forgotten when
        no source names them for ISLAND_WINDOW. A peer already in the book keeps its entry."""
        for name, addrs in peers.items():
            if name == self.own_id or name in self.book.entries or not addrs:
                continue
            if len(self.hints) >= MAX_HINTS and name not in self.hints:
                if name not in self.founders or not self._evict_hint():
                    continue
            if name not in self.hints and name not in self.connected:
                self.learned_from[name] = source
                log.info(
                    "heard of %s from %s",
                    name,
                    source,
                    extra={"fields": {"event": "discovered", "peer": name, "source": source}},
                )
            self.hints[name] = _dialable(addrs, name)
            self.hinted_at[name] = time.monotonic()

    def _evict_hint(self) -> bool:
        """Make room for a founder's hint: forget the hint named longest ago that is not a
        founder (False: every hint is one)."""
        others = [p for p in self.hints if p not in self.founders]
        if not others:
            return False
        oldest = min(others, key=lambda p: self.hinted_at.get(p, 0.0))
        for table in (self.hints, self.hinted_at, self.learned_from, self.backoff):
            table.pop(oldest, None)
        return True

    def _update_view(self) -> None:
        now = time.monotonic()
        wall = time.time()
        # A peer no connected node has named for ISLAND_WINDOW is forgotten: it left.
        for peer in [p for p, t in self.hinted_at.items() if now - t > ISLAND_WINDOW]:
            self.hints.pop(peer, None)
            self.hinted_at.pop(peer, None)
            self.backoff.pop(peer, None)
        unreachable = []
        for peer, state in self.backoff.items():
            if peer in self.connected or state.failing_since is None:
                continue
            if now - state.failing_since < self.s.island_after:
                continue
            recent = wall - self.book.entries.get(peer, {}).get("met", 0) < ISLAND_WINDOW
            if recent or peer in self.hints:
                unreachable.append(peer)
        diverged = []
        if self.flood is not None:
            mine = self.flood.ledger.bucket_digests(BUCKET_ROUNDS)
            our_newest = self.flood.ledger.max_round()
            for peer, (when, summary) in list(self.summaries.items()):
                if peer not in self.connected or now - when > 4 * self.s.summary_interval + 30:
                    self.differs_since.pop(peer, None)
                    continue
                settled = min(our_newest, summary.round) // BUCKET_ROUNDS - 1  # both past it
                differs = any(b <= settled and mine.get(b) != d for b, d in summary.digests.items())
                if differs:
                    since = self.differs_since.setdefault(peer, now)
                    if now - since >= self.s.island_after:
                        diverged.append(peer)
                else:
                    self.differs_since.pop(peer, None)
        partitioned = bool(unreachable or diverged)
        view = self.view
        if partitioned != view.partitioned:
            view.since = now
        view.connected = len(self.connected)
        view.known = len(set(self.book.entries) | set(self.hints) | set(self.bootstrap))
        view.unreachable, view.diverged = sorted(unreachable), sorted(diverged)
        changed = partitioned != view.partitioned
        view.partitioned = partitioned
        self.metrics.unreachable.set(len(unreachable))
        self.metrics.diverged.set(len(diverged))
        self.metrics.partitioned.set(int(partitioned))
        fields = {"event": "island", **view.as_status()}
        if partitioned and (changed or now - self._last_island_log > 60):
            self._last_island_log = now
            log.warning("partitioned: %s", view.describe(), extra={"fields": fields})
        elif changed:
            log.info("no longer partitioned: %s", view.describe(), extra={"fields": fields})

    async def run(self) -> None:
        """The loop: dial what is due, exchange summaries, update the island view."""
        while True:
            try:
                await self.dial_due()
                if self.flood is not None:
                    now = time.monotonic()
                    if now - self._last_summary >= self.s.summary_interval:
                        self._last_summary = now
                        await self._refresh_own_addrs()
                        await self.retry_hole_punches()
                        await self._refresh_relay_counters()
                        await asyncio.gather(*(self._exchange(p) for p in sorted(self.connected)))
                    self._update_view()
                self.book.save()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must outlive any one bad pass
                log.warning("reconnect pass failed: %r", exc)
            await asyncio.sleep(LOOP_TICK)


HOLE_PUNCH_TRIES = 3  # redials of a relayed-only peer for a hole punch (retry_hole_punches)
HOLE_PUNCH_EVERY = 20.0  # seconds relayed-only before the first, and between them
RELAY_LOG_EVERY = 10.0  # seconds between `relay_service` log lines (when the counters moved)


def _relay_of(addr: str) -> str:
    """The relay's peer id in a circuit address ``.../p2p/<relay>/p2p-circuit...``."""
    head = addr.split("/p2p-circuit", 1)[0]
    return head.rsplit("/p2p/", 1)[1] if "/p2p/" in head else "?"


def _is_public(addr: str) -> bool:
    import ipaddress

    m = re.match(r"/ip[46]/([^/]+)/", addr)
    try:
        return bool(m) and ipaddress.ip_address(m.group(1)).is_global
    except ValueError:
        return False


def _peer_bytes(peer: str) -> bytes:
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer).to_bytes()


def _peer_name(peer: bytes) -> str | None:
    from hivemind.p2p import PeerID

    try:
        return PeerID(peer).to_base58()
    except Exception:
        return None


def _log_task_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("repair on a new connection failed: %r", task.exception())


async def catch_up(
    reconnector: Reconnector,
    flood,
    others: list[str],
    stopping: Callable[[], bool],
    set_state: Callable[[str], None] = lambda state: None,
) -> int:
    """Before a node trains or serves joiners: if it knows others exist (`others`: peer
    ids from its ledger, book or bootstrap list), wait until at least one of them answered
    a full repair pass, dialling all the while. Logs why it waits every 10 s. Returns the
    rows fetched; 0 at once when `others` is empty (the first node of a run)."""
    from hivemind.p2p import PeerID

    if not others:
        return 0
    waited_since = time.monotonic()
    last_log: float | None = None
    while not stopping():
        # The reconnector's loop dials and keeps `connected`; all of them at once, so
        # a peer that is leaving (a 10 s call timeout) does not hold up the others.
        connected = sorted(reconnector.connected)
        results = await asyncio.gather(
            *(flood.sync_with(PeerID.from_base58(p)) for p in connected), return_exceptions=True
        )
        fetched, synced = 0, []
        for peer, result in zip(connected, results, strict=True):
            if isinstance(result, UserError):
                raise result  # our own ledger cannot be written: stop
            if isinstance(result, BaseException):
                if not isinstance(result, RemoteCallError):
                    log.warning("catch-up sync with %s failed: %r", peer, result)
                continue
            fetched += result
            synced.append(peer)
        if synced:
            log.info(
                "caught up with %d peer(s) (%s): fetched %d missing messages",
                len(synced),
                ", ".join(p[-8:] for p in synced),
                fetched,
                extra={"fields": {"event": "caught_up", "peers": len(synced), "count": fetched}},
            )
            return fetched
        tried = reconnector.candidates()
        reason = (
            f"waiting: this node knows {len(others)} other node(s) of the run "
            f"({', '.join(p[-8:] for p in others[:6])}) and has reached none of them "
            f"(dialled {len(tried)} known address set(s)); it does not train or serve joiners "
            "alone: start them, fix the network, or pass --allow-alone"
        )
        set_state(reason)
        now = time.monotonic()
        if now - waited_since >= 3 and (last_log is None or now - last_log >= 10):
            last_log = now
            log.warning(
                "%s (waiting %.0f s)",
                reason,
                now - waited_since,
                extra={"fields": {"event": "waiting", "known": len(others)}},
            )
        await asyncio.sleep(LOOP_TICK)
    return 0
