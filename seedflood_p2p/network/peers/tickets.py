"""Join tickets: the run creator's key signs (identity, expiry) for a run that wants them.

A run says how strangers join in its manifest (`join_mode`; `extra.join` is parsed into
`RunConfig.join`):

    open          anyone (the default); new identities are on probation if the run has
                  founders (algorithm/probation.py)
    allow-listed  only the peers of `allow_peers` (admission drops others: `not_allowed`)
    ticketed      only peers holding an unexpired ticket signed by `extra.join.creator`
                  (admission drops others: `no_ticket`)

A ticket is 4 + 8 + 38 + 8 + 64 = 122 bytes: b"sft2", the first 8 bytes of the run id,
the holder's peer id (Ed25519), its end round (big-endian), and the creator's Ed25519
signature over everything before it. It names its run, so a ticket of one run is worth
nothing in another, and its holder, so it cannot be passed on. As text it is base58
(what `seedflood ticket` prints and a peer's `--ticket` reads).

The end is a round, not a time: an update of round t counts iff its author holds a ticket
whose end round is > t. That is a pure function of the row and the tickets, so every
peer admits the same rows whenever they reach it and ledgers agree (a clock-time expiry
would admit a late-repaired row at one peer and drop it at another).

How tickets travel: each peer is started with its own (`--ticket`); a node that drops a
row for `no_ticket` asks the peers it is connected to for that author's ticket
(`seedflood.tickets`, `TicketBook.wanted`) and keeps every valid one it gets, serving it
on in turn; the dropped rows come back through anti-entropy repair, which never holds a
`no_ticket` row against its server. A ticket proves itself (the creator's signature), so
any peer may hand it on.

Revocation. The creator may cut a ticket short: a revocation is 4 + 8 + 38 + 8 + 64 = 122
bytes, b"sfr1", the run id's first 8 bytes, the holder, an effective round R and the
creator's signature (`seedflood ticket revoke` prints it as base58; `--revoke T` hands it
to any node of the run). It is a ledger fact, not an admission rule: every node keeps the
valid ones in the ledger's `revocations` table, and an update (holder, t) counts iff
t < R (the earliest R of the holder's revocations), in the final judgement and in every
settled state S_t (`algorithm/probation.py:Standing.revoked`). Admission is unchanged
(the ticket's own end), so a row of round >= R that reached one peer before the
revocation and another after is in both ledgers: the ledgers stay identical whatever the
order, and what counts is a pure function of them, in replay too. A live peer that had
applied such a row takes it back when the revocation arrives (as for a ban,
`PeerAudits.set_standing`). The race: a sender that trained round t > R + lag before
the revocation reached it held the holder's rows of rounds R..t - lag - 1, which its
auditors do not: for it the revocation is a late row (as an update of round R arriving
after round R + lag is). So the creator names a round ahead of the run: a node handed a
revocation whose R is not past its own round + lag + 1 warns
(`event=revocation_not_ahead`). Revocations travel by pull: every ASK_EVERY_SECONDS a
node sends one connected peer the digest of the set it holds (`seedflood.revocations`);
a peer holding another set answers with its revocations, each checked on receipt; a
hostile one is counted by reason and dropped. A late joiner gets them the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import base58
import msgpack

from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
from seedflood_p2p.core.config import MAX_ROUND, RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.transport.rpc import call_bytes, serve_bytes

log = logging.getLogger("seedflood.tickets")

MAGIC = b"sft2"
TICKET_BYTES = 4 + 8 + 38 + 8 + 64
NO_END = (1 << 63) - 1  # a ticket without an end round
MAX_TICKETS_PER_REQUEST = 64  # peer ids asked for in one `seedflood.tickets` request
MAX_WANTED = 1024  # authors whose tickets a node is looking for (bounded: any key can send)
REVOKE_MAGIC = b"sfr1"
REVOCATION_BYTES = 4 + 8 + 38 + 8 + 64
MAX_REVOCATIONS = 4096  # revocations a node keeps and serves (each one signed by the creator)


@dataclass(frozen=True)
class Ticket:
    run_tag: bytes  # the run id's first 8 bytes
    peer: bytes  # the holder's peer id
    expires: int  # the end round: the holder's updates of rounds < expires count
    signature: bytes

    def body(self) -> bytes:
        return MAGIC + self.run_tag + self.peer + struct.pack(">Q", self.expires)

    def encode(self) -> bytes:
        return self.body() + self.signature

    def text(self) -> str:
        return base58.b58encode(self.encode()).decode()


def join_mode(config: RunConfig) -> str:
    """How a peer joins this run: 'allow-listed', 'ticketed' or 'open'."""
    return "allow-listed" if config.allow_peers else config.join.mode


def issue(key_path: Path, config: RunConfig, peer: bytes, expires: int = NO_END) -> Ticket:
    """A ticket for `peer`'s updates of rounds < `expires` in `config`'s run, signed with
    the creator's key file (a libp2p identity key, as every seedflood node has)."""
    from seedflood_p2p.network.transport.identity import load_signing_key

    key = load_signing_key(key_path)
    unsigned = Ticket(bytes.fromhex(config.run_id)[:8], peer, int(expires), b"")
    return Ticket(unsigned.run_tag, peer, unsigned.expires, key.sign(unsigned.body()))


def decode(data: bytes | str) -> Ticket:
    """A ticket from its bytes or base58 text; a malformed one is a UserError line."""
    if isinstance(data, str):
        try:
            data = base58.b58decode(data.strip())
        except ValueError:
            raise UserError("ticket is not base58 text") from None
    if len(data) != TICKET_BYTES or not data.startswith(MAGIC):
        raise UserError(f"ticket is not a seedflood join ticket ({len(data)} bytes)")
    (expires,) = struct.unpack(">Q", data[50:58])
    return Ticket(data[4:12], data[12:50], expires, data[58:])


def check(ticket: Ticket, config: RunConfig, creator: bytes) -> str | None:
    """Why `ticket` is not a ticket of this run's creator for its holder, or None."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if ticket.run_tag != bytes.fromhex(config.run_id)[:8]:
        return "for another run"
    if not ticket.peer.startswith(ED25519_PEER_ID_PREFIX) or len(ticket.peer) != 38:
        return "holder is not an Ed25519 peer id"
    try:
        Ed25519PublicKey.from_public_bytes(creator[6:]).verify(ticket.signature, ticket.body())
    except (InvalidSignature, ValueError):
        return "not signed by the run creator"
    return None


@dataclass(frozen=True)
class Revocation:
    run_tag: bytes  # the run id's first 8 bytes
    peer: bytes  # the holder whose ticket it cuts short
    round: int  # the effective round R: the holder's updates of rounds >= R never count
    signature: bytes

    def body(self) -> bytes:
        return REVOKE_MAGIC + self.run_tag + self.peer + struct.pack(">Q", self.round)

    def encode(self) -> bytes:
        return self.body() + self.signature

    def text(self) -> str:
        return base58.b58encode(self.encode()).decode()


def revoke(key_path: Path, config: RunConfig, peer: bytes, round_: int) -> Revocation:
    """A revocation of `peer`'s ticket from round `round_` on in `config`'s run, signed with
    the creator's key file."""
    from seedflood_p2p.network.transport.identity import load_signing_key

    key = load_signing_key(key_path)
    unsigned = Revocation(bytes.fromhex(config.run_id)[:8], peer, int(round_), b"")
    return Revocation(unsigned.run_tag, peer, unsigned.round, key.sign(unsigned.body()))


def decode_revocation(data: bytes | str) -> Revocation:
    """A revocation from its bytes or base58 text; a malformed one is a UserError line."""
    if isinstance(data, str):
        try:
            data = base58.b58decode(data.strip())
        except ValueError:
            raise UserError("revocation is not base58 text") from None
    if len(data) != REVOCATION_BYTES or not data.startswith(REVOKE_MAGIC):
        raise UserError(f"not a seedflood ticket revocation ({len(data)} bytes)")
    (round_,) = struct.unpack(">Q", data[50:58])
    return Revocation(data[4:12], data[12:50], round_, data[58:])


def check_revocation(revocation: Revocation, config: RunConfig, creator: bytes) -> str | None:
    """Why `revocation` is not a revocation of this run's creator, or None."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if revocation.run_tag != bytes.fromhex(config.run_id)[:8]:
        return "for another run"
    if not revocation.peer.startswith(ED25519_PEER_ID_PREFIX) or len(revocation.peer) != 38:
        return "holder is not an Ed25519 peer id"
    if not 0 <= revocation.round <= MAX_ROUND:
        return "round out of range"
    try:
        Ed25519PublicKey.from_public_bytes(creator[6:]).verify(
            revocation.signature, revocation.body()
        )
    except (InvalidSignature, ValueError):
        return "not signed by the run creator"
    return None


class TicketBook:
    """The tickets a node has seen and checked: whose updates of which rounds a ticketed
    run admits, and which authors' tickets it is still looking for."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.creator = config.join.creator
        self.tickets: dict[bytes, Ticket] = {}  # holder -> its ticket with the latest end
        self.wanted: dict[bytes, float] = {}  # author -> when it was last asked for
        # checked revocations, by their bytes (so equal sets have equal digests)
        self.revocations: dict[bytes, Revocation] = {}

    @property
    def required(self) -> bool:
        return self.creator is not None

    def add(self, ticket: Ticket) -> str | None:
        """Keep a valid ticket (the latest end per holder); returns why not, or None."""
        if self.creator is None:
            return "the run is not ticketed"
        problem = check(ticket, self.config, self.creator)
        if problem is None:
            held = self.tickets.get(ticket.peer)
            if held is None or ticket.expires > held.expires:
                self.tickets[ticket.peer] = ticket
            self.wanted.pop(ticket.peer, None)
        return problem

    def revoke(self, revocation: Revocation) -> str | None:
        """Keep a valid revocation; returns why not, or None (also for one held already)."""
        if self.creator is None:
            return "the run is not ticketed"
        problem = check_revocation(revocation, self.config, self.creator)
        if problem is None and revocation.encode() not in self.revocations:
            if len(self.revocations) >= MAX_REVOCATIONS:
                return "too many revocations"
            self.revocations[revocation.encode()] = revocation
        return problem

    def revocations_digest(self) -> bytes:
        """8 bytes naming the set of revocations held: two nodes with equal ones agree."""
        return hashlib.sha256(b"".join(sorted(self.revocations))).digest()[:8]

    def admits(self, peer: bytes, round_: int | None = None) -> bool:
        """Whether `peer`'s update of `round_` counts (None: whether any of its could)."""
        if self.creator is None or peer == self.creator:
            return True
        ticket = self.tickets.get(peer)
        return ticket is not None and (round_ is None or round_ < ticket.expires)

    def want(self, peer: bytes) -> None:
        """A row of `peer` was dropped for want of its ticket: look for it (bounded)."""
        if peer not in self.tickets and peer not in self.wanted and len(self.wanted) < MAX_WANTED:
            self.wanted[peer] = 0.0

    def due(self, now: float, every: float) -> list[bytes]:
        """Authors whose tickets to ask for now (each at most once per `every` seconds)."""
        peers = [p for p, last in self.wanted.items() if now - last >= every]
        peers = peers[:MAX_TICKETS_PER_REQUEST]
        for p in peers:
            self.wanted[p] = now
        return peers

    def encoded(self, peers: list[bytes]) -> list[bytes]:
        """The tickets held for `peers`, as bytes (to serve them on)."""
        return [
            self.tickets[p].encode() for p in peers[:MAX_TICKETS_PER_REQUEST] if p in self.tickets
        ]


ASK_EVERY_SECONDS = 2.0  # how often a node asks for the tickets it wants
ASK_AGAIN_SECONDS = 10.0  # the same author's ticket is asked for at most this often
ASK_PEERS = 3  # connected peers asked per round of asking
ASK_TIMEOUT = 5.0
REVOCATIONS_REPLY_BYTES = MAX_REVOCATIONS * (REVOCATION_BYTES + 3) + 8  # msgpack overhead


class TicketExchange:
    """`seedflood.tickets`: hand on the tickets this node holds, and fetch the ones its
    admission wants from connected peers (the author itself first, when connected).

    Request: msgpack [run_id, [peer id, ...]] (at most MAX_TICKETS_PER_REQUEST); reply:
    msgpack [ticket bytes, ...], only tickets held. A reply's tickets are checked one by
    one (`TicketBook.add`); a bad one costs its server nothing but the bytes (bounded).
    """

    def __init__(
        self,
        p2p,
        run_id: str,
        book: TicketBook,
        connected,
        on_revoked: Callable[[list[Revocation]], Awaitable[None]] | None = None,
    ) -> None:
        self.p2p, self.run_id, self.book, self.connected = p2p, run_id, book, connected
        self.on_revoked = on_revoked  # new valid revocations (the flood node logs them)
        self.fetched = self.refused = 0
        self.revocations_dropped: Counter[str] = Counter()  # bad revocations, by reason

    async def start(self) -> None:
        await serve_bytes(self.p2p, "seedflood.tickets", self._serve, max_request=4096)
        await serve_bytes(
            self.p2p,
            "seedflood.revocations",
            self._serve_revocations,
            max_request=256,
            max_response=REVOCATIONS_REPLY_BYTES,
        )

    async def _serve_revocations(self, peer, request: bytes) -> bytes:
        """Request: msgpack [run_id, digest of the asker's set]; reply: msgpack [revocation
        bytes, ...], every one held when the digests differ, else none."""
        try:
            run_id, digest = msgpack.unpackb(request)
        except Exception:  # malformed: answered with nothing
            return msgpack.packb([])
        if run_id != self.run_id or digest == self.book.revocations_digest():
            return msgpack.packb([])
        return msgpack.packb(sorted(self.book.revocations)[:MAX_REVOCATIONS])

    async def take_revocations(self, raws: list) -> list[Revocation]:
        """Keep the valid revocations of `raws` (from a peer, or handed to this node); a bad
        one is counted by reason, logged and dropped. New ones go to `on_revoked`."""
        new = []
        for raw in raws[:MAX_REVOCATIONS]:
            try:
                revocation = decode_revocation(raw) if isinstance(raw, bytes) else None
            except UserError:
                revocation = None
            if revocation is None:
                self.revocations_dropped["malformed"] += 1
                continue
            known = revocation.encode() in self.book.revocations
            problem = self.book.revoke(revocation)
            if problem is not None:
                self.revocations_dropped[problem] += 1
                log.warning(
                    "ticket revocation dropped: %s",
                    problem,
                    extra={"fields": {"event": "revocation_dropped", "why": problem}},
                )
            elif not known:
                new.append(revocation)
        if new and self.on_revoked is not None:
            await self.on_revoked(new)
        return new

    async def pull_revocations(self) -> None:
        """Ask one connected peer for its revocations if its set differs from ours."""
        peers = await self.connected()
        if not peers:
            return
        peer = random.choice(peers)
        request = msgpack.packb([self.run_id, self.book.revocations_digest()])
        try:
            reply = await call_bytes(
                self.p2p,
                peer,
                "seedflood.revocations",
                request,
                ASK_TIMEOUT,
                max_response=REVOCATIONS_REPLY_BYTES,
            )
            raws = msgpack.unpackb(reply)
        except Exception:  # unreachable, timed out, malformed: another peer next time
            return
        if isinstance(raws, list):
            await self.take_revocations(raws)

    async def _serve(self, peer, request: bytes) -> bytes:
        try:
            run_id, peers = msgpack.unpackb(request)
            if run_id != self.run_id or not isinstance(peers, list):
                return msgpack.packb([])
            peers = [p for p in peers[:MAX_TICKETS_PER_REQUEST] if isinstance(p, bytes)]
        except Exception:  # malformed: answered with nothing
            return msgpack.packb([])
        return msgpack.packb(self.book.encoded(peers))

    async def run(self) -> None:
        """Ask one peer for revocations, and for wanted tickets, every ASK_EVERY_SECONDS
        (until cancelled)."""
        while True:
            await asyncio.sleep(ASK_EVERY_SECONDS)
            await self.pull_revocations()
            wanted = self.book.due(time.monotonic(), ASK_AGAIN_SECONDS)
            if not wanted:
                continue
            peers = await self.connected()
            authors = [p for p in peers if p.to_bytes() in wanted]  # asked first
            others = [p for p in peers if p.to_bytes() not in wanted]
            random.shuffle(others)
            for peer in (authors + others)[:ASK_PEERS]:
                request = msgpack.packb([self.run_id, wanted])
                try:
                    reply = await call_bytes(
                        self.p2p, peer, "seedflood.tickets", request, ASK_TIMEOUT
                    )
                    tickets = msgpack.unpackb(reply)
                except Exception:  # unreachable, timed out, malformed: the next peer
                    continue
                for raw in tickets[:MAX_TICKETS_PER_REQUEST] if isinstance(tickets, list) else []:
                    self._take(raw)
                wanted = [p for p in wanted if p in self.book.wanted]
                if not wanted:
                    break

    def _take(self, raw: object) -> None:
        """Keep one ticket of a reply if it checks out (any peer may hand tickets on)."""
        try:
            ticket = decode(raw) if isinstance(raw, bytes) else None
        except UserError:
            ticket = None
        if ticket is None or self.book.add(ticket) is not None:
            self.refused += 1
            return
        self.fetched += 1
        log.info(
            "join ticket of %s fetched",
            base58.b58encode(ticket.peer).decode()[-8:],
            extra={"fields": {"event": "ticket_fetched"}},
        )
