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

The layout (issue 46: ~117 B a row, from 247.5) stores the run id once, names peers by a
small number and an 8-byte seqno by its distance from what the sender's first seqno and
the row's round predict (`_SCHEMA`); a file of an older layout is converted in place when
opened (PRAGMA user_version).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import sqlite3
import threading
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

log = logging.getLogger("seedflood.ledger")

# The file's layout: PRAGMA user_version. 0 is the first (issue 46 made the second): the
# run id (64 characters) and the peer id (38 bytes) in every row; `Ledger` converts such a
# file in place when it opens it (`_convert_first_layout`), in one transaction. 3 adds
# `bucket_digests` (a file of layout 2 gains the empty table when it is opened); an older
# seedflood refuses a layout-3 file, as it would write rows without updating the table.
# 4 adds `peers.seqno_origin` (a layout-3 file gains the column when opened; its peers with a
# `seqno_base` keep theirs): an older seedflood would misread the seqnos stored against it.
LAYOUT = 4

# One run a file: its id is stored once, in meta under RUN_KEY (set by the first row).
RUN_KEY = "run_id"

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # Update rows name their sender by a small integer (2 bytes a row for up to 32,767
    # peers, instead of its 38-byte id). The id's order means nothing: every iteration
    # that feeds a digest, a replay or repair orders by the peer id bytes (`_BY_PEER`).
    """CREATE TABLE IF NOT EXISTS peers (
        id INTEGER PRIMARY KEY,
        peer BLOB NOT NULL UNIQUE,
        seqno_base INTEGER,  -- layout 3: the peer's first 8-byte seqno, as a signed int64
        seqno_origin INTEGER  -- layout 4: that seqno minus its row's round (signed int64)
    )""",
    # `scalars` and `round` are also inside `data` (the signed payload), kept anyway: rows
    # without an envelope (local runs, our own not yet echoed) have only these, reading
    # them back needs no msgpack decoding (replay, digests), and `verify` compares them
    # against the payload (2 bytes a row for k = 1).
    # `seqno`: go-libp2p-pubsub signs an 8-byte big-endian counter that starts at the
    # publisher's nanosecond clock (~2^60, so 8 bytes as an INTEGER too) and counts up one
    # a message. A peer publishes one update a round (audit records only on a mismatch),
    # so its seqno is predicted by its first one and the row's round: an 8-byte seqno is
    # stored as an INTEGER, seqno - peers.seqno_origin - round modulo 2^64 (0: no bytes at
    # all in SQLite's record, while the publisher runs and skips no round; 1-2 bytes
    # after skipped rounds or published audit records; up to 8 across its restarts:
    # never more than the blob). Peers of a layout-3 file that have a `seqno_base` keep
    # seqno - seqno_base. Any other seqno is the BLOB it is (rows converted from layout 0
    # keep theirs). Read back exactly (`_seqno_bytes`).
    """CREATE TABLE IF NOT EXISTS messages (
        round INTEGER NOT NULL,
        peer INTEGER NOT NULL,  -- peers.id
        scalars BLOB NOT NULL,  -- little-endian float16, one per direction (as on the wire)
        data BLOB,          -- the signed GossipSub envelope (NULL for local-only runs)
        seqno,              -- INTEGER: seqno - origin - round (mod 2^64); or BLOB: itself
        signature BLOB,
        PRIMARY KEY (round, peer)
    ) WITHOUT ROWID""",
    # Audit records (issue 11): auditor recomputed (accused, round) and got scalars; what
    # they decide is algorithm/audit_rules.py:judge, a pure function of this table and
    # messages. Peers by their id bytes here: a few rows a round, and their orders (below,
    # and audit repair's cursor) compare two peer ids.
    """CREATE TABLE IF NOT EXISTS audits (
        accused BLOB NOT NULL,
        round INTEGER NOT NULL,
        auditor BLOB NOT NULL,
        scalars BLOB NOT NULL,
        data BLOB,          -- the auditor's signed GossipSub envelope (NULL: not yet echoed)
        seqno BLOB,
        signature BLOB,
        at INTEGER,         -- the auditor's round when it published (NULL: older record)
        PRIMARY KEY (accused, round, auditor, scalars)
    ) WITHOUT ROWID""",
    # Audit repair serves and digests records in (round, accused, auditor, scalars) order.
    "CREATE INDEX IF NOT EXISTS audits_by_round ON audits (round, accused, auditor, scalars)",
    # Ticket revocations (network/peers/tickets.py): the run creator's signed `data` says
    # the holder's updates of rounds >= round never count
    # (algorithm/probation.py:Standing.revoked).
    """CREATE TABLE IF NOT EXISTS revocations (
        holder BLOB NOT NULL,
        round INTEGER NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (data)
    )""",  # a rowid table: SQLite 3.40's quick_check misreads this key WITHOUT ROWID
    # The losing copies of equivocations (issue 45): scalars a (peer, round) was signed with
    # besides the row `messages` keeps (`keeps_new`), in the order they lost. Local
    # evidence for an audit's retry only (peer/state_rewind.py): an honest sender may have
    # trained on a state holding a copy that lost later. Never digested, repaired or
    # replayed. At most MAX_LOSING_COPIES per (peer, round), the first to lose always among
    # them.
    """CREATE TABLE IF NOT EXISTS replaced (
        round INTEGER NOT NULL,
        peer BLOB NOT NULL,
        scalars BLOB NOT NULL,
        PRIMARY KEY (round, peer, scalars)
    )""",  # a rowid table: the rowid is the order they lost in
    # Set digests of buckets below the newest (`bucket_digests`), kept so that a daemon
    # holding a long ledger does not hash every row again at start (issue 46: 51 of the
    # 57 s a start took at ten million rows). Valid while the bucket holds `count` rows:
    # the tables only grow, and what changes a row in place (an equivocation's `replace`,
    # a record's smaller `at`) deletes its table's digests in the same transaction.
    """CREATE TABLE IF NOT EXISTS bucket_digests (
        kind TEXT NOT NULL,             -- 'messages' or 'audits'
        bucket_rounds INTEGER NOT NULL,
        bucket INTEGER NOT NULL,
        count INTEGER NOT NULL,
        digest BLOB NOT NULL,
        PRIMARY KEY (kind, bucket_rounds, bucket)
    ) WITHOUT ROWID""",
)

# Update rows with their sender's id bytes, in canonical order (round, peer id bytes): the
# scan walks `messages` in round order (its key) and sorts each round's rows by peer.
# CROSS JOIN keeps `messages` the outer loop.
_MESSAGES = "messages m CROSS JOIN peers p ON p.id = m.peer"
_BY_PEER = "ORDER BY m.round, p.peer"
# The id of the peer bound to the next `?` (NULL: none, so it matches no row).
_PEER_ID = "(SELECT id FROM peers WHERE peer = ?)"

# Losing copies kept per (peer, round) (`Ledger.keep_losing`): the first copy to lose (the
# one peers most likely trained on before the other arrived) and at most two more. Each
# costs an audit of a later update one retry at most (peer/state_rewind.py caps those), and
# an author that signs many copies of one round is banned at the second anyway.
MAX_LOSING_COPIES = 3


def _envelope_columns(env: Envelope | None) -> tuple:
    return (None, None, None) if env is None else (env.data, env.seqno, env.signature)


_U64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """`value` modulo 2^64, as the signed 64-bit integer SQLite stores."""
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


def _seqno_bytes(stored: object, base: object, origin: object, round_: object) -> object:
    """A `messages.seqno` as signed: an INTEGER is its distance from the peer's
    `seqno_origin` + the row's round (or, for a peer of a layout-3 file, from its
    `seqno_base`); anything else (a BLOB, NULL, a damaged cell) is returned as it is, and
    so is an INTEGER without an origin or base (then `verify` calls the envelope
    malformed)."""
    if isinstance(stored, int):
        if isinstance(origin, int) and isinstance(round_, int):
            return ((origin + round_ + stored) & _U64).to_bytes(8, "big")
        if isinstance(base, int):
            return ((base + stored) & _U64).to_bytes(8, "big")
    return stored


def digest_of(messages: Iterable[UpdateMessage]) -> str:
    """The ledger digest of `messages` (canonical order): what `Ledger.digest` returns."""
    digest = RunningDigest()
    for m in messages:
        digest.add(m)
    return digest.hexdigest()


def digest_within(
    messages: Iterable[UpdateMessage], covered: Container[tuple[bytes, int]]
) -> tuple[int, str]:
    """(count, `digest_of`) of the messages (canonical order) whose (peer, round) is in
    `covered` (a cut): what a trusted link's rows are checked against."""
    inside = RunningDigest()
    for m in messages:
        if (m.peer, m.round) in covered:
            inside.add(m)
    return inside.count, inside.hexdigest()


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


class RunningDigest:
    """`digest_of`, fed one message at a time (canonical order), for a pass that does
    other work with each row too (a restart's, `LiveModel.restore`)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def add(self, message: UpdateMessage) -> None:
        self.add_hash(_message_hash(message))

    def add_hash(self, h: bytes) -> None:
        """Add a row by its `row_digest` (computed once for several digests)."""
        self._h.update(h)
        self.count += 1

    def copy(self) -> RunningDigest:
        """This digest so far, to be fed on apart (a chain link's, `ChainTail`)."""
        other = RunningDigest()
        other._h, other.count = self._h.copy(), self.count
        return other

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def row_digest(m: UpdateMessage) -> bytes:
    """A row's part of the ledger digest (`digest_of`: SHA-256 over these, in order)."""
    return _message_hash(m)


def _message_hash(m: UpdateMessage) -> bytes:
    body = m.round.to_bytes(8, "little") + len(m.peer).to_bytes(2, "little") + m.peer
    return hashlib.sha256(body + pack_scalars(m.scalars)).digest()[:8]


def _set_member_hash(m: UpdateMessage) -> bytes:
    """Full SHA-256 of one message, as a member of a bucket's set digest."""
    return _row_member_hash(m.round, m.peer, pack_scalars(m.scalars))


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


def _row_member_hash(round_: int, peer: bytes, scalars: bytes) -> bytes:
    """`_set_member_hash` of a row as stored: its scalars are the wire's float16 bytes."""
    body = round_.to_bytes(8, "little") + len(peer).to_bytes(2, "little") + peer
    return hashlib.sha256(body + scalars).digest()


@dataclass
class _BucketMembers:
    """A growing bucket's member hashes, sorted, and the rows (peer numbers by round)
    they cover."""

    peers: dict[int, set[int]] = field(default_factory=dict)
    hashes: list[bytes] = field(default_factory=list)


def set_digest(messages: Iterable[UpdateMessage]) -> bytes:
    """The set digest `bucket_digests` gives a bucket holding exactly `messages`."""
    return _set_digest(_set_member_hash(m) for m in messages)


def _audit_member_hash(r: AuditRecord) -> bytes:
    """Full SHA-256 of one audit record, as a member of an audit bucket's set digest. It
    covers `at` (-1: not carried): two ledgers that kept copies differing only in `at`
    differ here, so repair brings them the smaller (`Ledger.add_audits`)."""
    body = r.round.to_bytes(8, "little")
    for peer in (r.accused, r.auditor):
        body += len(peer).to_bytes(2, "little") + peer
    at = r.at.to_bytes(8, "little", signed=True)
    return hashlib.sha256(body + pack_scalars(r.scalars) + at).digest()


def audit_set_digest(records: Iterable[AuditRecord]) -> bytes:
    """The set digest `audit_bucket_digests` gives a bucket holding exactly `records`."""
    return _set_digest(_audit_member_hash(r) for r in records)


def _set_digest(member_hashes: Iterable[bytes]) -> bytes:
    """SHA-256 over sorted member hashes: a set digest, independent of order."""
    return hashlib.sha256(b"".join(sorted(member_hashes))).digest()


def _every_message(db: sqlite3.Connection) -> Iterator[UpdateMessage]:
    """Every update row `db` reads, in canonical order (a snapshot's, a child's check)."""
    for row in db.execute(f"SELECT m.round, p.peer, m.scalars FROM {_MESSAGES} {_BY_PEER}"):
        yield _message(*row)


def _message(round_: int, peer: bytes, scalars: bytes) -> UpdateMessage:
    return UpdateMessage(round_, shared_peer_id(peer), unpack_scalars(scalars))


def _audit_record(
    accused: bytes, round_: int, auditor: bytes, scalars: bytes, at: int | None
) -> AuditRecord:
    return AuditRecord(
        bytes(accused), round_, bytes(auditor), unpack_scalars(scalars), -1 if at is None else at
    )


@dataclass(frozen=True)
class _SeqnoRef:
    """What a peer's 8-byte seqnos are stored against: `value` + the row's round (layout 4,
    `peers.seqno_origin`), or `value` alone (`by_round` False: a layout-3 `seqno_base`)."""

    value: int
    by_round: bool


@dataclass
class _Pending:
    """What a write transaction looked up or numbered (`Ledger._peer_id`), cached only
    once it commits: peer id -> peers.id, and peers.id -> its seqno reference."""

    ids: dict[bytes, int] = field(default_factory=dict)
    bases: dict[int, _SeqnoRef] = field(default_factory=dict)


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
        self._syncer: _WalSyncer | None = None  # sync_in_background: fsyncs off the caller
        self._file_run: str | None = None  # the run the file's rows belong to (RUN_KEY)
        self._peer_ids: dict[bytes, int] = {}  # peers.id of peers committed (`_peer_id`)
        self._seqno_bases: dict[int, _SeqnoRef] = {}  # each peer's, committed
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
            if self._layout() != LAYOUT:
                self._set_up()
        except sqlite3.OperationalError as exc:  # before its base class DatabaseError
            raise UserError(f"cannot open ledger {self.path} ({exc}): check the path") from None
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a damaged schema: the
            # latter when sqlite3's own error text quotes bytes that are not UTF-8
            raise UserError(
                f"ledger {self.path} is corrupt or not a seedflood ledger ({exc}): move it "
                "aside and let the peer re-sync from the network, or rebuild it from a "
                "peer's copy"
            ) from None

    def _layout(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _set_up(self) -> None:
        """Create the tables of a new file, or convert a file of an older layout: in one
        transaction (another process opening the same file waits, then finds it done)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            layout = self._layout()
            if layout > LAYOUT:
                raise UserError(
                    f"ledger {self.path} was written by a newer seedflood (layout {layout}, "
                    f"this version reads {LAYOUT} and older): upgrade seedflood-p2p"
                )
            tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master")}
            if layout == 0 and "messages" in tables:
                self._convert_first_layout()
            for statement in _SCHEMA:
                self._db.execute(statement)
            peer_columns = {row[1] for row in self._db.execute("PRAGMA table_info(peers)")}
            if "seqno_origin" not in peer_columns:  # a file of layout 1-3
                self._db.execute("ALTER TABLE peers ADD COLUMN seqno_origin INTEGER")
            self._db.execute(f"PRAGMA user_version = {LAYOUT}")
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _convert_first_layout(self) -> None:
        """Rewrite a ledger of layout 0 (run id and peer id bytes in every row) into this
        one, inside the caller's transaction: same rows, same values, peers numbered in id
        order, losing copies and revocations keeping their rowids (their order)."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}
        if "scalars" not in columns:
            raise UserError(
                f"ledger {self.path} was written by an older seedflood (one float32 "
                "scalar per message); this version carries k float16 scalars and cannot "
                "continue that run: use a new --data-dir, or the older seedflood-p2p"
            )
        try:
            audit_columns = {row[1] for row in self._db.execute("PRAGMA table_info(audits)")}
            if "at" not in audit_columns:  # an older version's records: without it
                self._db.execute("ALTER TABLE audits ADD COLUMN at INTEGER")
            runs = [
                row[0]
                for row in self._db.execute(
                    "SELECT run_id FROM messages UNION SELECT run_id FROM audits UNION "
                    "SELECT run_id FROM revocations UNION SELECT run_id FROM replaced"
                )
            ]
            if len(runs) > 1:
                raise UserError(
                    f"cannot convert ledger {self.path} to this version's layout: it holds "
                    f"rows of {len(runs)} runs, and a ledger now holds one; keep it for the "
                    "older seedflood-p2p, and use a new --data-dir"
                )
            old_rows = self._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
            self._db.execute("DROP INDEX IF EXISTS audits_by_round")
            for table in ("messages", "audits", "revocations", "replaced"):
                self._db.execute(f"ALTER TABLE {table} RENAME TO {table}_layout0")
            for statement in _SCHEMA:
                self._db.execute(statement)
            for statement in (
                "INSERT INTO peers (peer) SELECT DISTINCT peer FROM messages_layout0 ORDER BY peer",
                "INSERT INTO messages SELECT o.round, p.id, o.scalars, o.data, o.seqno, "
                "o.signature FROM messages_layout0 o JOIN peers p ON p.peer = o.peer",
                "INSERT INTO audits (accused, round, auditor, scalars, data, seqno, "
                "signature, at) SELECT accused, round, auditor, scalars, data, seqno, "
                "signature, at FROM audits_layout0",
                "INSERT INTO revocations (rowid, holder, round, data) "
                "SELECT rowid, holder, round, data FROM revocations_layout0",
                "INSERT INTO replaced (rowid, round, peer, scalars) "
                "SELECT rowid, round, peer, scalars FROM replaced_layout0",
            ):
                self._db.execute(statement)
            new_rows = self._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
            if new_rows != old_rows:
                raise sqlite3.DatabaseError(f"{new_rows} rows converted of {old_rows}")
            if runs:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (RUN_KEY, runs[0]))
            for table in ("messages", "audits", "revocations", "replaced"):
                self._db.execute(f"DROP TABLE {table}_layout0")
        except sqlite3.Error as exc:
            raise UserError(
                f"cannot convert ledger {self.path} to this version's layout ({exc}); "
                "nothing was changed: free disk space and retry, or use the older "
                "seedflood-p2p"
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
        self._syncer = _WalSyncer(Path(f"{self.path}-wal"), self._fsync)
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

    def _envelope_columns(
        self, number: int, round_: int, env: Envelope | None, pending: _Pending
    ) -> tuple:
        """(data, seqno, signature) as `messages` stores them for peer `number`'s row of
        `round_`: an 8-byte seqno as its distance from the peer's `seqno_origin` (its first
        one's seqno minus round) + `round_`."""
        data, seqno, signature = _envelope_columns(env)
        if not (isinstance(seqno, bytes) and len(seqno) == 8):
            return data, seqno, signature
        value = int.from_bytes(seqno, "big")
        ref = self._seqno_bases.get(number, pending.bases.get(number))
        if ref is None:
            query = "SELECT seqno_base, seqno_origin FROM peers WHERE id = ?"
            base, origin = self._db.execute(query, (number,)).fetchone()
            if isinstance(origin, int):
                ref = _SeqnoRef(origin, by_round=True)
            elif isinstance(base, int):  # a peer of a layout-3 file
                ref = _SeqnoRef(base, by_round=False)
            else:  # the peer's first: its origin
                ref = _SeqnoRef(_int64(value - round_), by_round=True)
                query = "UPDATE peers SET seqno_origin = ? WHERE id = ?"
                self._db.execute(query, (ref.value, number))
            pending.bases[number] = ref
        predicted = ref.value + round_ if ref.by_round else ref.value
        return data, _int64(value - predicted), signature

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
                    + self._envelope_columns(number, m.round, env, pending)
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
                    key + _envelope_columns(env) + (at,),
                )
                if not cur.rowcount:
                    cur = self._db.execute(
                        "UPDATE audits SET data = ?, seqno = ?, signature = ?, at = ? WHERE "
                        "accused = ? AND round = ? AND auditor = ? AND "
                        "scalars = ? AND COALESCE(at, -1) > ?",
                        _envelope_columns(env) + (at, *key, r.at),
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
                    (*_envelope_columns(envelope), r.accused, r.round, r.auditor,
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
                    *self._envelope_columns(number, message.round, envelope, pending),
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
                        *self._envelope_columns(row[0], message.round, envelope, pending),
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
            f"SELECT m.round, p.peer, m.scalars FROM {_MESSAGES} WHERE m.round BETWEEN ? AND ? "
            f"{_BY_PEER}",
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
        query = f"SELECT p.peer, m.round FROM {_MESSAGES} WHERE m.round >= ?"
        out: dict[bytes, list[int]] = {}
        # a peer is in one part only, and each part comes in round order
        for part in [None] if numbers is None else _parts(numbers):
            where = "" if part is None else f" AND m.peer IN ({_marks(part)})"
            args = [min_round, *(part or ())]
            for peer, round_ in self._db.execute(query + where + " ORDER BY m.round", args):
                out.setdefault(bytes(peer), []).append(round_)
        return out

    def peers(self) -> set[bytes]:
        """Every peer with at least one row: who the run is known to have."""
        if not self._mine():
            return set()
        query = (
            "SELECT p.peer FROM (SELECT DISTINCT peer FROM messages) m "
            "JOIN peers p ON p.id = m.peer"
        )
        return {bytes(row[0]) for row in self._db.execute(query)}

    def has(self, peer: bytes, round_: int) -> bool:
        return self.scalars_of(peer, round_) is not None

    def payload_of(self, peer: bytes, round_: int) -> bytes | None:
        """The signed envelope's payload of `peer`'s update of `round_` (None: no such row,
        or a row logged without one yet: local-only, or our own not yet echoed)."""
        query = f"SELECT data FROM messages WHERE round = ? AND peer = {_PEER_ID}"
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
            lambda key, lo, hi, growing: _set_digest(
                _audit_member_hash(r) for r in self.audits(lo, hi)
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
                    new.append(_row_member_hash(round_, bytes(peer), bytes(scalars)))
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
            f"SELECT p.peer, COUNT(*), MIN(m.round), MAX(m.round) FROM {_MESSAGES} GROUP BY m.peer"
        ).fetchall()
        return {bytes(peer): (n, lo, hi) for peer, n, lo, hi in rows}

    def round_peers(self, min_round: int, max_round: int) -> Iterator[tuple[int, bytes]]:
        """(round, peer) of every row in [min_round, max_round], canonical order; no
        scalars (the run page's updates-by-peer)."""
        if not self._mine():
            return
        rows = self._db.execute(
            f"SELECT m.round, p.peer FROM {_MESSAGES} WHERE m.round BETWEEN ? AND ? {_BY_PEER}",
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
            f"SELECT p.peer, MAX(m.round) FROM {_MESSAGES} GROUP BY m.peer"
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
            f"p.seqno_origin FROM {_MESSAGES} WHERE m.round BETWEEN ? AND ? "
            f"AND (m.round > ? OR p.peer > ?) AND m.signature IS NOT NULL {_BY_PEER} LIMIT ?",
            (round_, max_round, round_, peer, limit),
        ).fetchall()
        return [
            (_message(r, p, s), Envelope(bytes(d), bytes(_seqno_bytes(q, b, o, r)), bytes(g)))
            for r, p, s, d, q, g, b, o in rows
        ]

    def unsigned(self, peer: bytes) -> list[UpdateMessage]:
        """`peer`'s messages logged without a signed envelope (our own, not yet echoed)."""
        if not self._mine():
            return []
        rows = self._db.execute(
            f"SELECT round, scalars FROM messages WHERE peer = {_PEER_ID} AND "
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
        query = f"SELECT scalars FROM messages WHERE round = ? AND peer = {_PEER_ID}"
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
        `network.identity.verify_pubsub_signature`: ~120 us per Ed25519 check, so about
        10 s for 80,000 rows). Rows without an envelope cannot be checked: they are the
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
        its checkpoint, not 80,000 signatures.

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
        rows = self._db.execute(  # LEFT JOIN: a row whose peer number names no peer is named
            "SELECT m.round, p.peer, m.scalars, m.data, m.seqno, m.signature, p.seqno_base, "
            f"p.seqno_origin FROM messages m LEFT JOIN peers p ON p.id = m.peer {_BY_PEER}"
        )
        for round_, peer, packed, data, seqno, signature, base, origin in rows if mine else ():
            envelope = [data, _seqno_bytes(seqno, base, origin, round_), signature]
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
    f"FROM {_MESSAGES} {_BY_PEER}"
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
            for column in (scalars, data, _seqno_bytes(seqno, base, origin, round_), signature):
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


class _WalSyncer:
    """The thread that fsyncs a ledger's WAL behind its commits (`sync_in_background`).

    Commits are numbered (`generation`); the thread fsyncs the WAL whenever commits are
    owed and then marks every commit made before that fsync began durable, so one fsync
    covers all the commits made while the previous one ran (group commit). The fsync goes
    through its own descriptor of the -wal file: on Linux fsync flushes the file, whoever
    wrote it. SQLite itself fsyncs the WAL before it copies it into the database (a
    checkpoint), so a reset WAL never holds the only copy of a row."""

    def __init__(self, wal: Path, fsync: Callable[[int], None]) -> None:
        self.wal = wal
        self.fsync = fsync
        self.generation = 0  # commits made
        self.synced = 0  # commits known to be on disk
        self.error: OSError | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[int, object, object]] = []  # (generation, loop, future)
        self._stopping = False
        self._fd: int | None = None
        self._thread = threading.Thread(target=self._run, name="ledger-fsync", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def caught_up(self) -> bool:
        return self.synced >= self.generation

    def wait(self, generation: int) -> None:
        with self._cond:
            while self.synced < generation and self.error is None:
                self._cond.wait()
            self._raise()

    async def wait_async(self, generation: int) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self.synced >= generation or self.error is not None:
                self._raise()
                return
            self._waiters.append((generation, loop, future))
        await future
        self._raise()  # woken by a failed fsync: nothing after it is durable

    def stop(self) -> None:
        """Sync what is owed, then end the thread (close)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise UserError(
                f"cannot sync ledger {self.wal} to disk ({self.error}): check the disk "
                "and restart the peer"
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                while self.synced >= self.generation and not self._stopping:
                    self._cond.wait()
                if self.synced >= self.generation:  # stopping, nothing owed
                    return
                target = self.generation
            try:
                self._fsync_wal()
            except OSError as exc:
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                    self._wake(everyone=True)
                return
            with self._cond:
                self.synced = max(self.synced, target)
                self._cond.notify_all()
                self._wake()

    def _fsync_wal(self) -> None:
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            os.close(self._fd)  # the WAL was deleted and made anew: sync the new one
            self._fd = None
        if self._fd is None:
            try:
                self._fd = os.open(self.wal, os.O_RDONLY)
            except FileNotFoundError:  # no WAL: every commit was checkpointed (synced)
                return
        self.fsync(self._fd)

    def _wake(self, everyone: bool = False) -> None:
        """Resolve the event-loop waiters this sync covers (under the lock)."""
        keep = []
        for generation, loop, future in self._waiters:
            if everyone or generation <= self.synced:
                loop.call_soon_threadsafe(_resolve, future)
            else:
                keep.append((generation, loop, future))
        self._waiters = keep


def _resolve(future) -> None:
    if not future.done():
        future.set_result(None)


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
