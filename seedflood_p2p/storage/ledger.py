"""The durable log of accepted update messages: one SQLite file in WAL mode.

A message is keyed by (peer, round) (a file holds one run); inserting it twice is a
no-op, so applying the ledger is idempotent and arrival order does not matter. Every
insert is committed with synchronous=FULL before the caller applies the
message, so a process killed at any point reopens with every committed
message intact (SQLite's journal rolls back a half-written transaction).

A flood node (`network/gossip/flood.py`) moves the fsync off its event loop
(`Ledger.sync_in_background`, issue 46): commits are then written to the WAL with
synchronous=NORMAL (they survive a killed process, as before, and keep their order), and a
sync thread fsyncs the WAL behind them, one fsync for every commit since the last.
What a power loss or kernel crash may then lose: rows committed within the last fsync
(~6-9 ms), which repair fetches again from peers. Never this peer's own update (the node
publishes it only after `flush`), and never a row a checkpoint counts (`rows_sha256`
flushes first).
The run's manifest is stored beside the messages, so a ledger file alone is
enough to rebuild the model from the base weights.

The file's layout (`storage/layout.py`: ~117 B a row, from 247.5) stores the run id once,
names peers by a small number and an 8-byte seqno by its distance from what the sender's
first seqno and the row's round predict; a file of an older layout is converted in place
when opened. The digests are `storage/digests.py`'s, the background fsync
`storage/wal_sync.py`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from seedflood_p2p.core.config import MAX_ROUND, RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.audit_record import MAX_AUDIT_BYTES, check_audit_envelope
from seedflood_p2p.protocol.framing import MAX_PEER_ID_BYTES, MAX_SCALARS, Rejected, topic_for
from seedflood_p2p.protocol.message import (
    AuditRecord,
    Envelope,
    UpdateMessage,
    pack_scalars,
    shared_peer_id,
    unpack_scalars,
)
from seedflood_p2p.protocol.update import MAX_UPDATE_BYTES, check_envelope
from seedflood_p2p.storage.cut import CutRanges
from seedflood_p2p.storage.digests import (
    audit_member_hash,
    digest_of,
    digest_within,
    member_set_digest,
    row_member_hash,
)
from seedflood_p2p.storage.layout import (
    BY_PEER,
    LAYOUT,
    MESSAGES,
    PEER_ID,
    RUN_KEY,
    SeqnoRef,
    envelope_columns,
    int64,
    layout_of,
    seqno_bytes,
    set_up,
)
from seedflood_p2p.storage.wal_sync import WalSyncer

log = logging.getLogger("seedflood.ledger")

# Losing copies kept per (peer, round) (`Ledger.keep_losing`): the first copy to lose (the
# one peers most likely trained on before the other arrived) and at most two more. Each
# costs an audit of a later update one retry at most (peer/state_rewind.py caps those), and
# an author that signs many copies of one round is banned at the second anyway.
MAX_LOSING_COPIES = 3


def digest_within_file(path: str | Path, cut: dict[str, list[list[int]]]) -> tuple[int, str]:
    """`digest_within` of a ledger file's update rows, read on a read-only connection of
    its own (committed rows: under WAL, what a writer in another process committed)."""
    from seedflood_p2p.storage.cut import cut_contains

    covered = cut_contains(cut)
    db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    try:
        return digest_within(_every_message(db), covered)
    finally:
        db.close()


def digest_within_main() -> None:
    """A child process's `digest_within_file` (peer/latejoin.py runs the history check in
    one, so that a pass over ten million rows does not hold the daemon's GIL): JSON
    {"path", "cut"} on stdin, JSON [count, digest] on stdout."""
    import json
    import sys

    asked = json.load(sys.stdin)
    json.dump(list(digest_within_file(asked["path"], asked["cut"])), sys.stdout)


def _gapped(first: int, last: int, inside: int, low: int, high: int) -> bool:
    """Does a peer whose rows span [first, last], `inside` of them in [low, high], miss a
    round of [max(low, first + 1), min(high, last - 1)]? Its first and last rows lie
    outside that range, and count in `inside` when they are in [low, high]."""
    a, b = max(low, first + 1), min(high, last - 1)
    if b < a:
        return False
    return inside - (low <= first <= high) - (low <= last <= high) < b - a + 1


def _parts(items: list, size: int = 450) -> Iterator[list]:
    """`items` in lists of at most `size`: SQLite bounds a statement's variables (two
    parts of 450 stay under the oldest bound, 999)."""
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


def _marks(items: Sequence) -> str:
    """The "?, ?, ..." of an IN list of `items`."""
    return ",".join("?" * len(items))


@dataclass
class _BucketMembers:
    """A growing bucket's member hashes, sorted, and the rows (peer numbers by round)
    they cover."""

    peers: dict[int, set[int]] = field(default_factory=dict)
    hashes: list[bytes] = field(default_factory=list)


def _every_message(db: sqlite3.Connection) -> Iterator[UpdateMessage]:
    """Every update row `db` reads, in canonical order (a snapshot's, a child's check)."""
    for row in db.execute(f"SELECT m.round, p.peer, m.scalars FROM {MESSAGES} {BY_PEER}"):
        yield _message(*row)


def _message(round_: int, peer: bytes, scalars: bytes) -> UpdateMessage:
    return UpdateMessage(round_, shared_peer_id(peer), unpack_scalars(scalars))


def _audit_record(
    accused: bytes, round_: int, auditor: bytes, scalars: bytes, at: int | None
) -> AuditRecord:
    return AuditRecord(
        bytes(accused), round_, bytes(auditor), unpack_scalars(scalars), -1 if at is None else at
    )


@dataclass
class _Pending:
    """What a write transaction looked up or numbered (`Ledger._peer_id`), cached only
    once it commits: peer id -> peers.id, and peers.id -> its seqno reference."""

    ids: dict[bytes, int] = field(default_factory=dict)
    bases: dict[int, SeqnoRef] = field(default_factory=dict)


@dataclass(frozen=True)
class LedgerCheck:
    """What `Ledger.verify` checked: update rows with a signed envelope, rows without, the
    peers with unsigned rows (updates or audit records), seconds, and audit records signed
    and unsigned."""

    signed: int
    unsigned: int
    unsigned_peers: int
    seconds: float
    audits_signed: int = 0
    audits_unsigned: int = 0
    trusted: int = 0  # signed rows not re-checked: unchanged since a checkpoint (see verify)


VERIFY_CHUNK = 4096  # rows `Ledger.verify` hands `check_many` at once

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_name(peer: bytes) -> str:
    """A peer id as libp2p prints it (base58), for error lines."""
    n, out = int.from_bytes(peer, "big"), ""
    while n:
        n, digit = divmod(n, 58)
        out = _B58[digit] + out
    return "1" * (len(peer) - len(peer.lstrip(b"\0"))) + out


class Ledger:
    """Accepted messages of one run, in a SQLite file."""

    def __init__(self, path: str | Path, run_id: str) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self._config: RunConfig | None = None  # the stored manifest, parsed: open_existing
        self._bucket_cache: dict[tuple[int, int], tuple[int, bytes]] = {}
        self._audit_bucket_cache: dict[tuple[int, int], tuple[int, bytes]] = {}
        self._members: dict[tuple[int, int], _BucketMembers] = {}  # the newest bucket's
        self._count: tuple[str, int] | None = None  # (run_id, rows): kept current by add()
        # bucket_rounds -> {bucket: rows} of the messages: counted once, then kept current
        # by add() (`bucket_digests` is asked every second; a GROUP BY over every row took
        # 0.27 s at a million rows)
        self._bucket_counts: dict[int, dict[int, int]] = {}
        self._syncer: WalSyncer | None = None  # sync_in_background: fsyncs off the caller
        self._file_run: str | None = None  # the run the file's rows belong to (RUN_KEY)
        self._peer_ids: dict[bytes, int] = {}  # peers.id of peers committed (`_peer_id`)
        self._seqno_bases: dict[int, SeqnoRef] = {}  # each peer's, committed
        # Rows this object replaced (`replace`): with a count of the rows below a round,
        # whether those rows are still the ones read before (chain.ChainTail).
        self.replacements = 0
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # A damaged cell may hold text that is not UTF-8 (e.g. a blob turned text by
            # `||`): read it anyway, so `verify` names the row instead of sqlite3 failing.
            self._db.text_factory = _lenient_text
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(check)
            if layout_of(self._db) != LAYOUT:
                set_up(self._db, self.path)
        except sqlite3.OperationalError as exc:  # before its base class DatabaseError
            raise UserError(f"cannot open ledger {self.path} ({exc}): check the path") from None
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a damaged schema: the
            # latter when sqlite3's own error text quotes bytes that are not UTF-8
            raise UserError(
                f"ledger {self.path} is corrupt or not a seedflood ledger ({exc}): move it "
                "aside and let the peer re-sync from the network, or rebuild it from a "
                "peer's copy"
            ) from None

    @classmethod
    def open_existing(cls, path: str | Path) -> Ledger:
        """Open a ledger file for reading, taking the run id from its manifest; the manifest,
        parsed once here, is `config`."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"ledger file {path} does not exist: pass the path of a .sqlite ledger")
        try:  # look before opening for writing: never add our tables to someone else's file
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                ours = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone()
        except (sqlite3.DatabaseError, UnicodeDecodeError):
            ours = True  # unreadable: the constructor says how (corrupt, locked, ...)
        if not ours:
            raise UserError(f"{path} is not a seedflood ledger (no run manifest)")
        ledger = cls(path, run_id="")
        manifest = ledger.get_meta("manifest")
        if manifest is None:
            raise UserError(f"ledger {path} has no run manifest: it was not written by seedflood")
        ledger._config = RunConfig.from_json(manifest)
        ledger.run_id = ledger._config.run_id
        return ledger

    @property
    def config(self) -> RunConfig:
        """The run's manifest as stored in this ledger: parsed once when it was opened
        (`open_existing`), or the one it was claimed for (`claim`). Pass this on rather
        than parsing `get_meta("manifest")` again."""
        if self._config is None:
            raise RuntimeError(f"ledger {self.path} has no run yet: open_existing or claim it")
        return self._config

    def close(self) -> None:
        if self._syncer is not None:  # every commit durable before the file is let go
            self._syncer.stop()
            self._syncer = None
            self._db.execute("PRAGMA synchronous=FULL")
        self._db.close()

    # -- durability: the fsync off the event loop ---------------------------
    def sync_in_background(self) -> None:
        """From now on, commit without waiting for the disk: each commit is written to the
        WAL (synchronous=NORMAL: it survives a killed process, in commit order) and a sync
        thread fsyncs the WAL behind it; `flush` waits for that. The caller's thread (a
        node's event loop) then never waits on an fsync (6-9 ms wall each, issue 46). A
        file ledger only (":memory:" has no disk)."""
        if self._syncer is not None or str(self.path) == ":memory:":
            return
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._syncer = WalSyncer(Path(f"{self.path}-wal"), self._fsync)
        self._mark_committed()  # anything before, written under FULL, is durable anyway

    def _fsync(self, fd: int) -> None:
        """One fsync of the WAL (a seam: tests make it slow)."""
        os.fsync(fd)

    def _mark_committed(self) -> None:
        """A transaction was committed: the sync thread owes the disk an fsync."""
        if self._syncer is not None:
            self._syncer.committed()

    def durable(self) -> bool:
        """Is every commit so far on disk (fsynced)?"""
        return self._syncer is None or self._syncer.caught_up()

    def flush(self) -> None:
        """Block until every commit so far is on disk (no-op without `sync_in_background`)."""
        if self._syncer is not None:
            self._syncer.wait(self._syncer.generation)

    async def flush_async(self) -> None:
        """`flush` without blocking the event loop: awaits the sync thread's fsync that
        covers every commit so far (other coroutines run meanwhile)."""
        if self._syncer is not None:
            await self._syncer.wait_async(self._syncer.generation)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the run and the peers a file's rows name -------------------------
    def _mine(self) -> bool:
        """Are the file's rows this run's? A file holds one run (meta RUN_KEY, set with its
        first row): a ledger opened for another run finds none of them, as it did when
        every row carried its run id."""
        if self._file_run is None:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (RUN_KEY,)).fetchone()
            if row is None:
                return True  # no row yet
            self._file_run = row[0]
        return self._file_run == self.run_id

    def _bind_run(self) -> None:
        """Before rows are written (in their transaction): the file's run is this one, or
        becomes it. A file holds one run: rows of another are refused."""
        if not self._mine():
            raise UserError(
                f"ledger {self.path} holds rows of run {self._file_run!s:.12}, not of "
                f"{self.run_id:.12}: a ledger file holds one run; use a new --data-dir per run"
            )
        if self._file_run is None:  # read again once committed (this may roll back)
            self._db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (RUN_KEY, self.run_id))

    def _peer_id(self, peer: bytes, pending: _Pending) -> int:
        """`peer`'s peers.id, numbered now if it has none (in the caller's transaction:
        `pending` collects what was looked up, cached once it commits: `_committed`)."""
        got = self._peer_ids.get(peer)
        if got is None:
            got = pending.ids.get(peer)
        if got is None:
            row = self._db.execute("SELECT id FROM peers WHERE peer = ?", (peer,)).fetchone()
            if row is None:
                got = self._db.execute("INSERT INTO peers (peer) VALUES (?)", (peer,)).lastrowid
            else:
                got = row[0]
            pending.ids[peer] = got
        return got

    def _stored_envelope(
        self, number: int, round_: int, env: Envelope | None, pending: _Pending
    ) -> tuple:
        """(data, seqno, signature) as `messages` stores them for peer `number`'s row of
        `round_`: an 8-byte seqno as its distance from the peer's `seqno_origin` (its first
        one's seqno minus round) + `round_`."""
        data, seqno, signature = envelope_columns(env)
        if not (isinstance(seqno, bytes) and len(seqno) == 8):
            return data, seqno, signature
        value = int.from_bytes(seqno, "big")
        ref = self._seqno_bases.get(number, pending.bases.get(number))
        if ref is None:
            query = "SELECT seqno_base, seqno_origin FROM peers WHERE id = ?"
            base, origin = self._db.execute(query, (number,)).fetchone()
            if isinstance(origin, int):
                ref = SeqnoRef(origin, by_round=True)
            elif isinstance(base, int):  # a peer of a layout-3 file
                ref = SeqnoRef(base, by_round=False)
            else:  # the peer's first: its origin
                ref = SeqnoRef(int64(value - round_), by_round=True)
                query = "UPDATE peers SET seqno_origin = ? WHERE id = ?"
                self._db.execute(query, (ref.value, number))
            pending.bases[number] = ref
        predicted = ref.value + round_ if ref.by_round else ref.value
        return data, int64(value - predicted), signature

    def _committed(self, pending: _Pending) -> None:
        """The transaction `pending` was filled in committed: cache its peers."""
        self._peer_ids.update(pending.ids)
        self._seqno_bases.update(pending.bases)

    # -- writing ---------------------------------------------------------
    def add(
        self,
        messages: Iterable[UpdateMessage],
        envelopes: Sequence[Envelope | None] | None = None,
    ) -> list[UpdateMessage]:
        """Insert messages in one committed transaction; returns those that were new.

        `envelopes`, if given, holds each message's signed envelope (or None).
        """
        messages = list(messages)
        envelopes = list(envelopes) if envelopes is not None else [None] * len(messages)
        insert = "INSERT OR IGNORE INTO messages VALUES (?, ?, ?, ?, ?, ?)"
        pending = _Pending()
        try:
            self._db.execute("BEGIN IMMEDIATE")
            if messages:
                self._bind_run()
            rows = []
            for m, env in zip(messages, envelopes, strict=True):
                number = self._peer_id(m.peer, pending)
                rows.append(
                    (m.round, number, pack_scalars(m.scalars))
                    + self._stored_envelope(number, m.round, env, pending)
                )
            # Admission has already dropped what the ledger holds, so all are new but for a
            # race: one statement for the batch, and row by row only when one was ignored.
            new = messages
            self._db.execute("SAVEPOINT batch")  # the peers numbered above stay
            if self._db.executemany(insert, rows).rowcount != len(rows):
                self._db.execute("ROLLBACK TO batch")
                new = [m for m, r in zip(messages, rows) if self._db.execute(insert, r).rowcount]
            self._db.execute("COMMIT")
            self._committed(pending)
            self._mark_committed()
            if self._count is not None and self._count[0] == self.run_id:
                self._count = (self.run_id, self._count[1] + len(new))
            for bucket_rounds, counts in self._bucket_counts.items():
                for m in new:
                    bucket = m.round // bucket_rounds
                    counts[bucket] = counts.get(bucket, 0) + 1
        except BaseException as exc:  # nothing half-written stays open
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc).lower():
                raise UserError(
                    f"disk full while writing ledger {self.path}: free space on "
                    f"{self.path.parent} and restart the peer (nothing committed was lost)"
                ) from None
            raise
        return new

    def add_audits(
        self,
        records: Iterable[AuditRecord],
        envelopes: Sequence[Envelope | None] | None = None,
    ) -> list[AuditRecord]:
        """Log audit records in one committed transaction; returns those that were new.

        Of two copies of a record that differ only in `at` (its auditor signed both), the
        smaller `at` (-1, not carried, smallest) is kept, with its envelope, whichever came
        first: `at` fixes when the record takes effect (algorithm/probation.py), so every
        ledger must keep the same one. A copy that replaces the held one counts as new."""
        records = list(records)
        envelopes = list(envelopes) if envelopes is not None else [None] * len(records)
        new = []
        replaced = False
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if records:
                self._bind_run()
            for r, env in zip(records, envelopes, strict=True):
                key = (r.accused, r.round, r.auditor, pack_scalars(r.scalars))
                at = r.at if r.at >= 0 else None
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO audits (accused, round, auditor, scalars, "
                    "data, seqno, signature, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    key + envelope_columns(env) + (at,),
                )
                if not cur.rowcount:
                    cur = self._db.execute(
                        "UPDATE audits SET data = ?, seqno = ?, signature = ?, at = ? WHERE "
                        "accused = ? AND round = ? AND auditor = ? AND "
                        "scalars = ? AND COALESCE(at, -1) > ?",
                        envelope_columns(env) + (at, *key, r.at),
                    )
                    replaced |= bool(cur.rowcount)
                if cur.rowcount:
                    new.append(r)
            if replaced:
                self._db.execute("DELETE FROM bucket_digests WHERE kind = 'audits'")
            self._db.execute("COMMIT")
            self._mark_committed()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        if replaced:  # a bucket's digest changed with its count unchanged
            self._audit_bucket_cache.clear()
        return new

    def audits(self, min_round: int = 0, max_round: int | None = None) -> list[AuditRecord]:
        """The audit records of this run (of accused updates in rounds min..max), in
        (accused, round, auditor, scalars) order."""
        if not self._mine():
            return []
        upper = (1 << 62) if max_round is None else max_round
        rows = self._db.execute(
            "SELECT accused, round, auditor, scalars, at FROM audits WHERE "
            "round BETWEEN ? AND ? ORDER BY accused, round, auditor, scalars",
            (min_round, upper),
        )
        return [_audit_record(*row) for row in rows]

    def has_audit(self, record: AuditRecord) -> bool:
        """Is `record` held, as it is or with an `at` no larger (`add_audits` keeps that)?"""
        query = (
            "SELECT 1 FROM audits WHERE accused = ? AND round = ? AND "
            "auditor = ? AND scalars = ? AND COALESCE(at, -1) <= ?"
        )
        key = (record.accused, record.round, record.auditor, pack_scalars(record.scalars))
        found = self._db.execute(query, (*key, record.at)).fetchone() is not None
        return found and self._mine()

    def signed_audits_after(
        self, cursor: tuple[int, bytes, bytes, bytes], max_round: int, limit: int
    ) -> list[tuple[AuditRecord, Envelope]]:
        """Up to `limit` signed audit records after `cursor` (round, accused, auditor,
        packed scalars), in that order, through `max_round`: what audit repair serves."""
        if not self._mine():
            return []
        rows = self._db.execute(
            "SELECT round, accused, auditor, scalars, data, seqno, signature, at FROM audits "
            "WHERE (round, accused, auditor, scalars) > (?, ?, ?, ?) "
            "AND round <= ? AND signature IS NOT NULL "
            "ORDER BY round, accused, auditor, scalars LIMIT ?",
            (*cursor, max_round, limit),
        ).fetchall()
        return [
            (
                _audit_record(a, r, b, s, at),
                Envelope(bytes(d), bytes(q), bytes(g)),
            )
            for r, a, b, s, d, q, g, at in rows
        ]

    def unsigned_audits(self, auditor: bytes) -> list[AuditRecord]:
        """`auditor`'s records logged without a signed envelope (our own, not yet echoed)."""
        if not self._mine():
            return []
        rows = self._db.execute(
            "SELECT accused, round, auditor, scalars, at FROM audits WHERE "
            "auditor = ? AND signature IS NULL ORDER BY round, accused, scalars",
            (auditor,),
        )
        return [_audit_record(*row) for row in rows]

    def set_audit_envelopes(self, items: Iterable[tuple[AuditRecord, Envelope]]) -> int:
        """Attach signed envelopes to our own records logged before they were signed (their
        echo from the daemon); returns how many rows got one. Then others can fetch them."""
        changed = 0
        if not self._mine():
            return 0
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for r, envelope in items:
                cur = self._db.execute(
                    "UPDATE audits SET data = ?, seqno = ?, signature = ? WHERE "
                    "accused = ? AND round = ? AND auditor = ? AND scalars = ? "
                    "AND signature IS NULL",
                    (*envelope_columns(envelope), r.accused, r.round, r.auditor,
                     pack_scalars(r.scalars)),
                )  # fmt: skip
                changed += cur.rowcount
            self._db.execute("COMMIT")
            self._mark_committed()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return changed

    def add_revocations(self, items: Iterable[tuple[bytes, int, bytes]]) -> int:
        """Log (holder, round, signed bytes) ticket revocations, checked by the caller, in
        one committed transaction; returns how many were new."""
        new = 0
        items = list(items)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if items:
                self._bind_run()
            for holder, round_, data in items:
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO revocations VALUES (?, ?, ?)", (holder, round_, data)
                )
                new += cur.rowcount
            self._db.execute("COMMIT")
            self._mark_committed()  # the sync thread owes its fsync (sync_in_background)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return new

    def revocations(self) -> list[tuple[bytes, int, bytes]]:
        """Every ticket revocation logged: (holder, round, signed bytes), in bytes order."""
        if not self._mine():
            return []
        rows = self._db.execute("SELECT holder, round, data FROM revocations ORDER BY data")
        return [(bytes(h), r, bytes(d)) for h, r, d in rows]

    def replace(self, message: UpdateMessage, envelope: Envelope | None) -> tuple[float, ...]:
        """Hold `message` instead of the update logged for its (peer, round): the
        equivocation rule (protocol.keeps_new). Returns the scalars it replaced.
        The replaced scalars are kept as a losing copy (`keep_losing`, same transaction).
        """
        old = self.scalars_of(message.peer, message.round)
        if old is None:
            raise KeyError((message.round, message.peer))
        pending = _Pending()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            number = self._peer_id(message.peer, pending)
            self._db.execute(
                "UPDATE messages SET scalars = ?, data = ?, seqno = ?, signature = ? "
                "WHERE round = ? AND peer = ?",
                (
                    pack_scalars(message.scalars),
                    *self._stored_envelope(number, message.round, envelope, pending),
                    message.round,
                    number,
                ),
            )
            self._insert_losing(UpdateMessage(message.round, message.peer, old))
            self._db.execute("DELETE FROM bucket_digests WHERE kind = 'messages'")
            self._db.execute("COMMIT")
            self._committed(pending)
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._mark_committed()
        self._bucket_cache.clear()  # same count, another set: cached hashes are stale
        self._members.clear()
        self.replacements += 1
        return old

    def keep_losing(self, message: UpdateMessage) -> bool:
        """Keep `message` as a losing copy of an equivocation: a signed update of a (peer,
        round) whose other copy the ledger holds (`replace` keeps the ones it replaces
        itself; the admission adds a copy that lost to the row held). At most
        MAX_LOSING_COPIES per (peer, round), the earliest kept. Returns whether it was new.
        Only an audit's retry reads them (`losing_copies`); nothing else does."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            added = self._insert_losing(message)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._mark_committed()
        return added

    def _insert_losing(self, message: UpdateMessage) -> bool:
        """(In the caller's transaction.)"""
        self._bind_run()
        cur = self._db.execute(
            "INSERT OR IGNORE INTO replaced (round, peer, scalars) SELECT ?, ?, ? "
            "WHERE (SELECT COUNT(*) FROM replaced WHERE round = ? AND peer = ?) < ?",
            (message.round, message.peer, pack_scalars(message.scalars),
             message.round, message.peer, MAX_LOSING_COPIES),
        )  # fmt: skip
        return cur.rowcount > 0

    def has_losing_copies(self, peer: bytes) -> bool:
        """Did `peer` sign two updates for one round (a losing copy of its is kept)?"""
        if not self._mine():
            return False
        row = self._db.execute("SELECT 1 FROM replaced WHERE peer = ? LIMIT 1", (peer,))
        return row.fetchone() is not None

    def losing_copies(
        self, min_round: int = 0, max_round: int | None = None
    ) -> dict[tuple[bytes, int], list[tuple[float, ...]]]:
        """The losing copies kept (`keep_losing`) of rounds min_round..max_round: (peer,
        round) -> their scalars, in the order they lost."""
        upper = MAX_ROUND if max_round is None else max_round
        rows = self._db.execute(
            "SELECT round, peer, scalars FROM replaced WHERE round BETWEEN ? AND ? ORDER BY rowid",
            (min_round, upper),
        )
        out: dict[tuple[bytes, int], list[tuple[float, ...]]] = {}
        if not self._mine():
            return out
        for round_, peer, scalars in rows:
            out.setdefault((bytes(peer), round_), []).append(unpack_scalars(scalars))
        return out

    def set_envelope(self, message: UpdateMessage, envelope: Envelope) -> None:
        """Attach the signed envelope to a message logged before it was signed (our own)."""
        self.set_envelopes([(message, envelope)])

    def set_envelopes(self, items: Iterable[tuple[UpdateMessage, Envelope]]) -> None:
        """`set_envelope` for several messages in one transaction."""
        if not self._mine():
            return  # no row of this run to attach one to
        pending = _Pending()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for message, envelope in items:
                row = self._db.execute(
                    "SELECT id FROM peers WHERE peer = ?", (message.peer,)
                ).fetchone()
                if row is None:
                    continue  # no row of that peer
                self._db.execute(
                    "UPDATE messages SET data = ?, seqno = ?, signature = ? WHERE "
                    "round = ? AND peer = ? AND signature IS NULL",
                    (
                        *self._stored_envelope(row[0], message.round, envelope, pending),
                        message.round,
                        row[0],
                    ),
                )
            self._db.execute("COMMIT")
            self._committed(pending)
            self._mark_committed()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
        self._mark_committed()

    def claim(self, config: RunConfig, fix: str) -> None:
        """Record the run's manifest (`config.to_json()`) here; `config` is then this
        ledger's `config`. A ledger of another run is refused: replacing its manifest would
        leave its messages without the settings that give them meaning."""
        manifest_json = config.to_json()
        stored = self.get_meta("manifest")
        if stored is not None and stored != manifest_json:
            other = hashlib.sha256(stored.encode()).hexdigest()[:12]  # = that run's id
            raise UserError(f"{self.path.parent} holds a ledger of another run ({other}): {fix}")
        self.set_meta("manifest", manifest_json)
        self._config = config

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    # -- reading ---------------------------------------------------------
    def __len__(self) -> int:
        """Messages of this run. COUNT(*) scans the run's rows (15 ms at 80,000 rows), and
        FloodNode asks after every accepted message: count once, then keep count in add()."""
        if self._count is None or self._count[0] != self.run_id:
            n = self._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
            self._count = (self.run_id, n if self._mine() else 0)
        return self._count[1]

    def messages(self, min_round: int = 0, max_round: int | None = None) -> Iterator[UpdateMessage]:
        """Messages in canonical order: (round, peer)."""
        if not self._mine():
            return
        upper = (1 << 62) if max_round is None else max_round
        rows = self._db.execute(
            f"SELECT m.round, p.peer, m.scalars FROM {MESSAGES} WHERE m.round BETWEEN ? AND ? "
            f"{BY_PEER}",
            (min_round, upper),
        )
        for row in rows:
            yield _message(*row)

    def count_below(self, round_: int) -> int:
        """The rows of rounds < `round_`: from the bucket counts `add` keeps (and a range
        count inside the last bucket) once `bucket_digests` has taken them, else one range
        count over the key (0.6 s at ten million rows)."""
        if not self._mine():
            return 0
        query = "SELECT COUNT(*) FROM messages WHERE round >= ? AND round < ?"
        if not self._bucket_counts:
            return self._db.execute(query, (0, round_)).fetchone()[0]
        bucket_rounds, counts = next(iter(self._bucket_counts.items()))
        start = round_ // bucket_rounds * bucket_rounds
        below = sum(count for bucket, count in counts.items() if bucket * bucket_rounds < start)
        if start < round_:
            below += self._db.execute(query, (start, round_)).fetchone()[0]
        return below

    def snapshot(self) -> LedgerRows | list[UpdateMessage]:
        """The update rows as they are now, in canonical order, read again on each pass
        (`LedgerRows`) instead of held as objects: what a restart streams. An in-memory
        ledger has no second connection to read from: its rows, as a list."""
        if str(self.path) == ":memory:":
            return list(self.messages())
        return LedgerRows(self)

    def max_round(self) -> int:
        """The highest round in the ledger, or -1 when empty."""
        row = self._db.execute("SELECT MAX(round) FROM messages").fetchone()
        return -1 if row[0] is None or not self._mine() else row[0]

    def rounds_by_peer(
        self, min_round: int, low: int, high: int, holes_only: bool = False
    ) -> dict[bytes, list[int]]:
        """{peer: its rounds >= `min_round`, ascending}; with `holes_only`, only the peers
        missing a round of [low, high] between their first and last rows there (a peer
        publishes every round once started: peer/rounds.py `holes`). That choice is one
        aggregate query over the rows, so a round's check of the settled state reads the
        rows of the few peers with a gap, not of all M (issue 46)."""
        if not self._mine():
            return {}
        numbers = None
        if holes_only:
            spans = self._db.execute(
                "SELECT peer, MIN(round), MAX(round), SUM(round BETWEEN ? AND ?) FROM messages "
                "WHERE round >= ? GROUP BY peer",
                (low, high, min_round),
            )
            numbers = [
                n for n, first, last, inside in spans if _gapped(first, last, inside, low, high)
            ]
            if not numbers:
                return {}
        query = f"SELECT p.peer, m.round FROM {MESSAGES} WHERE m.round >= ?"
        out: dict[bytes, list[int]] = {}
        # a peer is in one part only, and each part comes in round order
        for part in [None] if numbers is None else _parts(numbers):
            where = "" if part is None else f" AND m.peer IN ({_marks(part)})"
            args = [min_round, *(part or ())]
            for peer, round_ in self._db.execute(query + where + " ORDER BY m.round", args):
                out.setdefault(bytes(peer), []).append(round_)
        return out

    def peers(self, below: int | None = None) -> set[bytes]:
        """Every peer with at least one row (of a round < `below`, if given): who the run
        is known to have."""
        if not self._mine():
            return set()
        where = "" if below is None else f" WHERE round < {int(below)}"
        query = (
            f"SELECT p.peer FROM (SELECT DISTINCT peer FROM messages{where}) m "
            "JOIN peers p ON p.id = m.peer"
        )
        return {bytes(row[0]) for row in self._db.execute(query)}

    def has(self, peer: bytes, round_: int) -> bool:
        return self.scalars_of(peer, round_) is not None

    def payload_of(self, peer: bytes, round_: int) -> bytes | None:
        """The signed envelope's payload of `peer`'s update of `round_` (None: no such row,
        or a row logged without one yet: local-only, or our own not yet echoed)."""
        query = f"SELECT data FROM messages WHERE round = ? AND peer = {PEER_ID}"
        row = self._db.execute(query, (round_, peer)).fetchone()
        return None if row is None or row[0] is None or not self._mine() else bytes(row[0])

    def bucket_digests(self, bucket_rounds: int) -> dict[int, tuple[int, bytes]]:
        """{bucket: (count, hash)} over rounds [b * bucket_rounds, (b + 1) * bucket_rounds).

        The hash is SHA-256 over the bucket's per-message SHA-256 hashes, sorted: a set
        digest two peers compare without agreeing on an order, and collision-resistant
        (the XOR of 64-bit hashes it replaced could be collided with ~2^32 work, hiding a
        fork from repair for good). The ledger only grows and holds one message per
        (peer, round), so an unchanged count means an unchanged set (`replace` clears the
        cache): hashes are cached per (bucket, count), and the newest bucket, which grows
        every round, keeps its members' hashes, so a call hashes only the rows new to it.
        """
        return self._bucket_digests("messages", bucket_rounds, self._bucket_cache, self._grown)

    def audit_bucket_digests(self, bucket_rounds: int) -> dict[int, tuple[int, bytes]]:
        """`bucket_digests` of the audit records, bucketed by their accused update's round:
        what audit repair compares (the table only grows, so the same cache rule holds; a
        copy that replaces a record's `at` clears the cache)."""
        return self._bucket_digests(
            "audits",
            bucket_rounds,
            self._audit_bucket_cache,
            lambda key, lo, hi, growing: member_set_digest(
                audit_member_hash(r) for r in self.audits(lo, hi)
            ),
        )

    def _bucket_counts_of(self, table: str, bucket_rounds: int) -> list[tuple[int, int]]:
        """[(bucket, rows)] ascending: the messages' from counts add() keeps current, the
        audit records' (a few a round) counted each time."""
        counts = self._bucket_counts.get(bucket_rounds) if table == "messages" else None
        if counts is None:
            counts = dict(
                self._db.execute(
                    f"SELECT round / ?, COUNT(*) FROM {table} GROUP BY round / ?",
                    (bucket_rounds, bucket_rounds),
                ).fetchall()
            )
            if table == "messages":
                self._bucket_counts[bucket_rounds] = counts
        return sorted(counts.items())

    def _bucket_digests(self, table: str, bucket_rounds: int, cache: dict, digest_of) -> dict:
        if not self._mine():
            return {}
        rows = self._bucket_counts_of(table, bucket_rounds)
        if rows and not any(key[0] == bucket_rounds for key in cache):
            cache.update(self._kept_digests(table, bucket_rounds))
        newest = max((bucket for bucket, _ in rows), default=0)
        out, computed = {}, []
        for bucket, count in rows:
            key = (bucket_rounds, bucket)
            cached = cache.get(key)
            if cached is None or cached[0] != count:
                lo = bucket * bucket_rounds
                digest = digest_of(key, lo, lo + bucket_rounds - 1, bucket == newest)
                cached = cache[key] = (count, digest)
                if bucket < newest:  # the newest bucket still grows every round
                    computed.append((table, bucket_rounds, bucket, count, cached[1]))
            out[bucket] = cached
        if computed:
            self._keep_digests(computed)
        return out

    def _grown(self, key: tuple[int, int], lo: int, hi: int, growing: bool) -> bytes:
        """The set digest of the messages of rounds [lo, hi], bucket `key`, hashing only
        the rows that its kept members lack (`_members`: the `growing` bucket's, the
        newest, only): a round whose count moved is read again, its new rows hashed, the
        sorted list merged (two sorted runs: linear). An older bucket's digest is kept,
        not its members."""
        members = self._members.pop(key, None) if not growing else self._members.get(key)
        if members is None:
            members = _BucketMembers()
            if growing:
                for other in [k for k in self._members if k[0] == key[0]]:
                    del self._members[other]
                self._members[key] = members
        counts = self._db.execute(
            "SELECT round, COUNT(*) FROM messages WHERE round BETWEEN ? AND ? GROUP BY round",
            (lo, hi),
        ).fetchall()
        new: list[bytes] = []
        for round_, count in counts:
            known = members.peers.setdefault(round_, set())
            if len(known) == count:
                continue
            rows = self._db.execute(
                "SELECT m.peer, p.peer, m.scalars FROM messages m CROSS JOIN peers p "
                "ON p.id = m.peer WHERE m.round = ?",
                (round_,),
            )
            for number, peer, scalars in rows:
                if number not in known:
                    known.add(number)
                    new.append(row_member_hash(round_, bytes(peer), bytes(scalars)))
        if new:
            new.sort()
            members.hashes.extend(new)
            members.hashes.sort()
        return hashlib.sha256(b"".join(members.hashes)).digest()

    def _kept_digests(self, table: str, bucket_rounds: int) -> dict:
        """The digests `_keep_digests` kept for `table` at this bucket size."""
        rows = self._db.execute(
            "SELECT bucket, count, digest FROM bucket_digests WHERE kind = ? AND bucket_rounds = ?",
            (table, bucket_rounds),
        )
        return {(bucket_rounds, b): (count, bytes(digest)) for b, count, digest in rows}

    def _keep_digests(self, rows: list[tuple[str, int, int, int, bytes]]) -> None:
        """Keep bucket digests in the file (a cache: a failed write loses nothing)."""
        if self._db.in_transaction:
            return  # inside a caller's transaction (e.g. a digest read while writing)
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT OR REPLACE INTO bucket_digests VALUES (?, ?, ?, ?, ?)", rows
            )
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            log.warning("bucket digests not kept in %s: %s", self.path, exc)
            return
        self._mark_committed()

    def peer_totals(self) -> dict[bytes, tuple[int, int, int]]:
        """{peer: (rows, first round, newest round)}: one scan of the run's rows."""
        if not self._mine():
            return {}
        rows = self._db.execute(
            f"SELECT p.peer, COUNT(*), MIN(m.round), MAX(m.round) FROM {MESSAGES} GROUP BY m.peer"
        ).fetchall()
        return {bytes(peer): (n, lo, hi) for peer, n, lo, hi in rows}

    def round_peers(self, min_round: int, max_round: int) -> Iterator[tuple[int, bytes]]:
        """(round, peer) of every row in [min_round, max_round], canonical order; no
        scalars (the run page's updates-by-peer)."""
        if not self._mine():
            return
        rows = self._db.execute(
            f"SELECT m.round, p.peer FROM {MESSAGES} WHERE m.round BETWEEN ? AND ? {BY_PEER}",
            (min_round, max_round),
        )
        for round_, peer in rows:
            yield round_, bytes(peer)

    def audit_counts(self, min_round: int, max_round: int) -> list[tuple[int, int]]:
        """[(round, audit records of updates of that round)] in [min_round, max_round]."""
        if not self._mine():
            return []
        return self._db.execute(
            "SELECT round, COUNT(*) FROM audits WHERE round BETWEEN ? AND ?"
            " GROUP BY round ORDER BY round",
            (min_round, max_round),
        ).fetchall()

    def peer_rounds(self) -> dict[bytes, int]:
        """{peer: its newest round in the ledger}: what a quorum round is taken over."""
        if not self._mine():
            return {}
        rows = self._db.execute(
            f"SELECT p.peer, MAX(m.round) FROM {MESSAGES} GROUP BY m.peer"
        ).fetchall()
        return {bytes(peer): round_ for peer, round_ in rows}

    def signed_after(
        self, round_: int, peer: bytes, max_round: int, limit: int
    ) -> list[tuple[UpdateMessage, Envelope]]:
        """Up to `limit` signed messages after (round_, peer) in canonical order."""
        if not self._mine():
            return []
        rows = self._db.execute(  # (round, peer id bytes) > (round_, peer), as a row value
            "SELECT m.round, p.peer, m.scalars, m.data, m.seqno, m.signature, p.seqno_base, "
            f"p.seqno_origin FROM {MESSAGES} WHERE m.round BETWEEN ? AND ? "
            f"AND (m.round > ? OR p.peer > ?) AND m.signature IS NOT NULL {BY_PEER} LIMIT ?",
            (round_, max_round, round_, peer, limit),
        ).fetchall()
        return [
            (_message(r, p, s), Envelope(bytes(d), bytes(seqno_bytes(q, b, o, r)), bytes(g)))
            for r, p, s, d, q, g, b, o in rows
        ]

    def unsigned(self, peer: bytes) -> list[UpdateMessage]:
        """`peer`'s messages logged without a signed envelope (our own, not yet echoed)."""
        if not self._mine():
            return []
        rows = self._db.execute(
            f"SELECT round, scalars FROM messages WHERE peer = {PEER_ID} AND "
            "signature IS NULL ORDER BY round",
            (peer,),
        ).fetchall()
        return [_message(round_, peer, scalars) for round_, scalars in rows]

    def claims(self, keys: Iterable[tuple[int, bytes]]) -> dict[tuple[int, bytes], tuple]:
        """{(round, peer): scalars} of the rows among `keys` that the ledger holds: what a
        judgement reads of the updates (`probation.standing_of_ledger`)."""
        out = {}
        for round_, peer in set(keys):
            scalars = self.scalars_of(peer, round_)
            if scalars is not None:
                out[(round_, peer)] = scalars
        return out

    def scalars_of(self, peer: bytes, round_: int) -> tuple[float, ...] | None:
        query = f"SELECT scalars FROM messages WHERE round = ? AND peer = {PEER_ID}"
        row = self._db.execute(query, (round_, peer)).fetchone()
        return None if row is None or not self._mine() else unpack_scalars(row[0])

    def scalars_of_many(
        self, keys: Iterable[tuple[bytes, int]]
    ) -> dict[tuple[bytes, int], tuple[float, ...]]:
        """`scalars_of` of many (peer, round) keys in one query (admission's batch):
        {key: scalars} for the keys the ledger holds."""
        keys = set(keys)
        if not keys or not self._mine():
            return {}
        numbers = {p: self._peer_ids[p] for p, _ in keys if p in self._peer_ids}
        for part in _parts(list({p for p, _ in keys} - numbers.keys())):
            query = f"SELECT peer, id FROM peers WHERE peer IN ({_marks(part)})"
            numbers.update((bytes(p), n) for p, n in self._db.execute(query, part))
        if not numbers:
            return {}
        peer_of = {n: p for p, n in numbers.items()}
        rounds, ids = sorted({r for _, r in keys}), sorted(peer_of)
        out = {}
        for some_rounds in _parts(rounds):  # the pairs of two IN lists: point lookups
            for some_ids in _parts(ids):
                query = (
                    f"SELECT round, peer, scalars FROM messages WHERE round IN "
                    f"({_marks(some_rounds)}) AND peer IN ({_marks(some_ids)})"
                )
                for round_, number, scalars in self._db.execute(query, some_rounds + some_ids):
                    key = (peer_of[number], round_)
                    if key in keys:
                        out[key] = unpack_scalars(scalars)
        return out

    def digest(self) -> str:
        """SHA-256 over all messages in canonical order: equal digests, equal ledgers."""
        return digest_of(self.messages())

    # -- checking a ledger file ------------------------------------------
    def verify(
        self,
        check_signature: Callable[[bytes, bytes, bytes, str, bytes], bool],
        fix: str,
        directions: int | None = None,
        own_peer: bytes | None = None,
        trusted: Container[tuple[bytes, int]] | None = None,
        check_many: Callable[[list[tuple]], list[bool]] | None = None,
    ) -> LedgerCheck:
        """Check every row of a ledger file before it is replayed or restored; O(rows).

        Each row must be well-formed (round in range, a peer id, 1..16 finite float16
        scalars, `directions` of them if given), and a row that carries a signed envelope
        must carry its sender's valid signature over exactly this update
        (`protocol.update.check_envelope` with `check_signature`, normally
        `network.identity.verify_pubsub_signature`: ~45 us per Ed25519 check, so about
        4 s for 80,000 rows on one core). Rows without an envelope cannot be checked: they are the
        writer's own updates not yet echoed, or a local `seedflood train` ledger. So with
        `own_peer` (a daemon restoring its own ledger) only that peer's rows may lack one;
        without it, a ledger holding signed rows may have unsigned rows of one peer only
        (its writer). Audit records (the `audits` table) are checked the same way against
        their auditor's signature on the audit topic (`audit_record.check_audit_envelope`); the
        writer's own records may lack one (not echoed yet), nobody else's. A row that fails
        stops everything: a UserError naming the row (round, peer; for a record, round,
        accused and auditor), what is wrong, and `fix`.

        `trusted` (peer, round) update rows skip every check: rows the caller knows are byte
        for byte those already checked, e.g. the rows a checkpoint covers when `rows_sha256`
        of them still equals what the checkpoint recorded
        (storage/checkpoint.py:unchanged_rows). A restart then checks only the rows after
        its checkpoint, not 80,000 signatures. Given as `CutRanges` (rows the ledger holds,
        as `unchanged_rows` guarantees) that are every row up to their newest round, those
        rounds are not even read, but for their unsigned rows (checked as always): a
        restart at ten million rows read 10M trusted rows one by one for nothing.

        `check_many`, if given, answers `check_signature` for a list of its argument tuples
        at once (network/transport/sigcheck.py: by signer, in worker processes): update
        rows are then checked VERIFY_CHUNK at a time, with the same result and the same
        first failing row named as one by one.
        """
        started = time.perf_counter()
        signed = unsigned = skipped = 0
        unsigned_peers: dict[bytes, int] = {}  # peer -> first round it has an unsigned row

        def refuse(where: str, what: str) -> UserError:
            return UserError(
                f"ledger {self.path}: row ({where}) {what}: the file was altered or damaged; {fix}"
            )

        def unsigned_row(where: str, writer: bytes, round_: int, kind: str) -> None:
            if own_peer is not None and writer != own_peer:
                raise refuse(where, f"is another peer's {kind} without its signed envelope")
            unsigned_peers.setdefault(writer, round_)

        def bad_envelope(exc: Rejected, signer: str) -> str:
            return {
                "bad_signature": f"does not carry its {signer}'s valid signature",
                "mismatch": f"differs from the {'update' if signer == 'sender' else 'record'} "
                f"its {signer} signed",
            }.get(exc.reason, f"carries a bad envelope ({exc.reason})")

        pending: list[tuple[UpdateMessage, Envelope]] = []  # signed rows, not checked yet
        topic = topic_for(self.run_id)

        def settle() -> None:
            """Check the pending rows, in order (their signatures in one batch)."""
            nonlocal signed
            items = [(m.peer, e.data, e.seqno, topic, e.signature) for m, e in pending]
            answers = check_many(items)
            for (message, envelope), ok in zip(pending, answers, strict=True):
                try:
                    check_envelope(message, envelope, self.run_id, lambda *_, ok=ok: ok)
                except Rejected as exc:
                    where = _update_label(message.round, message.peer)
                    raise refuse(where, bad_envelope(exc, "sender")) from None
                signed += 1
            pending.clear()

        mine = self._mine()
        # LEFT JOIN: a row whose peer number names no peer is named
        select = (
            "SELECT m.round, p.peer, m.scalars, m.data, m.seqno, m.signature, p.seqno_base, "
            "p.seqno_origin FROM messages m LEFT JOIN peers p ON p.id = m.peer"
        )
        whole = isinstance(trusted, CutRanges) and mine and len(trusted) > 0
        newest = trusted.last_round() if whole else -1
        if whole and self.count_below(newest + 1) == len(trusted):
            # Every row of rounds <= newest is trusted: read only those without an
            # envelope there (never skipped), then every row after, in canonical order.
            unsigned_below = self._db.execute(
                f"{select} WHERE m.round <= ? AND m.data IS NULL {BY_PEER}", (newest,)
            ).fetchall()
            rows = itertools.chain(
                unsigned_below, self._db.execute(f"{select} WHERE m.round > ? {BY_PEER}", (newest,))
            )
            signed += len(trusted) - len(unsigned_below)
            skipped += len(trusted) - len(unsigned_below)
        else:
            rows = self._db.execute(f"{select} {BY_PEER}") if mine else iter(())
        for round_, peer, packed, data, seqno, signature, base, origin in rows:
            envelope = [data, seqno_bytes(seqno, base, origin, round_), signature]
            if trusted is not None and envelope[0] is not None and (peer, round_) in trusted:
                signed += 1  # byte for byte a row checked before (see above)
                skipped += 1
                continue
            problem = _row_problem(round_, peer, packed, envelope, directions)
            if problem:
                if pending:  # an earlier row's failure is the one to name
                    settle()
                raise refuse(_update_label(round_, peer), problem)
            message = _message(round_, peer, packed)
            if envelope[0] is None:
                unsigned += 1
                if pending and own_peer is not None and peer != own_peer:
                    settle()  # as above: unsigned_row refuses this one
                unsigned_row(_update_label(round_, peer), peer, round_, "update")
                continue
            if check_many is not None:
                pending.append((message, Envelope(*envelope)))
                if len(pending) >= VERIFY_CHUNK:
                    settle()
                continue
            try:
                check_envelope(message, Envelope(*envelope), self.run_id, check_signature)
            except Rejected as exc:
                raise refuse(_update_label(round_, peer), bad_envelope(exc, "sender")) from None
            signed += 1
        if pending:
            settle()
        # Audit records: the same checks, against the auditor's signature on the
        # audit topic. A forged record could ban an honest peer in every replay.
        audits_signed = audits_unsigned = 0
        rows = self._db.execute(
            "SELECT accused, round, auditor, scalars, data, seqno, signature, at FROM audits "
            "ORDER BY round, accused, auditor, scalars"
        )
        for accused, round_, auditor, packed, *envelope, at in rows if mine else ():
            where = (
                f"audit of round {round_!r:.24}, accused {_peer_label(accused)}, "
                f"auditor {_peer_label(auditor)}"
            )
            problem = _row_problem(round_, auditor, packed, envelope, directions, MAX_AUDIT_BYTES)
            if not problem and not (
                isinstance(accused, bytes) and 0 < len(accused) <= MAX_PEER_ID_BYTES
            ):
                problem = "has no valid accused peer id"
            if problem:
                raise refuse(where, problem)
            if at is not None and not (isinstance(at, int) and 0 <= at <= MAX_ROUND):
                raise refuse(where, "has a bad publication round (at)")
            record = _audit_record(accused, round_, auditor, packed, at)
            if envelope[0] is None:
                audits_unsigned += 1
                unsigned_row(where, auditor, round_, "audit record")
                continue
            try:
                check_audit_envelope(record, Envelope(*envelope), self.run_id, check_signature)
            except Rejected as exc:
                raise refuse(where, bad_envelope(exc, "auditor")) from None
            audits_signed += 1
        if signed + audits_signed and len(unsigned_peers) > 1:
            peer, round_ = sorted(unsigned_peers.items(), key=lambda kv: (kv[1], kv[0]))[1]
            raise UserError(
                f"ledger {self.path}: row (round {round_}, peer {peer_name(peer)}) has no "
                f"signed envelope, like rows of {len(unsigned_peers) - 1} other peer(s), in a "
                "ledger of signed rows: only its writer's own rows may lack one; the file was "
                f"altered or damaged; {fix}"
            )
        return LedgerCheck(
            signed,
            unsigned,
            len(unsigned_peers),
            time.perf_counter() - started,
            audits_signed,
            audits_unsigned,
            skipped,
        )

    def rows_sha256(self, rows: Container[tuple[bytes, int]]) -> str:
        """SHA-256 over every column (update and envelope) of the given (peer, round) rows,
        in canonical order: equal iff those rows are byte for byte unchanged. A checkpoint
        records it: every commit is made durable first, so no checkpoint counts a row that
        a power loss could take from the file (`sync_in_background`)."""
        self.flush()
        return _rows_sha256(self._db, rows) if self._mine() else _rows_sha256(None, rows)


_ROW_COLUMNS = (
    "SELECT m.round, p.peer, m.scalars, m.data, m.seqno, m.signature, p.seqno_base, "
    "p.seqno_origin "
    f"FROM {MESSAGES} {BY_PEER}"
)


def _rows_sha256(db: sqlite3.Connection | None, rows: Container[tuple[bytes, int]] | None) -> str:
    """`Ledger.rows_sha256` of the rows `db` reads (None: none) that are in `rows` (None:
    every row)."""
    h = hashlib.sha256()
    for round_, peer, scalars, data, seqno, signature, base, origin in (
        db.execute(_ROW_COLUMNS) if db is not None else ()
    ):
        if rows is None or (peer, round_) in rows:
            h.update(str(round_).encode() + b"|" + peer)
            for column in (scalars, data, seqno_bytes(seqno, base, origin, round_), signature):
                h.update(b"|%d|" % (-1 if column is None else len(column)))
                h.update(column or b"")
    return h.hexdigest()


class LedgerRows:
    """A ledger's update rows at one instant (`Ledger.snapshot`), in canonical order, read
    from the file again on each iteration. A read transaction on a connection of its own
    holds the instant: under WAL, rows committed later are invisible to it, as they are to
    a list taken then. A restart streams the rows through it in memory of one row at a
    time, where a list of 10M rows as objects is ~2 GB. `close()` (or the context
    manager) ends the transaction, which otherwise keeps the WAL from being checkpointed."""

    def __init__(self, ledger: Ledger) -> None:
        self._mine = ledger._mine()
        self._len: int | None = None
        # check_same_thread off: taken on the event loop, read on the model thread
        self._db = sqlite3.connect(ledger.path, isolation_level=None, check_same_thread=False)
        self._db.text_factory = _lenient_text
        self._db.execute("BEGIN")
        self._db.execute("SELECT COUNT(*) FROM meta").fetchone()  # the read that pins it

    def __iter__(self) -> Iterator[UpdateMessage]:
        if self._db is None:
            raise ValueError("this ledger snapshot is closed")
        if not self._mine:
            return
        yield from _every_message(self._db)

    def __len__(self) -> int:
        if self._len is None:
            if self._db is None:
                raise ValueError("this ledger snapshot is closed")
            n = self._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
            self._len = n if self._mine else 0
        return self._len

    def rows_sha256(self) -> str:
        """`Ledger.rows_sha256` of every row of the snapshot (the caller flushes first)."""
        if self._db is None:
            raise ValueError("this ledger snapshot is closed")
        return _rows_sha256(self._db if self._mine else None, None)

    def close(self) -> None:
        if self._db is not None:
            self._db.execute("ROLLBACK")
            self._db.close()
            self._db = None

    def __enter__(self) -> LedgerRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _lenient_text(raw: bytes) -> str:
    """SQLite text as str; bytes that are not UTF-8 kept as surrogates (see `Ledger`)."""
    return raw.decode("utf-8", "surrogateescape")


def _update_label(round_: object, peer: object) -> str:
    """An update row's name in an error line (built only for one)."""
    return f"round {round_!r:.24}, peer {_peer_label(peer)}"


def _peer_label(peer: object) -> str:
    if isinstance(peer, bytes) and 0 < len(peer) <= MAX_PEER_ID_BYTES:
        return peer_name(peer)
    return f"<{type(peer).__name__}>"


def _row_problem(
    round_: object,
    peer: object,
    packed: object,
    envelope: list,
    directions: int | None,
    max_payload: int = MAX_UPDATE_BYTES,
) -> str | None:
    """Why a ledger row (as SQLite returns it) is not a well-formed update (or, with the
    audit payload bound, audit record: `peer` its auditor), or None."""
    if not isinstance(round_, int) or not 0 <= round_ <= MAX_ROUND:
        return "has a round outside 0..2^62-1"
    if not isinstance(peer, bytes) or not 0 < len(peer) <= MAX_PEER_ID_BYTES:
        return "has no valid peer id"
    if not isinstance(packed, bytes) or not 2 <= len(packed) <= 2 * MAX_SCALARS or len(packed) % 2:
        return "does not hold 1..16 float16 scalars"
    scalars = unpack_scalars(packed)
    if not all(math.isfinite(x) for x in scalars):
        return "holds a non-finite scalar"
    if directions is not None and len(scalars) != directions:
        return f"holds {len(scalars)} scalars, the run sends {directions}"
    if not (
        all(x is None for x in envelope)
        or all(isinstance(x, bytes) for x in envelope)
        and len(envelope[0]) <= max_payload
    ):
        return "has a partial or malformed envelope"
    return None
