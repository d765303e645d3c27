"""The ledger: idempotent, canonical, durable across SIGKILL, and loud when corrupt."""

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage, pack_scalars
from seedflood_p2p.storage.ledger import Ledger

PEER = "(SELECT id FROM peers WHERE peer = ?)"  # a `messages` row names its peer by number


def _msgs(n_rounds: int, peers: int) -> list[UpdateMessage]:
    return [
        UpdateMessage(t, bytes([p]) * 4, (0.25 * t - p, float(p)))
        for t in range(n_rounds)
        for p in range(peers)
    ]


def test_inserts_are_idempotent_and_reads_are_canonical(tmp_path):
    msgs = _msgs(5, 3)
    shuffled = msgs[:]
    random.Random(0).shuffle(shuffled)
    with Ledger(tmp_path / "a.sqlite", "run") as a, Ledger(tmp_path / "b.sqlite", "run") as b:
        assert len(a.add(msgs)) == 15
        assert a.add(msgs[:4]) == []  # duplicates are ignored
        b.add(shuffled[:8])
        b.add(shuffled)
        assert len(a) == len(b) == 15
        assert list(a.messages()) == list(b.messages()) == sorted(msgs)
        assert a.digest() == b.digest()
        assert a.max_round() == 4 and a.has(bytes([2]) * 4, 3)
        b.add([UpdateMessage(9, b"x", (1.0, 2.0))])
        assert a.digest() != b.digest()


def test_a_batch_with_held_rows_keeps_only_the_new_ones_and_their_new_peers(tmp_path):
    """A batch is one statement; when some of it is already held (or repeated in it), the
    rows are inserted one by one instead: the new ones, in order, with the peers and
    seqno bases first numbered in that batch kept."""
    from seedflood_p2p.protocol.message import Envelope

    def envelope(m: UpdateMessage) -> Envelope:
        return Envelope(b"d" + m.peer, (1000 + m.round).to_bytes(8, "big"), b"s" * 64)

    held = _msgs(2, 2)
    fresh = [UpdateMessage(1, b"new-peer", (0.5, 1.0)), UpdateMessage(2, b"new-peer", (2.0, 0.0))]
    batch = [held[0], fresh[0], held[0], fresh[1], held[3]]
    with Ledger(tmp_path / "a.sqlite", "run") as a, Ledger(tmp_path / "b.sqlite", "run") as b:
        a.add(held, [envelope(m) for m in held])
        assert a.add(batch, [envelope(m) for m in batch]) == fresh
        assert b.add(held + fresh, [envelope(m) for m in held + fresh]) == held + fresh
        assert len(a) == 6 and a.digest() == b.digest()
        signed = [x.signed_after(-1, b"", 10, 100) for x in (a, b)]
        assert signed[0] == signed[1] and len(signed[0]) == 6  # peers, seqnos, envelopes
        assert a.add(batch) == []  # all held: nothing new, nothing written


def test_replace_swaps_an_update_and_its_digests(tmp_path):
    """The equivocation rule's write: same (peer, round), another scalar, fresh digests."""
    msgs = _msgs(3, 2)
    winner = UpdateMessage(1, msgs[2].peer, (-7.0, 1.0))
    with Ledger(tmp_path / "a.sqlite", "run") as a, Ledger(tmp_path / "b.sqlite", "run") as b:
        a.add(msgs)
        before = a.bucket_digests(64)  # cached per (bucket, count): replace must drop it
        assert a.replace(winner, None) == msgs[2].scalars
        b.add([winner if (m.round, m.peer) == (1, winner.peer) else m for m in msgs])
        assert len(a) == 6 and a.scalars_of(winner.peer, 1) == (-7.0, 1.0)
        assert a.bucket_digests(64) == b.bucket_digests(64) != before
        assert a.digest() == b.digest()
        with pytest.raises(KeyError):
            a.replace(UpdateMessage(99, b"nobody", (1.0,)), None)


def test_bucket_digests_are_kept_in_the_file_and_dropped_when_a_row_changes(tmp_path, monkeypatch):
    """A daemon holding a long ledger reads its old buckets' digests instead of hashing
    every row at start (issue 46); a row changed in place (an equivocation's `replace`, a
    record's smaller `at`) drops them, so no stale digest survives a restart."""
    from seedflood_p2p.protocol.message import AuditRecord
    from seedflood_p2p.storage import ledger as ledger_module
    from seedflood_p2p.storage.digests import audit_set_digest, set_digest

    path = tmp_path / "l.sqlite"
    msgs = _msgs(10, 3)  # buckets of 4 rounds: 0, 1 (kept) and 2 (the newest)
    record = AuditRecord(msgs[0].peer, 1, b"auditor", (1.0, 2.0), 7)
    with Ledger(path, "run") as a:
        a.add(msgs)
        a.add_audits([record, AuditRecord(msgs[0].peer, 9, b"auditor", (1.0,), 9)])
        first, first_audits = a.bucket_digests(4), a.audit_bucket_digests(4)
    assert sorted(first) == [0, 1, 2]
    assert first[1] == (12, set_digest(m for m in msgs if 4 <= m.round < 8))
    with Ledger(path, "run") as b:
        hashed = []
        real = ledger_module.row_member_hash
        monkeypatch.setattr(
            ledger_module, "row_member_hash", lambda r, p, s: hashed.append(r) or real(r, p, s)
        )
        assert b.bucket_digests(4) == first
        assert sorted(set(hashed)) == [8, 9]  # only the newest bucket was read and hashed
        assert b.audit_bucket_digests(4) == first_audits
        # an equivocation replaces a row of the kept bucket 0: its digest is recomputed
        winner = UpdateMessage(1, msgs[3].peer, (-9.0, 0.0))
        b.replace(winner, None)
        b.add_audits([dataclasses.replace(record, at=3)])  # a smaller `at` replaces it
    changed = [winner if (m.round, m.peer) == (1, winner.peer) else m for m in msgs]
    with Ledger(path, "run") as c:
        assert c.bucket_digests(4)[0] == (12, set_digest(m for m in changed if m.round < 4))
        assert c.bucket_digests(4)[1] == first[1]
        assert c.audit_bucket_digests(4)[0] == (
            1,
            audit_set_digest([dataclasses.replace(record, at=3)]),
        )


def test_bucket_counts_are_kept_by_add_not_counted_on_every_call(tmp_path):
    """bucket_digests is asked every second (the island view), every summary and every
    repair exchange; counting the rows per bucket with a GROUP BY over the whole table took
    0.27 s a call at a million rows. The counts are taken once and kept by add() (new rows
    only: a batch with rows held already, a replace), and agree with a fresh count."""
    msgs = _msgs(12, 4)
    path = tmp_path / "l.sqlite"
    with Ledger(path, "run") as ledger:
        ledger.add(msgs[:10])
        ledger.bucket_digests(4)
        statements: list[str] = []
        ledger._db.set_trace_callback(statements.append)
        ledger.add(msgs[5:30])  # five held already: the row-by-row path
        ledger.add(msgs[30:])
        ledger.replace(UpdateMessage(2, msgs[9].peer, (-3.0, 1.0)), None)
        kept = ledger.bucket_digests(4)
        ledger._db.set_trace_callback(None)
        assert not [s for s in statements if "GROUP BY round /" in s]
    with Ledger(path, "run") as fresh:
        assert kept == fresh.bucket_digests(4)
        assert sum(count for count, _ in kept.values()) == len(msgs)


def test_the_growing_bucket_hashes_only_its_new_rows(tmp_path, monkeypatch):
    """The newest bucket grows every round, and a swarm of M peers puts 64 x M rows in it:
    a digest call hashes only the rows it has not met (issue 46: rehashing the bucket on
    every summary and repair exchange was a fifth of a flooded daemon's CPU), and its
    digest is always the full set digest, through late rows, a new bucket and a replace."""
    from seedflood_p2p.storage import ledger as ledger_module
    from seedflood_p2p.storage.digests import set_digest

    hashed = []
    real = ledger_module.row_member_hash
    monkeypatch.setattr(
        ledger_module, "row_member_hash", lambda r, p, s: hashed.append((r, p)) or real(r, p, s)
    )
    msgs = _msgs(12, 5)
    random.Random(1).shuffle(msgs)
    held: list[UpdateMessage] = []

    def expected(bucket: int) -> tuple[int, bytes]:
        rows = [m for m in held if m.round // 8 == bucket]
        return len(rows), set_digest(rows)

    with Ledger(tmp_path / "l.sqlite", "run") as ledger:
        newest = -1
        for i in range(0, len(msgs), 7):  # rows of many rounds at a time, out of order
            batch = msgs[i : i + 7]
            ledger.add(batch)
            held += batch
            want = {b: expected(b) for b in {m.round // 8 for m in held}}
            hashed.clear()
            assert ledger.bucket_digests(8) == want
            # each row hashed at most once, only in buckets that changed, and the growing
            # bucket, once it is the newest, only its new rows
            assert len(hashed) == len(set(hashed))
            assert {r // 8 for r, _ in hashed} <= {m.round // 8 for m in batch}
            if max(want) == newest:
                new = {(m.round, m.peer) for m in batch}
                assert {(r, p) for r, p in hashed if r // 8 == newest} <= new
            newest = max(want)
        want = {0: expected(0), 1: expected(1)}
        hashed.clear()
        assert ledger.bucket_digests(8) == want
        assert hashed == []  # nothing new: nothing hashed
        winner = UpdateMessage(9, held[0].peer, (-3.0, 2.0))
        old = next(m for m in held if (m.round, m.peer) == (9, winner.peer))
        ledger.replace(winner, None)
        held = [winner if m is old else m for m in held]
        assert ledger.bucket_digests(8) == {0: expected(0), 1: expected(1)}


def test_runs_are_kept_apart(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path, "run-a") as a:
        a.add(_msgs(2, 2))
    with Ledger(path, "run-b") as b:
        assert len(b) == 0


def test_the_manifest_is_parsed_once_and_handed_out_as_config(tmp_path):
    """A claimed ledger's `config` is the run it was claimed for; an opened one's is its
    stored manifest, parsed on open; one that holds no run yet has none to hand out."""
    from seedflood_p2p.core.config import RunConfig

    config = RunConfig(salt="ledger-config", directions=2)
    path = tmp_path / "l.sqlite"
    with Ledger(path, config.run_id) as ledger:
        with pytest.raises(RuntimeError, match="no run yet"):
            _ = ledger.config
        ledger.claim(config, "")
        assert ledger.config is config
        with pytest.raises(UserError, match="holds a ledger of another run .*: FIX"):
            ledger.claim(RunConfig(salt="other"), "FIX")
        assert ledger.config is config
    with Ledger.open_existing(path) as ledger:
        assert ledger.config == config and ledger.run_id == config.run_id
        assert ledger.get_meta("manifest") == config.to_json()


def test_sigkill_mid_write_keeps_every_committed_message(tmp_path):
    path = tmp_path / "killed.sqlite"
    writer = textwrap.dedent(f"""
        import sys
        from seedflood_p2p.storage.ledger import Ledger
        from seedflood_p2p.protocol.message import UpdateMessage
        ledger = Ledger({str(path)!r}, "run")
        for t in range(1_000_000):
            ledger.add([UpdateMessage(t, bytes([p]), (float(t),)) for p in range(4)])
            print(t, flush=True)  # printed only after the transaction committed
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    try:
        last = -1
        deadline = time.monotonic() + 60
        while last < 200 and time.monotonic() < deadline:
            last = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: the writer never pauses
    finally:
        proc.kill()
        proc.wait()
    assert last >= 200
    with Ledger(path, "run") as ledger:
        got = {(m.round, m.peer): m.scalars[0] for m in ledger.messages()}
        for t in range(last + 1):
            for p in range(4):
                assert got[(t, bytes([p]))] == float(t)
        assert ledger._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # Nothing half-written: a round is either complete or absent.
        rounds = {}
        for (t, _), _ in got.items():
            rounds[t] = rounds.get(t, 0) + 1
        assert set(rounds.values()) == {4}


def test_corrupt_file_is_a_readable_error(tmp_path):
    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(UserError, match="corrupt or not a seedflood ledger"):
        Ledger(path, "run")
    with pytest.raises(UserError, match="does not exist"):
        Ledger.open_existing(tmp_path / "missing.sqlite")


def test_damage_inside_a_valid_file_is_one_error_naming_the_row_or_the_file(tmp_path):
    """A fuzzer's finds: a blob turned text by `||` (not UTF-8), and a byte that is not UTF-8
    in the schema text, once ended in sqlite3's OperationalError and UnicodeDecodeError."""
    import sqlite3

    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature as check

    config = RunConfig(model="tiny-llama")
    path = tmp_path / "l.sqlite"
    with Ledger(path, config.run_id) as ledger:
        ledger.claim(config, "")
        ledger.add([UpdateMessage(t, b"peer-%d" % p, (0.5,)) for t in range(3) for p in range(2)])
    with sqlite3.connect(path) as db:
        db.execute("UPDATE messages SET scalars = scalars || x'ff' WHERE round = 1")
    with Ledger.open_existing(path) as ledger:
        with pytest.raises(UserError, match=r"row \(round 1, peer .*\) does not hold 1..16"):
            ledger.verify(check, "FIX")
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA writable_schema = ON")
        (sql,) = db.execute("SELECT sql FROM sqlite_master WHERE name = 'meta'").fetchone()
        db.execute(
            "UPDATE sqlite_master SET sql = ? WHERE name = 'meta'", (sql.encode() + b" \xff",)
        )
    with pytest.raises(UserError, match="corrupt or not a seedflood ledger") as info:
        Ledger.open_existing(path)
    assert str(path) in str(info.value)


def _signer(key):
    """sign(round, scalars) -> (message, envelope), exactly as go-libp2p-pubsub signs."""
    from cryptography.hazmat.primitives import serialization as ser
    from hivemind.proto import p2pd_pb2 as pb

    from seedflood_p2p.protocol.framing import topic_for
    from seedflood_p2p.protocol.message import Envelope
    from seedflood_p2p.protocol.update import encode_update

    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    peer = bytes.fromhex("002408011220") + public

    def sign(run_id: str, round_: int, scalars: tuple[float, ...]):
        data, seqno = encode_update(run_id, round_, scalars), round_.to_bytes(8, "big")
        body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[topic_for(run_id)])
        setattr(body, "from", peer)
        signature = key.sign(b"libp2p-pubsub:" + body.SerializeToString())
        return UpdateMessage(round_, peer, scalars), Envelope(data, seqno, signature)

    def sign_audit(run_id: str, accused: bytes, round_: int, scalars: tuple[float, ...]):
        """An audit record by this key, signed on the run's audit topic."""
        from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
        from seedflood_p2p.protocol.message import AuditRecord

        data, seqno = encode_audit(run_id, accused, round_, scalars), round_.to_bytes(8, "big")
        body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[audit_topic_for(run_id)])
        setattr(body, "from", peer)
        signature = key.sign(b"libp2p-pubsub:" + body.SerializeToString())
        return AuditRecord(accused, round_, peer, scalars), Envelope(data, seqno, signature)

    sign.audit = sign_audit
    return peer, sign


_SIGNERS: dict = {}  # peer id -> its `_signer` function (sign.audit signs audit records)


def _network_ledger(path, rounds=6):
    """A peer's ledger: 3 senders' signed rows, and 2 own rows not yet echoed (unsigned)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from seedflood_p2p.core.config import RunConfig

    config = RunConfig(salt="ledger-verify", directions=2)
    signers = [_signer(Ed25519PrivateKey.generate()) for _ in range(3)]
    _SIGNERS.update(signers)  # each peer's signer, to sign audit records with its key
    own = signers[0][0]
    ledger = Ledger(path, config.run_id)
    ledger.claim(config, "")
    for t in range(rounds):
        rows = [sign(config.run_id, t, (0.5 * t, -1.0)) for _, sign in signers]
        if t >= rounds - 2:  # the writer's own last updates, logged before publishing
            ledger.add([rows[0][0]])
            rows = rows[1:]
        ledger.add([m for m, _ in rows], [e for _, e in rows])
    return ledger, config, own, [peer for peer, _ in signers]


def test_verify_checks_every_signed_row_and_names_a_tampered_one(tmp_path):
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature as check
    from seedflood_p2p.storage.ledger import peer_name

    ledger, config, own, peers = _network_ledger(tmp_path / "l.sqlite")
    result = ledger.verify(check, "FIX", config.directions, own_peer=own)
    assert (result.signed, result.unsigned, result.unsigned_peers) == (16, 2, 1)
    assert ledger.verify(check, "FIX").signed == 16  # replay: one writer's unsigned rows ok
    db = ledger._db

    def refused(match: str, **kwargs) -> str:
        with pytest.raises(UserError, match=match) as info:
            ledger.verify(check, "FIX", config.directions, **kwargs)
        line = str(info.value)
        assert "\n" not in line and line.endswith("; FIX") and str(ledger.path) in line
        return line

    where = f"WHERE round = 3 AND peer = {PEER}"
    original = db.execute(
        f"SELECT scalars, signature FROM messages {where}", (peers[1],)
    ).fetchone()
    # A changed scalar: the envelope no longer matches the row.
    db.execute(f"UPDATE messages SET scalars = ? {where}", (pack_scalars((9.0, -1.0)), peers[1]))
    line = refused("differs from the update its sender signed", own_peer=own)
    assert f"row (round 3, peer {peer_name(peers[1])})" in line
    db.execute(f"UPDATE messages SET scalars = ? {where}", (original[0], peers[1]))
    # A flipped signature bit.
    bad = bytes([original[1][0] ^ 1]) + original[1][1:]
    db.execute(f"UPDATE messages SET signature = ? {where}", (bad, peers[1]))
    refused(r"row \(round 3, .*\) does not carry its sender's valid signature")
    db.execute(f"UPDATE messages SET signature = ? {where}", (original[1], peers[1]))
    ledger.verify(check, "FIX", config.directions, own_peer=own)  # restored: fine again
    # A stripped envelope (then anything could be written): another peer's row.
    db.execute(
        f"UPDATE messages SET data = NULL, seqno = NULL, signature = NULL {where}", (peers[2],)
    )
    refused("is another peer's update without its signed envelope", own_peer=own)
    refused("has no signed envelope, like rows of 1 other peer")  # replay: two unsigned peers
    db.execute(f"UPDATE messages SET data = x'00' {where}", (peers[2],))
    refused("has a partial or malformed envelope")
    db.execute(f"DELETE FROM messages WHERE round = 3 AND peer = {PEER}", (peers[2],))
    # Rows that are not updates at all (one round of peers[1] each, deleted after).
    for t, (column, value, match) in enumerate(
        [
            ("scalars", b"\0\0\0", "does not hold 1..16 float16 scalars"),
            ("scalars", b"\x00\x7c" * 2, "holds a non-finite scalar"),
            ("scalars", b"\0" * 6, "holds 3 scalars, the run sends 2"),
            ("peer", "text, not bytes", "has no valid peer id"),
            ("round", -4, "has a round outside"),
        ]
    ):
        db.execute(
            f"UPDATE messages SET {column} = ? WHERE round = ? AND peer = {PEER}",
            (value, t, peers[1]),
        )
        refused(match)
        db.execute(f"DELETE FROM messages WHERE {column} = ?", (value,))
    ledger.verify(check, "FIX", config.directions, own_peer=own)
    ledger.close()


def _replay_refusal(capsys, tmp_path, monkeypatch, make_ledger, sql, scalars) -> str:
    """`seedflood replay` of the ledger `make_ledger` builds: replayed as it is (0); once
    `sql` (parameters: `scalars` packed, the third peer) tampered with it, refused (2) with
    one line on stderr, which is returned."""
    from seedflood.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ledger, _, _, peers = make_ledger(tmp_path / "l.sqlite")
    ledger.close()
    argv = ["replay", "--ledger", str(tmp_path / "l.sqlite"), "--out", str(tmp_path / "model")]
    assert main(argv) == 0  # genuine: replayed
    capsys.readouterr()
    with Ledger.open_existing(tmp_path / "l.sqlite") as ledger:
        ledger._db.execute(sql, (pack_scalars(scalars), peers[2]))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ledger ")
    return err[0]


def test_replay_refuses_a_tampered_ledger_with_one_line(capsys, tmp_path, monkeypatch):
    sql = f"UPDATE messages SET scalars = ? WHERE round = 2 AND peer = {PEER}"
    line = _replay_refusal(capsys, tmp_path, monkeypatch, _network_ledger, sql, (-60000.0, -1.0))
    assert "row (round 2, peer 12D3KooW" in line and "differs from the update" in line
    assert "replay a copy from a peer" in line


def _audited_ledger(path):
    """`_network_ledger` plus audit records: two other auditors' signed ones on round 1 of
    the writer, and one of the writer's own, logged before it was published (unsigned)."""
    from seedflood_p2p.protocol.message import AuditRecord

    ledger, config, own, peers = _network_ledger(path)
    for peer in peers[1:]:
        record, envelope = _SIGNERS[peer].audit(config.run_id, own, 1, (0.25, -1.0))
        ledger.add_audits([record], [envelope])

    ledger.add_audits([AuditRecord(peers[1], 2, own, (1.5, -1.0))])
    return ledger, config, own, peers


def test_verify_checks_audit_records_signatures_and_names_a_tampered_one(tmp_path):
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature as check
    from seedflood_p2p.storage.ledger import peer_name

    ledger, config, own, peers = _audited_ledger(tmp_path / "l.sqlite")
    result = ledger.verify(check, "FIX", config.directions, own_peer=own)
    assert (result.audits_signed, result.audits_unsigned, result.unsigned_peers) == (2, 1, 1)
    db = ledger._db

    def refused(match: str, **kwargs) -> str:
        with pytest.raises(UserError, match=match) as info:
            ledger.verify(check, "FIX", config.directions, **kwargs)
        line = str(info.value)
        assert "\n" not in line and line.endswith("; FIX") and str(ledger.path) in line
        return line

    where = "WHERE round = 1 AND auditor = ?"
    original = db.execute(f"SELECT scalars, signature FROM audits {where}", (peers[1],)).fetchone()
    # A changed scalar: a match vote turned into an accusation.
    db.execute(f"UPDATE audits SET scalars = ? {where}", (pack_scalars((9.0, -1.0)), peers[1]))
    line = refused("differs from the record its auditor signed", own_peer=own)
    assert (
        f"row (audit of round 1, accused {peer_name(own)}, auditor {peer_name(peers[1])})" in line
    )
    db.execute(f"UPDATE audits SET scalars = ? {where}", (original[0], peers[1]))
    # A flipped signature bit.
    bad = bytes([original[1][0] ^ 1]) + original[1][1:]
    db.execute(f"UPDATE audits SET signature = ? {where}", (bad, peers[1]))
    refused(r"row \(audit of round 1, .*\) does not carry its auditor's valid signature")
    db.execute(f"UPDATE audits SET signature = ? {where}", (original[1], peers[1]))
    ledger.verify(check, "FIX", config.directions, own_peer=own)  # restored: fine again
    # A record forged in another auditor's name: no envelope, and not the writer's.
    db.execute(
        f"UPDATE audits SET data = NULL, seqno = NULL, signature = NULL {where}", (peers[2],)
    )
    refused("is another peer's audit record without its signed envelope", own_peer=own)
    refused("has no signed envelope, like rows of 1 other peer")  # replay: two unsigned
    db.execute(f"DELETE FROM audits {where}", (peers[2],))
    db.execute(f"UPDATE audits SET scalars = ? {where}", (b"\0\0\0", peers[1]))
    refused("does not hold 1..16 float16 scalars")
    ledger.close()


def test_replay_refuses_a_forged_audit_record_with_one_line(capsys, tmp_path, monkeypatch):
    sql = "UPDATE audits SET scalars = ? WHERE auditor = ?"
    line = _replay_refusal(capsys, tmp_path, monkeypatch, _audited_ledger, sql, (-3.0, -1.0))
    assert "(audit of round 1, accused 12D3KooW" in line and "differs from the record" in line


def test_rows_a_checkpoint_covers_are_not_rechecked_while_unchanged(tmp_path):
    """A restart checks the signatures of the rows after its checkpoint only, as long as the
    rows it covers are byte for byte what they were (`ledger_rows_sha256`)."""
    import json

    from seedflood_p2p.network.transport.identity import verify_pubsub_signature as check
    from seedflood_p2p.storage.checkpoint import unchanged_rows
    from seedflood_p2p.storage.cut import encode_cut

    ledger, config, own, peers = _network_ledger(tmp_path / "l.sqlite")
    covered = {(m.peer, m.round) for m in ledger.messages() if m.round < 4}
    (tmp_path / "checkpoint.json").write_text(
        json.dumps(
            {"ledger_cut": encode_cut(covered), "ledger_rows_sha256": ledger.rows_sha256(covered)}
        )
    )
    trusted = unchanged_rows(ledger, tmp_path)
    every = [(m.peer, m.round) for m in ledger.messages()]
    assert len(trusted) == len(covered) and {k for k in every if k in trusted} == covered
    result = ledger.verify(check, "FIX", config.directions, own, trusted)
    assert (result.signed, result.trusted) == (16, 12)  # 12 signed rows below round 4
    # One covered row's signature flipped: the rows changed, so every row is checked again.
    where = f"WHERE round = 2 AND peer = {PEER}"
    signature = ledger._db.execute(
        f"SELECT signature FROM messages {where}", (peers[1],)
    ).fetchone()[0]
    bad = bytes([signature[0] ^ 1]) + signature[1:]
    ledger._db.execute(f"UPDATE messages SET signature = ? {where}", (bad, peers[1]))
    assert unchanged_rows(ledger, tmp_path) is None
    with pytest.raises(UserError, match="does not carry its sender's valid signature"):
        ledger.verify(check, "FIX", config.directions, own, unchanged_rows(ledger, tmp_path))
    assert unchanged_rows(ledger, tmp_path / "nowhere") is None


def test_scalars_of_many_is_scalars_of_for_each_key(tmp_path):
    """Admission reads a batch's held rows in one query (issue 46); it must answer as one
    `scalars_of` a key, for known and unknown peers and rounds, across the IN-list bounds."""
    msgs = [  # 700 peers: more than one IN list of peers
        UpdateMessage(t, p.to_bytes(2, "big") * 2, (0.5 * t, float(p % 7)))
        for t in range(6)
        for p in range(700)
    ]
    with Ledger(tmp_path / "l.sqlite", "run") as ledger:
        ledger.add(msgs[::2])
        keys = [(m.peer, m.round) for m in msgs[::3]] + [(b"nobody", 1), (msgs[0].peer, 99)]
        got = ledger.scalars_of_many(keys)
        assert got == {k: s for k in keys if (s := ledger.scalars_of(*k)) is not None}
        assert len(got) == len(msgs[::6])  # the rows of even index among every third
        assert ledger.scalars_of_many([]) == {}


def test_trusted_rows_up_to_the_checkpoint_are_not_read_and_the_answer_is_the_same(
    tmp_path, monkeypatch
):
    """`verify` with `trusted` as a checkpoint's `CutRanges` that are every row up to their
    newest round reads only the unsigned rows there (checked as always) and the rows
    after: the same answer as the row-by-row pass, which a restart at 10M rows spent 20 s
    on. A trusted row without its envelope is still refused when it is not ours, and a
    row the cut lacks below its newest round turns the shortcut off."""
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature as check
    from seedflood_p2p.storage import ledger as ledger_module
    from seedflood_p2p.storage.cut import cut_contains, encode_cut

    ledger, config, own, peers = _network_ledger(tmp_path / "l.sqlite")
    covered = {(m.peer, m.round) for m in ledger.messages()}  # rounds 0-5, own rows unsigned
    reads = []
    real = ledger_module.seqno_bytes
    monkeypatch.setattr(ledger_module, "seqno_bytes", lambda *a: reads.append(a) or real(*a))

    def fields(result):
        return result.signed, result.unsigned, result.unsigned_peers, result.trusted

    fast = ledger.verify(check, "FIX", config.directions, own, cut_contains(encode_cut(covered)))
    fast_reads, reads[:] = len(reads), []
    slow = ledger.verify(check, "FIX", config.directions, own, set(covered))  # no ranges
    assert fields(fast) == fields(slow) == (16, 2, 1, 16)
    assert (fast_reads, len(reads)) == (2, 18)  # the two unsigned rows, against every row

    # Someone else's row without its envelope, inside the trusted rounds: refused as ever.
    where = f"WHERE round = 1 AND peer = {PEER}"
    ledger._db.execute(
        f"UPDATE messages SET data = NULL, seqno = NULL, signature = NULL {where}", (peers[1],)
    )
    with pytest.raises(UserError, match="another peer's update without its signed envelope"):
        ledger.verify(check, "FIX", config.directions, own, cut_contains(encode_cut(covered)))

    # A row the cut lacks below its newest round (a late row): every row is read, and that
    # row's signature is checked (a flipped one is found).
    ledger2, config, own, peers = _network_ledger(tmp_path / "m.sqlite")
    late = (peers[2], 1)
    covered = {(m.peer, m.round) for m in ledger2.messages()} - {late}
    signature = ledger2._db.execute(f"SELECT signature FROM messages {where}", (late[0],))
    signature = signature.fetchone()[0]
    ledger2._db.execute(
        f"UPDATE messages SET signature = ? {where}",
        (bytes([signature[0] ^ 1]) + signature[1:], late[0]),
    )
    with pytest.raises(UserError, match="does not carry its sender's valid signature"):
        ledger2.verify(check, "FIX", config.directions, own, cut_contains(encode_cut(covered)))
