"""Banned peers of one data dir: a small SQLite file beside the ledger (`bans.sqlite`).

A ban is a local decision (this peer stops talking to that one), not a ledger fact, so it
lives outside the ledger: replay never reads it. It survives restarts, so a peer banned for
equivocation or abuse does not get a fresh start by waiting for us to restart. Whatever
decides a ban (network/peers/reputation.py from network behaviour, or a ledger-derived verdict)
calls `BanStore.ban(peer, reason)`.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from seedflood_p2p.storage.ledger import peer_name

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bans (
    peer BLOB PRIMARY KEY,
    reason TEXT NOT NULL,
    since REAL NOT NULL    -- unix time of the ban
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class Ban:
    peer: bytes
    reason: str
    since: float


class BanStore:
    """Persistent set of banned peer ids; `path=None` keeps it in memory (tests, tools)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._db = sqlite3.connect(":memory:" if path is None else str(path))
        self._db.executescript(_SCHEMA)
        rows = self._db.execute("SELECT peer, reason, since FROM bans ORDER BY since")
        # Held in memory too: checked for every gossip message, shown after close().
        self._banned = {bytes(p): Ban(bytes(p), r, s) for p, r, s in rows}

    def ban(self, peer: bytes, reason: str) -> bool:
        """Ban `peer` for `reason`; False if it was banned already (the first reason stays)."""
        if peer in self._banned:
            return False
        ban = Ban(peer, reason, time.time())
        with self._db:
            self._db.execute(
                "INSERT OR IGNORE INTO bans VALUES (?, ?, ?)", (peer, reason, ban.since)
            )
        self._banned[peer] = ban
        return True

    def unban(self, peer: bytes) -> None:
        with self._db:
            self._db.execute("DELETE FROM bans WHERE peer = ?", (peer,))
        self._banned.pop(peer, None)

    def is_banned(self, peer: bytes) -> bool:
        return peer in self._banned

    def __len__(self) -> int:
        return len(self._banned)

    def all(self) -> list[Ban]:
        """Every ban, oldest first (from memory: valid after `close`)."""
        return sorted(self._banned.values(), key=lambda ban: ban.since)

    def status(self) -> list[dict]:
        """Banned peers for a status page: base58 id, reason, since (unix time)."""
        return [
            {"peer": peer_name(b.peer), "reason": b.reason, "since": b.since} for b in self.all()
        ]

    def close(self) -> None:
        self._db.close()
