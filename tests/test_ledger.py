"""The ledger: idempotent, canonical, durable across SIGKILL, and loud when corrupt."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


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


def test_runs_are_kept_apart(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path, "run-a") as a:
        a.add(_msgs(2, 2))
    with Ledger(path, "run-b") as b:
        assert len(b) == 0


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
