"""One network host: p2pd, the flood node, reconnection, discovery and the status server.

The one composition root of the network side, used by the peer daemon, the bootstrap
node and the benchmarks. Started in this order, shut down in the reverse:

    async with NetworkHost(settings, metrics) as host:   # p2pd, reconnector, DHT node
        await host.serve_status(status, ...)            # when the caller wants it
        node = host.flood_node(ledger, config, on_accept=..., on_audit_records=...)
        await host.start_node(round_of, services=...)   # flood, services, reconnection,
                                                         # repair on connect, discovery loop
        await host.catch_up(host.known_others(ledger), stopping, set_state)
    # on exit: background tasks, status server, discovery, reconnector, flood node,
    # services, p2pd

The node's callbacks are given once, when it is built (`flood_node`): nothing is
rewired afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.monitoring.metrics import HttpEndpoint, NodeMetrics, serve_http
from seedflood_p2p.network.peers.discovery import Discovery, run_discovery
from seedflood_p2p.network.peers.reconnect import Reconnector, catch_up
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.network.transport.p2pd import create_p2p, remove_stale_sockets
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.host")


@dataclass
class HostSettings:
    """Where a node listens and what it runs besides its flood node."""

    node: NodeSettings = field(default_factory=NodeSettings)
    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce: list[str] = field(default_factory=list)
    # dialled by the reconnector with backoff, never handed to p2pd (it would give up)
    bootstrap: list[str] = field(default_factory=list)
    # handed to p2pd at start, which fails when none answers (benchmarks)
    initial_peers: list[str] = field(default_factory=list)
    # identity.key, peers.json and status_port live here; None: a fresh identity each
    # start, and neither reconnection nor discovery (both need the data dir)
    data_dir: Path | None = None
    serve_relay: bool = False  # relay_service "auto" means on (the bootstrap node)
    remove_stale_sockets: bool = False  # delete control sockets of killed daemons first


class Service(Protocol):
    """Something served on the node's daemon (e.g. network/transfer/checkpoints.py's server)."""

    async def start(self) -> None: ...

    def close(self) -> None: ...


class NetworkHost:
    """p2pd and what runs on it, as one async context manager (see the module docstring)."""

    def __init__(self, settings: HostSettings, metrics: NodeMetrics | None = None) -> None:
        self.s = settings
        self.metrics = metrics if metrics is not None else NodeMetrics()
        self.p2p: Any = None
        self.reconnector: Reconnector | None = None
        self.discovery: Discovery | None = None
        self.node: FloodNode | None = None
        self.http: HttpEndpoint | None = None
        self._services: list[Service] = []
        self._discovering: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def peer_id(self) -> bytes:
        return self.p2p.peer_id.to_bytes()

    # -- start -----------------------------------------------------------------------
    async def __aenter__(self) -> NetworkHost:
        s, n = self.s, self.s.node
        if s.remove_stale_sockets and (stale := remove_stale_sockets()):
            log.info("removed %d stale p2pd control socket(s) of killed daemons", len(stale))
        identity = None if s.data_dir is None else s.data_dir / "identity.key"
        # No initial peers for a daemon with a bootstrap list: it would give up at once when
        # they are down. The reconnector dials the bootstrap list and the peer book itself.
        self.p2p = await create_p2p(
            identity_path=identity,
            host_maddrs=s.listen,
            initial_peers=s.initial_peers,
            announce_maddrs=s.announce or None,
            use_auto_relay=n.auto_relay,
            reachability=n.reachability,
            relays=n.relays,
            relay_service=n.relay_limits(default_on=s.serve_relay),
            nat_port_map=n.nat_port_map,
            startup_timeout=n.daemon_start_timeout,
            bootstrap_addrs=s.bootstrap,
            mesh=n.mesh(),
        )
        try:
            if s.data_dir is not None:
                self.reconnector = Reconnector(self.p2p, s.data_dir, s.bootstrap, n, self.metrics)
                if n.discovery:
                    self.discovery = Discovery(self.p2p, identity, self.metrics)
                    await self.discovery.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def serve_status(
        self,
        host: str,
        port: int,
        status: Callable[[], dict],
        finish_after: Callable[[int], dict] | None = None,
        routes: Callable[[Any], None] | None = None,
    ) -> int:
        """Serve /metrics, /status (and `routes`) on host:port (0: any free port); the port
        is written to DATA_DIR/status_port for scripts. Returns the port."""
        self.http = await serve_http(host, port, self.metrics, status, finish_after, routes)
        if self.s.data_dir is not None:
            (self.s.data_dir / "status_port").write_text(str(self.http.port))
        return self.http.port

    def flood_node(
        self,
        ledger: Ledger,
        config: RunConfig,
        on_accept: Callable[[list[UpdateMessage]], None] = lambda messages: None,
        on_audit_records: Callable[[list[AuditRecord]], Awaitable[None]] | None = None,
        hears: Callable[[], bool] = lambda: True,
        avoids: Callable[[bytes], bool] = lambda peer: False,
    ) -> FloodNode:
        """The run's flood node on this daemon, built (not started) with its callbacks:
        every admitted update goes to `on_accept`, new audit records to `on_audit_records`;
        gossip from others is taken in when `hears()` says so (always, for an honest peer);
        peers `avoids` names (banned by the ledger's verdicts) are never asked for repair."""
        assert self.node is None, "one flood node per host"
        self.node = FloodNode(
            self.p2p,
            ledger,
            config,
            self.metrics,
            self.s.node,
            on_accept=on_accept,
            on_audit_records=on_audit_records,
            hears=hears,
            avoids=avoids,
        )
        return self.node

    async def start_node(
        self,
        round_of: Callable[[], int] | None = None,
        services: Sequence[Service] = (),
    ) -> None:
        """Start the flood node, then `services` (on its daemon), then reconnection with
        repair on every new connection, then the discovery loop (our round: `round_of`,
        default the newest round in the ledger)."""
        node = self.node
        assert node is not None, "flood_node first"
        await node.start()
        for service in services:
            await service.start()
            self._services.append(service)
        if self.reconnector is not None:
            await self.reconnector.attach(node)
        if self.discovery is not None:
            self._discovering = asyncio.create_task(
                run_discovery(
                    self.discovery,
                    self.reconnector,
                    node,
                    round_of or (lambda: node.newest_round),
                    self.s.node.discovery_interval,
                ),
                name="discovery",
            )

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        """A background task of the caller's, cancelled first at shutdown."""
        task = asyncio.create_task(coro, name=name)
        # (one a chain link, and on; a task that failed stays, for the shutdown's gather)
        self._tasks = [t for t in self._tasks if not t.done() or _failed(t)]
        self._tasks.append(task)
        return task

    # -- catching up -------------------------------------------------------------------
    def known_others(self, ledger: Ledger) -> list[str]:
        """Other nodes this one knows the run has: its ledger's peers, its peer book and
        bootstrap list (base58 ids)."""
        import base58

        own = self.peer_id
        found = {base58.b58encode(p).decode() for p in ledger.peers() if p != own}
        if self.reconnector is not None:
            found |= set(self.reconnector.others_known())
        return sorted(found)

    async def catch_up(
        self,
        others: list[str],
        stopping: Callable[[], bool],
        set_state: Callable[[str], None] = lambda state: None,
    ) -> int:
        """Wait until one of `others` answered a full repair pass (network/peers/reconnect.py:
        catch_up); 0 at once when there are none. Rows fetched."""
        assert self.node is not None and self.reconnector is not None
        return await catch_up(self.reconnector, self.node, others, stopping, set_state)

    def refuses(self, peer: bytes) -> str | None:
        """Why we do not talk to `peer` (banned, outside a closed run); None before the
        flood node exists."""
        return None if self.node is None else self.node.refuses(peer)

    # -- stop ------------------------------------------------------------------------
    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Shut down in order: the caller's tasks, the status server, discovery,
        reconnection, the flood node, the services, p2pd. One log line says what each
        step took, so a slow exit names its step."""
        took: dict[str, float] = {}

        async def step(name: str, done: Awaitable[Any]) -> None:
            started = time.monotonic()
            await done
            took[name] = time.monotonic() - started

        for task in self._tasks:
            task.cancel()
        await step("tasks", asyncio.gather(*self._tasks, return_exceptions=True))
        self._tasks.clear()
        if self.http is not None:
            await step("status server", self.http.close())
            self.http = None
        if self.discovery is not None:
            await step("discovery", self.discovery.stop(self._discovering))
        if self.reconnector is not None:
            await step("reconnection", self.reconnector.stop())
        if self.node is not None:
            await step("flood node", self.node.stop())
        for service in self._services:
            service.close()
        self._services.clear()
        if self.p2p is not None:
            await step("p2pd", self.p2p.shutdown())
        log.info(
            "stopped in %.1f s (%s)",
            sum(took.values()),
            ", ".join(f"{name} {seconds:.1f} s" for name, seconds in took.items()),
            extra={"fields": {"event": "stopped", **{k: round(v, 3) for k, v in took.items()}}},
        )


def _failed(task: asyncio.Task) -> bool:
    """Did a finished task end with an exception (not read here)?"""
    return not task.cancelled() and task.exception() is not None
