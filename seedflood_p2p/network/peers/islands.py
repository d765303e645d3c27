"""Whether this node is cut off from the run: an island.

It says "partitioned" (log, /status, metrics) when peers it met in the last
ISLAND_WINDOW seconds, or that its connected peers name, cannot be dialled for
island_after seconds, or when a connected peer's settled ledger buckets differ from ours
for island_after seconds (repair should have closed them). A node cannot tell a
partition from peers that stopped: the status says both. `IslandWatch` decides from
what the reconnect loop (`reconnect.py`) knows: its dial failures, its peer book and
hints, the summaries of connected peers."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.protocol.summary import Summary

log = logging.getLogger("seedflood.reconnect")

ISLAND_WINDOW = 600.0  # peers met this recently and now unreachable count as "cut off"


def summary_fresh_for(settings) -> float:
    """Seconds a peer's latest summary is read for: four exchange intervals and a call's
    worth more (older ones are ignored here, and forgotten: summaries.py `remember`)."""
    return 4 * settings.summary_interval + 30


@dataclass
class IslandView:
    """What this node knows about the others it cannot reach (the module docstring)."""

    connected: int = 0
    known: int = 0
    unreachable: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    partitioned: bool = False
    since: float | None = None  # monotonic time the current verdict began

    def as_status(self) -> dict:
        return {
            "state": "partitioned" if self.partitioned else "connected",
            "connected_peers": self.connected,
            "known_peers": self.known,
            "unreachable": self.unreachable[:16],
            "diverged": self.diverged[:16],
            "for_s": None if self.since is None else round(time.monotonic() - self.since, 1),
        }

    def describe(self) -> str:
        parts = []
        if self.unreachable:
            parts.append(
                f"{len(self.unreachable)} peer(s) met recently or named by others cannot be "
                f"reached ({', '.join(p[-8:] for p in self.unreachable[:6])}): a partition, or "
                "they stopped"
            )
        if self.diverged:
            parts.append(
                f"the ledger differs from {len(self.diverged)} connected peer(s)' "
                f"({', '.join(p[-8:] for p in self.diverged[:6])}) and repair has not closed it"
            )
        return "; ".join(parts) or "every known peer reachable"


class IslandWatch:
    """Decides, each pass of the reconnect loop, whether this node is an island, and
    keeps the `view` that says so (log, /status, metrics)."""

    def __init__(self, settings, metrics: NodeMetrics) -> None:
        self.s = settings
        self.metrics = metrics
        self.view = IslandView()
        self.differs_since: dict[str, float] = {}  # connected peer -> first seen differing
        self._last_log = 0.0

    def unreachable(
        self,
        now: float,
        failing_since: Mapping[str, float | None],
        connected: set[str],
        met: Mapping[str, dict],
        hinted: Mapping[str, list[str]],
    ) -> list[str]:
        """Peers that failed every dial (`failing_since`: since when, monotonic) for
        island_after seconds and that we `met` (the peer book) in the last ISLAND_WINDOW
        seconds, or still hear of (`hinted`)."""
        wall = time.time()
        unreachable = []
        for peer, since in failing_since.items():
            if peer in connected or since is None:
                continue
            if now - since < self.s.island_after:
                continue
            recent = wall - met.get(peer, {}).get("met", 0) < ISLAND_WINDOW
            if recent or peer in hinted:
                unreachable.append(peer)
        return unreachable

    def diverged(
        self,
        now: float,
        ledger,
        summaries: Mapping[str, tuple[float, Summary]],
        connected: set[str],
    ) -> list[str]:
        """Connected peers whose settled ledger buckets (their latest summary) have
        differed from ours for island_after seconds."""
        mine = ledger.bucket_digests(BUCKET_ROUNDS)
        our_newest = ledger.max_round()
        diverged = []
        for peer, (when, summary) in list(summaries.items()):
            if peer not in connected or now - when > summary_fresh_for(self.s):
                self.differs_since.pop(peer, None)
                continue
            settled = min(our_newest, summary.round) // BUCKET_ROUNDS - 1  # both past it
            differs = any(b <= settled and mine.get(b) != d for b, d in summary.digests.items())
            if differs:
                since = self.differs_since.setdefault(peer, now)
                if now - since >= self.s.island_after:
                    diverged.append(peer)
            else:
                self.differs_since.pop(peer, None)
        for gone in [p for p in self.differs_since if p not in summaries]:
            del self.differs_since[gone]  # its summary forgotten (summaries.py `remember`)
        return diverged

    def show(
        self, now: float, connected: int, known: int, unreachable: list[str], diverged: list[str]
    ) -> None:
        """Set the view, its metrics, and log a change (a partition again every minute)."""
        partitioned = bool(unreachable or diverged)
        view = self.view
        if partitioned != view.partitioned:
            view.since = now
        view.connected = connected
        view.known = known
        view.unreachable, view.diverged = sorted(unreachable), sorted(diverged)
        changed = partitioned != view.partitioned
        view.partitioned = partitioned
        self.metrics.unreachable.set(len(unreachable))
        self.metrics.diverged.set(len(diverged))
        self.metrics.partitioned.set(int(partitioned))
        fields = {"event": "island", **view.as_status()}
        if partitioned and (changed or now - self._last_log > 60):
            self._last_log = now
            log.warning("partitioned: %s", view.describe(), extra={"fields": fields})
        elif changed:
            log.info("no longer partitioned: %s", view.describe(), extra={"fields": fields})
