"""Peer reputation, bans, per-peer rate limits and rate-limited drop logs.

Every peer starts at score 0. Behaviour that no honest peer shows lowers it (`PENALTIES`:
bad signatures and pages, equivocation, rounds outside the window, rate abuse); the score
recovers `RECOVERY_PER_SECOND` points a second up to 0, so an honest peer's rare slip
(a late gossip message) is forgiven, while a stream of them reaches `BAN_SCORE` and the
peer is banned. Equivocation is a ban at once: two signed updates for one round are
proof, never an accident of the network.

A ban is persisted (storage/bans.py, `bans.sqlite` in the data dir), counted
(`seedflood_peers_banned{reason}`), shown by `seedflood status`, and handed to `on_ban`
(the flood node closes the connection through the daemon; its request handlers refuse the
peer's streams; admission drops its gossip as `banned`). `ban(peer, reason)` is public so
that a verdict derived from the ledger can feed the same store.

What a ban cannot do: p2pd relays GossipSub messages before Python sees them (its control
protocol has no validator hook and no peer-scoring flags), so a banned peer's messages
still cross this daemon to its mesh neighbours; and the banned peer may dial again (we
then refuse its streams and drop its gossip, but the connection is the daemon's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from seedflood_p2p.storage.bans import BanStore

log = logging.getLogger("seedflood.node")

BAN_SCORE = -100.0
RECOVERY_PER_SECOND = 1.0
BAN_AT_ONCE = float("inf")
# Points off per event, by the admission reason or repair failure it was counted under.
# Reasons an honest peer can cause (duplicate, own_backfill, not_allowed, banned, a
# reply that timed out once) cost little or nothing; proof of bad intent costs a ban.
PENALTIES: dict[str, float] = {
    "equivocation": BAN_AT_ONCE,
    # A repair page holding a row whose signature or payload fails: every honest peer
    # checks each row before it stores it (and its ledger file on start), so it never
    # serves one. Proof, like equivocation.
    "bad_page": BAN_AT_ONCE,
    "bad_signature": 25.0,
    "mismatch": 25.0,
    "bad_reply": 25.0,
    "repair_timeout": 25.0,
    "non_finite": 10.0,
    "malformed": 5.0,
    "self_audit": 5.0,  # an audit record naming its own signer
    "oversized": 5.0,
    "rate_limited": 2.0,
    "out_of_window": 1.0,
    "bad_version": 1.0,
    "wrong_run": 1.0,
    "bad_key": 1.0,
    "no_work": 1.0,  # a key without the run's identity work: a stranger's, or a sybil's
}
# Peers with a score or a bucket past which the settled ones are forgotten (one identity
# each); past it, forgetting runs again only once the table has doubled, so a flood of
# fresh identities costs O(1) a new peer, not a pass over the table each.
MAX_TRACKED = 10_000


class Reputation:
    """Scores of peers and the bans they lead to."""

    def __init__(
        self,
        store: BanStore,
        count_ban: Callable[[str], None] = lambda reason: None,
        on_ban: Callable[[bytes], None] = lambda peer: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.count_ban = count_ban
        self.on_ban = on_ban
        self.clock = clock
        self._scores: dict[bytes, tuple[float, float]] = {}  # peer -> (score, when)
        self._forget_at = MAX_TRACKED

    def is_banned(self, peer: bytes) -> bool:
        return self.store.is_banned(peer)

    def score(self, peer: bytes) -> float:
        score, when = self._scores.get(peer, (0.0, self.clock()))
        return min(0.0, score + (self.clock() - when) * RECOVERY_PER_SECOND)

    def penalize(self, peer: bytes, reason: str, times: int = 1) -> bool:
        """Lower `peer`'s score for `times` events of `reason`; True if it is now banned."""
        points = PENALTIES.get(reason, 0.0) * times
        if not points or self.store.is_banned(peer):
            return self.store.is_banned(peer)
        if points == BAN_AT_ONCE:
            return self.ban(peer, reason)
        score = self.score(peer) - points
        if len(self._scores) >= self._forget_at and peer not in self._scores:
            self._forget_recovered()
        self._scores[peer] = (score, self.clock())
        if score <= BAN_SCORE:
            return self.ban(peer, reason)
        return False

    def ban(self, peer: bytes, reason: str) -> bool:
        """Ban `peer` (persisted) for `reason`; True (banned), whether new or not."""
        if self.store.ban(peer, reason):
            self._scores.pop(peer, None)
            self.count_ban(reason)
            log.warning(
                "banned peer %s: %s",
                short_id(peer),
                reason,
                extra={"fields": {"event": "ban", "reason": reason}},
            )
            self.on_ban(peer)
        return True

    def _forget_recovered(self) -> None:
        """Drop the scores back at 0 (what an untracked peer has)."""
        for peer in [p for p in self._scores if self.score(p) >= 0.0]:
            del self._scores[peer]
        self._forget_at = max(MAX_TRACKED, 2 * len(self._scores))


class PeerBuckets:
    """A token bucket per peer: `rate` events a second on average, bursts of `burst`."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[bytes, tuple[float, float]] = {}  # peer -> (tokens, when)
        self._forget_at = MAX_TRACKED

    def allow(self, peer: bytes, cost: float = 1.0) -> bool:
        now = self.clock()
        tokens, when = self._buckets.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        if tokens < cost:
            self._buckets[peer] = (tokens, now)
            return False
        if len(self._buckets) >= self._forget_at and peer not in self._buckets:
            self._forget_full(now)
        self._buckets[peer] = (tokens - cost, now)
        return True

    def tracked(self) -> int:
        """Peers with a bucket in memory."""
        return len(self._buckets)

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled by `now`: a full bucket is what an untracked
        peer gets. (A bucket is stored after a take, so below `burst`: testing the stored
        tokens, as before, kept every bucket.)"""
        rate, burst = self.rate, self.burst
        self._buckets = {
            p: (tokens, when)
            for p, (tokens, when) in self._buckets.items()
            if tokens + (now - when) * rate < burst
        }
        self._forget_at = max(MAX_TRACKED, 2 * len(self._buckets))


class LogLimiter:
    """At most `lines` log lines per `period` seconds per key; the next line allowed says
    how many were held back. Counters stay exact: only the logging is thinned (a hostile
    peer once made 10-20 MB of drop logs per honest peer)."""

    def __init__(
        self, lines: int = 10, period: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lines, self.period, self.clock = lines, period, clock
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (start, logged, held)

    def allow(self, key: str) -> tuple[bool, int]:
        """(log this line?, lines held back since the last one logged)."""
        now = self.clock()
        start, logged, held = self._windows.get(key, (now, 0, 0))
        if now - start >= self.period:
            start, logged = now, 0
        if logged < self.lines:
            self._windows[key] = (start, logged + 1, 0)
            return True, held
        self._windows[key] = (start, logged, held + 1)
        return False, 0


def short_id(peer: bytes) -> str:
    """The last 8 base58 digits of a peer id, as logs show it."""
    try:
        import base58

        return base58.b58encode(peer).decode()[-8:]
    except Exception:
        return peer.hex()[:8]
