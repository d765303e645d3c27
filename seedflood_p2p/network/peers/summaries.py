"""The summary exchange (`seedflood.summary`, protocol/summary.py): what connected peers
tell each other every summary_interval, split out of the reconnect loop (`reconnect.py`)
so that the dialling and the protocol each read on their own.

A summary carries a node's newest round, ledger size, live peer count, newest bucket
digests, own addresses and the peers it is connected to (with addresses: peer exchange).
Serving one answers a caller on our run (and notes where the caller listens); asking one
keeps the caller's latest summary (the island view compares bucket digests with it) and
learns the addresses of the peers it names (`add_hints`, dialled by the reconnect loop).

Summaries travel over libp2p request/response: the secure channel (Noise/TLS)
authenticates the answering peer id, which is what a direct summary needs. They are not
signed for forwarding; a summary is never relayed, only its addresses are tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
from seedflood_p2p.network.peers.islands import ISLAND_WINDOW, summary_fresh_for
from seedflood_p2p.network.peers.links import Links
from seedflood_p2p.network.peers.peer_book import Hints, PeerBook
from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes
from seedflood_p2p.protocol.framing import Rejected
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.protocol.summary import (
    MAX_SUMMARY_PEERS,
    Summary,
    decode_summary,
    decode_summary_request,
    encode_summary,
    encode_summary_request,
)

log = logging.getLogger("seedflood.reconnect")

PROTOCOL = "seedflood.summary"
# Seconds our summary is served as made: each connected peer asks every summary_interval,
# and a caller may ask as often as it likes, but the bucket digests are hashed at most
# once per SUMMARY_FRESH whatever the number of callers (the newest bucket changes with
# every row, so its digest cache rarely helps).
SUMMARY_FRESH = 1.0
FORGET_AT_LEAST = 64  # summaries kept before `remember` first looks for stale ones


class SummaryExchange:
    """One node's side of the summary protocol: serve ours, ask a peer for its own.

    `connected()`: the peers we hold a connection to (the reconnect loop's view);
    `add_hints(peers, source)`: where the peers a summary names go (the reconnect loop
    dials them). Inert until `flood` (the run's flood node) is set: before that we serve
    nothing and ask nothing, as we know no run."""

    def __init__(
        self,
        p2p,
        book: PeerBook,
        hints: Hints,
        links: Links,
        settings,
        connected: Callable[[], set[str]],
        add_hints: Callable[[dict[str, list[str]], str], None],
    ) -> None:
        self.p2p = p2p
        self.book = book
        self.hints = hints
        self.links = links
        self.s = settings
        self.connected = connected
        self.add_hints = add_hints
        self.flood = None
        self.summaries: dict[str, tuple[float, Summary]] = {}  # peer -> (when, summary)
        self._own: tuple[float, bytes] | None = None  # (when made, our encoded summary)
        self._forget_at = FORGET_AT_LEAST  # `remember` forgets stale summaries past this

    def own_summary(self) -> Summary:
        """Our summary: the ledger's newest round, size and bucket digests, our addresses
        and the connected peers we know addresses of (longest met first)."""
        flood = self.flood
        peers = {}
        for peer in sorted(
            self.connected(), key=lambda p: -self.book.entries.get(p, {}).get("met", 0)
        ):
            addrs = self.book.entries.get(peer, {}).get("addrs") or self.hints.addrs.get(peer)
            if addrs:
                peers[peer_bytes(peer)] = addrs
            if len(peers) >= MAX_SUMMARY_PEERS:
                break
        live = sum(
            1 for st in flood.peers.values() if time.monotonic() - st.last_seen < ISLAND_WINDOW
        )
        return Summary(
            round=flood.ledger.max_round(),
            rows=len(flood.ledger),
            live=live,
            digests=flood.ledger.bucket_digests(BUCKET_ROUNDS),
            addrs=self.links.own_addrs,
            peers=peers,
        )

    async def serve(self, peer, request: bytes) -> bytes:
        """The `seedflood.summary` handler: our summary for a caller on our run (empty
        otherwise); a caller that says where it listens is met in the peer book."""
        decoded = decode_summary_request(request)
        if decoded is None or self.flood is None or decoded[0] != self.flood.run_id:
            return b""
        caller = peer.to_base58()
        if decoded[1]:
            self.book.met(caller, decoded[1])  # connected to us, and says where it listens
        now = time.monotonic()
        if self._own is None or now - self._own[0] >= SUMMARY_FRESH:
            self._own = (now, encode_summary(self.own_summary()))
        return self._own[1]

    def remember(self, peer: str, summary: Summary, now: float) -> None:
        """Keep `peer`'s latest summary. The stale ones are forgotten once the table has
        doubled: a run with churn meets ever more peers, and a summary carries a digest
        per ledger bucket (~5 KB at 10M rows), so keeping every peer ever asked grows
        with the run."""
        self.summaries[peer] = (now, summary)
        if len(self.summaries) < self._forget_at:
            return
        horizon = summary_fresh_for(self.s)  # the island view reads none older
        for stale in [p for p, (when, _) in self.summaries.items() if now - when > horizon]:
            del self.summaries[stale]  # in place: the reconnector reads this dict
        self._forget_at = max(FORGET_AT_LEAST, 2 * len(self.summaries))

    async def ask(self, peer: str) -> None:
        """Ask `peer` for its summary; learn its addresses and the peers it names."""
        from hivemind.p2p import PeerID

        request = encode_summary_request(self.flood.run_id, self.links.own_addrs)
        try:
            reply = await call_bytes(
                self.p2p,
                PeerID.from_base58(peer),
                PROTOCOL,
                request,
                self.s.call_timeout,
            )
        except RemoteCallError as exc:
            log.debug("summary from %s failed: %s", peer, exc)
            return
        if not reply:  # not on this run (or not started yet)
            return
        try:
            summary = decode_summary(reply)
        except Rejected as exc:
            self.flood.admission.drop_reply(exc, peer_bytes(peer))
            return
        self.remember(peer, summary, time.monotonic())
        self.book.met(peer, summary.addrs)
        named_peers = {}
        for named, addrs in summary.peers.items():
            if not (len(named) == 38 and named.startswith(ED25519_PEER_ID_PREFIX)):
                continue  # seedflood peers are Ed25519 identities only
            if name := peer_name(named):
                named_peers[name] = addrs
        self.add_hints(named_peers, "summary")


def peer_bytes(peer: str) -> bytes:
    """A base58 peer id as bytes."""
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer).to_bytes()


def peer_name(peer: bytes) -> str | None:
    """A peer id's bytes as base58; None if they are no peer id."""
    from hivemind.p2p import PeerID

    try:
        return PeerID(peer).to_base58()
    except Exception:
        return None
