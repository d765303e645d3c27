"""How this node and its peers are reached: directly, or only through a circuit relay.

A peer behind NAT is reached through its reservation on a relay; go-libp2p may then
upgrade such a connection by a hole punch (DCUtR). `Links` keeps, for the reconnect loop
(`reconnect.py`): how each connected peer is reached and through which relay, the hole
punches seen, redials that give a hole punch another try, the relay service this node
gives others, and this node's own addresses (its NAT status)."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Container

from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.peer_book import dialable
from seedflood_p2p.network.transport.p2pd import connect_peer, is_relayed, relay_counters

log = logging.getLogger("seedflood.reconnect")

HOLE_PUNCH_TRIES = 3  # redials of a relayed-only peer for a hole punch (retry_hole_punches)
HOLE_PUNCH_EVERY = 20.0  # seconds relayed-only before the first, and between them
RELAY_LOG_EVERY = 10.0  # seconds between `relay_service` log lines (when the counters moved)


class Links:
    """How each connected peer is reached, and how this node is."""

    def __init__(self, p2p, own_id: str, settings, metrics: NodeMetrics) -> None:
        self.p2p = p2p
        self.own_id = own_id
        self.s = settings
        self.metrics = metrics
        self.own_addrs: list[str] = []
        self.kind: dict[str, str] = {}  # connected peer -> "direct" or "relayed"
        self.relayed_via: dict[str, str] = {}  # relayed-only peer -> the relay's id
        self.hole_punches = 0
        self.relay_service: dict[str, int] | None = None
        self._logged_relay: dict[str, int] | None = None
        self._last_relay_log = -math.inf
        # relayed-only peer -> (monotonic time first seen relayed-only, redials made)
        self._relayed_since: dict[str, tuple[float, int]] = {}
        self._relayed_addr: dict[str, str] = {}  # relayed-only peer -> its circuit address

    def track(self, connections: dict[str, list[str]]) -> None:
        """How each connected peer is reached: "direct", or "relayed" (only through a circuit
        relay, named in `relayed_via`). A peer that was relayed-only and now also has a
        direct connection was hole-punched (DCUtR) or became directly dialable: logged as
        `hole_punched` and counted."""
        reached: dict[str, str] = {}
        for peer, addrs in connections.items():
            relayed = bool(addrs) and all(is_relayed(a) for a in addrs)
            reached[peer] = "relayed" if relayed else "direct"
            if relayed:
                self.relayed_via[peer] = _relay_of(addrs[0])
                self._relayed_addr[peer] = addrs[0].split("/p2p-circuit")[0] + "/p2p-circuit"
            elif self.kind.get(peer) == "relayed":
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
        for peer in [p for p in self.relayed_via if reached.get(p) != "relayed"]:
            del self.relayed_via[peer]
            self._relayed_addr.pop(peer, None)  # kept for a relayed-only peer's redial only
        self.kind = reached
        for kind in ("direct", "relayed"):
            self.metrics.links.labels(kind).set(sum(1 for k in reached.values() if k == kind))

    async def retry_hole_punches(
        self, addrs_of: Callable[[str], list[str]], bootstrap: Container[str]
    ) -> None:
        """Redial, through its relay, a peer reached only through a relay for a while, so
        that a hole punch is tried again. go-libp2p tries DCUtR once, when an inbound relayed
        connection opens, and only once its hole-punch service runs (after the node has seen
        its own public address from 4 peers): a relayed connection made earlier is never
        upgraded. The side with the smaller peer id closes it and dials the same circuit
        address; the other side then punches. At most HOLE_PUNCH_TRIES times per peer,
        HOLE_PUNCH_EVERY seconds apart; gossip resumes on the new connection and repair
        fetches what was missed. `addrs_of(peer)`: the addresses known for a peer;
        peers of the `bootstrap` list are left alone."""
        from hivemind.p2p import PeerID

        now = time.monotonic()
        for peer in [p for p in self._relayed_since if self.kind.get(p) != "relayed"]:
            del self._relayed_since[peer]
        for peer, kind in sorted(self.kind.items()):
            if kind != "relayed" or peer in bootstrap:
                continue
            since, tries = self._relayed_since.setdefault(peer, (now, 0))
            if self.own_id > peer or tries >= HOLE_PUNCH_TRIES:
                continue
            if now - since < HOLE_PUNCH_EVERY * (tries + 1):
                continue
            self._relayed_since[peer] = (since, tries + 1)
            via = self.relayed_via.get(peer)
            known = addrs_of(peer)
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

    async def refresh_relay_counters(self) -> None:
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

    async def refresh_own_addrs(self) -> None:
        """Our addresses as the daemon announces them. Re-read every summary pass: behind
        NAT, a relay address appears only once AutoNAT says "private" and auto-relay has a
        reservation, tens of seconds after start."""
        try:
            visible = await self.p2p.get_visible_maddrs(latest=True)
            addrs = dialable((str(a) for a in visible), self.own_id)
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
            "direct_peers": sum(1 for k in self.kind.values() if k == "direct"),
            "relayed_peers": sum(1 for k in self.kind.values() if k == "relayed"),
            "relayed_via": dict(sorted(self.relayed_via.items())),
            "hole_punches": self.hole_punches,
            "relay_service": self.relay_service,  # what we relay for others, if we serve
        }


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
