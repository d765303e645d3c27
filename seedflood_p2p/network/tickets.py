"""Join tickets: the run creator's key signs (identity, expiry) for a run that wants them.

A run says how strangers join in its manifest (`join_mode`):

    open          anyone (the default); new identities are on probation if the run has
                  founders (algorithm/probation.py)
    allow-listed  only the peers of `allow_peers` (admission drops others: `not_allowed`)
    ticketed      only peers holding an unexpired ticket signed by `extra.join.creator`
                  (admission drops others: `no_ticket`)

A ticket is 4 + 8 + 38 + 8 + 64 = 122 bytes: b"sft1", the first 8 bytes of the run id,
the holder's peer id (Ed25519), the expiry (unix seconds, big-endian), and the creator's
Ed25519 signature over everything before it. It names its run, so a ticket of one run is
worth nothing in another, and its holder, so it cannot be passed on. As text it is
base58 (what `seedflood ticket` prints and `--ticket` reads).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import base58

from seedflood_p2p.core.config import ED25519_PEER_ID_PREFIX, RunConfig
from seedflood_p2p.core.errors import UserError

MAGIC = b"sft1"
TICKET_BYTES = 4 + 8 + 38 + 8 + 64
JOIN_MODES = ("open", "allow-listed", "ticketed")


@dataclass(frozen=True)
class Ticket:
    run_tag: bytes  # the run id's first 8 bytes
    peer: bytes  # the holder's peer id
    expires: int  # unix seconds
    signature: bytes

    def body(self) -> bytes:
        return MAGIC + self.run_tag + self.peer + struct.pack(">Q", self.expires)

    def encode(self) -> bytes:
        return self.body() + self.signature

    def text(self) -> str:
        return base58.b58encode(self.encode()).decode()


def join_mode(config: RunConfig) -> str:
    """How a peer joins this run: 'allow-listed', 'ticketed' or 'open'."""
    if config.allow_peers:
        return "allow-listed"
    body = config.extra.get("join")
    if isinstance(body, dict) and body.get("mode") == "ticketed":
        return "ticketed"
    return "open"


def ticket_creator(config: RunConfig) -> bytes | None:
    """The raw peer id whose key signs this run's tickets (None: not a ticketed run). A bad
    `extra.join` is one UserError line."""
    body = config.extra.get("join")
    if body is None:
        return None
    if not isinstance(body, dict) or set(body) - {"mode", "creator"}:
        raise UserError("run setting extra.join must be a table with keys mode and creator")
    mode = body.get("mode", "open")
    if mode not in JOIN_MODES or mode == "allow-listed":
        raise UserError(
            "run setting extra.join.mode must be 'open' or 'ticketed' (an allow-listed run "
            "sets allow_peers)"
        )
    if mode != "ticketed":
        return None
    creator = body.get("creator")
    raw = _peer_id(creator) if isinstance(creator, str) else None
    if raw is None:
        raise UserError("run setting extra.join.creator must be a base58 Ed25519 peer id")
    return raw


def _peer_id(text: str) -> bytes | None:
    try:
        raw = base58.b58decode(text) if len(text) <= 64 else b""
    except ValueError:
        return None
    return raw if len(raw) == 38 and raw.startswith(ED25519_PEER_ID_PREFIX) else None


def issue(key_path: Path, config: RunConfig, peer: bytes, expires: int) -> Ticket:
    """A ticket for `peer` in `config`'s run until `expires`, signed with the creator's key
    file (a libp2p identity key, as every seedflood node has)."""
    from seedflood_p2p.network.identity import load_signing_key

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


def check(
    ticket: Ticket, config: RunConfig, creator: bytes, now: float | None = None
) -> str | None:
    """Why `ticket` does not admit its holder to this run now, or None."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if ticket.run_tag != bytes.fromhex(config.run_id)[:8]:
        return "for another run"
    if not ticket.peer.startswith(ED25519_PEER_ID_PREFIX) or len(ticket.peer) != 38:
        return "holder is not an Ed25519 peer id"
    if ticket.expires <= (time.time() if now is None else now):
        return "expired"
    try:
        Ed25519PublicKey.from_public_bytes(creator[6:]).verify(ticket.signature, ticket.body())
    except (InvalidSignature, ValueError):
        return "not signed by the run creator"
    return None


class TicketBook:
    """The tickets a node has seen and checked: which senders a ticketed run admits."""

    def __init__(self, config: RunConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.creator = ticket_creator(config)
        self.clock = clock
        self.expiry: dict[bytes, int] = {}

    @property
    def required(self) -> bool:
        return self.creator is not None

    def add(self, ticket: Ticket) -> str | None:
        """Keep a valid ticket (the latest expiry per holder); returns why not, or None."""
        if self.creator is None:
            return "the run is not ticketed"
        problem = check(ticket, self.config, self.creator, self.clock())
        if problem is None:
            self.expiry[ticket.peer] = max(self.expiry.get(ticket.peer, 0), ticket.expires)
        return problem

    def admits(self, peer: bytes) -> bool:
        if self.creator is None or peer == self.creator:
            return True
        return self.expiry.get(peer, 0) > self.clock()
