"""The peers a node knows: those it has met (`PeerBook`, kept on disk) and those it has
only heard of (`Hints`, from summaries and discovery records), each with the addresses
to dial it at (`reconnect.py` dials them)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Container, Iterable
from pathlib import Path

from seedflood_p2p.protocol.summary import MAX_ADDRS

log = logging.getLogger("seedflood.reconnect")

BOOK_FILE = "peers.json"
MAX_BOOK = 256  # peers kept in the book (the most recently met)
MAX_HINTS = 256  # peers heard of (from summaries) but not met: dialled, not persisted
FORGET_AFTER = 7 * 86400.0  # a book entry not met for a week is dropped
SAVE_EVERY = 10.0  # seconds between writes of a changed book


def split_full_addr(addr: str) -> tuple[str, str]:
    """(peer id, address without /p2p/...) of a full multiaddr `.../p2p/<peer id>`."""
    base, _, peer = addr.rpartition("/p2p/")
    return peer, base


def dialable(addrs: Iterable[str], peer: str) -> list[str]:
    """Addresses as the daemon dials them: a trailing /p2p/<peer> stripped, no duplicates,
    bounded. A relay address ``/ip4/R/tcp/P/p2p/<relay>/p2p-circuit`` is kept whole: it is
    how a peer behind NAT is reached (through its reservation on the relay)."""
    out: list[str] = []
    for a in addrs:
        head, circuit, _ = a.partition("/p2p-circuit")
        if circuit:  # relay address: keep the relay's /p2p/<id>, drop what follows the circuit
            a = head + circuit
            if "/p2p/" not in head:
                continue  # a circuit needs to name its relay
        elif "/p2p/" in a:
            a = a.split("/p2p/")[0]
        if a and a not in out:
            out.append(a)
    return out[:MAX_ADDRS]


class PeerBook:
    """Peers this node has met: base58 peer id -> {"addrs": [...], "met": unix time}.

    Kept in DATA_DIR/peers.json, written to a temporary file, fsynced, then renamed, so
    a crash leaves the old book or the new one. A damaged file is moved aside with one
    warning (the node still has its bootstrap list), never a crash."""

    def __init__(self, data_dir: Path, own_id: str) -> None:
        self.path = Path(data_dir) / BOOK_FILE
        self.own_id = own_id
        self.entries: dict[str, dict] = {}
        self._dirty = self._urgent = False
        self._saved_at = 0.0
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            raw = json.loads(self.path.read_text())
            entries = {
                str(peer): {"addrs": dialable(e["addrs"], peer), "met": float(e["met"])}
                for peer, e in raw["peers"].items()
                if isinstance(e.get("addrs"), list) and all(isinstance(a, str) for a in e["addrs"])
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self.path.with_suffix(".damaged")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.warning("peer book %s is damaged (%r): moved to %s", self.path, exc, aside)
            return
        entries.pop(self.own_id, None)
        self.entries = entries

    def met(self, peer: str, addrs: Iterable[str]) -> None:
        """`peer` is connected and reachable at `addrs` (its own word, or what we dialled).
        A peer met for the first time is written at the next `save`, unthrottled: a node
        killed seconds after joining must still find it on restart."""
        if peer == self.own_id:
            return
        addrs = dialable(addrs, peer)
        entry = self.entries.get(peer)
        if entry is None or (addrs and entry["addrs"] != addrs):
            self._urgent = True
        if self._urgent or time.time() - entry["met"] > 60:
            old = (entry or {}).get("addrs", [])
            self.entries[peer] = {"addrs": addrs or old, "met": time.time()}
            self._dirty = True

    def others(self) -> list[str]:
        return [p for p in self.entries if p != self.own_id]

    def save(self, force: bool = False) -> None:
        throttled = time.monotonic() - self._saved_at < SAVE_EVERY
        if not self._dirty or (throttled and not force and not self._urgent):
            return
        now = time.time()
        keep = sorted(
            (e["met"], p) for p, e in self.entries.items() if now - e["met"] < FORGET_AFTER
        )[-MAX_BOOK:]
        self.entries = {p: self.entries[p] for _, p in keep}
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"version": 1, "peers": self.entries}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:  # a full disk must not stop the node: the book is a hint
            log.warning("cannot write the peer book %s: %s", self.path, exc)
            return
        self._dirty = self._urgent = False
        self._saved_at = time.monotonic()


class Hints:
    """Peers heard of (base58 id -> addresses) but not met: dialled, never persisted.

    Bounded by MAX_HINTS. Fresh keys are free, so a list that many identities of one
    attacker filled still takes one of the run's founders (`founders`, set once the run
    is known), in place of the hint named longest ago."""

    def __init__(self, own_id: str) -> None:
        self.own_id = own_id
        self.addrs: dict[str, list[str]] = {}
        self.founders: frozenset[str] = frozenset()
        self.named_at: dict[str, float] = {}  # monotonic time a source last named each

    def add(
        self, peers: dict[str, list[str]], source: str, met: Container[str], connected: set[str]
    ) -> list[str]:
        """Take the peers `source` names ("summary": a connected peer's word; "dht": signed
        discovery records); a peer already `met` (in the book) keeps its entry there.
        Returns the hints evicted to make room for founders."""
        evicted = []
        for name, addrs in peers.items():
            if name == self.own_id or name in met or not addrs:
                continue
            if len(self.addrs) >= MAX_HINTS and name not in self.addrs:
                oldest = self._oldest_not_founder() if name in self.founders else None
                if oldest is None:
                    continue
                self.forget(oldest)
                evicted.append(oldest)
            if name not in self.addrs and name not in connected:
                log.info(
                    "heard of %s from %s",
                    name,
                    source,
                    extra={"fields": {"event": "discovered", "peer": name, "source": source}},
                )
            self.addrs[name] = dialable(addrs, name)
            self.named_at[name] = time.monotonic()
        return evicted

    def _oldest_not_founder(self) -> str | None:
        """The hint named longest ago that is not a founder (None: every hint is one)."""
        others = [p for p in self.addrs if p not in self.founders]
        if not others:
            return None
        return min(others, key=lambda p: self.named_at.get(p, 0.0))

    def forget_silent(self, now: float, window: float) -> list[str]:
        """Forget the peers no source has named for `window` seconds (they left); their ids."""
        silent = [p for p, t in self.named_at.items() if now - t > window]
        for peer in silent:
            self.forget(peer)
        return silent

    def forget(self, peer: str) -> None:
        self.addrs.pop(peer, None)
        self.named_at.pop(peer, None)
