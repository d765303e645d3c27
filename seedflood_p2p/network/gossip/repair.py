"""Anti-entropy repair, written once over a small table interface (`RepairTable`).

GossipSub may drop messages; repair makes every ledger converge anyway. Every few
seconds, and on every new connection, a node compares per-bucket digests of each
repairable table with one peer and fetches the buckets that differ. The node repairs two
tables, its updates (`UpdateTable`) and, in a run with audits, its audit records
(`AuditTable`); both are instances of the same interface, repaired by the same code.

The protocol (request/response over the node's own p2pd; wire forms and every reply rule
in protocol/repair.py), per table, with the table's `RowKind`:

    digest  [run_id, 64]                        -> [[bucket, count, sha256], ...]
    fetch   [run_id, *cursor, max_round, limit] -> rows strictly after the cursor, in key
                                                   order, through max_round

An exchange with one peer: ask each table's digest, plan the buckets whose (count, hash)
differ from ours (`plan`), fetch them as runs of consecutive buckets, page by page, and
hand each page to the table's `insert` (which checks every row's signature and the
admission rules and writes what passes).

Validation and hostile-input bounds, all here:

- A reply that fails the wire checks (digest shape; rows malformed, not strictly after
  the cursor, past the requested round, more than asked for) is dropped whole before any
  row is looked at: counted and held against the server (`Admission.drop_reply`,
  `bad_reply`), the exchange ends, the server is backed off (doubling up to MAX_BACKOFF).
- A page holding one row no honest server serves (`Intake.bad`: a bad signature or
  payload, a key that cannot sign) ends the exchange with the `bad_page` penalty (a ban at
  once, network/peers/reputation.py).
- Work per exchange and table is bounded by what the peer's digest claimed: at most
  MAX_EXCHANGE_PAGES pages, at most the claimed rows per bucket (rows past a claim are
  left without blame: an honest bucket grows while we fetch), and the exchange's deadline
  (EXCHANGE_BASE_SECONDS plus PAGE_SECONDS per claimed page, at most MAX_EXCHANGE_PAGES);
  an exchange over its deadline is penalized (`repair_timeout`) and backed off. Rows
  past the window's upper bound are not asked for.
- Serving: a request that fails its checks, or comes from a banned or (closed run)
  unlisted peer, is answered empty; each requester is served at most SERVE_BYTES_RATE
  bytes a second (the node's `may_serve`). A node still syncing (`syncing`) answers
  digest requests with no buckets: the others would fetch their own rows back from it.
- Asking: a banned peer (this node's reputation) or one its owner judged out (`avoids`:
  the peer daemon's ledger verdicts) is never asked, nor counted as a server we could ask
  (`sources`): a joiner does not spend its catch-up on identities its ledger already bans.
- A bucket set fetched whole and taken in (`Taken`) is not fetched again until the
  server's bucket changes; only a set whose received rows hash to the digest the server
  claimed counts, so a server cannot make us skip another set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.gossip.admission import Admission, Outcome, Verdict
from seedflood_p2p.network.gossip.audit_intake import AuditIntake
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, timed
from seedflood_p2p.network.peers.reputation import short_id
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes, serve_bytes
from seedflood_p2p.network.transport.sigcheck import SignaturePool
from seedflood_p2p.protocol.audit_record import decode_audit
from seedflood_p2p.protocol.framing import Rejected, same_scalars, topic_for
from seedflood_p2p.protocol.message import AuditRecord, Envelope
from seedflood_p2p.protocol.repair import (
    AUDIT_ROWS,
    BUCKET_ROUNDS,
    EXCHANGE_BASE_SECONDS,
    MAX_EXCHANGE_PAGES,
    MAX_FETCH_REPLY_BYTES,
    PAGE_SECONDS,
    UPDATE_ROWS,
    Row,
    RowKind,
    decode_digest_request,
    decode_digests,
)
from seedflood_p2p.protocol.update import quorum_round
from seedflood_p2p.storage.digests import audit_set_digest, set_digest
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.node")

Digests = dict[int, tuple[int, bytes]]  # {bucket: (rows, SHA-256 set digest)}

MAX_BACKOFF = 600.0  # seconds a peer that failed repair at most waits to be asked again
FORGET_AT_LEAST = 64  # back-offs kept before the ended ones are looked for
MAX_SYNC_PASSES = 100  # a joiner's catch-up: anti-entropy passes at most before it starts
BAD_PAGE_REASONS = ("bad_signature", "mismatch", "bad_key")  # a row no honest peer serves
# Drops that the same row meets again whenever it is fetched: an equivocation's loser
# (`protocol.update.keeps_new` is a total order), the author's key, allow-list or identity
# work, a malformed row; `own_backfill` from the same server (the reference only rises); an
# audit naming its own auditor. Not `out_of_window` or `no_ticket`: such a row may pass later.
SETTLED_DROPS = (
    "own_backfill",
    "equivocation",
    "not_allowed",
    "no_work",
    "bad_key",
    "malformed",
    "self_audit",
)
MAX_TAKEN_VERSIONS = 8  # bucket versions remembered per bucket (the oldest leave first)


# -- the table interface -------------------------------------------------------------------


@dataclass
class Intake:
    """What inserting one page of rows did: rows new to the table; whether a row was one no
    honest server serves (`bad`: the exchange ends, the server is penalized); the rounds of
    rows dropped for a reason that may pass later (`unsettled`: their bucket set is not
    remembered as taken) or refused only because this server served them (`server_only`,
    the `own_backfill` rule: the set is remembered for this server alone)."""

    new: int = 0
    bad: bool = False
    unsettled: set[int] = field(default_factory=set)
    server_only: set[int] = field(default_factory=set)


class RepairTable(Protocol):
    """What a table must provide to be repaired."""

    kind: RowKind  # its rows' wire form, request names and reply bound (protocol/repair.py)
    page_rows: int  # rows asked for per fetch page (at most kind.page_rows)

    def digests(self) -> Digests:
        """Per-bucket (count, set digest) of what the table holds."""
        ...

    def rows_after(self, cursor: tuple, max_round: int, limit: int) -> list[Row]:
        """Up to `limit` signed rows after `cursor` in key order, through `max_round`."""
        ...

    def set_digest(self, rows: Sequence[Row]) -> bytes:
        """The digest `digests` gives a bucket holding exactly the rows' records (as
        their envelopes carry them)."""
        ...

    def note_digest(self, server: bytes, theirs: Digests) -> None:
        """A server's digest reply was well-formed (what it claims to hold)."""
        ...

    async def insert(self, rows: list[Row], server: bytes, sole_server: bool) -> Intake:
        """Check and write rows served by `server`; never raises for a bad row."""
        ...


class Prechecked:
    """Signature checks made ahead, in bulk (`SignaturePool`: worker processes), for the
    admission to find: its `verify` (what the node gives `Admission`) answers a checked
    item from memory and checks any other one itself, so each answer is exactly
    `verify_pubsub_signature`'s. A repair page's new rows are checked this way before the
    page reaches admission: the event loop does not hold the GIL through 256 Ed25519
    checks (~100-160 us each), and a machine with more cores checks them side by side."""

    def __init__(self, pool: SignaturePool) -> None:
        self.pool = pool
        self._known: dict[tuple, bool] = {}
        self.hits = 0  # answers given from memory (the tests read it)

    def verify(self, sender: bytes, data: bytes, seqno: bytes, topic: str, sig: bytes) -> bool:
        known = self._known.get((sender, data, seqno, topic, sig))
        if known is None:
            return verify_pubsub_signature(sender, data, seqno, topic, sig)
        self.hits += 1
        return known

    async def check(self, items: list[tuple]) -> None:
        """Check `items` (verify's argument tuples) now; remembered until `forget`."""
        if items:
            self._known.update(zip(items, await self.pool.check_async(items), strict=True))

    def forget(self, items: list[tuple]) -> None:
        for item in items:
            self._known.pop(item, None)

    def close(self) -> None:
        self.pool.close()


class UpdateTable:
    """The ledger's updates, repaired through the node's admission (the same rules as
    gossip, plus the signature and the `own_backfill` rule)."""

    kind = UPDATE_ROWS
    page_rows = UPDATE_ROWS.page_rows

    def __init__(
        self,
        ledger: Ledger,
        admission: Admission,
        metrics: NodeMetrics,
        track: Callable[[list[Verdict]], None],
        prechecked: Prechecked | None = None,
    ) -> None:
        self.ledger, self.admission, self.metrics, self.track = ledger, admission, metrics, track
        self.prechecked = prechecked  # the admission's `verify` must be its `verify`
        self.topic = topic_for(ledger.run_id)

    def _unheld(self, rows: list[Row]) -> list[tuple]:
        """The signature checks admission will make for `rows`: those not held as they are
        (a duplicate skips its check, `Admission.repair`)."""
        held = self.ledger.scalars_of_many((m.peer, m.round) for m, _ in rows)
        return [
            (m.peer, e.data, e.seqno, self.topic, e.signature)
            for m, e in rows
            if not same_scalars(held.get((m.peer, m.round)), m.scalars)
        ]

    def digests(self) -> Digests:
        return self.ledger.bucket_digests(BUCKET_ROUNDS)

    def rows_after(self, cursor: tuple, max_round: int, limit: int) -> list[Row]:
        return self.ledger.signed_after(cursor[0], cursor[1], max_round, limit)

    def set_digest(self, rows: Sequence[Row]) -> bytes:
        return set_digest(m for m, _ in rows)

    def note_digest(self, server: bytes, theirs: Digests) -> None:
        if theirs:  # the window's upper bound may follow a quorum of digest claims
            self.admission.note_bucket_claim(server, (max(theirs) + 1) * BUCKET_ROUNDS - 1)

    async def insert(self, rows: list[Row], server: bytes, sole_server: bool) -> Intake:
        checked = self._unheld(rows) if self.prechecked is not None else []
        try:
            if checked:
                await self.prechecked.check(checked)
            verdicts = await self.admission.repair(rows, server, sole_server)
        finally:
            if checked:
                self.prechecked.forget(checked)
        self.track(verdicts)
        intake = Intake(new=sum(v.outcome is Outcome.ACCEPTED for v in verdicts))
        self.metrics.repaired.inc(intake.new)
        intake.bad = any(v.reason in BAD_PAGE_REASONS for v in verdicts)
        for verdict in verdicts:
            if verdict.outcome is Outcome.DROPPED:
                if verdict.reason not in SETTLED_DROPS:
                    intake.unsettled.add(verdict.message.round)
                if verdict.reason == "own_backfill":
                    intake.server_only.add(verdict.message.round)
        return intake


class AuditTable:
    """The ledger's audit records, repaired through the node's `AuditIntake`; new ones go
    to `on_new` (the peer daemon judges them)."""

    kind = AUDIT_ROWS
    page_rows = AUDIT_ROWS.page_rows

    def __init__(
        self,
        ledger: Ledger,
        intake: AuditIntake,
        on_new: Callable[[list[AuditRecord]], Awaitable[None]],
    ) -> None:
        self.ledger, self.intake, self.on_new = ledger, intake, on_new

    def digests(self) -> Digests:
        return self.ledger.audit_bucket_digests(BUCKET_ROUNDS)

    def rows_after(self, cursor: tuple, max_round: int, limit: int) -> list[Row]:
        return self.ledger.signed_audits_after(cursor, max_round, limit)

    def set_digest(self, rows: Sequence[Row]) -> bytes:
        # a fetch row carries `at` only in its envelope, and the digest covers it
        return audit_set_digest(self._as_signed(record, envelope) for record, envelope in rows)

    def _as_signed(self, record: AuditRecord, envelope: Envelope) -> AuditRecord:
        """`record` with the `at` its envelope carries (as it is: such a row that does not
        decode is refused, and its bucket not taken in)."""
        try:
            return decode_audit(envelope.data, self.ledger.run_id, record.auditor)
        except Exception:
            return record

    def note_digest(self, server: bytes, theirs: Digests) -> None:
        pass

    async def insert(self, rows: list[Row], server: bytes, sole_server: bool) -> Intake:
        fresh, bad, dropped = self.intake.repair(rows)
        if fresh:
            await self.on_new(fresh)
        unsettled = {round_ for round_, why in dropped if why not in SETTLED_DROPS}
        return Intake(new=len(fresh), bad=bool(bad), unsettled=unsettled)


# -- planning --------------------------------------------------------------------------------


@dataclass
class _Exchange:
    """One repair exchange with one peer: its deadline (grown by what the digests claimed),
    the rows it brought per table, whether it ended early, whether its page budget left
    rows out."""

    deadline: float
    new: Counter[str] = field(default_factory=Counter)
    aborted: bool = False
    left_out: bool = False


# Bucket versions (count, sha256 of the set, as digests claim them) fetched whole and
# taken in: every row now in our table or refused for good. Fetching the same set again,
# from any server, cannot bring anything, so `plan` skips it until the server's bucket
# changes. A set some of whose rows were refused as `own_backfill` (served by their
# author) is skipped only for that server, and only while it is not the sole server we
# could ask. bucket -> {(count, digest): None (any server) or that server}.
Taken = dict[int, dict[tuple[int, bytes], bytes | None]]


def _already_taken(
    taken: Taken, bucket: int, version: tuple[int, bytes], server: bytes, sole_server: bool
) -> bool:
    versions = taken.get(bucket, {})
    if version not in versions:
        return False
    who = versions[version]
    return who is None or (who == server and not sole_server)


def plan(
    theirs: Digests,
    mine: Digests,
    last_round: int,
    exchange: _Exchange,
    taken: Taken,
    server: bytes,
    sole_server: bool,
    page_rows: int,
    floor_round: int = 0,
) -> list[list[tuple[int, int]]]:
    """The buckets to fetch, as runs of consecutive buckets [(bucket, rows claimed)], each
    run fetched as one round range, `page_rows` rows a page across its buckets.

    Wanted: buckets whose (count, hash) differ from ours, start by `last_round`, end
    after `floor_round` (a joiner trusting a checkpoint asks for its tail first), and are
    not a set already taken in (`Taken`). Taken oldest first while the pages the runs need
    (their claimed rows, `page_rows` a page, one at least a run) fit MAX_EXCHANGE_PAGES
    (at least one bucket is taken). The deadline grows by PAGE_SECONDS per page counted
    per bucket (one at least, at most MAX_EXCHANGE_PAGES in all). Buckets left for a later
    exchange mark it `left_out`.

    After a long partition every bucket of it differs, most from each server only in rows
    we hold already: one page per bucket, and every exchange starting again at the oldest
    ones, made repair refetch the same buckets in vain (30 minutes of 0.4 s rounds: 70
    buckets, 137 s to heal)."""
    wanted = []
    for bucket, (count, digest) in sorted(theirs.items()):
        if mine.get(bucket) == (count, digest) or bucket * BUCKET_ROUNDS > last_round:
            continue
        if (bucket + 1) * BUCKET_ROUNDS <= floor_round:
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
        if sum(max(1, math.ceil(r / page_rows)) for r in rows) > MAX_EXCHANGE_PAGES and chosen:
            break
        if extend:
            runs[-1].append((bucket, count))
        else:
            runs.append([(bucket, count)])
        run_rows = rows
        deadline_pages += max(1, math.ceil(count / page_rows))
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


def compare_digests(mine: Digests, theirs: Digests) -> tuple[int, int, int]:
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


# -- the engine ------------------------------------------------------------------------------


class Repair:
    """One node's repair of its `tables` (the first is its primary one, the updates:
    `sync_with` and the passes count its new rows). Serves them (`start`) and pulls them
    from peers (`sync_with`, `sync_round`, `anti_entropy_pass`, ...)."""

    def __init__(
        self,
        p2p,
        run_id: str,
        tables: list[RepairTable],
        admission: Admission,
        metrics: NodeMetrics,
        settings: NodeSettings,
        *,
        may_serve: Callable[[Any, int], bool],
        refuses: Callable[[bytes], str | None],
        peers: Callable[[], Awaitable[list]],
        avoids: Callable[[bytes], bool] = lambda peer: False,
        syncing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.p2p = p2p
        self.run_id = run_id
        self.tables = tables
        self.admission = admission
        self.metrics = metrics
        self.settings = settings  # call_timeout, repair_interval (read when used)
        self.may_serve = may_serve
        self.refuses = refuses
        self.avoids = avoids  # peers judged out (ledger bans): never asked, like refused ones
        self.peers = peers
        # While this node syncs (a joiner's catch-up) it answers digests with none: its
        # ledger is a partial copy of the others', and their anti-entropy fetched their
        # own rows back from it (a joiner of a million rows: a third of each founder's CPU).
        self.syncing = syncing
        self.behind: set[bytes] = set()  # peers whose last exchange left claimed rows out
        # Buckets wholly below this round are not fetched: a joiner that trusts a link of
        # this round syncs the rows after it first, and sets it back to 0 once ready.
        self.floor_round = 0
        self._backoff: dict[bytes, tuple[float, int]] = {}  # peer -> (not before, failures)
        self._forget_at = FORGET_AT_LEAST  # `_forget_backoffs` looks past this size
        self._taken: dict[str, Taken] = {t.kind.name: {} for t in tables}
        # `sync_with` runs one exchange at a time: side by side (a joiner's catch-up with
        # every connected peer, each new connection's repair) they fetched, decoded and
        # checked the same rows from each server, before any of them was written (a joiner
        # of 100,000 rows and 3 servers: 3x the work). One after another, the first brings
        # the rows and the next ones find their buckets equal. Anti-entropy's exchanges
        # are not held by it, so a slow server holds up no more than the exchanges queued
        # behind it (each within its deadline).
        self._one_at_a_time = asyncio.Lock()
        self.handlers: dict[str, Callable[[Any, bytes], Awaitable[bytes]]] = {}
        for table in tables:
            self.handlers[table.kind.digest_rpc] = self._digest_handler(table)
            self.handlers[table.kind.fetch_rpc] = self._fetch_handler(table)

    # -- serving ------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve every table's digest and fetch requests."""
        for name, handler in self.handlers.items():
            await serve_bytes(self.p2p, name, handler)

    def _digest_handler(self, table: RepairTable):
        label = table.kind.digest_rpc.removeprefix("seedflood.")
        empty = msgpack.packb([])

        async def serve(peer, request: bytes) -> bytes:
            if (
                decode_digest_request(request) != self.run_id
                or not self.may_serve(peer, 0)
                or self.syncing()
            ):
                return empty
            with timed(self.metrics.repair_serve_seconds.labels(label)):
                digests = table.digests()
                reply = msgpack.packb([[b, c, h] for b, (c, h) in sorted(digests.items())])
            return reply if self.may_serve(peer, len(reply)) else empty

        return serve

    def _fetch_handler(self, table: RepairTable):
        kind = table.kind
        label = kind.fetch_rpc.removeprefix("seedflood.")
        empty = kind.encode_rows([])

        async def serve(peer, request: bytes) -> bytes:
            fields = kind.decode_fetch_request(request)
            if fields is None or fields[0] != self.run_id or not self.may_serve(peer, 0):
                return empty
            _, cursor, max_round, limit = fields
            with timed(self.metrics.repair_serve_seconds.labels(label)):
                reply = kind.encode_rows(table.rows_after(cursor, max_round, limit))
            return reply if self.may_serve(peer, len(reply)) else empty

        return serve

    # -- one exchange -------------------------------------------------------------------
    async def sync_with(self, peer_id, sole_server: bool = True) -> int:
        """Pull every row `peer_id` has in buckets that differ from ours, table by table;
        returns the primary table's new rows. Bounded as the module docstring says; a bad
        reply or page ends the exchange (counted, penalized, backed off). `sole_server`:
        the peer is the only one we could ask (repair's old-row rule). One such exchange
        at a time (`_one_at_a_time`)."""
        async with self._one_at_a_time:
            return await self._sync_with(peer_id, sole_server)

    async def _sync_with(self, peer_id, sole_server: bool) -> int:
        server = peer_id.to_bytes()
        self.behind.discard(server)
        if not self.is_source(server) or time.monotonic() < self._backoff.get(server, (0.0, 0))[0]:
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
        return exchange.new[self.tables[0].kind.name]

    async def _exchange(
        self, peer_id, server: bytes, sole_server: bool, exchange: _Exchange
    ) -> None:
        loop = asyncio.get_running_loop()

        async def call(name: str, request: bytes) -> bytes:
            """One repair request, within the exchange's deadline, timed, its reply counted."""
            left = min(self.settings.call_timeout, exchange.deadline - loop.time())
            if left <= 0:
                raise RemoteCallError(f"repair exchange with {short_id(server)} over its deadline")
            label = name.removeprefix("seedflood.")
            with timed(self.metrics.repair_call_seconds.labels(label)):
                reply = await call_bytes(
                    self.p2p, peer_id, name, request, left, max_response=MAX_FETCH_REPLY_BYTES
                )
            self.metrics.repair_bytes_in.labels(label).inc(len(reply))
            return reply

        last_round = None
        for table in self.tables:
            reply = await call(table.kind.digest_rpc, msgpack.packb([self.run_id, BUCKET_ROUNDS]))
            try:
                theirs = decode_digests(reply)
            except Rejected as exc:
                self._abort(server, "bad_reply", exchange)
                self.admission.drop_reply(exc, server)
                return
            table.note_digest(server, theirs)
            if last_round is None:  # once per exchange, after the primary table's claims
                last_round = self._last_round()
            taken = self._taken[table.kind.name]
            runs = plan(
                theirs,
                table.digests(),
                last_round,
                exchange,
                taken,
                server,
                sole_server,
                table.page_rows,
                self.floor_round,
            )
            pages = 0
            for run in runs:
                pages = await self._fetch_run(
                    table, call, server, sole_server, exchange, run, theirs, last_round, pages
                )
                if pages is None:
                    return

    def _last_round(self) -> int:
        """Rows past the window's upper bound would be refused anyway: not fetched."""
        admission = self.admission
        upper = max(admission.reference_round(), quorum_round(admission.bucket_claims.values()))
        return upper + admission.window.max_ahead

    async def _fetch_run(
        self,
        table: RepairTable,
        call,
        server: bytes,
        sole_server: bool,
        exchange: _Exchange,
        run: list[tuple[int, int]],
        theirs: Digests,
        last_round: int,
        pages: int,
    ) -> int | None:
        """Fetch one run of consecutive buckets as one round range, page by page, taking
        from each bucket no more than the rows its digest claimed. Returns the pages used
        so far, None if the exchange ended (a bad reply or page: counted and penalized).

        An honest server's bucket grows while a run goes on (gossip arrives between its
        digest and our fetch): rows past a bucket's claim are left, without blame, for
        the next exchange. That still bounds the work: at most MAX_EXCHANGE_PAGES pages."""
        kind, limit = table.kind, table.page_rows
        claims = dict(run)
        got = dict.fromkeys(claims, 0)
        settled = dict.fromkeys(claims, True)  # every row in our table or refused for good
        received: dict[int, list] = {b: [] for b in claims}
        backfill = dict.fromkeys(claims, False)
        lo = max(run[0][0] * BUCKET_ROUNDS, self.floor_round)  # a floor inside the bucket
        hi = min(run[-1][0] * BUCKET_ROUNDS + BUCKET_ROUNDS - 1, last_round)
        cursor = kind.first_cursor(lo)

        def ask(after: tuple) -> asyncio.Task:
            request = kind.encode_fetch_request(self.run_id, after, hi, limit)
            return asyncio.ensure_future(call(kind.fetch_rpc, request))

        # The next page is asked for as soon as this one is decoded, so the server builds it
        # and it travels while this one's signatures are checked and its rows written.
        ahead = ask(cursor)
        try:
            while pages < MAX_EXCHANGE_PAGES:
                data = await ahead
                ahead = None
                pages += 1
                try:
                    rows = kind.decode_rows(data, limit)
                    kind.check_rows_follow(rows, cursor, hi)
                except Rejected as exc:
                    self._abort(server, "bad_reply", exchange)
                    self.admission.drop_reply(exc, server)
                    return None
                keep = []
                for row in rows:  # (record, envelope) pairs, ascending
                    bucket = row[0].round // BUCKET_ROUNDS
                    if got.get(bucket, 0) < claims.get(bucket, 0):
                        got[bucket] += 1
                        keep.append(row)
                        received[bucket].append(row)
                more = len(rows) == limit and not all(got[b] >= claims[b] for b in claims)
                if more:
                    cursor = kind.key(rows[-1][0])
                    if pages < MAX_EXCHANGE_PAGES:
                        ahead = ask(cursor)
                intake = await table.insert(keep, server, sole_server)
                exchange.new[kind.name] += intake.new
                if intake.bad:
                    # one bad row: no honest peer serves it (see reputation.PENALTIES)
                    self._abort(server, "bad_page", exchange, "bad_page")
                    return None
                for round_ in intake.unsettled:
                    settled[round_ // BUCKET_ROUNDS] = False
                for round_ in intake.server_only:
                    backfill[round_ // BUCKET_ROUNDS] = True
                if not more:
                    break
            else:  # the page budget ran out inside this run
                exchange.left_out = True
                return pages
        finally:
            if ahead is not None:  # the exchange ended early: the page asked ahead is not read
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead
        taken = self._taken[kind.name]
        for bucket, claimed in run:
            whole = bucket * BUCKET_ROUNDS + BUCKET_ROUNDS - 1 <= hi
            # The set taken in must be the one the digest named: a server claiming another
            # set's digest (an honest peer's full bucket) for rows we hold would make us
            # skip that set, and the rows we lack, for good.
            version = theirs[bucket]
            if whole and got[bucket] == claimed and settled[bucket]:
                if table.set_digest(received[bucket]) != version[1]:
                    continue
                versions = taken.setdefault(bucket, {})
                if versions.get(version, server) is not None:  # None (any server) stays
                    versions[version] = server if backfill[bucket] else None
                while len(versions) > MAX_TAKEN_VERSIONS:
                    del versions[next(iter(versions))]
        return pages

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
            self.admission.reputation.penalize(server, penalty)
        failures = self._backoff.get(server, (0.0, 0))[1] + 1
        wait = min(MAX_BACKOFF, self.settings.repair_interval * 2**failures)
        now = time.monotonic()
        self._backoff[server] = (now + wait, failures)
        self._forget_backoffs(now)
        log.info(
            "repair with %s ended (%s): not asked again for %.0f s",
            short_id(server),
            why,
            wait,
            extra={"fields": {"event": "repair_abort", "why": why}},
        )

    def _forget_backoffs(self, now: float) -> None:
        """Forget the back-offs that ended more than MAX_BACKOFF ago (a peer that fails
        after that starts again from the shortest wait), once the table has doubled: a
        run with churn meets ever more peers, and most that failed never come back."""
        if len(self._backoff) < self._forget_at:
            return
        for peer in [p for p, (until, _) in self._backoff.items() if now - until > MAX_BACKOFF]:
            del self._backoff[peer]
        self._forget_at = max(FORGET_AT_LEAST, 2 * len(self._backoff))

    # -- passes -------------------------------------------------------------------------
    def is_source(self, server: bytes) -> bool:
        """May `server` be asked: not refused (banned here, outside a closed run), not
        judged out (`avoids`: banned by the ledger's verdicts)?"""
        return self.refuses(server) is None and not self.avoids(server)

    def sources(self, peers: list) -> list:
        """`peers` (PeerIDs) that may be asked (`is_source`), in their order."""
        return [p for p in peers if self.is_source(p.to_bytes())]

    async def sync_round(self, peers: list | None = None, so_far: int | None = None) -> int:
        """One anti-entropy pass with the given (default: all topic) peers; banned ones are
        skipped (`sources`), and do not count as servers we could ask. `so_far`: rows a
        joiner's catch-up fetched before this pass; each exchange that brings rows is then
        logged (a long history takes minutes, and shows its progress)."""
        new = 0
        given = peers if peers is not None else await self.peers()
        peers = self.sources(given)
        for skipped in set(given) - set(peers):
            self.behind.discard(skipped.to_bytes())  # not a reason for another pass
        for peer_id in peers:
            try:
                fetched = await self.sync_with(peer_id, sole_server=len(peers) <= 1)
                new += fetched
                if so_far is not None and fetched:
                    log.info(
                        "syncing: %d rows from %s (%d in all so far)",
                        fetched,
                        short_id(peer_id.to_bytes()),
                        so_far + new,
                        extra={"fields": {"event": "sync_progress", "rows": so_far + new}},
                    )
            except RemoteCallError as exc:
                log.debug("sync with %s failed: %s", peer_id, exc)
            except UserError:
                raise  # our own ledger cannot be written
            except Exception as exc:  # whatever a peer sends, we go on with the others
                log.warning("sync with %s failed: %r", peer_id, exc)
        return new

    async def sync_until_complete(self, peers: list, max_passes: int = MAX_SYNC_PASSES) -> int:
        """Anti-entropy passes with `peers` until no exchange had rows left out by its page
        budget (a late joiner's long history takes several), a pass brings nothing, or
        `max_passes`; returns the new rows. Each pass is bounded as `sync_with` is."""
        total = 0
        for _ in range(max_passes):
            new = await self.sync_round(peers, so_far=total)
            total += new
            if not new or not self.behind:
                break
        return total

    async def repair_new_peer(self, peer_id) -> int:
        """Repair from a newly connected peer (network/peers/reconnect.py). When a partition
        heals, every peer across it connects at once; their exchanges run one after another
        (`sync_with`), so the first brings the other side's rows and the next ones skip the
        sets it took (the memo `Taken`). A slow peer delays the next exchange by at most its
        deadline (74 s, then backoff); anti-entropy goes on meanwhile."""
        return await self.sync_round([peer_id])

    async def anti_entropy_pass(self) -> int:
        """One exchange with a random topic peer; failures are logged, never raised (but a
        UserError: our own ledger cannot be written)."""
        peers = self.sources(await self.peers())  # a pass is never spent on a banned peer
        if not peers:
            return 0
        try:
            new = await self._sync_with(random.choice(peers), sole_server=len(peers) <= 1)
        except RemoteCallError as exc:
            log.debug("anti-entropy failed: %s", exc)
            return 0
        except UserError:
            raise
        except Exception as exc:  # repair must outlive any one bad exchange
            log.warning("anti-entropy failed: %r", exc)
            return 0
        if new:
            log.info(
                "repair: fetched %d missing messages",
                new,
                extra={"fields": {"event": "repair", "count": new}},
            )
        return new

    # -- a joiner's check of its sources --------------------------------------------------
    async def check_sources(self, peers: list) -> SourceCheck:
        """Ask each of `peers` for its primary table's digests (one bounded request each)
        and compare them with ours: what a joiner fetched, checked against every source."""
        check = SourceCheck()
        table = self.tables[0]
        request = msgpack.packb([self.run_id, BUCKET_ROUNDS])
        for peer_id in self.sources(peers):
            source = peer_id.to_bytes()
            try:
                reply = await call_bytes(
                    self.p2p,
                    peer_id,
                    table.kind.digest_rpc,
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
            lacking, ahead, differ = compare_digests(table.digests(), theirs)
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
