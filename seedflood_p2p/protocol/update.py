"""The update message, gossiped and repaired, and every rule a received update must pass.

Update message (GossipSub payload), msgpack array, 11 + 2k to 28 + 2k bytes:

    [version: int = 3, run_tag: bin(4), round: uint, scalars: bin(2k), held: uint64]

`held` (optional: absent from a sender that keeps no audit state) is the digest of the
ledger rows the sender's model held when it trained the round
(`protocol/held_state.py`): auditors recompute on exactly that state instead of guessing
which rows had not reached it. Version 3 added it; a version-2 peer's update is dropped
as `bad_version`, so peers of both versions never mix in one run.

`scalars` holds the k projected gradients (one per direction, k = the run's
`directions`, at most 16) as little-endian float16. The sender is not in the payload:
it is the signed GossipSub envelope's `from` (strict signing is on, so it cannot be
forged). The seeds are derived from (run, sender, round, direction), so they are not
sent either.

A received update is accepted only if all of these hold; otherwise it is
dropped and counted under the named reason (never raised out of the daemon):

    oversized      payload longer than MAX_UPDATE_BYTES
    malformed      not a msgpack array of the shape above, or not the run's k scalars,
                   or a `held` that is not an integer in 0 .. 2^64 - 1
    bad_version    version is not PROTOCOL_VERSION
    wrong_run      run_tag differs from this run's
    non_finite     a scalar is NaN or infinite
    out_of_window  round < 0, round > MAX_ROUND, or outside [reference - max_behind,
                   reference + max_ahead] (`WindowRule`). The reference is the receiver's
                   own training round, or, where higher or where the receiver does not
                   train, the round reached by a quorum of distinct peers
                   (`quorum_round`): never the highest round seen, which one identity
                   could walk forward
    bad_key        the sender's peer id is not an Ed25519 key (its signature could not be
                   checked offline, so repair could never hand the row on: gossip and
                   repair refuse it alike)
    banned         the sender is banned by this peer (network/peers/reputation.py); not a rule
                   every peer applies at once, see `own_backfill` for why ledgers still agree
    not_allowed    a closed run (the manifest's `allow_peers`) and the sender is not in it
    no_work        a run with identity work (`extra.identity_work`) and the sender's peer id
                   lacks it: blake2b-256(run id || peer id) has fewer than `difficulty`
                   leading zero bits, and the manifest does not name the sender
                   (framing.check_sender_work; gossip, repair and audit records alike)
    no_ticket      a ticketed run and the sender holds no valid ticket of the run creator
    rate_limited   the sender sent more updates than `SENDER_RATE` / `SENDER_BURST` allow
    duplicate      same (sender, round, scalars) already in the ledger
    equivocation   same (sender, round) already in the ledger with other scalars; both are
                   the sender's signed words, so every peer keeps the same one by a fixed
                   rule (`keeps_new`: the smaller scalars, compared in order, -0.0 below
                   0.0) and a peer that
                   applied the other takes it back. Repair hands each peer the copy it
                   lacks (bucket digests differ), so peers that saw the two in different
                   orders still converge. The drop is counted either way.
    own            our own message echoed back (not an error)

Repair (request/response between peers) carries ledger entries as msgpack rows
`[round, peer, scalars, data, seqno, signature]`: the update together with the
signed GossipSub envelope it first arrived in (one row codec for updates and audit
records, `RowKind`, with its rules: `protocol/repair.py`). A repaired row passes the same
checks except the window's lower bound (a late message is still valid: additions
commute, and a late joiner fetches the whole history), and two more, so that no peer can
forge another's update:

    bad_signature  the envelope's Ed25519 signature does not verify for `peer`
    mismatch       the envelope's payload does not decode to (round, scalars)
    own_backfill   a row older than the window's lower bound, served by its own author.
                   A row that was on time reached some honest peer by gossip, so another
                   peer can relay it; a row only its author holds was written late, to
                   backfill rounds the window closed. Not held
                   against the author: a late joiner asks honest peers for their history.
                   Where the server is the only peer we know, it is accepted (a two-peer
                   run has nobody else to relay).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgpack

from seedflood_p2p.core.checks import is_int
from seedflood_p2p.protocol.framing import (
    PROTOCOL_VERSION,
    Rejected,
    check_round_and_scalars,
    check_run_tag,
    run_tag,
    same_scalars,
    topic_for,
)
from seedflood_p2p.protocol.message import Envelope, UpdateMessage, pack_scalars, shared_peer_id

MAX_UPDATE_BYTES = 64  # k = 16 with a held digest: 60
MAX_HELD = (1 << 64) - 1
SENDER_RATE = 50.0  # gossip messages per second one author may average: a backstop (the
SENDER_BURST = 128.0  # window already allows one update per round) against floods
QUORUM_PEERS = 2  # distinct peers that must reach a round before it sets a reference


def encode_update(
    run_id: str, round_: int, scalars: Sequence[float], held: int | None = None
) -> bytes:
    """The payload of an update; `held`: the sender's held-state digest (None: not sent)."""
    # The scalars travel as float16, the precision every peer applies.
    packer = msgpack.Packer(use_bin_type=True)
    body = [PROTOCOL_VERSION, run_tag(run_id), round_, pack_scalars(tuple(scalars))]
    return packer.pack(body if held is None else [*body, held])


def decode_update(
    data: bytes, run_id: str, sender: bytes, directions: int | None = None
) -> UpdateMessage:
    """Parse and check the payload alone (no state); raises Rejected. `directions`, when
    given, is the run's k: a message with another number of scalars is malformed."""
    if len(data) > MAX_UPDATE_BYTES:
        raise Rejected("oversized", f"{len(data)} bytes > {MAX_UPDATE_BYTES}")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=64,
            max_str_len=64,
            max_array_len=8,
            max_map_len=0,
        )
    except Exception as exc:  # msgpack raises several types on garbage
        raise Rejected("malformed", f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, list) or len(body) < 1 or not is_int(body[0]):
        # bool is an int subclass: msgpack `true` must not pass as version 1
        raise Rejected("malformed", "not a versioned array")
    if body[0] != PROTOCOL_VERSION:
        raise Rejected("bad_version", f"version {body[0]}, expected {PROTOCOL_VERSION}")
    if len(body) not in (4, 5):
        raise Rejected("malformed", f"{len(body)} fields, expected 4 or 5")
    _, tag, round_, packed, *held = body
    if held and not (is_int(held[0]) and 0 <= held[0] <= MAX_HELD):
        raise Rejected("malformed", "held-state digest is not a 64-bit unsigned integer")
    check_run_tag(tag, run_id)
    scalars = check_round_and_scalars(round_, packed, directions)
    return UpdateMessage(round_, shared_peer_id(sender), scalars)


def decode_held(data: bytes | None) -> int | None:
    """The held-state digest of a stored, already checked update payload (None: the
    payload carries none, or there is no payload: a local-only row)."""
    if not data:
        return None
    try:
        body = msgpack.unpackb(data, raw=False, max_bin_len=64, max_str_len=64, max_array_len=8)
    except Exception:  # the ledger's own rows were checked on the way in; be safe anyway
        return None
    if isinstance(body, list) and len(body) == 5 and is_int(body[4]):
        return body[4] if 0 <= body[4] <= MAX_HELD else None
    return None


@dataclass
class WindowRule:
    """Rounds a sender may use, around the receiver's reference round (see `quorum_round`):
    from `max_behind` rounds before it to `max_ahead` rounds past it. Both bounds matter:
    without the upper one a sender walks rounds forward, without the lower one it fills
    every past round it never took part in."""

    max_ahead: int
    max_behind: int = 30

    def check(self, message: UpdateMessage, reference: int) -> None:
        """Gossip: both bounds. A reference of -1 (nothing known yet) opens the lower one."""
        self.check_ahead(message, reference)
        if message.round < reference - self.max_behind:
            raise Rejected(
                "out_of_window",
                f"round {message.round} is more than {self.max_behind} behind {reference}",
            )

    def check_ahead(self, message: UpdateMessage, reference: int) -> None:
        if message.round > reference + self.max_ahead:
            raise Rejected(
                "out_of_window",
                f"round {message.round} is more than {self.max_ahead} ahead of {reference}",
            )

    def check_repair(
        self,
        message: UpdateMessage,
        reference: int,
        server: bytes,
        sole_server: bool,
        upper_reference: int | None = None,
    ) -> None:
        """Repair: the upper bound (around `upper_reference` if given: a late joiner's
        quorum of digest claims), and an old row only if relayed (see `own_backfill`)."""
        self.check_ahead(message, max(reference, upper_reference or -1))
        if message.round < reference - self.max_behind and message.peer == server:
            if not sole_server:
                raise Rejected("own_backfill", f"round {message.round}, reference {reference}")


def quorum_round(rounds: Iterable[int], quorum: int = QUORUM_PEERS) -> int:
    """The highest round that at least `quorum` of the given peers (one round each: their
    newest) reached; with fewer peers, the lowest of them; -1 for none. One identity moves
    it no higher than the honest peers' own rounds, however high it claims to be."""
    ordered = sorted(rounds, reverse=True)
    if not ordered:
        return -1
    return ordered[min(quorum, len(ordered)) - 1]


class RoundClaims(dict):
    """Rounds by identity (a dict: peer -> round) that keeps `quorum_round` of its values up
    to date as they change, so a batch of gossip pays O(quorum) per changed claim instead
    of sorting every identity's (250 us a batch at 10,000 identities).

    The top `quorum` claims are kept; a raise (the usual change) updates them in place.
    Anything else (a lowered claim, a removal, `update`, ...) marks them stale and the next
    `quorum_round()` recomputes them from all claims, so the answer always equals
    `quorum_round(claims.values(), quorum)`."""

    def __init__(self, claims=(), quorum: int = QUORUM_PEERS) -> None:
        super().__init__(claims)
        self.quorum = quorum
        self._top: dict[bytes, int] | None = None  # the `quorum` highest claims; None: stale

    def __setitem__(self, peer, round_) -> None:
        top = self._top
        if top is not None:
            old = self.get(peer)
            if old is not None and round_ < old:
                top = self._top = None  # lowered: recompute when asked
            elif peer in top:
                top[peer] = round_
            elif len(top) < self.quorum:
                top[peer] = round_
            else:  # outside the top: every claim there is <= the top's lowest
                low = min(top, key=top.__getitem__)
                if round_ > top[low]:
                    del top[low]
                    top[peer] = round_
        super().__setitem__(peer, round_)

    def __delitem__(self, peer) -> None:
        self._top = None
        super().__delitem__(peer)

    def pop(self, *args):
        self._top = None
        return super().pop(*args)

    def popitem(self):
        self._top = None
        return super().popitem()

    def clear(self) -> None:
        self._top = None
        super().clear()

    def update(self, *args, **kwargs) -> None:
        self._top = None
        super().update(*args, **kwargs)

    def setdefault(self, peer, round_=None):
        if peer not in self:
            self[peer] = round_
        return self[peer]

    def __ior__(self, other):
        self.update(other)
        return self

    def quorum_round(self) -> int:
        """`quorum_round(self.values(), self.quorum)`."""
        if self._top is None:
            ordered = sorted(self.items(), key=lambda kv: kv[1], reverse=True)
            self._top = dict(ordered[: self.quorum])
        return min(self._top.values()) if self._top else -1


def _order(scalars: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """A total order on tuples of finite floats that tells -0.0 from 0.0 (== does not)."""
    return tuple((x, math.copysign(1.0, x)) for x in scalars)


def check_against_ledger(message: UpdateMessage, existing: tuple[float, ...] | None) -> None:
    """One message per (peer, round): a repeat is a duplicate, a different one equivocation."""
    if existing is None:
        return
    if same_scalars(existing, message.scalars):
        raise Rejected("duplicate")
    raise Rejected("equivocation", f"round {message.round} already has {existing}")


def keeps_new(existing: tuple[float, ...], new: tuple[float, ...]) -> bool:
    """Of two signed updates for one (peer, round), all peers keep the smaller scalars."""
    return _order(new) < _order(existing)


def check_envelope(
    message: UpdateMessage,
    envelope: Envelope,
    run_id: str,
    verify: Callable[[bytes, bytes, bytes, str, bytes], bool],
) -> None:
    """A repaired row must carry its sender's valid signature over exactly this update."""
    if not verify(
        message.peer, envelope.data, envelope.seqno, topic_for(run_id), envelope.signature
    ):
        raise Rejected("bad_signature", f"round {message.round}")
    decoded = decode_update(envelope.data, run_id, message.peer)
    if decoded.round != message.round or not same_scalars(decoded.scalars, message.scalars):
        raise Rejected("mismatch", f"round {message.round}")
