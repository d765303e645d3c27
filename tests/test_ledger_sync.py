"""The ledger's fsync off the event loop (`Ledger.sync_in_background`, issue 46): commits
keep their order and survive a killed process, `flush` waits for the disk, and a slow
fsync never stops other coroutines."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


def _round(t: int, peers: int = 4) -> list[UpdateMessage]:
    return [UpdateMessage(t, bytes([p + 1]) * 4, (float(t),)) for p in range(peers)]


class _GatedLedger(Ledger):
    """A ledger whose WAL fsync waits for the test to open a gate (a slow disk)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.fsyncs: list[int] = []  # the commit generation each fsync covered

    def _fsync(self, fd: int) -> None:
        self.gate.wait(30)
        super()._fsync(fd)
        self.fsyncs.append(self._syncer.generation)


def test_rows_reported_committed_survive_a_killed_process(tmp_path):
    """A writer in its own process commits round after round with the fsync in the
    background, says which rounds it committed, and is SIGKILLed mid-write: reopened, the
    file holds every round reported, whole, in order (no gap before the last one), and
    those reported flushed too."""
    path = tmp_path / "killed.sqlite"
    writer = textwrap.dedent(f"""
        from seedflood_p2p.storage.ledger import Ledger
        from seedflood_p2p.protocol.message import UpdateMessage
        ledger = Ledger({str(path)!r}, "run")
        ledger.sync_in_background()
        for t in range(1_000_000):
            ledger.add([UpdateMessage(t, bytes([p + 1]) * 4, (float(t),)) for p in range(4)])
            if t % 50 == 0:
                ledger.flush()
                print("flushed", t, flush=True)
            print("committed", t, flush=True)  # printed only after COMMIT returned
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    committed = flushed = -1
    try:
        deadline = time.monotonic() + 120
        while committed < 300 and time.monotonic() < deadline:
            what, t = proc.stdout.readline().split()
            if what == "flushed":
                flushed = int(t)
            else:
                committed = int(t)
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: the writer never pauses
    finally:
        proc.kill()
        proc.wait()
    assert committed >= 300 and flushed >= 300
    with Ledger(path, "run") as ledger:
        counts: dict[int, int] = {}
        for m in ledger.messages():
            assert m.scalars == (float(m.round),)
            counts[m.round] = counts.get(m.round, 0) + 1
        assert set(counts.values()) == {4}  # nothing half-written
        newest = max(counts)
        assert newest >= committed
        assert sorted(counts) == list(range(newest + 1))  # commit order kept: no gaps
        assert ledger._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_a_slow_fsync_does_not_block_the_event_loop(tmp_path):
    """While the sync thread is stuck in fsync, commits return at once and another
    coroutine keeps running; the flushing coroutine resumes only after the fsync, and one
    fsync covers every commit made while it waited."""
    ledger = _GatedLedger(tmp_path / "slow.sqlite", "run")
    ledger.sync_in_background()
    events: list[str] = []
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def writer() -> None:
        assert len(ledger.add(_round(0))) == 4
        events.append("committed")
        await ledger.flush_async()
        events.append("durable")

    tick_task = asyncio.create_task(ticker())
    write_task = asyncio.create_task(writer())
    while "committed" not in events:
        await asyncio.sleep(0)
    before = ticks
    for _ in range(50):  # the loop goes on while the fsync is held
        await asyncio.sleep(0)
    assert ticks >= before + 50
    assert events == ["committed"] and not write_task.done()
    assert not ledger.durable()
    for t in range(1, 6):  # more commits meanwhile: none waits on the disk
        assert len(ledger.add(_round(t))) == 4
    assert ledger.fsyncs == []
    ledger.gate.set()
    await asyncio.wait_for(write_task, 30)
    assert events == ["committed", "durable"]
    await asyncio.to_thread(ledger.flush)
    assert ledger.durable()
    # the first fsync covered the first commit; at most one more covered the other five
    assert 1 <= len(ledger.fsyncs) <= 2 and ledger.fsyncs[-1] >= 6
    tick_task.cancel()
    ledger.close()
    with Ledger(tmp_path / "slow.sqlite", "run") as again:
        assert len(again) == 24


def test_checkpoint_rows_hash_and_close_wait_for_the_disk(tmp_path):
    """`rows_sha256` (what a checkpoint records) returns only once every commit is
    durable; `close` syncs what is owed. Shown with a gate the test opens from a timer
    thread: rows_sha256 cannot return before the gate opened."""
    ledger = _GatedLedger(tmp_path / "ckpt.sqlite", "run")
    ledger.sync_in_background()
    rows = _round(0)
    ledger.add(rows)
    order: list[str] = []

    def open_gate() -> None:
        time.sleep(0.2)
        order.append("gate")
        ledger.gate.set()

    opener = threading.Thread(target=open_gate)
    opener.start()
    ledger.rows_sha256({(m.peer, m.round) for m in rows})
    order.append("hashed")
    opener.join()
    assert order == ["gate", "hashed"]
    assert ledger.durable()
    # (before the hash: one or two fsyncs, as the sync thread's first one began before or
    # after the round was added)
    before = len(ledger.fsyncs)
    ledger.add(_round(1))
    owed = ledger._syncer.generation
    ledger.close()  # owes one fsync: made before the file is let go
    assert len(ledger.fsyncs) == before + 1 and ledger.fsyncs[-1] == owed


def test_a_failed_fsync_is_a_user_error_for_whoever_waits(tmp_path):
    class Failing(Ledger):
        def _fsync(self, fd: int) -> None:
            raise OSError(5, "Input/output error")

    ledger = Failing(tmp_path / "eio.sqlite", "run")
    ledger.sync_in_background()
    ledger.add(_round(0))
    with pytest.raises(UserError, match="cannot sync ledger"):
        ledger.flush()
    with pytest.raises(UserError, match="cannot sync ledger"):
        asyncio.run(ledger.flush_async())
    ledger._syncer = None  # the thread has ended; close the file without it
    ledger.close()


def test_in_memory_and_plain_ledgers_flush_at_once(tmp_path):
    for ledger in (Ledger(":memory:", "run"), Ledger(tmp_path / "plain.sqlite", "run")):
        if str(ledger.path) == ":memory:":
            ledger.sync_in_background()  # nothing to sync: stays as it is
        ledger.add(_round(0))
        assert ledger.durable()
        ledger.flush()
        asyncio.run(ledger.flush_async())
        ledger.close()
