"""A node's network settings (`NodeSettings`): the round window, repair pacing, NAT and
relay behaviour, redialling, summaries and discovery. Every field is a flag, a TOML key and
a `SEEDFLOOD_*` environment variable (core/flags.py); peers and the bootstrap node share
them. Not hashed into the run id: each node may choose its own. Frozen once loaded: a
change is a new NodeSettings (`dataclasses.replace`), so every reader sees the same one."""

from __future__ import annotations

from dataclasses import dataclass, field

from seedflood_p2p.core.flags import MAX_INT, MAX_SECONDS, bounded
from seedflood_p2p.network.transport.p2pd import RelayLimits
from seedflood_p2p.network.transport.p2pd_build import MeshSettings


@dataclass(frozen=True)
class NodeSettings:
    # round window: rounds past the reference round (protocol.update.WindowRule) and rounds
    # before it (gossip; repair relays older rows)
    max_ahead: int = bounded(10, 0, MAX_INT, "a number of rounds")
    max_behind: int = bounded(30, 0, MAX_INT, "a number of rounds")
    # seconds between anti-entropy exchanges
    repair_interval: float = bounded(3.0, 0, MAX_SECONDS, "seconds", open_low=True)
    call_timeout: float = bounded(10.0, 0, MAX_SECONDS, "seconds", open_low=True)
    # publishes are paced to this rate
    publish_rate: float = bounded(50.0, 0, 1e9, "messages per second", open_low=True)
    # Behind NAT: reserve a slot on a relay (the bootstrap nodes and `relays`, as p2pd's
    # static relays) once this node counts itself unreachable, and announce the relay address.
    auto_relay: bool = True
    relays: list[str] = field(default_factory=list)  # relays besides the bootstrap nodes
    # A ticketed run: revocations from its creator (`seedflood ticket revoke`, base58) this
    # node logs and hands on to the run (network/peers/tickets.py)
    revoke: list[str] = field(default_factory=list)
    nat_port_map: bool = False  # ask the home router for a port mapping (UPnP / NAT-PMP)
    # Reachability as auto-relay sees it: "auto" asks AutoNAT (other peers dial us back; it
    # needs public addresses on both sides), "private" skips the wait and reserves relay
    # slots at once (a peer that knows it is behind NAT), "public" never uses relays.
    reachability: str = field(default="auto", metadata={"choices": ("auto", "private", "public")})
    # Serve as a circuit relay for peers behind NAT: "auto" (the bootstrap node does, a peer
    # does not), "on" (a public peer opting in; implies reachability public), "off".
    relay_service: str = field(default="auto", metadata={"choices": ("auto", "on", "off")})
    # A relay's limits, per relayed connection: its lifetime and bytes per direction before
    # the relay resets it (the peers then redial), open circuits per peer, reservations.
    relay_time_limit: float = bounded(3600.0, 1, MAX_SECONDS, "seconds")
    relay_data_limit: int = bounded(1 << 32, 1 << 16, 1 << 50, "bytes")
    relay_max_circuits: int = bounded(16, 1, 1 << 16, "circuits per peer")
    relay_max_reservations: int = bounded(128, 1, 1 << 20, "reservations")

    def mesh(self) -> MeshSettings | None:
        """Our p2pd build's settings (None: the bundled p2pd as it is)."""
        if self.p2pd == "bundled":
            return None
        return MeshSettings(
            degree=self.gossip_degree,
            history=self.gossip_history,
            gossip_factor=self.gossip_factor,
            seen_ttl=self.seen_ttl,
            validation_queue=self.validation_queue,
            subscription_buffer=self.subscription_buffer,
            inbound_queue=self.inbound_queue,
            outbound_queue=self.outbound_queue,
        )

    def relay_limits(self, default_on: bool) -> RelayLimits | None:
        """The limits to serve a relay under, or None when this node serves none."""
        if self.relay_service == "off" or (self.relay_service == "auto" and not default_on):
            return None
        return RelayLimits(
            time_limit=self.relay_time_limit,
            data_limit=self.relay_data_limit,
            max_circuits=self.relay_max_circuits,
            max_reservations=self.relay_max_reservations,
        )

    # Which p2pd runs: "ours" is hivemind's unpacked and patched (network/transport/
    # p2pd_build.py): no second, unmetered relay, and the GossipSub settings below, which the
    # bundled binary has no flags for; "bundled" runs hivemind's as it is (and ignores them).
    p2pd: str = field(default="ours", metadata={"choices": ("ours", "bundled")})
    # GossipSub's mesh degree D (Dlo = D - 1, Dhi = 2D, Dlazy = D: the spec's ratios).
    # GossipSub's 6 made each message cost each node more bytes and p2pd CPU than 4 at
    # every N measured (32-192), with every message delivered under 5% loss at both
    # (bench/results/mesh*.md): a publisher floods its own message to every topic peer
    # it is connected to, so the mesh only carries it on to the rest
    gossip_degree: int = bounded(4, 3, 1000, "a number of peers")
    # heartbeats of message ids kept for IWANT; 3 of them are gossiped in IHAVE
    gossip_history: int = bounded(5, 3, 1000, "a number of heartbeats")
    # the share of a node's other topic peers (not in its mesh) each heartbeat's IHAVE
    # names recent message ids to, at least gossip_degree of them (0: gossip_degree, as
    # GossipSub v1.0 did). GossipSub's 0.25 made the bytes every message cost every node
    # grow with its connections, which the DHTs' lookups make to most peers of a run:
    # 4.5, 7.3, 9.5 KB at N = 64, 128, 192 against 3.4, 4.1, 4.0 KB at 0, every message
    # delivered at both (bench/results/mesh-gossip.md). A message gossip misses, repair
    # fetches (anti-entropy with a random connected peer every repair_interval).
    gossip_factor: float = bounded(0.0, 0.0, 1.0, "a share of peers")
    # how long a message id stays seen (a copy arriving later is a new message to GossipSub;
    # the ledger still refuses it as a duplicate)
    seen_ttl: float = bounded(120.0, 1, 86400, "seconds")
    # p2pd's queues, each dropping a message when full: signature checks waiting, messages
    # waiting for us to read them, RPCs from peers waiting, and messages waiting per peer.
    # GossipSub's 32 lost 1% of a daemon's updates at 2,000/s and 4% at 4,000/s while its
    # event loop was busy; 4096 lost none at either (bench/results/ingest-queues-*.md).
    validation_queue: int = bounded(4096, 1, 1 << 20, "a number of messages")
    subscription_buffer: int = bounded(4096, 1, 1 << 20, "a number of messages")
    inbound_queue: int = bounded(4096, 1, 1 << 20, "a number of RPCs")
    outbound_queue: int = bounded(4096, 1, 1 << 20, "a number of messages")
    # seconds for p2pd to start (slow disks, busy hosts)
    daemon_start_timeout: float = bounded(15.0, 0, MAX_SECONDS, "seconds", open_low=True)
    # an unreachable known peer is retried after redial_min s, doubling up to redial_max,
    # for as long as the node runs
    redial_min: float = bounded(1.0, 0, MAX_SECONDS, "seconds", open_low=True)
    redial_max: float = bounded(30.0, 0, MAX_SECONDS, "seconds", open_low=True)
    # peers this node dials and keeps a connection to (reconnect.choose_links), besides
    # those that dial it: not every peer it hears of, which in a large run meant a dial
    # and a repair pass per peer (the DHTs still connect most pairs at N <= 192, so the
    # gossip factor, not this, bounds a message's bytes: bench/results/mesh.md)
    max_links: int = bounded(16, 2, MAX_INT, "a number of peers")
    # seconds between summary exchanges with connected peers
    summary_interval: float = bounded(5.0, 0, MAX_SECONDS, "seconds", open_low=True)
    # unreachable or diverged this long: say "partitioned"
    island_after: float = bounded(30.0, 0, MAX_SECONDS, "seconds")
    allow_alone: bool = False  # start (train, serve joiners) although others are known
    # Signed discovery records in hivemind's DHT on our own daemon (network/peers/discovery.py):
    # the run's manifest, live peers and ledger summaries, written and read this often.
    discovery: bool = True
    discovery_interval: float = bounded(15.0, 0, MAX_SECONDS, "seconds", open_low=True)
