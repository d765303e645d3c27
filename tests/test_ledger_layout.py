"""The ledger's compact layout (issue 46): one run a file, peers by number, 8-byte seqnos as
distances. A file of the first layout converts in place on open, and every read of it
(digests, canonical order, repair pages, rows_sha256, verify) equals a fresh ledger's."""

import contextlib
import hashlib
import sqlite3

import pytest
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.network.transport.sigcheck import signed_bytes
from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
from seedflood_p2p.protocol.framing import topic_for
from seedflood_p2p.protocol.message import AuditRecord, Envelope, UpdateMessage, pack_scalars
from seedflood_p2p.protocol.update import encode_update
from seedflood_p2p.storage.digests import digest_of
from seedflood_p2p.storage.layout import LAYOUT
from seedflood_p2p.storage.ledger import Ledger

# The first layout (user_version 0), as seedflood wrote it before issue 46: kept here to
# write such files.
LAYOUT0_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    run_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    peer BLOB NOT NULL,
    scalars BLOB NOT NULL,  -- little-endian float16, one per direction (as on the wire)
    data BLOB,          -- the signed GossipSub envelope (NULL for local-only runs)
    seqno BLOB,
    signature BLOB,
    PRIMARY KEY (run_id, round, peer)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audits (
    run_id TEXT NOT NULL,
    accused BLOB NOT NULL,
    round INTEGER NOT NULL,
    auditor BLOB NOT NULL,
    scalars BLOB NOT NULL,
    data BLOB,          -- the auditor's signed GossipSub envelope (NULL: not yet echoed)
    seqno BLOB,
    signature BLOB,
    at INTEGER,         -- the auditor's round when it published (NULL: older record)
    PRIMARY KEY (run_id, accused, round, auditor, scalars)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS audits_by_round ON audits (run_id, round, accused, auditor, scalars);
CREATE TABLE IF NOT EXISTS revocations (
    run_id TEXT NOT NULL,
    holder BLOB NOT NULL,
    round INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, data)
);
CREATE TABLE IF NOT EXISTS replaced (
    run_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    peer BLOB NOT NULL,
    scalars BLOB NOT NULL,
    PRIMARY KEY (run_id, round, peer, scalars)
);
"""

CONFIG = RunConfig(salt="ledger-layout", directions=1)
RUN = CONFIG.run_id
U64 = 1 << 64


def _key(i: int):
    key = Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32)
    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    return key, bytes.fromhex("002408011220") + public


KEYS = [_key(i) for i in range(5)]
# Numbered by first appearance, which is not their bytes order: canonical order must still
# be by peer id bytes.
ORDER = sorted(range(5), key=lambda i: KEYS[i][1], reverse=True)
OWN = KEYS[ORDER[-1]][1]  # the writer: its rows are unsigned


def _seqno(i: int, round_: int) -> bytes:
    """Seqnos a sender may sign: go-libp2p's counter from a nanosecond clock (peer 2),
    one about to wrap past 2^64 (0), one across SQLite's signed 64 bits (1), one that
    restarted lower (3: a negative distance; round 2 not 8 bytes long), and the writer's
    (4, whose rows are unsigned)."""
    if i == 3 and round_ == 2:
        return b"\x01\x02\x03"
    value = {
        0: U64 - 3 + round_,
        1: (1 << 63) - 2 + round_,
        2: 1_764_300_000_123_456_789 + 2 * round_,
        3: 1_764_300_000_000_000_000 - 1000 * round_,
        4: 7 + round_,
    }[i]
    return (value % U64).to_bytes(8, "big")


def _update(i: int, round_: int, scalars: tuple[float, ...]) -> tuple[UpdateMessage, Envelope]:
    key, peer = KEYS[i]
    data, seqno = encode_update(RUN, round_, scalars), _seqno(i, round_)
    signature = key.sign(signed_bytes(peer, data, seqno, topic_for(RUN)))
    return UpdateMessage(round_, peer, scalars), Envelope(data, seqno, signature)


def _audit(i: int, accused: bytes, round_: int, scalars, at: int):
    key, peer = KEYS[i]
    data, seqno = encode_audit(RUN, accused, round_, scalars, at), _seqno(i, 50 + round_)
    signature = key.sign(signed_bytes(peer, data, seqno, audit_topic_for(RUN)))
    return AuditRecord(accused, round_, peer, scalars, at), Envelope(data, seqno, signature)


def _history():
    """(updates in arrival order, each with its envelope or None; the winner of an
    equivocation, its envelope, and the copy it replaced; a losing copy kept; signed and
    unsigned audit records; revocations)."""
    rows = []
    for round_ in range(6):
        for i in ORDER:
            message, envelope = _update(i, round_, (0.25 * round_ - i,))
            rows.append((message, None if message.peer == OWN else envelope))
    i = ORDER[1]
    winner, winner_env = _update(i, 3, (-7.0,))
    loser = UpdateMessage(4, KEYS[i][1], (5.5,))
    audits = [
        _audit(ORDER[0], KEYS[ORDER[1]][1], 1, (0.25,), 2),
        _audit(ORDER[2], KEYS[ORDER[1]][1], 1, (0.25,), -1),
        (AuditRecord(KEYS[ORDER[0]][1], 2, OWN, (1.5,), 3), None),
    ]
    revocations = [(KEYS[ORDER[2]][1], 4, b"revocation-b"), (KEYS[ORDER[3]][1], 2, b"rev-a")]
    return rows, (winner, winner_env), loser, audits, revocations


def _fresh(path) -> Ledger:
    rows, (winner, winner_env), loser, audits, revocations = _history()
    ledger = Ledger(path, RUN)
    ledger.claim(CONFIG, "")
    for k in range(0, len(rows), 7):  # several transactions
        chunk = rows[k : k + 7]
        ledger.add([m for m, _ in chunk], [e for _, e in chunk])
    ledger.replace(winner, winner_env)
    ledger.keep_losing(loser)
    ledger.add_audits([r for r, _ in audits], [e for _, e in audits])
    ledger.add_revocations(revocations)
    return ledger


def _write_layout0(path) -> None:
    """The same history as the first layout stored it, written with its own schema."""
    rows, (winner, winner_env), loser, audits, revocations = _history()
    db = sqlite3.connect(path)
    db.executescript(LAYOUT0_SCHEMA)
    with db:
        db.execute("INSERT INTO meta VALUES ('manifest', ?)", (CONFIG.to_json(),))
        replaced = None
        for m, env in rows:
            if (m.round, m.peer) == (winner.round, winner.peer):
                replaced, m, env = m, winner, winner_env
            envelope = (None, None, None) if env is None else (env.data, env.seqno, env.signature)
            db.execute(
                "INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?)",
                (RUN, m.round, m.peer, pack_scalars(m.scalars), *envelope),
            )
        for m in (replaced, loser):  # rowid order: the order they lost in
            db.execute(
                "INSERT INTO replaced VALUES (?, ?, ?, ?)",
                (RUN, m.round, m.peer, pack_scalars(m.scalars)),
            )
        for r, env in audits:
            envelope = (None, None, None) if env is None else (env.data, env.seqno, env.signature)
            db.execute(
                "INSERT INTO audits VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (RUN, r.accused, r.round, r.auditor, pack_scalars(r.scalars), *envelope,
                 r.at if r.at >= 0 else None),
            )  # fmt: skip
        for holder, round_, data in revocations:
            db.execute("INSERT INTO revocations VALUES (?, ?, ?, ?)", (RUN, holder, round_, data))
    db.close()


def _rows_sha256_layout0(path, rows: set) -> str:
    """`Ledger.rows_sha256` as the first layout computed it, from that file's columns."""
    db = sqlite3.connect(path)
    h = hashlib.sha256()
    cursor = db.execute(
        "SELECT round, peer, scalars, data, seqno, signature FROM messages "
        "WHERE run_id = ? ORDER BY round, peer",
        (RUN,),
    )
    for round_, peer, *columns in cursor:
        if (peer, round_) in rows:
            h.update(str(round_).encode() + b"|" + peer)
            for column in columns:
                h.update(b"|%d|" % (-1 if column is None else len(column)))
                h.update(column or b"")
    db.close()
    return h.hexdigest()


def _pages(ledger: Ledger, limit: int) -> list:
    """Every signed row, as repair pages them (`signed_after` from the first cursor)."""
    out, cursor = [], (-1, b"\xff" * 64)
    while True:
        page = ledger.signed_after(*cursor, 1 << 62, limit)
        out += page
        if len(page) < limit:
            return out
        cursor = (page[-1][0].round, page[-1][0].peer)


def _counts(check) -> tuple[int, int, int]:
    return check.signed, check.unsigned, check.unsigned_peers


def _reads(ledger: Ledger) -> dict:
    """Everything a caller can read back."""
    peers = sorted(ledger.peers())
    return {
        "len": len(ledger),
        "messages": list(ledger.messages()),
        "window": list(ledger.messages(2, 3)),
        "digest": ledger.digest(),
        "buckets": ledger.bucket_digests(2),
        "audit_buckets": ledger.audit_bucket_digests(2),
        "pages": _pages(ledger, 4),
        "pages_wide": _pages(ledger, 1000),
        "rows_sha256": ledger.rows_sha256({(m.peer, m.round) for m in ledger.messages()}),
        "peers": peers,
        "peer_totals": ledger.peer_totals(),
        "peer_rounds": ledger.peer_rounds(),
        "round_peers": list(ledger.round_peers(0, 9)),
        "max_round": ledger.max_round(),
        "unsigned": ledger.unsigned(OWN),
        "payloads": [ledger.payload_of(p, 2) for p in peers],
        "scalars": [ledger.scalars_of(p, 3) for p in peers],
        "audits": ledger.audits(),
        "audit_pages": ledger.signed_audits_after((-1, b"", b"", b""), 99, 10),
        "unsigned_audits": ledger.unsigned_audits(OWN),
        "audit_counts": ledger.audit_counts(0, 9),
        "revocations": ledger.revocations(),
        "losing": ledger.losing_copies(),
        "verify": _counts(ledger.verify(verify_pubsub_signature, "FIX", 1, own_peer=OWN)),
    }


def test_a_first_layout_file_converts_in_place_and_reads_as_a_fresh_one(tmp_path):
    old_path = tmp_path / "layout0.sqlite"
    _write_layout0(old_path)
    every = {(m.peer, m.round) for m, _ in _history()[0]}
    before = _rows_sha256_layout0(old_path, every)
    with _fresh(tmp_path / "fresh.sqlite") as fresh:
        expected = _reads(fresh)
    with Ledger.open_existing(old_path) as converted:
        assert converted.run_id == RUN
        got = _reads(converted)
    assert got == expected
    # What the first layout served: canonical order by peer id bytes, and the same hashes.
    assert [(m.round, m.peer) for m in got["messages"]] == sorted(
        (m.round, m.peer) for m, _ in _history()[0]
    )
    assert got["digest"] == digest_of(got["messages"])
    assert got["rows_sha256"] == before
    assert [m for m, _ in got["pages"]] == [m for m in got["messages"] if m.peer != OWN]
    assert got["verify"] == (24, 6, 1)
    # Seqnos come back byte for byte, whatever their value or length.
    by_key = {(m.round, m.peer): e for m, e in _history()[0] if e is not None}
    winner, winner_env = _history()[1]
    by_key[(winner.round, winner.peer)] = winner_env
    assert {(m.round, m.peer): e for m, e in got["pages"]} == by_key
    db = sqlite3.connect(old_path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT
    columns = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
    assert columns == {"round", "peer", "scalars", "data", "seqno", "signature"}
    assert db.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone() == (RUN,)
    names = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    assert not any(name.endswith("layout0") for name in names)
    db.close()


def test_fresh_rows_store_8_byte_seqnos_as_distances_from_one_a_round(tmp_path):
    with _fresh(tmp_path / "l.sqlite") as ledger:
        kinds = dict(
            ledger._db.execute(
                "SELECT typeof(seqno), COUNT(*) FROM messages WHERE seqno IS NOT NULL "
                "GROUP BY typeof(seqno)"
            ).fetchall()
        )
        assert kinds == {"integer": 23, "blob": 1}  # the 3-byte seqno stays a blob
        stored = {
            bytes(peer): sorted(v for (v,) in ledger._db.execute(
                "SELECT m.seqno FROM messages m JOIN peers p ON p.id = m.peer "
                "WHERE p.peer = ? AND typeof(m.seqno) = 'integer'", (peer,)
            ))
            for (peer,) in ledger._db.execute("SELECT peer FROM peers")
        }  # fmt: skip
        # Counting up one a round, across 2^64 and across SQLite's signed 64 bits: all 0,
        # which SQLite stores in no bytes at all (serial type 8).
        assert stored[KEYS[0][1]] == [0] * 6 and stored[KEYS[1][1]] == [0] * 6
        assert stored[KEYS[2][1]] == [0, 1, 2, 3, 4, 5]  # two a round: one more each round
        # peer 3's restart: 1000 a round below its first, and the round counted up
        assert stored[KEYS[3][1]] == [-5005, -4004, -3003, -1001, 0]
        # Every signature still checks: the seqnos are the ones signed.
        assert ledger.verify(verify_pubsub_signature, "FIX", 1, own_peer=OWN).signed == 24


def test_a_file_of_two_runs_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "two.sqlite"
    _write_layout0(path)
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO messages (run_id, round, peer, scalars) VALUES ('b', 0, x'01', x'0000')"
        )
    with pytest.raises(UserError, match="holds rows of 2 runs") as info:
        Ledger(path, RUN)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 31
    db.close()


def test_a_failed_conversion_is_one_line_and_changes_nothing(tmp_path):
    path = tmp_path / "l.sqlite"
    _write_layout0(path)
    with sqlite3.connect(path) as db:  # in the way of the new layout's table
        db.execute("CREATE TABLE peers (something_else)")
    with pytest.raises(UserError, match="cannot convert ledger .* nothing was changed") as info:
        Ledger(path, RUN)
    assert "\n" not in str(info.value)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM messages WHERE run_id = ?", (RUN,)).fetchone() == (30,)
    db.close()


def test_a_file_holds_one_run(tmp_path):
    """Another run's ledger reads as empty (as when rows carried their run id), and cannot
    write its rows into this file."""
    path = tmp_path / "l.sqlite"
    _fresh(path).close()
    with Ledger(path, "another-run") as other:
        assert len(other) == 0 and list(other.messages()) == [] and other.max_round() == -1
        assert other.bucket_digests(2) == {} and other.audits() == [] and not other.peers()
        assert other.revocations() == [] and other.losing_copies() == {}
        assert other.scalars_of(OWN, 0) is None and other.signed_after(-1, b"", 99, 9) == []
        with pytest.raises(UserError, match="holds rows of run .* one run"):
            other.add([UpdateMessage(0, b"x", (1.0,))])
    with Ledger(path, RUN) as ledger:
        assert len(ledger) == 30


def test_a_newer_layout_is_refused(tmp_path):
    path = tmp_path / "l.sqlite"
    Ledger(path, RUN).close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {LAYOUT + 1}")
    with pytest.raises(UserError, match="written by a newer seedflood"):
        Ledger(path, RUN)


def test_a_second_layout_file_gains_the_bucket_digest_table_and_keeps_its_rows(tmp_path):
    """Layout 2 (before issue 46's kept bucket digests) -> 3: the table is added in place,
    nothing else changes."""
    path = tmp_path / "l.sqlite"
    msgs = [UpdateMessage(t, bytes([p]) * 38, (0.5 * t,)) for t in range(130) for p in range(2)]
    with Ledger(path, RUN) as ledger:
        ledger.add(msgs)
        digest, buckets = ledger.digest(), ledger.bucket_digests(64)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("DROP TABLE bucket_digests")
        db.execute("PRAGMA user_version = 2")
    with Ledger(path, RUN) as ledger:
        assert len(ledger) == len(msgs) and ledger.digest() == digest
        assert ledger.bucket_digests(64) == buckets
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT
        kept = db.execute("SELECT bucket, count FROM bucket_digests ORDER BY bucket").fetchall()
    assert kept == [(0, 128), (1, 128)]  # the buckets below the newest (2: rounds 128-129)


def _int64(value: int) -> int:
    value %= U64
    return value - U64 if value >> 63 else value


def test_a_third_layout_file_reads_the_same_and_keeps_its_peers_seqno_bases(tmp_path):
    """Layout 3 stored an 8-byte seqno as its distance from the peer's first (peers.
    seqno_base); layout 4 from its first minus its round, plus the row's round. A layout-3
    file gains the column in place: its rows and peers stay as they are and read back the
    same, its peers' new rows go on against their base, and new peers get an origin."""
    path = tmp_path / "l.sqlite"
    with _fresh(path) as ledger:
        expected = _reads(ledger)
    with contextlib.closing(sqlite3.connect(path)) as db, db:  # written as layout 3 wrote it
        origins = dict(db.execute("SELECT id, seqno_origin FROM peers"))
        for number, origin in origins.items():
            if origin is None:
                continue
            base = _int64(origin + 1_000)  # any value: the file's first row set it
            db.execute("UPDATE peers SET seqno_base = ? WHERE id = ?", (base, number))
            for round_, stored in db.execute(
                "SELECT round, seqno FROM messages WHERE peer = ? AND typeof(seqno) = "
                "'integer'", (number,)
            ).fetchall():  # fmt: skip
                db.execute(
                    "UPDATE messages SET seqno = ? WHERE peer = ? AND round = ?",
                    (_int64(origin + round_ + stored - base), number, round_),
                )
        db.execute("ALTER TABLE peers RENAME TO peers_layout4")
        db.execute(  # the table as layout 3 created it
            "CREATE TABLE peers (id INTEGER PRIMARY KEY, peer BLOB NOT NULL UNIQUE, "
            "seqno_base INTEGER)"
        )
        db.execute("INSERT INTO peers SELECT id, peer, seqno_base FROM peers_layout4")
        db.execute("DROP TABLE peers_layout4")
        db.execute("PRAGMA user_version = 3")
    with Ledger(path, RUN) as ledger:
        assert _reads(ledger) == expected
        new_key = _key(9)
        later = [_update(ORDER[0], 6, (1.0,))]
        data, seqno = encode_update(RUN, 6, (2.0,)), (12_345).to_bytes(8, "big")
        signature = new_key[0].sign(signed_bytes(new_key[1], data, seqno, topic_for(RUN)))
        later.append((UpdateMessage(6, new_key[1], (2.0,)), Envelope(data, seqno, signature)))
        ledger.add([m for m, _ in later], [e for _, e in later])
        assert ledger.signed_after(5, b"\xff" * 64, 6, 10) == sorted(
            later, key=lambda row: row[0].peer
        )  # both read back as signed
        rows = ledger._db.execute(
            "SELECT p.seqno_base IS NOT NULL, p.seqno_origin, m.seqno FROM messages m "
            "JOIN peers p ON p.id = m.peer WHERE m.round = 6 ORDER BY p.seqno_base IS NULL"
        ).fetchall()
        assert rows[0][:2] == (True, None)  # the old peer: still against its base
        assert rows[1] == (False, 12_345 - 6, 0)  # the new peer: an origin, stored as 0
        assert ledger.verify(verify_pubsub_signature, "FIX", 1, own_peer=OWN).signed == 26
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT == 4
