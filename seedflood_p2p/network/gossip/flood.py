"""The network side of a participant: gossip in and out, through admission. No model here.

Data flows one way: every update, from gossip, repair or our own publish, goes
through admission (`network/gossip/admission.py`: decode, validate, policy, ledger),
then is handed to `on_accept` (the peer applies it to its model). Lost gossip is
repaired by anti-entropy (`network/gossip/repair.py`, one `Repair` per node over its update
table and, in a run with audits, its audit table): every few seconds the node compares
per-bucket digests with a random peer and fetches the buckets that differ, so every
ledger converges even when GossipSub drops messages. Peers and the bootstrap node both
run a FloodNode; the bootstrap just never trains.

Request/response protocols (msgpack over the same libp2p daemon):

    seedflood.manifest  b""                     -> run manifest JSON + version + clock
                                                   (or {"not_ready": why, "run_id"} while
                                                    syncing)
    seedflood.digest, seedflood.fetch           update repair (network/gossip/repair.py)
    seedflood.audit_digest, seedflood.audit_fetch   audit repair (runs with audits)
    seedflood.tickets   [run, [peer id]]        -> their join tickets (network/peers/tickets.py)

A run with audits (the manifest's `extra.audit`) has a second topic for audit records
(`network/gossip/audit_intake.py:AuditIntake` admits them, from gossip and from repair).

Against hostile peers (protocol/ states the rules, network/gossip/repair.py the repair
bounds, network/peers/reputation.py the scores): gossip passes admission's window, rate and
sender rules; banned peers' gossip is dropped and they are disconnected through the
daemon; banned and (in a closed run) unlisted peers get empty answers, and each requester
is served at most SERVE_BYTES_RATE bytes a second (`may_serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgpack

from seedflood_p2p import __version__
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.tasks import BackgroundTasks
from seedflood_p2p.network.gossip.admission import Admission, Outcome, Verdict
from seedflood_p2p.network.gossip.audit_intake import AuditIntake
from seedflood_p2p.network.gossip.peer_table import PeerTable
from seedflood_p2p.network.gossip.repair import (
    MAX_SYNC_PASSES,
    AuditTable,
    Prechecked,
    Repair,
    RepairTable,
    SourceCheck,
    UpdateTable,
)
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.reputation import PeerBuckets, Reputation, short_id
from seedflood_p2p.network.peers.tickets import (
    Revocation,
    TicketBook,
    TicketExchange,
    check_revocation,
    decode_revocation,
)
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.network.transport.pubsub import PubSubClient
from seedflood_p2p.network.transport.rpc import serve_bytes
from seedflood_p2p.network.transport.sigcheck import SignaturePool
from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
from seedflood_p2p.protocol.framing import topic_for
from seedflood_p2p.protocol.message import AuditRecord, Envelope, UpdateMessage
from seedflood_p2p.protocol.repair import SERVE_BYTES_BURST, SERVE_BYTES_RATE
from seedflood_p2p.protocol.update import encode_update
from seedflood_p2p.storage.bans import BanStore
from seedflood_p2p.storage.ledger import Ledger, peer_name

log = logging.getLogger("seedflood.node")

GOSSIP_BATCH = 256  # most gossip messages committed in one ledger transaction
# Seconds a gossip batch that found the queue empty may wait, from its first arrival, for
# more before its transaction: one commit (one fsync, ~300 us CPU and 6-9 ms wall) then
# serves every update of those ms instead of one or two (bench/results/ingest.md).
GOSSIP_COALESCE = 0.002
LIVE_ROUNDS = 8  # a repaired update this close to our newest round shows its sender alive
FORGET_AFTER = 3600.0  # seconds without gossip before a peer leaves the `peers` table
STOP_SECONDS = 10.0  # a cancelled task still running after this is left behind by `stop`


class FloodNode:
    coalesce = GOSSIP_COALESCE  # group commit window of gossip batches (0: none)

    def __init__(
        self,
        p2p,
        ledger: Ledger,
        config: RunConfig,
        metrics: NodeMetrics,
        settings: NodeSettings,
        on_accept: Callable[[list[UpdateMessage]], None] = lambda msgs: None,
        on_audit_records: Callable[[list[AuditRecord]], Awaitable[None]] | None = None,
        hears: Callable[[], bool] = lambda: True,
        avoids: Callable[[bytes], bool] = lambda peer: False,
    ) -> None:
        self.p2p = p2p
        self.ledger = ledger
        self.run_id = ledger.run_id
        self.topic = topic_for(self.run_id)
        self.config = config  # the run's settings, parsed once by the caller
        self.manifest_json = config.to_json()  # what this node serves as the run manifest
        self.directions = config.directions  # scalars per update
        self.metrics = metrics
        self.settings = settings
        self.on_accept = on_accept
        # whether to take in the next gossip message from another peer (the peer's
        # Behaviour: always, but for a test's peer that loses some; peer/behaviour.py)
        self.hears = hears
        # Peers its owner judged out (the peer daemon: banned by the ledger's audit
        # verdicts): never asked for repair, like banned ones. Scheduling only: their rows
        # still pass admission (relayed by others), so honest ledgers stay identical.
        self.avoids = avoids
        self.peer_id = p2p.peer_id.to_bytes()
        # Commits never wait on the disk here: a sync thread fsyncs the ledger's WAL behind
        # them (storage/ledger.py, issue 46); what must be on disk before it leaves this
        # node, our own signed rows, is flushed before it is published (`publish`).
        ledger.sync_in_background()
        # Bans live beside the ledger file (in memory for an in-memory ledger).
        on_disk = ledger.path is not None and str(ledger.path) != ":memory:"
        self.bans = BanStore(Path(ledger.path).parent / "bans.sqlite" if on_disk else None)
        self.reputation = Reputation(self.bans, metrics.count_ban, on_ban=self._disconnect)
        # A ticketed run: which authors' rows count, and the exchange that finds tickets
        self.tickets = TicketBook(config) if config.join.creator is not None else None
        # Repair pages' signatures, checked in bulk in worker processes (started on the
        # first large page: a late join, a healed partition) before admission asks.
        self.prechecked = Prechecked(SignaturePool())
        self.admission = Admission(
            ledger,
            self.directions,
            self.peer_id,
            metrics,
            settings.max_ahead,
            deliver=lambda messages: self.on_accept(messages),  # on_accept may be replaced
            max_behind=settings.max_behind,
            reputation=self.reputation,
            allowed=config.allowed_peer_ids(),
            tickets=self.tickets,
            work=config.identity_work,
            verify=self.prechecked.verify,
        )
        self.ticket_exchange = (
            None
            if self.tickets is None
            else TicketExchange(
                p2p, self.run_id, self.tickets, lambda: self.connected_peers(), self._revoked
            )
        )
        # Called after new ticket revocations reach the ledger (the peer daemon judges it
        # again: the holder's updates from the revoked round on stop counting).
        self.on_revocations: Callable[[], Awaitable[None]] | None = None
        # Audit records, in a run whose manifest has them: gossip on their own
        # topic and repair, through the same sender rules. New records go to
        # `on_audit_records` (the peer daemon judges them; the bootstrap keeps and serves).
        with_audits = config.audit.enabled
        self.audits = AuditIntake(ledger, self.directions, self.admission) if with_audits else None
        self.on_audit_records = on_audit_records
        self._served_bytes = PeerBuckets(SERVE_BYTES_RATE, SERVE_BYTES_BURST)
        # Anti-entropy repair of the ledger's updates and (with audits) audit records.
        tables: list[RepairTable] = [
            UpdateTable(
                ledger,
                self.admission,
                metrics,
                lambda v: self._track(v, heard=False),
                self.prechecked,
            )
        ]
        if self.audits is not None:
            tables.append(AuditTable(ledger, self.audits, self._new_audit_records))
        self.repair = Repair(
            p2p,
            self.run_id,
            tables,
            self.admission,
            metrics,
            settings,
            may_serve=self.may_serve,
            refuses=self.refuses,
            peers=lambda: self.connected_peers(),  # late-bound: tools replace it
            avoids=lambda peer: self.avoids(peer),
            syncing=lambda: self.not_ready is not None,
        )
        self.peers = PeerTable()  # training peers, from their updates
        self._pubsub = PubSubClient(p2p, max_rate=settings.publish_rate, burst=10)
        self._tasks: list[asyncio.Task] = []
        self._background = BackgroundTasks()  # started and not awaited: disconnects of bans
        self.last_accept = time.monotonic()
        self.fatal: Exception | None = None  # e.g. disk full: the owner must stop
        self._not_ready: str | None = None

    @property
    def not_ready(self) -> str | None:
        """Why joiners are not served the manifest yet (None: they are): a node that knows
        others exist syncs with them first, so a joiner never starts from its stale copy.
        While it is set, gossip ahead of our window is our lag (`Admission.catching_up`)."""
        return self._not_ready

    @not_ready.setter
    def not_ready(self, why: str | None) -> None:
        self._not_ready = why
        self.admission.catching_up = why is not None

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        await serve_bytes(self.p2p, "seedflood.manifest", self._serve_manifest)
        await self.repair.start()  # every table's digest and fetch requests
        if self.settings.revoke and self.tickets is None:
            raise UserError("--revoke: this run is not ticketed, it has no tickets to revoke")
        if self.ticket_exchange is not None:
            await self._load_revocations()
            await self.ticket_exchange.start()
            # cancelled with the node's other tasks
            self._tasks.append(asyncio.create_task(self.ticket_exchange.run(), name="tickets"))
        # Our own messages come back too: their signed envelopes make them repairable.
        subscription = await self._pubsub.subscribe(self.topic, include_own=True)
        self._tasks.append(asyncio.create_task(self._receive(subscription), name="receive"))
        if self.audits is not None:
            # Our own records come back too: signed, they become repairable (AuditIntake).
            await self.serve_topic(
                audit_topic_for(self.run_id), self._admit_audit_gossip, include_own=True
            )
        self._tasks.append(asyncio.create_task(self._anti_entropy(), name="anti-entropy"))
        self.metrics.ledger_size.set(len(self.ledger))

    async def _load_revocations(self) -> None:
        """The ledger's revocations into the ticket book (a restart), then those handed to
        this node (`--revoke`); a bad one handed in stops the node with one line."""
        for _, _, data in self.ledger.revocations():
            self.tickets.revoke(decode_revocation(data))  # checked before they were logged
        handed = []
        for text in self.settings.revoke:
            revocation = decode_revocation(text)
            problem = check_revocation(revocation, self.config, self.tickets.creator)
            if problem is not None:
                raise UserError(f"--revoke is not a revocation of this run's creator: {problem}")
            handed.append(revocation.encode())
        await self.ticket_exchange.take_revocations(handed)

    async def _revoked(self, new: list[Revocation]) -> None:
        """New valid revocations: into the ledger (replay and late joiners see them), then
        the owner's judgement (`on_revocations`)."""
        self.ledger.add_revocations((r.peer, r.round, r.encode()) for r in new)
        ahead = self.admission.reference_round() + self.config.audit.lag + 1
        for r in new:
            fields = {"event": "revocation_logged", "peer": peer_name(r.peer), "round": r.round}
            log.info(
                "ticket revocation logged: peer %s's updates of rounds >= %d do not count",
                peer_name(r.peer),
                r.round,
                extra={"fields": fields},
            )
            if r.round <= ahead:
                log.warning(
                    "ticket revocation of peer %s from round %d is not ahead of the run "
                    "(round %d here): peers that trained past it before it reached them "
                    "held its rows (late rows for their audits); name a later round",
                    peer_name(r.peer),
                    r.round,
                    self.admission.reference_round(),
                    extra={"fields": {**fields, "event": "revocation_not_ahead"}},
                )
        if self.on_revocations is not None:
            await self.on_revocations()

    async def stop(self) -> None:
        """Cancel the node's tasks and close its pubsub client. A task that does not end
        within STOP_SECONDS of its cancellation is named in a warning and left behind:
        stopping (and the checkpoint after it) must not wait on one stuck call."""
        self._background.cancel_all()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            done, stuck = await asyncio.wait(self._tasks, timeout=STOP_SECONDS)
            for task in done:  # retrieved, so asyncio does not report them at exit
                if not task.cancelled():
                    task.exception()
            for task in stuck:
                log.warning(
                    "task %s did not stop within %.0f s of its cancellation; left behind",
                    task.get_name(),
                    STOP_SECONDS,
                    extra={"fields": {"event": "stuck_task", "task": task.get_name()}},
                )
        await self._pubsub.close()
        self.bans.close()
        self.prechecked.close()

    def _disconnect(self, peer: bytes) -> None:
        """A banned peer: close its connection through the daemon (it may dial again; its
        streams are then refused and its gossip dropped, see network/peers/reputation.py)."""
        from hivemind.p2p import PeerID

        async def disconnect() -> None:
            try:
                await self.p2p._client.disconnect(PeerID(peer))
            except Exception as exc:  # already gone, or the daemon is stopping
                log.debug("disconnecting %s failed: %r", short_id(peer), exc)

        with contextlib.suppress(RuntimeError):  # no running loop (tools, tests)
            self._background.spawn(disconnect(), name=f"disconnect:{short_id(peer)}")

    def is_source(self, peer: bytes) -> bool:
        """May `peer` be asked for repair: not banned here (reputation), not judged out by
        the owner (`avoids`), not outside a closed run?"""
        return self.refuses(peer) is None and not self.avoids(peer)

    def disconnect(self, peer: bytes) -> None:
        """Close `peer`'s connection through the daemon (it may dial again), without
        banning it here: the owner's judgement of it (a ledger verdict) is not a local
        ban, whose admission would drop its gossip."""
        self._disconnect(peer)

    def refuses(self, peer: bytes) -> str | None:
        """Why we do not talk to `peer` (banned, or outside a closed run), or None."""
        if self.reputation.is_banned(peer):
            return "banned"
        if self.admission.allowed is not None and peer not in self.admission.allowed:
            return "not_allowed"
        return None

    # -- admission: every update in, see network/gossip/admission.py ----------------------
    @property
    def newest_round(self) -> int:
        return self.admission.newest_round

    def _track(self, verdicts: list[Verdict], heard: bool) -> None:
        """Track each peer's progress from the updates that changed our ledger, and when
        each was last alive. Gossip (`heard`) shows a peer is alive. So does a repaired
        update of a recent round (within LIVE_ROUNDS of our newest) once this node is in
        step with the run (`not_ready` is None): after a partition heals or a restart,
        the other side's peers reach us by repair first, and the staleness bound must
        wait for them rather than run ahead of peers it has not heard. Repaired history
        of a peer that left is old, so it never makes us wait."""
        now = time.monotonic()
        in_step = self.not_ready is None
        for verdict in verdicts:
            if not verdict.changed_ledger:
                continue
            message = verdict.message
            self.last_accept = now
            if message.peer != self.peer_id:
                recent = message.round >= self.newest_round - LIVE_ROUNDS
                alive = heard or (in_step and recent)
                self.peers.heard(message.peer, message.round, now if alive else None)

    def _forget_silent_peers(self) -> None:
        """Peers not heard by gossip for FORGET_AFTER seconds leave the table: it would
        otherwise grow with every identity that ever sent an update."""
        cutoff = time.monotonic() - FORGET_AFTER
        for peer in [p for p, state in self.peers.items() if state.last_seen < cutoff]:
            self.peers.forget(peer)

    # -- gossip -----------------------------------------------------------
    async def publish(self, message: UpdateMessage, held: int | None = None) -> None:
        """Admit our own update (logged, handed to `on_accept` like anyone's), then flood
        it, with `held` (the digest of the state it was trained on, for its auditors). Its
        echo from the daemon attaches the signed envelope to our row."""
        verdict = self.admission.own(message)
        self._track([verdict], heard=True)
        if verdict.outcome is not Outcome.ACCEPTED:
            # Signing a second update for a round would make this peer an equivocator.
            raise UserError(
                f"this peer's ledger already holds an update of its own for round "
                f"{message.round} ({verdict.reason}): is another process running with the "
                "same identity.key?"
            )
        data = encode_update(self.run_id, message.round, message.scalars, held)
        # On disk before anyone can see it: a power loss after publishing must not let the
        # restarted peer sign another update for this round (an equivocation).
        await self.ledger.flush_async()
        await self._pubsub.publish(self.topic, data)
        self.metrics.published.inc()
        self.metrics.bytes_out.inc(len(data))

    async def publish_on(self, topic: str, data: bytes) -> None:
        """Publish `data` on another topic of the run (the audit topic), once what the
        ledger logged (our record) is on disk."""
        await self.ledger.flush_async()
        await self._pubsub.publish(topic, data)
        self.metrics.bytes_out.inc(len(data))

    async def serve_topic(
        self,
        topic: str,
        admit: Callable[[list[tuple[bytes, Envelope]]], Awaitable[None]],
        include_own: bool = False,
    ) -> None:
        """Subscribe to another topic of the run; arrivals go to `admit` in batches, each
        (signer, envelope). `admit` must count and drop bad payloads, never raise."""
        subscription = await self._pubsub.subscribe(topic, include_own=include_own)

        async def receive() -> None:
            batch: list[tuple[bytes, Envelope]] = []
            async for item in subscription:
                self.metrics.bytes_in.inc(len(item.data))
                if self.reputation.is_banned(item.sender):
                    continue
                batch.append((item.sender, Envelope(item.data, item.seqno_bytes, item.signature)))
                if subscription.pending == 0 or len(batch) >= GOSSIP_BATCH:
                    try:
                        await admit(batch)
                    except Exception:  # never let one batch stop the receiver
                        log.exception("records on %s failed to be admitted", topic)
                    batch = []

        self._tasks.append(asyncio.create_task(receive(), name=f"receive {topic}"))

    async def _admit_audit_gossip(self, arrivals: list[tuple[bytes, Envelope]]) -> None:
        fresh = self.audits.admit(arrivals)
        if fresh:
            await self._new_audit_records(fresh)

    async def _new_audit_records(self, fresh: list[AuditRecord]) -> None:
        if self.on_audit_records is not None:
            await self.on_audit_records(fresh)

    async def republish_unsigned(self) -> int:
        """Publish our own updates that were logged but never came back signed (killed
        between logging and publishing, or the echo was lost): without a signed envelope no
        other peer can fetch them, and our ledger would differ from everyone's for good.
        Their echo attaches the envelope. Returns how many were published again."""
        missing = self.ledger.unsigned(self.peer_id)
        if missing:
            await self.ledger.flush_async()
        for message in missing:
            data = encode_update(self.run_id, message.round, message.scalars)
            await self._pubsub.publish(self.topic, data)
            self.metrics.bytes_out.inc(len(data))
        records = self.ledger.unsigned_audits(self.peer_id) if self.audits is not None else []
        for record in records:  # our audit records likewise (their echo signs them)
            data = encode_audit(
                self.run_id, record.accused, record.round, record.scalars, record.at
            )
            await self.publish_on(audit_topic_for(self.run_id), data)
        return len(missing) + len(records)

    async def _receive(self, subscription) -> None:
        try:
            await self._receive_loop(subscription)
        except UserError as exc:  # the ledger cannot be written: nothing may be applied
            self.fatal = exc
            log.error("%s", exc)
        except Exception as exc:  # a deaf peer must stop, not train on alone
            self.fatal = UserError(f"the gossip receiver failed ({exc!r}): restart the peer")
            log.exception("gossip receiver failed")

    async def _receive_loop(self, subscription) -> None:
        """Admit gossip in groups: whatever has arrived by the time the queue is empty goes
        into one ledger transaction (one fsync), not one commit per message. Group commit:
        a batch that finds the queue empty first waits until `coalesce` s after its first
        arrival for more. The wait comes before the transaction: nothing is logged, handed
        on or applied before its commit, as without it. The commit's fsync is not waited
        for here: the ledger's sync thread makes it (`Ledger.sync_in_background`)."""
        batch: list[tuple[bytes, Envelope]] = []
        first = 0.0
        async for item in subscription:
            self.metrics.bytes_in.inc(len(item.data))
            if item.sender == self.peer_id or self.hears():
                if not batch:
                    first = time.monotonic()
                batch.append((item.sender, Envelope(item.data, item.seqno_bytes, item.signature)))
            if batch and subscription.pending == 0 and len(batch) < GOSSIP_BATCH:
                wait = first + self.coalesce - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    if subscription.pending:  # more arrived meanwhile: into this batch
                        continue
            if batch and (subscription.pending == 0 or len(batch) >= GOSSIP_BATCH):
                self._track(self.admission.gossip(batch), heard=True)
                batch = []
        if batch:  # the subscription closed during a wait: what arrived before it counts
            self._track(self.admission.gossip(batch), heard=True)

    # -- requests: the manifest here, repair in network/gossip/repair.py ----------------------
    async def _serve_manifest(self, peer, request: bytes) -> bytes:
        if self.not_ready is not None:
            # The run id lets the joiner read the manifest from the DHT's signed records.
            return msgpack.packb({"not_ready": self.not_ready, "run_id": self.run_id})
        return msgpack.packb(
            {"manifest": self.manifest_json, "version": __version__, "time": time.time()}
        )

    def may_serve(self, peer, size: int) -> bool:
        """Refuse banned and unlisted requesters, and any requester past its byte rate
        (SERVE_BYTES_RATE: what keeps a small request from buying replies without end)."""
        requester = peer.to_bytes()
        why = self.refuses(requester)
        if why is None and size and not self._served_bytes.allow(requester, size):
            why = "rate_limited"
            self.reputation.penalize(requester, why)
        if why is not None:
            self.metrics.served_refused.labels(why).inc()
            return False
        return True

    async def connected_peers(self) -> list:
        """Peers subscribed to the run's topic (others' ledgers to sync with)."""
        try:
            ids = await self._pubsub.list_peers(self.topic)
        except Exception as exc:
            log.debug("list_peers failed: %s", exc)
            return []
        from hivemind.p2p import PeerID

        return [PeerID.from_base58(i) for i in ids]

    # The repair entry points the daemons and network/peers/reconnect.py use
    # (network/gossip/repair.py).
    @property
    def behind(self) -> set[bytes]:
        """Peers whose last exchange left claimed rows out (its page budget ran out)."""
        return self.repair.behind

    async def sync_with(self, peer_id, sole_server: bool = True) -> int:
        """One repair exchange with `peer_id`; the new updates (`Repair.sync_with`)."""
        return await self.repair.sync_with(peer_id, sole_server)

    async def sync_round(self, peers: list | None = None) -> int:
        """One anti-entropy pass with the given (default: all topic) peers."""
        return await self.repair.sync_round(peers)

    async def sync_until_complete(self, peers: list, max_passes: int = MAX_SYNC_PASSES) -> int:
        """A joiner's catch-up with `peers` (`Repair.sync_until_complete`)."""
        return await self.repair.sync_until_complete(peers, max_passes)

    async def repair_new_peer(self, peer_id) -> int:
        """Repair from a newly connected peer, one such exchange at a time."""
        return await self.repair.repair_new_peer(peer_id)

    async def check_sources(self, peers: list) -> SourceCheck:
        """Our ledger compared with each of `peers`' digests (`Repair.check_sources`)."""
        return await self.repair.check_sources(peers)

    async def cross_check(self, peers: list) -> SourceCheck:
        """After a sync: compare, fetch again from any ahead, compare again."""
        return await self.repair.cross_check(peers)

    async def _anti_entropy(self) -> None:
        try:
            await self._anti_entropy_loop()
        except UserError as exc:
            self.fatal = exc
            log.error("%s", exc)

    async def _anti_entropy_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repair_interval * (0.5 + random.random()))
            self._forget_silent_peers()
            if self.not_ready is None:  # while syncing, its catch-up passes are the repair
                await self.repair.anti_entropy_pass()
