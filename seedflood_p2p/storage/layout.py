"""The ledger file's layout: its tables (`SCHEMA`, PRAGMA user_version `LAYOUT`), how a
row stores its sender and its seqno, and the conversion of a file of an older layout in
place when it is opened (`set_up`). `storage/ledger.py` reads and writes the rows."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import Envelope

# The file's layout: PRAGMA user_version. 0 is the first (issue 46 made the second): the
# run id (64 characters) and the peer id (38 bytes) in every row; `Ledger` converts such a
# file in place when it opens it (`set_up`), in one transaction. 3 adds
# `bucket_digests` (a file of layout 2 gains the empty table when it is opened); an older
# seedflood refuses a layout-3 file, as it would write rows without updating the table.
# 4 adds `peers.seqno_origin` (a layout-3 file gains the column when opened; its peers with a
# `seqno_base` keep theirs): an older seedflood would misread the seqnos stored against it.
LAYOUT = 4

# One run a file: its id is stored once, in meta under RUN_KEY (set by the first row).
RUN_KEY = "run_id"

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # Update rows name their sender by a small integer (2 bytes a row for up to 32,767
    # peers, instead of its 38-byte id). The id's order means nothing: every iteration
    # that feeds a digest, a replay or repair orders by the peer id bytes (`BY_PEER`).
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
    # keep theirs). Read back exactly (`seqno_bytes`).
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
MESSAGES = "messages m CROSS JOIN peers p ON p.id = m.peer"
BY_PEER = "ORDER BY m.round, p.peer"
# The id of the peer bound to the next `?` (NULL: none, so it matches no row).
PEER_ID = "(SELECT id FROM peers WHERE peer = ?)"


def envelope_columns(env: Envelope | None) -> tuple:
    """(data, seqno, signature) of a signed envelope as they are given; (None,) * 3: none."""
    return (None, None, None) if env is None else (env.data, env.seqno, env.signature)


_U64 = (1 << 64) - 1


def int64(value: int) -> int:
    """`value` modulo 2^64, as the signed 64-bit integer SQLite stores."""
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


def seqno_bytes(stored: object, base: object, origin: object, round_: object) -> object:
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


@dataclass(frozen=True)
class SeqnoRef:
    """What a peer's 8-byte seqnos are stored against: `value` + the row's round (layout 4,
    `peers.seqno_origin`), or `value` alone (`by_round` False: a layout-3 `seqno_base`)."""

    value: int
    by_round: bool


def layout_of(db: sqlite3.Connection) -> int:
    """The file's layout (PRAGMA user_version: 0 for a new, empty file)."""
    return db.execute("PRAGMA user_version").fetchone()[0]


def set_up(db: sqlite3.Connection, path: Path) -> None:
    """Create the tables of a new file, or convert a file of an older layout: in one
    transaction (another process opening the same file waits, then finds it done)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        layout = layout_of(db)
        if layout > LAYOUT:
            raise UserError(
                f"ledger {path} was written by a newer seedflood (layout {layout}, "
                f"this version reads {LAYOUT} and older): upgrade seedflood-p2p"
            )
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
        if layout == 0 and "messages" in tables:
            _convert_first_layout(db, path)
        for statement in SCHEMA:
            db.execute(statement)
        peer_columns = {row[1] for row in db.execute("PRAGMA table_info(peers)")}
        if "seqno_origin" not in peer_columns:  # a file of layout 1-3
            db.execute("ALTER TABLE peers ADD COLUMN seqno_origin INTEGER")
        db.execute(f"PRAGMA user_version = {LAYOUT}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _convert_first_layout(db: sqlite3.Connection, path: Path) -> None:
    """Rewrite a ledger of layout 0 (run id and peer id bytes in every row) into this
    one, inside the caller's transaction: same rows, same values, peers numbered in id
    order, losing copies and revocations keeping their rowids (their order)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
    if "scalars" not in columns:
        raise UserError(
            f"ledger {path} was written by an older seedflood (one float32 "
            "scalar per message); this version carries k float16 scalars and cannot "
            "continue that run: use a new --data-dir, or the older seedflood-p2p"
        )
    try:
        audit_columns = {row[1] for row in db.execute("PRAGMA table_info(audits)")}
        if "at" not in audit_columns:  # an older version's records: without it
            db.execute("ALTER TABLE audits ADD COLUMN at INTEGER")
        runs = [
            row[0]
            for row in db.execute(
                "SELECT run_id FROM messages UNION SELECT run_id FROM audits UNION "
                "SELECT run_id FROM revocations UNION SELECT run_id FROM replaced"
            )
        ]
        if len(runs) > 1:
            raise UserError(
                f"cannot convert ledger {path} to this version's layout: it holds "
                f"rows of {len(runs)} runs, and a ledger now holds one; keep it for the "
                "older seedflood-p2p, and use a new --data-dir"
            )
        old_rows = db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        db.execute("DROP INDEX IF EXISTS audits_by_round")
        for table in ("messages", "audits", "revocations", "replaced"):
            db.execute(f"ALTER TABLE {table} RENAME TO {table}_layout0")
        for statement in SCHEMA:
            db.execute(statement)
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
            db.execute(statement)
        new_rows = db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        if new_rows != old_rows:
            raise sqlite3.DatabaseError(f"{new_rows} rows converted of {old_rows}")
        if runs:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (RUN_KEY, runs[0]))
        for table in ("messages", "audits", "revocations", "replaced"):
            db.execute(f"DROP TABLE {table}_layout0")
    except sqlite3.Error as exc:
        raise UserError(
            f"cannot convert ledger {path} to this version's layout ({exc}); "
            "nothing was changed: free disk space and retry, or use the older "
            "seedflood-p2p"
        ) from None
