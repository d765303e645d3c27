"""The network side of a participant: flood, admit, repair. No model here.

Data flows one way: every update, from gossip, repair or our own publish, goes
through admission (`network/admission.py`: decode, validate, policy, ledger),
then is handed to `on_accept` (the peer applies it to its model). Lost
gossip is repaired by anti-entropy: every few seconds the node compares
per-bucket ledger digests with a random peer and fetches the buckets that
differ, so every ledger converges even when GossipSub drops messages. Peers
and the bootstrap node both run a FloodNode; the bootstrap just never trains.

Request/response protocols (msgpack over the same libp2p daemon):

    seedflood.manifest  b""                        -> run manifest JSON + version + clock
                                                      (or {"not_ready": why, "run_id"} while
                                                       syncing)
    seedflood.digest    [run_id, bucket_rounds]    -> [[bucket, count, sha256], ...]
    seedflood.fetch     [run_id, round, peer, max_round, limit] -> signed rows after (round, peer)
    seedflood.audit_digest, seedflood.audit_fetch: the same for audit records (runs with
                        audits; protocol/wire.py, "audit repair")

A run with audits (the manifest's `extra.audit`) has a second topic for audit records,
and a repair exchange pulls the audit table's differing buckets after the updates', with
the same budgets and the same penalties (`network/audit.py:AuditIntake` admits them).

Against hostile peers (protocol/wire.py states the budgets, network/reputation.py the
scores): a repair exchange is bounded in pages, rows and time by what the peer's digest
claimed; a peer whose page holds one bad row, or whose exchange overruns, is penalized and
not asked again for a growing while (backoff); banned and (in a closed run) unlisted
peers get empty answers, and banned ones are disconnected through the daemon; each
requester is served at most SERVE_BYTES_RATE bytes a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from seedflood_p2p import __version__
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.admission import Admission, Outcome, Verdict
from seedflood_p2p.network.audit import AuditIntake, audits_on
from seedflood_p2p.network.metrics import NodeMetrics, timed
from seedflood_p2p.network.pubsub import PubSubClient
from seedflood_p2p.network.reputation import PeerBuckets, Reputation, short_id
from seedflood_p2p.network.rpc import RemoteCallError, call_bytes, serve_bytes
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.protocol.message import AuditRecord, Envelope, UpdateMessage
from seedflood_p2p.protocol.wire import (
    AUDIT_FETCH_LIMIT,
    BUCKET_ROUNDS,
    EXCHANGE_BASE_SECONDS,
    FETCH_LIMIT,
    MAX_EXCHANGE_PAGES,
    MAX_FETCH_REPLY_BYTES,
    PAGE_SECONDS,
    SERVE_BYTES_BURST,
    SERVE_BYTES_RATE,
    Rejected,
    audit_row_key,
    audit_topic_for,
    check_audit_rows_follow,
    check_rows_follow,
    decode_audit_fetch_request,
    decode_audit_rows,
    decode_digest_request,
    decode_digests,
    decode_fetch_request,
    decode_rows,
    encode_audit,
    encode_audit_fetch_request,
    encode_audit_rows,
    encode_rows,
    encode_update,
    first_audit_cursor,
    quorum_round,
    topic_for,
)
from seedflood_p2p.storage.bans import BanStore
from seedflood_p2p.storage.ledger import Ledger, set_digest

log = logging.getLogger("seedflood.node")

GOSSIP_BATCH = 256  # most gossip messages committed in one ledger transaction
LIVE_ROUNDS = 8  # a repaired update this close to our newest round shows its sender alive
FORGET_AFTER = 3600.0  # seconds without gossip before a peer leaves the `peers` table
MAX_BACKOFF = 600.0  # seconds a peer that failed repair at most waits to be asked again
STOP_SECONDS = 10.0  # a cancelled task still running after this is left behind by `stop`
BAD_PAGE_REASONS = ("bad_signature", "mismatch", "bad_key")  # a row no honest peer serves
# FETCH_LIMIT (protocol/wire.py), rows per fetch response: a row carries its signed envelope,
# ~139 bytes with 38-byte peer ids and an 18-byte update, at most ~215 for any valid row,
# so 4096 rows stay below the 1 MiB response limit of serve_bytes (8192 rows were 1.14 MB:
# every fetch of a bucket with more than ~7,500 rows, i.e. ~118+ peers per round, failed).

# A joiner's catch-up: at most this many anti-entropy passes (each bounded by the page
# budget and deadline of `sync_with`) before it starts; the rest arrives by repair later.
MAX_SYNC_PASSES = 100


@dataclass
class _Exchange:
    """One repair exchange with one peer: its deadline (grown by what the digest claimed),
    the rows it brought, whether it ended early, whether its page budget left rows out."""

    deadline: float
    new: int = 0
    new_audits: int = 0  # audit records it brought (runs with audits)
    aborted: bool = False
    left_out: bool = False


def _budget(
    theirs: dict[int, tuple[int, bytes]],
    mine: dict[int, tuple[int, bytes]],
    last_round: int,
    rows_per_page: int,
    exchange: _Exchange,
) -> list[tuple[int, int]]:
    """The buckets to fetch, (bucket, rows claimed): those whose (count, hash) differ from
    ours and start by `last_round`, as many as MAX_EXCHANGE_PAGES pages of what the digest
    claimed allow (at least one). The exchange's deadline grows by PAGE_SECONDS a page;
    buckets left for a later exchange mark it `left_out`."""
    wanted = [
        (bucket, count)
        for bucket, (count, digest) in sorted(theirs.items())
        if mine.get(bucket) != (count, digest) and bucket * BUCKET_ROUNDS <= last_round
    ]
    pages, budget = 0, []
    for bucket, count in wanted:
        need = max(1, math.ceil(count / rows_per_page))
        if pages + need > MAX_EXCHANGE_PAGES and budget:
            break
        budget.append((bucket, count))
        pages += need
    exchange.deadline += PAGE_SECONDS * min(pages, MAX_EXCHANGE_PAGES)
    exchange.left_out |= len(budget) < len(wanted)
    return budget


# Bucket versions (count, sha256 of the set, as digests claim them) fetched whole and
# taken in: every row now in our ledger or refused for good. Fetching the same set again,
# from any server, cannot bring anything, so `_plan` skips it until the server's bucket
# changes. A set some of whose rows were refused as `own_backfill` (served by their
# author) is skipped only for that server, and only while it is not the sole server we
# could ask. bucket -> {(count, digest): None (any server) or that server}.
Taken = dict[int, dict[tuple[int, bytes], bytes | None]]

# Drops that the same row meets again whenever it is fetched: an equivocation's loser
# (`wire.keeps_new` is a total order), the author's key or allow-list, a malformed row;
# `own_backfill` from the same server (the reference only rises). Not `out_of_window`:
# a row ahead of the window is admitted later.
SETTLED_DROPS = ("own_backfill", "equivocation", "not_allowed", "bad_key", "malformed")
MAX_TAKEN_VERSIONS = 8  # versions remembered per bucket (the oldest leave first)


def _already_taken(
    taken: Taken, bucket: int, version: tuple[int, bytes], server: bytes, sole_server: bool
) -> bool:
    versions = taken.get(bucket, {})
    if version not in versions:
        return False
    who = versions[version]
    return who is None or (who == server and not sole_server)


def _plan(
    theirs: dict[int, tuple[int, bytes]],
    mine: dict[int, tuple[int, bytes]],
    last_round: int,
    exchange: _Exchange,
    taken: Taken,
    server: bytes,
    sole_server: bool,
) -> list[list[tuple[int, int]]]:
    """The update buckets to fetch, as runs of consecutive buckets [(bucket, rows claimed)],
    each run fetched as one round range, FETCH_LIMIT rows a page across its buckets.

    Wanted: buckets whose (count, hash) differ from ours, start by `last_round`, and are
    not a set already taken in (`Taken`). Taken oldest first
    while the pages the runs need (their claimed rows, FETCH_LIMIT a page, one at least a
    run) fit MAX_EXCHANGE_PAGES (at least one bucket is taken). The deadline grows by
    PAGE_SECONDS per page as `_budget` counts them (one at least per bucket, at most
    MAX_EXCHANGE_PAGES): the bounds are unchanged, only the round trips are fewer. Buckets
    left for a later exchange mark it `left_out`.

    After a long partition every bucket of it differs, most from each server only in rows
    we hold already: one page per bucket, and every exchange starting again at the oldest
    ones, made repair refetch the same buckets in vain (30 minutes of 0.4 s rounds: 70
    buckets, 137 s to heal)."""
    wanted = []
    for bucket, (count, digest) in sorted(theirs.items()):
        if mine.get(bucket) == (count, digest) or bucket * BUCKET_ROUNDS > last_round:
            continue
        if _already_taken(taken, bucket, (count, digest), server, sole_server):
            continue
        wanted.append((bucket, count))
    runs: list[list[tuple[int, int]]] = []
    run_rows: list[int] = []
    deadline_pages, chosen = 0, 0
    for bucket, count in wanted:
        extend = bool(runs) and runs[-1][-1][0] == bucket - 1
        rows = run_rows + ([] if extend else [0])
        rows[-1] += count
        if sum(max(1, math.ceil(r / FETCH_LIMIT)) for r in rows) > MAX_EXCHANGE_PAGES and chosen:
            break
        if extend:
            runs[-1].append((bucket, count))
        else:
            runs.append([(bucket, count)])
        run_rows = rows
        deadline_pages += max(1, math.ceil(count / FETCH_LIMIT))
        chosen += 1
    exchange.deadline += PAGE_SECONDS * min(deadline_pages, MAX_EXCHANGE_PAGES)
    exchange.left_out |= chosen < len(wanted)
    return runs


@dataclass
class SourceCheck:
    """A joiner's ledger compared with each source's digest after its sync, bucket by
    bucket below the newest bucket either side holds (the newest one still fills):
    `lacking` sources miss rows we hold (behind, or withholding what others served),
    `ahead` ones hold rows we miss, `differ` ones hold as many rows as we do but other
    ones (an equivocation not yet resolved); counts are rows, summed over buckets."""

    agree: list[bytes] = field(default_factory=list)
    lacking: dict[bytes, int] = field(default_factory=dict)
    ahead: dict[bytes, int] = field(default_factory=dict)
    differ: dict[bytes, int] = field(default_factory=dict)
    unanswered: list[bytes] = field(default_factory=list)

    @property
    def compared(self) -> int:
        return len(self.agree) + len(self.lacking) + len(self.ahead) + len(self.differ)


def compare_digests(
    mine: dict[int, tuple[int, bytes]], theirs: dict[int, tuple[int, bytes]]
) -> tuple[int, int, int]:
    """(rows they lack, rows they have beyond ours, buckets that differ at equal counts)
    over the buckets below the newest either side has."""
    newest = max([*mine, *theirs], default=-1)
    lacking = ahead = differ = 0
    for bucket in set(mine) | set(theirs):
        if bucket >= newest:
            continue
        ours, their = mine.get(bucket, (0, b"")), theirs.get(bucket, (0, b""))
        if ours == their:
            continue
        if their[0] < ours[0]:
            lacking += ours[0] - their[0]
        elif their[0] > ours[0]:
            ahead += their[0] - ours[0]
        else:
            differ += 1
    return lacking, ahead, differ


@dataclass
class PeerState:
    round: int
    last_seen: float


class FloodNode:
    def __init__(
        self,
        p2p,
        ledger: Ledger,
        manifest_json: str,
        metrics: NodeMetrics,
        settings: NodeSettings,
        on_accept: Callable[[list[UpdateMessage]], None] = lambda msgs: None,
    ) -> None:
        self.p2p = p2p
        self.ledger = ledger
        self.run_id = ledger.run_id
        self.topic = topic_for(self.run_id)
        self.manifest_json = manifest_json
        self.directions = RunConfig.from_json(manifest_json).directions  # scalars per update
        self.metrics = metrics
        self.settings = settings
        self.on_accept = on_accept
        self.peer_id = p2p.peer_id.to_bytes()
        # Bans live beside the ledger file (in memory for an in-memory ledger).
        on_disk = ledger.path is not None and str(ledger.path) != ":memory:"
        self.bans = BanStore(Path(ledger.path).parent / "bans.sqlite" if on_disk else None)
        self.reputation = Reputation(self.bans, metrics.count_ban, on_ban=self._disconnect)
        self.admission = Admission(
            ledger,
            self.directions,
            self.peer_id,
            metrics,
            settings.max_ahead,
            deliver=lambda messages: self.on_accept(messages),  # on_accept may be replaced
            max_behind=settings.max_behind,
            reputation=self.reputation,
            allowed=RunConfig.from_json(manifest_json).allowed_peer_ids(),
        )
        # Audit records, in a run whose manifest has them: gossip on their own
        # topic and repair, through the same sender rules. New records go to
        # `on_audit_records` (the peer daemon judges them; the bootstrap keeps and serves).
        with_audits = audits_on(RunConfig.from_json(manifest_json).extra)
        self.audits = AuditIntake(ledger, self.directions, self.admission) if with_audits else None
        self.on_audit_records: Callable[[list[AuditRecord]], Awaitable[None]] | None = None
        self._served_bytes = PeerBuckets(SERVE_BYTES_RATE, SERVE_BYTES_BURST)
        self._backoff: dict[bytes, tuple[float, int]] = {}  # peer -> (not before, failures)
        self.behind: set[bytes] = set()  # peers whose last exchange left claimed rows out
        self._connect_repair = asyncio.Lock()  # `repair_new_peer`: one at a time
        self._taken: Taken = {}  # bucket sets already fetched whole and taken in (`_plan`)
        self.peers: dict[bytes, PeerState] = {}  # training peers, from their updates
        self._pubsub = PubSubClient(p2p, max_rate=settings.publish_rate, burst=10)
        self._tasks: list[asyncio.Task] = []
        self._drop_rng = random.Random()
        self.last_accept = time.monotonic()
        self.fatal: Exception | None = None  # e.g. disk full: the owner must stop
        # Why joiners are not served the manifest yet (None: they are): a node that knows
        # others exist syncs with them first, so a joiner never starts from its stale copy.
        self.not_ready: str | None = None

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        await serve_bytes(self.p2p, "seedflood.manifest", self._serve_manifest)
        await serve_bytes(self.p2p, "seedflood.digest", self._serve_digest)
        await serve_bytes(self.p2p, "seedflood.fetch", self._serve_fetch)
        # Our own messages come back too: their signed envelopes make them repairable.
        subscription = await self._pubsub.subscribe(self.topic, include_own=True)
        self._tasks.append(asyncio.create_task(self._receive(subscription), name="receive"))
        if self.audits is not None:
            await serve_bytes(self.p2p, "seedflood.audit_digest", self._serve_audit_digest)
            await serve_bytes(self.p2p, "seedflood.audit_fetch", self._serve_audit_fetch)
            # Our own records come back too: signed, they become repairable (AuditIntake).
            await self.serve_topic(
                audit_topic_for(self.run_id), self._admit_audit_gossip, include_own=True
            )
        self._tasks.append(asyncio.create_task(self._anti_entropy(), name="anti-entropy"))
        self.metrics.ledger_size.set(len(self.ledger))

    async def stop(self) -> None:
        """Cancel the node's tasks and close its pubsub client. A task that does not end
        within STOP_SECONDS of its cancellation is named in a warning and left behind:
        stopping (and the checkpoint after it) must not wait on one stuck call."""
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

    def _disconnect(self, peer: bytes) -> None:
        """A banned peer: close its connection through the daemon (it may dial again; its
        streams are then refused and its gossip dropped, see network/reputation.py)."""
        from hivemind.p2p import PeerID

        async def disconnect() -> None:
            try:
                await self.p2p._client.disconnect(PeerID(peer))
            except Exception as exc:  # already gone, or the daemon is stopping
                log.debug("disconnecting %s failed: %r", short_id(peer), exc)

        with contextlib.suppress(RuntimeError):  # no running loop (tools, tests)
            asyncio.get_running_loop().create_task(disconnect())

    def refuses(self, peer: bytes) -> str | None:
        """Why we do not talk to `peer` (banned, or outside a closed run), or None."""
        if self.reputation.is_banned(peer):
            return "banned"
        if self.admission.allowed is not None and peer not in self.admission.allowed:
            return "not_allowed"
        return None

    # -- admission: every update in, see network/admission.py ----------------------
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
                state = self.peers.setdefault(message.peer, PeerState(message.round, -math.inf))
                state.round = max(state.round, message.round)
                recent = message.round >= self.newest_round - LIVE_ROUNDS
                if heard or (in_step and recent):
                    state.last_seen = now

    def _forget_silent_peers(self) -> None:
        """Peers not heard by gossip for FORGET_AFTER seconds leave the table: it would
        otherwise grow with every identity that ever sent an update."""
        cutoff = time.monotonic() - FORGET_AFTER
        for peer in [p for p, state in self.peers.items() if state.last_seen < cutoff]:
            del self.peers[peer]

    # -- gossip -----------------------------------------------------------
    async def publish(self, message: UpdateMessage) -> None:
        """Admit our own update (logged, handed to `on_accept` like anyone's), then flood
        it. Its echo from the daemon attaches the signed envelope to our row."""
        verdict = self.admission.own(message)
        self._track([verdict], heard=True)
        if verdict.outcome is not Outcome.ACCEPTED:
            # Signing a second update for a round would make this peer an equivocator.
            raise UserError(
                f"this peer's ledger already holds an update of its own for round "
                f"{message.round} ({verdict.reason}): is another process running with the "
                "same identity.key?"
            )
        data = encode_update(self.run_id, message.round, message.scalars)
        await self._pubsub.publish(self.topic, data)
        self.metrics.published.inc()
        self.metrics.bytes_out.inc(len(data))

    async def publish_on(self, topic: str, data: bytes) -> None:
        """Publish `data` on another topic of the run (the audit topic)."""
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
        for message in missing:
            data = encode_update(self.run_id, message.round, message.scalars)
            await self._pubsub.publish(self.topic, data)
            self.metrics.bytes_out.inc(len(data))
        records = self.ledger.unsigned_audits(self.peer_id) if self.audits is not None else []
        for record in records:  # our audit records likewise (their echo signs them)
            data = encode_audit(self.run_id, record.accused, record.round, record.scalars)
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
        into one ledger transaction (one fsync), not one commit per message."""
        batch: list[tuple[bytes, Envelope]] = []
        async for item in subscription:
            self.metrics.bytes_in.inc(len(item.data))
            lossy = self.settings.drop_incoming  # stands for the network losing it
            if not (lossy and item.sender != self.peer_id and self._drop_rng.random() < lossy):
                batch.append((item.sender, Envelope(item.data, item.seqno_bytes, item.signature)))
            if batch and (subscription.pending == 0 or len(batch) >= GOSSIP_BATCH):
                self._track(self.admission.gossip(batch), heard=True)
                batch = []

    # -- repair -------------------------------------------------------------
    async def _serve_manifest(self, peer, request: bytes) -> bytes:
        if self.not_ready is not None:
            # The run id lets the joiner read the manifest from the DHT's signed records.
            return msgpack.packb({"not_ready": self.not_ready, "run_id": self.run_id})
        return msgpack.packb(
            {"manifest": self.manifest_json, "version": __version__, "time": time.time()}
        )

    async def _serve_digest(self, peer, request: bytes) -> bytes:
        if decode_digest_request(request) != self.run_id or not self.may_serve(peer, 0):
            return msgpack.packb([])
        with timed(self.metrics.repair_serve_seconds.labels("digest")):
            digests = self.ledger.bucket_digests(BUCKET_ROUNDS)
            reply = msgpack.packb([[b, c, h] for b, (c, h) in sorted(digests.items())])
        return reply if self.may_serve(peer, len(reply)) else msgpack.packb([])

    async def _serve_fetch(self, peer, request: bytes) -> bytes:
        fields = decode_fetch_request(request)
        if fields is None or fields[0] != self.run_id or not self.may_serve(peer, 0):
            return encode_rows([])
        _, round_, after_peer, max_round, limit = fields
        with timed(self.metrics.repair_serve_seconds.labels("fetch")):
            reply = encode_rows(self.ledger.signed_after(round_, after_peer, max_round, limit))
        return reply if self.may_serve(peer, len(reply)) else encode_rows([])

    async def _serve_audit_digest(self, peer, request: bytes) -> bytes:
        if decode_digest_request(request) != self.run_id or not self.may_serve(peer, 0):
            return msgpack.packb([])
        with timed(self.metrics.repair_serve_seconds.labels("audit_digest")):
            digests = self.ledger.audit_bucket_digests(BUCKET_ROUNDS)
            reply = msgpack.packb([[b, c, h] for b, (c, h) in sorted(digests.items())])
        return reply if self.may_serve(peer, len(reply)) else msgpack.packb([])

    async def _serve_audit_fetch(self, peer, request: bytes) -> bytes:
        fields = decode_audit_fetch_request(request)
        if fields is None or fields[0] != self.run_id or not self.may_serve(peer, 0):
            return encode_audit_rows([])
        _, cursor, max_round, limit = fields
        with timed(self.metrics.repair_serve_seconds.labels("audit_fetch")):
            reply = encode_audit_rows(self.ledger.signed_audits_after(cursor, max_round, limit))
        return reply if self.may_serve(peer, len(reply)) else encode_audit_rows([])

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

    async def sync_with(self, peer_id, sole_server: bool = True) -> int:
        """Pull every message `peer_id` has in buckets that differ from ours; returns new count.

        Bounded by what its digest claimed: at most MAX_EXCHANGE_PAGES pages, the claimed
        rows per bucket, and `wire.exchange_deadline` seconds. A bad reply or a page with a
        bad row (see protocol/wire.py) ends the exchange: counted, held against the peer,
        which is then backed off. Its rows go through admission like gossip does.
        `sole_server`: the peer is the only one we could ask (repair's old-row rule)."""
        server = peer_id.to_bytes()
        self.behind.discard(server)
        if self.refuses(server) or time.monotonic() < self._backoff.get(server, (0.0, 0))[0]:
            return 0
        loop = asyncio.get_running_loop()
        exchange = _Exchange(deadline=loop.time() + EXCHANGE_BASE_SECONDS)
        try:
            await self._exchange(peer_id, server, sole_server, exchange)
        except RemoteCallError:
            if loop.time() < exchange.deadline - 0.05:
                raise  # unreachable or refused, not slow: the caller logs it
            self._abort(server, "deadline", exchange, "repair_timeout")
        else:
            if not exchange.aborted:
                self._backoff.pop(server, None)
                if exchange.left_out:
                    self.behind.add(server)
        return exchange.new

    async def sync_until_complete(self, peers: list, max_passes: int = MAX_SYNC_PASSES) -> int:
        """Anti-entropy passes with `peers` until no exchange had rows left out by its page
        budget (a late joiner's long history takes several), a pass brings nothing, or
        `max_passes`; returns the new rows. Each pass is bounded as `sync_with` is."""
        total = 0
        for _ in range(max_passes):
            new = await self.sync_round(peers)
            total += new
            if not new or not self.behind:
                break
        return total

    async def check_sources(self, peers: list) -> SourceCheck:
        """Ask each of `peers` for its bucket digests (one bounded request each) and compare
        them with our ledger: what a joiner fetched, checked against every source."""
        check = SourceCheck()
        request = msgpack.packb([self.run_id, BUCKET_ROUNDS])
        for peer_id in peers:
            source = peer_id.to_bytes()
            try:
                reply = await call_bytes(
                    self.p2p,
                    peer_id,
                    "seedflood.digest",
                    request,
                    self.settings.call_timeout,
                    max_response=MAX_FETCH_REPLY_BYTES,
                )
                theirs = decode_digests(reply)
            except Rejected as exc:
                self.admission.drop_reply(exc, source)
                check.unanswered.append(source)
                continue
            except RemoteCallError:
                check.unanswered.append(source)
                continue
            lacking, ahead, differ = compare_digests(
                self.ledger.bucket_digests(BUCKET_ROUNDS), theirs
            )
            if ahead:
                check.ahead[source] = ahead
            elif differ:
                check.differ[source] = differ
            elif lacking:
                check.lacking[source] = lacking
            else:
                check.agree.append(source)
        return check

    async def cross_check(self, peers: list) -> SourceCheck:
        """After a sync with `peers`: compare with each; fetch again from any that still
        holds rows we lack (one more bounded pass), then compare again. A source that
        lacks rows the others served is reported, not punished: an honest one may simply
        be behind (a joiner itself, or just restarted)."""
        check = await self.check_sources(peers)
        more = [p for p in peers if p.to_bytes() in check.ahead or p.to_bytes() in check.differ]
        if more:
            await self.sync_round(more)
            check = await self.check_sources(peers)
        return check

    async def _exchange(
        self, peer_id, server: bytes, sole_server: bool, exchange: _Exchange
    ) -> None:
        loop = asyncio.get_running_loop()

        async def call(request_name: str, request: bytes) -> bytes:
            """One repair request (`digest` or `fetch`), timed and its reply counted."""
            left = min(self.settings.call_timeout, exchange.deadline - loop.time())
            if left <= 0:
                raise RemoteCallError(f"repair exchange with {short_id(server)} over its deadline")
            with timed(self.metrics.repair_call_seconds.labels(request_name)):
                reply = await call_bytes(
                    self.p2p,
                    peer_id,
                    f"seedflood.{request_name}",
                    request,
                    left,
                    max_response=MAX_FETCH_REPLY_BYTES,
                )
            self.metrics.repair_bytes_in.labels(request_name).inc(len(reply))
            return reply

        reply = await call("digest", msgpack.packb([self.run_id, BUCKET_ROUNDS]))
        try:
            theirs = decode_digests(reply)
        except Rejected as exc:
            self._abort(server, "bad_reply", exchange)
            self.admission.drop_reply(exc, server)
            return
        if theirs:
            self.admission.note_bucket_claim(server, (max(theirs) + 1) * BUCKET_ROUNDS - 1)
        mine = self.ledger.bucket_digests(BUCKET_ROUNDS)
        # Rows past the window's upper bound would be refused anyway: not fetched.
        admission = self.admission
        upper = max(admission.reference_round(), quorum_round(admission.bucket_claims.values()))
        last_round = upper + admission.window.max_ahead
        pages = 0
        for run in _plan(theirs, mine, last_round, exchange, self._taken, server, sole_server):
            pages = await self._fetch_run(
                call, server, sole_server, exchange, run, theirs, last_round, pages
            )
            if pages is None:
                return
        if self.audits is not None:
            await self._exchange_audits(call, server, exchange, last_round)

    async def _fetch_run(
        self,
        call,
        server: bytes,
        sole_server: bool,
        exchange: _Exchange,
        run: list[tuple[int, int]],
        theirs: dict[int, tuple[int, bytes]],
        last_round: int,
        pages: int,
    ) -> int | None:
        """Fetch one run of consecutive buckets as one round range, page by page, taking
        from each bucket no more than the rows its digest claimed. Returns the pages used
        so far, None if the exchange ended (a bad reply or page: counted and penalized).

        An honest server's bucket grows while a run goes on (gossip arrives between its
        digest and our fetch): rows past a bucket's claim are left, without blame, for
        the next exchange. That still bounds the work: at most MAX_EXCHANGE_PAGES pages."""
        claims = dict(run)
        got = dict.fromkeys(claims, 0)
        settled = dict.fromkeys(claims, True)  # every row in our ledger or refused for good
        received: dict[int, list[UpdateMessage]] = {b: [] for b in claims}
        backfill = dict.fromkeys(claims, False)
        lo = run[0][0] * BUCKET_ROUNDS
        hi = min(run[-1][0] * BUCKET_ROUNDS + BUCKET_ROUNDS - 1, last_round)
        cursor = (lo - 1, b"\xff" * 64)
        while pages < MAX_EXCHANGE_PAGES:
            request = msgpack.packb([self.run_id, cursor[0], cursor[1], hi, FETCH_LIMIT])
            data = await call("fetch", request)
            pages += 1
            try:
                rows = decode_rows(data, FETCH_LIMIT)
                check_rows_follow(rows, cursor, hi)
            except Rejected as exc:
                self._abort(server, "bad_reply", exchange)
                self.admission.drop_reply(exc, server)
                return None
            keep = []
            for row in rows:  # rows are (message, envelope) pairs, ascending
                bucket = row[0].round // BUCKET_ROUNDS
                if got.get(bucket, 0) < claims.get(bucket, 0):
                    got[bucket] += 1
                    keep.append(row)
                    received[bucket].append(row[0])
            verdicts = await self.admission.repair(keep, server, sole_server)
            self._track(verdicts, heard=False)
            fetched = sum(v.outcome is Outcome.ACCEPTED for v in verdicts)
            exchange.new += fetched
            self.metrics.repaired.inc(fetched)
            if any(v.reason in BAD_PAGE_REASONS for v in verdicts):
                # one bad row: no honest peer serves it (see reputation.PENALTIES)
                self._abort(server, "bad_page", exchange, "bad_page")
                return None
            for verdict in verdicts:
                if verdict.outcome is Outcome.DROPPED:
                    bucket = verdict.message.round // BUCKET_ROUNDS
                    settled[bucket] &= verdict.reason in SETTLED_DROPS
                    backfill[bucket] |= verdict.reason == "own_backfill"
            if len(rows) < FETCH_LIMIT or all(got[b] >= claims[b] for b in claims):
                break
            last = rows[-1][0]
            cursor = (last.round, last.peer)
        else:  # the page budget ran out inside this run
            exchange.left_out = True
            return pages
        for bucket, claimed in run:
            whole = bucket * BUCKET_ROUNDS + BUCKET_ROUNDS - 1 <= hi
            # The set taken in must be the one the digest named: a server claiming another
            # set's digest (an honest peer's full bucket) for rows we hold would make us
            # skip that set, and the rows we lack, for good.
            version = theirs[bucket]
            if whole and got[bucket] == claimed and settled[bucket]:
                if set_digest(received[bucket]) != version[1]:
                    continue
                versions = self._taken.setdefault(bucket, {})
                if versions.get(version, server) is not None:  # None (any server) stays
                    versions[version] = server if backfill[bucket] else None
                while len(versions) > MAX_TAKEN_VERSIONS:
                    del versions[next(iter(versions))]
        return pages

    async def _exchange_audits(
        self, call, server: bytes, exchange: _Exchange, last_round: int
    ) -> None:
        """The audit table's part of a repair exchange: its differing buckets, with the
        update part's budgets (pages, the digest's claimed counts, the deadline) and
        penalties (a bad reply, a page with a row no honest server serves)."""
        reply = await call("audit_digest", msgpack.packb([self.run_id, BUCKET_ROUNDS]))
        try:
            theirs = decode_digests(reply)
        except Rejected as exc:
            self._abort(server, "bad_reply", exchange)
            self.admission.drop_reply(exc, server)
            return
        mine = self.ledger.audit_bucket_digests(BUCKET_ROUNDS)
        pages = 0
        for bucket, claimed in _budget(theirs, mine, last_round, AUDIT_FETCH_LIMIT, exchange):
            lo = bucket * BUCKET_ROUNDS
            hi = min(lo + BUCKET_ROUNDS - 1, last_round)
            cursor, taken = first_audit_cursor(lo), 0
            while pages < MAX_EXCHANGE_PAGES:
                request = encode_audit_fetch_request(self.run_id, cursor, hi, AUDIT_FETCH_LIMIT)
                data = await call("audit_fetch", request)
                pages += 1
                try:
                    rows = decode_audit_rows(data, AUDIT_FETCH_LIMIT)
                    check_audit_rows_follow(rows, cursor, hi)
                except Rejected as exc:
                    self._abort(server, "bad_reply", exchange)
                    self.admission.drop_reply(exc, server)
                    return
                claim_reached = taken + len(rows) >= claimed
                rows = rows[: claimed - taken]
                taken += len(rows)
                fresh, bad = self.audits.repair(rows)
                if fresh:
                    exchange.new_audits += len(fresh)
                    await self._new_audit_records(fresh)
                if bad:  # as for updates: no honest peer serves such a row
                    self._abort(server, "bad_page", exchange, "bad_page")
                    return
                if claim_reached or len(rows) < AUDIT_FETCH_LIMIT:
                    break
                cursor = audit_row_key(rows[-1][0])

    def _abort(
        self,
        server: bytes,
        why: str,
        exchange: _Exchange | None = None,
        penalty: str | None = None,
    ) -> None:
        """End repair with `server` for now: counted, penalized, backed off (doubling)."""
        if exchange is not None:
            exchange.aborted = True
        self.metrics.repair_aborted.labels(why).inc()
        if penalty is not None:
            self.reputation.penalize(server, penalty)
        failures = self._backoff.get(server, (0.0, 0))[1] + 1
        wait = min(MAX_BACKOFF, self.settings.repair_interval * 2**failures)
        self._backoff[server] = (time.monotonic() + wait, failures)
        log.info(
            "repair with %s ended (%s): not asked again for %.0f s",
            short_id(server),
            why,
            wait,
            extra={"fields": {"event": "repair_abort", "why": why}},
        )

    async def connected_peers(self) -> list:
        """Peers subscribed to the run's topic (others' ledgers to sync with)."""
        try:
            ids = await self._pubsub.list_peers(self.topic)
        except Exception as exc:
            log.debug("list_peers failed: %s", exc)
            return []
        from hivemind.p2p import PeerID

        return [PeerID.from_base58(i) for i in ids]

    async def sync_round(self, peers: list | None = None) -> int:
        """One anti-entropy pass with the given (default: all topic) peers."""
        new = 0
        peers = peers if peers is not None else await self.connected_peers()
        for peer_id in peers:
            try:
                new += await self.sync_with(peer_id, sole_server=len(peers) <= 1)
            except RemoteCallError as exc:
                log.debug("sync with %s failed: %s", peer_id, exc)
            except UserError:
                raise  # our own ledger cannot be written
            except Exception as exc:  # whatever a peer sends, we go on with the others
                log.warning("sync with %s failed: %r", peer_id, exc)
        return new

    async def repair_new_peer(self, peer_id) -> int:
        """Repair from a newly connected peer (network/reconnect.py), one such exchange at a
        time: when a partition heals, every peer across it connects at once, and exchanges
        run side by side fetched the same rows from each (the set memo `Taken` only knows
        a set once an exchange took it in whole). One after another, the first brings the
        other side's rows and the next ones skip the sets it took. A slow peer delays the
        next new connection's repair by at most its exchange deadline (74 s, then backoff);
        anti-entropy goes on meanwhile."""
        async with self._connect_repair:
            return await self.sync_round([peer_id])

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
            peers = await self.connected_peers()
            if not peers:
                continue
            try:
                new = await self.sync_with(random.choice(peers), sole_server=len(peers) <= 1)
            except RemoteCallError as exc:
                log.debug("anti-entropy failed: %s", exc)
                continue
            except UserError:
                raise
            except Exception as exc:  # repair must outlive any one bad exchange
                log.warning("anti-entropy failed: %r", exc)
                continue
            if new:
                log.info(
                    "repair: fetched %d missing messages",
                    new,
                    extra={"fields": {"event": "repair", "count": new}},
                )
