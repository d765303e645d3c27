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
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import base58
import msgpack

from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.transport.rpc import call_bytes, serve_bytes

log = logging.getLogger("seedflood.tickets")

MAGIC = b"sft2"
TICKET_BYTES = 4 + 8 + 38 + 8 + 64
NO_END = (1 << 63) - 1  # a ticket without an end round
MAX_TICKETS_PER_REQUEST = 64  # peer ids asked for in one `seedflood.tickets` request
MAX_WANTED = 1024  # authors whose tickets a node is looking for (bounded: any key can send)


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


class TicketBook:
    """The tickets a node has seen and checked: whose updates of which rounds a ticketed
    run admits, and which authors' tickets it is still looking for."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.creator = config.join.creator
        self.tickets: dict[bytes, Ticket] = {}  # holder -> its ticket with the latest end
        self.wanted: dict[bytes, float] = {}  # author -> when it was last asked for

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


class TicketExchange:
    """`seedflood.tickets`: hand on the tickets this node holds, and fetch the ones its
    admission wants from connected peers (the author itself first, when connected).

    Request: msgpack [run_id, [peer id, ...]] (at most MAX_TICKETS_PER_REQUEST); reply:
    msgpack [ticket bytes, ...], only tickets held. A reply's tickets are checked one by
    one (`TicketBook.add`); a bad one costs its server nothing but the bytes (bounded).
    """

    def __init__(self, p2p, run_id: str, book: TicketBook, connected) -> None:
        self.p2p, self.run_id, self.book, self.connected = p2p, run_id, book, connected
        self.fetched = self.refused = 0

    async def start(self) -> None:
        await serve_bytes(self.p2p, "seedflood.tickets", self._serve, max_request=4096)

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
        """Ask for wanted tickets every ASK_EVERY_SECONDS (until cancelled)."""
        while True:
            await asyncio.sleep(ASK_EVERY_SECONDS)
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
