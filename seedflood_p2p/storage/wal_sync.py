"""Group commit for a ledger: a thread that fsyncs the WAL behind its commits, so the
event loop never waits for the disk (`Ledger.sync_in_background`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from seedflood_p2p.core.errors import UserError


class WalSyncer:
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
