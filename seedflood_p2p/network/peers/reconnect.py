"""Finding the others again: the peer book, redialling with backoff, summaries, islands.

GossipSub and repair only reach peers this node has a connection to. A connection
lost in a partition, or a restart with the bootstrap node gone, is not re-made by
libp2p on its own: measured on main before this module, a 180 s partition never healed
(two ledgers for good), and a restarted peer with its bootstrap dead could not join.
So every node:

- keeps the peers it has met (`PeerBook`, peer_book.py: peer id -> the addresses it
  dials them at, DATA_DIR/peers.json, written atomically), learnt from summaries
  (below), and those it has only heard of (`Hints`);
- keeps links to `max_links` of the peers it knows (`choose_links`: its own stable
  choice, so the links form a random graph), redialling them and, while it has fewer
  connections than that, its bootstrap list, on a backoff schedule (redial_min doubling
  to redial_max, jittered) for as long as it runs, logging each failure with what it
  tried (`Reconnector.run`). A peer that fails to answer keeps being redialled, and the
  next peer in the order takes its place meanwhile. Not every peer: in a run of a
  thousand, a peer would dial, and run a repair pass with, every peer it hears of, and
  p2pd trims connections past 512 anyway. (What bounds the bytes each message costs a
  node is GossipSub's gossip factor: at N = 64-192 the DHTs' lookups connected most
  pairs whatever the reconnector dialled, bench/results/mesh.md);
- on every new connection, runs a repair pass with that peer at once, so a healed
  partition repairs by itself (the flood node's own anti-entropy would get there
  too, a random peer every few seconds);
- exchanges summaries (`SummaryExchange`, summaries.py: `seedflood.summary`,
  protocol/summary.py) with connected peers every summary_interval: their newest round,
  ledger size, newest bucket digests, own addresses and the peers they are connected to
  (with addresses: peer exchange, so a node learns of peers it never met and dials them);
- probes a peer's TCP addresses itself before each dial and asks the daemon to dial
  only once one answers (`tcp_answers`): libp2p's swarm backs off a
  peer's addresses after each failed dial (5 s + tries^2 s, up to 5 minutes) and p2pd's
  control protocol cannot clear that, so redialling through the daemon during a
  30-minute partition left every node in a 5-minute "dial backoff": measured, the
  first reconnection came ~3 minutes after the heal. Probed, the daemon's backoff never
  grows while the peer is away;
- says "partitioned" (`IslandWatch`, islands.py: log, /status, metrics) when peers it
  met in the last ISLAND_WINDOW seconds, or that its connected peers name, cannot be
  dialled for island_after seconds, or when a connected peer's settled ledger buckets
  differ from ours for island_after seconds (repair should have closed them);
- knows how each peer is reached, directly or through a relay, redials relayed-only
  peers for a hole punch, and how it is reached itself (`Links`, links.py).

A node cannot tell a partition from peers that stopped: the status says both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.tasks import BackgroundTasks
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.islands import ISLAND_WINDOW, IslandWatch
from seedflood_p2p.network.peers.links import Links
from seedflood_p2p.network.peers.peer_book import Hints, PeerBook, dialable, split_full_addr
from seedflood_p2p.network.peers.summaries import PROTOCOL as SUMMARY_PROTOCOL
from seedflood_p2p.network.peers.summaries import SummaryExchange
from seedflood_p2p.network.transport.p2pd import connect_peer, is_relayed, peer_connections
from seedflood_p2p.network.transport.rpc import RemoteCallError, serve_bytes
from seedflood_p2p.protocol.summary import Summary

log = logging.getLogger("seedflood.reconnect")

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


@dataclass
class Backoff:
    """When to dial a peer next: redial_min, doubling per failure up to redial_max."""

    failures: int = 0
    next_try: float = 0.0
    failing_since: float | None = None
    last_error: str = ""

    def failed(self, error: str, redial_min: float, redial_max: float) -> float:
        """Count a failed dial; the seconds until the next try (jittered by +-20%)."""
        self.failures += 1
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        delay = min(redial_max, redial_min * 2 ** (self.failures - 1))
        delay *= random.uniform(0.8, 1.2)
        self.next_try = now + delay
        self.last_error = error
        return delay


def choose_links(
    own_id: str,
    candidates: Iterable[str],
    connected: set[str],
    failing: set[str],
    bootstrap: Iterable[str],
    budget: int,
) -> list[str]:
    """The candidates this node dials and keeps a connection to: the first `budget` in its
    own order (a hash of both ids: stable across restarts, and a different order on every
    node, so the links form a random graph), where one that is `failing` (its last dial
    failed) is still included but leaves its place to the next; and the `bootstrap` peers
    while fewer than `budget` peers are connected (first contact, or cut off again).
    Connections others made to this node are kept whether chosen or not."""
    wanted = set(candidates)
    ranked = sorted(wanted, key=lambda p: hashlib.sha256(f"{own_id}/{p}".encode()).digest())
    chosen, places = [], budget
    for peer in ranked:
        if places <= 0:
            break
        chosen.append(peer)
        if peer in connected or peer not in failing:
            places -= 1
    if len(connected) < budget:
        chosen += [p for p in bootstrap if p in wanted and p not in chosen]
    return chosen


def run_founders(config: RunConfig) -> frozenset[str]:
    """The base58 ids of a run's founders (`extra.probation.founders` and its allow-list);
    empty for an open run without them."""
    import base58

    return frozenset(base58.b58encode(p).decode() for p in config.probation.founders)


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
        self.hints = Hints(self.own_id)  # heard of in summaries or records, not (yet) met
        self.backoff: dict[str, Backoff] = {}
        self.connected: set[str] = set()
        self.islands = IslandWatch(settings, metrics)
        self.links = Links(p2p, self.own_id, settings, metrics)
        self.exchange = SummaryExchange(
            p2p, self.book, self.hints, self.links, settings, lambda: self.connected, self.add_hints
        )
        self.flood = None
        self._on_connect: list[Callable[[str], None]] = []
        self._task: asyncio.Task | None = None
        self._repairs = BackgroundTasks()  # repair passes with new connections, not awaited
        self._dialling = asyncio.Lock()  # one dial pass at a time (the loop, first contact)
        self._last_summary = 0.0
        self._last_island_log = 0.0

    @property
    def summaries(self) -> dict[str, tuple[float, Summary]]:
        """Each connected peer's latest summary, with when it came (`SummaryExchange`)."""
        return self.exchange.summaries

    # -- candidates and dialling ---------------------------------------------------
    def candidates(self) -> dict[str, list[str]]:
        """Every peer to keep a connection to, with the addresses to dial it at."""
        out: dict[str, list[str]] = {}
        for source in (self.hints.addrs, {p: e["addrs"] for p, e in self.book.entries.items()}):
            for peer, addrs in source.items():
                out[peer] = addrs
        for peer, addrs in self.bootstrap.items():  # the operator's word comes first
            out[peer] = dialable([*addrs, *out.get(peer, [])], peer)
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
        self.links.track(connections)
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

    async def dial_due(self, force: bool = False) -> dict[str, str]:
        """Dial every chosen candidate (`chosen`) that is not connected and whose backoff
        has passed (all of them with `force`), at once. Returns {peer: error} of the dials
        that failed."""
        async with self._dialling:
            return await self._dial_due(force)

    def chosen(self, connected: set[str]) -> dict[str, list[str]]:
        """The candidates to keep a connection to (`choose_links`, `max_links` of them)."""
        candidates = self.candidates()
        failing = {p for p, state in self.backoff.items() if state.failures}
        chosen = choose_links(
            self.own_id, candidates, connected, failing, self.bootstrap, self.s.max_links
        )
        return {p: candidates[p] for p in chosen}

    async def _dial_due(self, force: bool) -> dict[str, str]:
        connected = await self.refresh_connected()
        now = time.monotonic()
        due = {
            p: a
            for p, a in self.chosen(connected).items()
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
            delay = state.failed(str(exc), self.s.redial_min, self.s.redial_max)
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
        self.flood = self.exchange.flood = flood
        self.hints.founders = run_founders(flood.config)
        await self.links.refresh_own_addrs()
        await serve_bytes(self.p2p, SUMMARY_PROTOCOL, self.exchange.serve)
        self._on_connect.append(self._repair_new_connection)
        self.start()

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
        self._repairs.cancel_all()
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
            await self.exchange.ask(peer)

        self._repairs.spawn(
            repair(), name=f"repair-on-connect:{peer[-8:]}", on_done=_log_task_failure
        )

    def add_hints(self, peers: dict[str, list[str]], source: str) -> None:
        """Peers heard of (base58 id -> addresses) from `source` ("summary": a connected
        peer's word; "dht": signed discovery records): dialled by the loop, forgotten when
        no source names them for ISLAND_WINDOW. A peer already in the book keeps its entry."""
        for evicted in self.hints.add(peers, source, self.book.entries, self.connected):
            self.backoff.pop(evicted, None)

    def _update_view(self) -> None:
        now = time.monotonic()
        # A peer no connected node has named for ISLAND_WINDOW is forgotten: it left.
        for peer in self.hints.forget_silent(now, ISLAND_WINDOW):
            self.backoff.pop(peer, None)
        failing_since = {peer: state.failing_since for peer, state in self.backoff.items()}
        unreachable = self.islands.unreachable(
            now, failing_since, self.connected, self.book.entries, self.hints.addrs
        )
        diverged = []
        if self.flood is not None:
            diverged = self.islands.diverged(now, self.flood.ledger, self.summaries, self.connected)
        known = set(self.book.entries) | set(self.hints.addrs) | set(self.bootstrap)
        self.islands.show(now, len(self.connected), len(known), unreachable, diverged)

    async def run(self) -> None:
        """The loop: dial what is due, exchange summaries, update the island view."""
        while True:
            try:
                await self.dial_due()
                if self.flood is not None:
                    now = time.monotonic()
                    if now - self._last_summary >= self.s.summary_interval:
                        self._last_summary = now
                        await self.links.refresh_own_addrs()
                        await self.links.retry_hole_punches(
                            lambda peer: self.candidates().get(peer, []), self.bootstrap
                        )
                        await self.links.refresh_relay_counters()
                        await asyncio.gather(
                            *(self.exchange.ask(p) for p in sorted(self.connected))
                        )
                    self._update_view()
                self.book.save()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must outlive any one bad pass
                log.warning("reconnect pass failed: %r", exc)
            await asyncio.sleep(LOOP_TICK)


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
        # The reconnector's loop dials and keeps `connected`. One at a time, until one
        # answers a whole pass: side by side each fetched (and checked) the whole history
        # again; one after another, a peer that is leaving holds the next up by one call
        # timeout (10 s), a slow one by its exchange's deadline (side by side, the slowest
        # held up the whole catch-up as long). Banned ones (here, or by the ledger's
        # verdicts: `flood.is_source`) are not asked: a 0 from an exchange that never
        # happened is no catch-up.
        connected = [
            p
            for p in sorted(reconnector.connected)
            if flood.is_source(PeerID.from_base58(p).to_bytes())
        ]
        for peer in connected:
            try:
                fetched = await flood.sync_with(PeerID.from_base58(peer))
            except UserError:
                raise  # our own ledger cannot be written: stop
            except RemoteCallError:
                continue
            except Exception as exc:  # whatever a peer sends, we go on with the others
                log.warning("catch-up sync with %s failed: %r", peer, exc)
                continue
            log.info(
                "caught up with %s: fetched %d missing messages",
                peer[-8:],
                fetched,
                extra={"fields": {"event": "caught_up", "peers": 1, "count": fetched}},
            )
            return fetched
        tried = reconnector.candidates()
        banned = len(reconnector.connected) - len(connected)
        reason = (
            f"waiting: this node knows {len(others)} other node(s) of the run "
            f"({', '.join(p[-8:] for p in others[:6])}) and has reached none of them "
            f"(dialled {len(tried)} known address set(s)"
            + (f"; {banned} reached but banned" if banned > 0 else "")
            + "); it does not train or serve joiners "
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
