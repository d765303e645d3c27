"""The SeedFlood wire protocol and its validation rules, stated in one place.

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
records, `RowKind`, with its rules: "repair rows" below). A repaired row passes the same
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

Repair replies themselves are checked before any row is looked at; a reply that fails
is dropped whole, counted as `bad_reply`, and that peer is not asked further this pass:

    bad_reply      digest reply not a list of [bucket, count, 32-byte hash] with buckets in
                   range, each listed once; fetch reply not a list of well-formed rows;
                   rows not strictly after the requested cursor, not ascending, or past
                   the requested round; a page holding a row with a bad signature or
                   payload (the whole exchange ends, the peer is backed off)

Repair budgets (network/gossip/repair.py applies them): an exchange with one peer fetches at most
`MAX_EXCHANGE_PAGES` pages, stops after `exchange_deadline(pages claimed)` seconds, and
takes at most the rows the digest claimed per bucket (more is not an offence: an honest
server's bucket grows while the run goes on; the rest waits for the next exchange); a
fetch reply is at most
`MAX_FETCH_REPLY_BYTES`. A server answers each requester at most `SERVE_BYTES_RATE` bytes
per second (burst `SERVE_BYTES_BURST`), so an 82-byte request cannot buy unbounded replies.
A bucket's digest is SHA-256 over its rows' sorted SHA-256 hashes (storage/ledger.py), so
a fork cannot hide behind a collided digest (the XOR of 64-bit hashes it replaced could be
collided with ~2^32 work).

Requests a peer serves are checked the same way (unknown run, bucket size other than
BUCKET_ROUNDS, limit outside 1..FETCH_LIMIT, cursor not a peer id): answered empty.

Summaries (`seedflood.summary`, request/response, network/peers/reconnect.py) tell a node
who else exists and whether its ledger agrees with theirs, and carry the addresses
peers are dialled at:

    request  [run_id: str, addrs: [str]]             the caller's dialable addresses
    reply    [round: int, rows: int, live: int, digests: [[bucket, count, sha256]],
              addrs: [str], peers: [[peer_id: bin, [str]]]]

At most MAX_SUMMARY_DIGESTS digests (the newest buckets), MAX_ADDRS addresses per
peer and MAX_SUMMARY_PEERS peers; an address is ASCII, starts with "/" and is at most
MAX_ADDR_CHARS long. A reply that breaks any of these is dropped whole as `bad_reply`;
a request that does is answered empty.

Checkpoint download (`seedflood.ckpt_offer`, `seedflood.ckpt_chunk`,
network/transfer/checkpoints.py):
the rules are stated with their codecs at the end of this file (offer shape and bounds,
chunk length and SHA-256, the quorum of identical offers, the serving rate); a reply that
breaks them is `bad_reply`, a request that does is answered empty.

Wherever an integer is meant (version, round, bucket, count, limit) only a msgpack
integer counts: `true` (Python's bool is an int subclass) and 64.0 are refused. No
decoder raises anything but Rejected or returns anything but None on garbage
(tests/test_fuzz.py, bench/bench_fuzz.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from seedflood_p2p.core.config import ED25519_PEER_ID_PREFIX
from seedflood_p2p.protocol.message import (
    AuditRecord,
    Envelope,
    UpdateMessage,
    pack_scalars,
    unpack_scalars,
)

PROTOCOL_VERSION = 3  # 3: updates carry the sender's held-state digest
MAX_SCALARS = 16  # directions per message (config.MAX_DIRECTIONS)
MAX_UPDATE_BYTES = 64  # k = 16 with a held digest: 60
MAX_HELD = (1 << 64) - 1
RUN_TAG_BYTES = 4
MAX_ROUND = (1 << 62) - 1  # rounds are SQLite integers; no real run comes near this
BUCKET_ROUNDS = 64  # rounds per digest bucket in anti-entropy
FETCH_LIMIT = 4096  # rows per fetch reply: ~146 B each, under the daemon's 1 MiB cap
MAX_PEER_ID_BYTES = 64
BUCKET_HASH_BYTES = 32  # SHA-256 set digest per bucket
MAX_FETCH_REPLY_BYTES = 960 * 1024  # below serve_bytes' 1 MiB; a valid Ed25519 row is < 215 B
MAX_EXCHANGE_PAGES = 32  # fetch pages per exchange with one peer (131,072 rows)
EXCHANGE_BASE_SECONDS = 10.0  # an exchange may take this ...
PAGE_SECONDS = 2.0  # ... plus this per page its digest claimed (at most MAX_EXCHANGE_PAGES)
SERVE_BYTES_RATE = 2 << 20  # repair bytes served per second to one requester ...
SERVE_BYTES_BURST = 32 << 20  # ... in bursts of this (a late join of ~150,000 rows)
SENDER_RATE = 50.0  # gossip messages per second one author may average: a backstop (the
SENDER_BURST = 128.0  # window already allows one update per round) against floods
QUORUM_PEERS = 2  # distinct peers that must reach a round before it sets a reference
MAX_ADDRS = 16  # multiaddrs per peer in a summary
MAX_ADDR_CHARS = 256
MAX_SUMMARY_PEERS = 32  # peers (with addresses) a summary names
MAX_SUMMARY_DIGESTS = 8  # newest ledger buckets a summary lists

DROP_REASONS = (
    "oversized",
    "malformed",
    "bad_version",
    "wrong_run",
    "non_finite",
    "out_of_window",
    "duplicate",
    "equivocation",
    "own",
    "bad_signature",
    "mismatch",
    "bad_reply",
    "bad_key",
    "own_backfill",
    "banned",
    "not_allowed",
    "no_ticket",
    "rate_limited",
)


def topic_for(run_id: str) -> str:
    # Every signed message carries the topic: a short one saves ~31 bytes per hop
    # (measured: 192 vs 223 bytes for an 18-byte update). 64 bits of run id suffice to
    # keep runs apart; the payload's run tag and the manifest check the rest.
    return f"sf/{run_id[:16]}"


def run_tag(run_id: str) -> bytes:
    return bytes.fromhex(run_id)[:RUN_TAG_BYTES]


def encode_update(
    run_id: str, round_: int, scalars: Sequence[float], held: int | None = None
) -> bytes:
    """The payload of an update; `held`: the sender's held-state digest (None: not sent)."""
    # The scalars travel as float16, the precision every peer applies.
    packer = msgpack.Packer(use_bin_type=True)
    body = [PROTOCOL_VERSION, run_tag(run_id), round_, pack_scalars(tuple(scalars))]
    return packer.pack(body if held is None else [*body, held])


class Rejected(Exception):
    """A message failed validation; `reason` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


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
    if not isinstance(body, list) or len(body) < 1 or not _is_int(body[0]):
        # bool is an int subclass: msgpack `true` must not pass as version 1
        raise Rejected("malformed", "not a versioned array")
    if body[0] != PROTOCOL_VERSION:
        raise Rejected("bad_version", f"version {body[0]}, expected {PROTOCOL_VERSION}")
    if len(body) not in (4, 5):
        raise Rejected("malformed", f"{len(body)} fields, expected 4 or 5")
    _, tag, round_, packed, *held = body
    if held and not (_is_int(held[0]) and 0 <= held[0] <= MAX_HELD):
        raise Rejected("malformed", "held-state digest is not a 64-bit unsigned integer")
    _check_run_tag(tag, run_id)
    scalars = _check_round_and_scalars(round_, packed, directions)
    return UpdateMessage(round_, sender, scalars)


def decode_held(data: bytes | None) -> int | None:
    """The held-state digest of a stored, already checked update payload (None: the
    payload carries none, or there is no payload: a local-only row)."""
    if not data:
        return None
    try:
        body = msgpack.unpackb(data, raw=False, max_bin_len=64, max_str_len=64, max_array_len=8)
    except Exception:  # the ledger's own rows were checked on the way in; be safe anyway
        return None
    if isinstance(body, list) and len(body) == 5 and _is_int(body[4]):
        return body[4] if 0 <= body[4] <= MAX_HELD else None
    return None


def _check_run_tag(tag: object, run_id: str) -> None:
    """An update's or audit record's run tag: 4 bytes, this run's."""
    if not isinstance(tag, bytes) or len(tag) != RUN_TAG_BYTES:
        raise Rejected("malformed", "bad run tag")
    if tag != run_tag(run_id):
        raise Rejected("wrong_run", f"run tag {tag.hex()} is not {run_tag(run_id).hex()}")


def _check_round_and_scalars(
    round_: object, packed: object, directions: int | None
) -> tuple[float, ...]:
    """The round and float16 scalars an update and an audit record share; the scalars."""
    if not _is_int(round_):
        raise Rejected("malformed", "round is not an integer")
    if not isinstance(packed, bytes) or not 2 <= len(packed) <= 2 * MAX_SCALARS or len(packed) % 2:
        raise Rejected("malformed", "scalars are not 1..16 float16 values")
    scalars = unpack_scalars(packed)
    if directions is not None and len(scalars) != directions:
        raise Rejected("malformed", f"{len(scalars)} scalars, the run sends {directions}")
    if not all(math.isfinite(x) for x in scalars):
        raise Rejected("non_finite")
    if not 0 <= round_ <= MAX_ROUND:
        raise Rejected("out_of_window", f"round {round_} outside 0..MAX_ROUND")
    return scalars


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


def check_sender_key(peer: bytes) -> None:
    """Only Ed25519 peer ids: their public key is in the id, so every peer can check their
    rows' signatures offline, on gossip and on repair alike."""
    if len(peer) != 38 or not peer.startswith(ED25519_PEER_ID_PREFIX):
        raise Rejected("bad_key", "sender's peer id is not an Ed25519 key")


def _order(scalars: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """A total order on tuples of finite floats that tells -0.0 from 0.0 (== does not)."""
    return tuple((x, math.copysign(1.0, x)) for x in scalars)


def same_scalars(a: tuple[float, ...] | None, b: tuple[float, ...]) -> bool:
    """Bitwise-equal float16 scalars (0.0 and -0.0 differ: they hash differently)."""
    return a is not None and pack_scalars(a) == pack_scalars(b)


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


def decode_digests(data: bytes) -> dict[int, tuple[int, bytes]]:
    """A digest reply: {bucket: (count, 32-byte hash)} for buckets of BUCKET_ROUNDS rounds."""
    try:
        body = msgpack.unpackb(data, raw=False, max_bin_len=BUCKET_HASH_BYTES, max_str_len=0)
    except Exception as exc:
        raise Rejected("bad_reply", f"digests not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, list):
        raise Rejected("bad_reply", "digests are not a list")
    out = {}
    for item in body:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and _is_round(item[0])
            and item[0] <= MAX_ROUND // BUCKET_ROUNDS
            and _is_round(item[1])
            and isinstance(item[2], bytes)
            and len(item[2]) == BUCKET_HASH_BYTES
        ):
            raise Rejected("bad_reply", "bad digest entry")
        if item[0] in out:
            raise Rejected("bad_reply", f"bucket {item[0]} listed twice")
        out[item[0]] = (item[1], item[2])
    return out


def decode_digest_request(data: bytes) -> str | None:
    """The run id of a well-formed digest request, else None (answered empty)."""
    body = _unpack_request(data, 2)
    if body is None:
        return None
    run_id, bucket_rounds = body
    if not (isinstance(run_id, str) and _is_int(bucket_rounds) and bucket_rounds == BUCKET_ROUNDS):
        return None  # 64.0 and `true` are not integers
    return run_id


def _unpack_request(data: bytes, fields: int) -> list | None:
    """A request's msgpack array of exactly `fields` items, else None."""
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=128,
            max_bin_len=MAX_PEER_ID_BYTES,
            max_array_len=fields,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception:  # msgpack raises several types on garbage
        return None
    return body if isinstance(body, list) and len(body) == fields else None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_round(x: object) -> bool:
    return _is_int(x) and 0 <= x <= MAX_ROUND


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


# -- summaries (peer exchange and island detection) -----------------------------------------


@dataclass(frozen=True)
class Summary:
    """What a peer says about itself: progress, its newest buckets, where it and others are."""

    round: int  # the newest round its ledger holds (-1: none)
    rows: int  # rows in its ledger
    live: int  # training peers it hears
    digests: dict[int, tuple[int, bytes]]  # its newest buckets: {bucket: (count, SHA-256)}
    addrs: list[str]  # its own dialable multiaddrs
    peers: dict[bytes, list[str]]  # peers it is connected to, with their addresses


def _is_addr(x: object) -> bool:
    return (
        isinstance(x, str)
        and 1 < len(x) <= MAX_ADDR_CHARS
        and x.isascii()
        and x.startswith("/")
        and x.isprintable()
    )


def _is_addr_list(x: object) -> bool:
    return isinstance(x, list) and len(x) <= MAX_ADDRS and all(_is_addr(a) for a in x)


def encode_summary_request(run_id: str, addrs: Sequence[str]) -> bytes:
    return msgpack.packb([run_id, list(addrs)[:MAX_ADDRS]], use_bin_type=True)


def decode_summary_request(data: bytes) -> tuple[str, list[str]] | None:
    """(run id, the caller's addresses) of a well-formed summary request, else None."""
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=MAX_ADDR_CHARS,
            max_bin_len=0,
            max_array_len=MAX_ADDRS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception:
        return None
    if not (
        isinstance(body, list)
        and len(body) == 2
        and isinstance(body[0], str)
        and _is_addr_list(body[1])
    ):
        return None
    return body[0], body[1]


def encode_summary(summary: Summary) -> bytes:
    newest = sorted(summary.digests)[-MAX_SUMMARY_DIGESTS:]
    peers = list(summary.peers.items())[:MAX_SUMMARY_PEERS]
    return msgpack.packb(
        [
            summary.round,
            summary.rows,
            summary.live,
            [[b, *summary.digests[b]] for b in newest],
            list(summary.addrs)[:MAX_ADDRS],
            [[p, list(a)[:MAX_ADDRS]] for p, a in peers],
        ],
        use_bin_type=True,
    )


def decode_summary(data: bytes) -> Summary:
    """A summary reply, or Rejected("bad_reply")."""
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=MAX_ADDR_CHARS,
            max_bin_len=MAX_PEER_ID_BYTES,
            max_array_len=max(MAX_SUMMARY_PEERS, MAX_ADDRS, MAX_SUMMARY_DIGESTS, 6),
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:
        raise Rejected("bad_reply", f"summary not msgpack ({type(exc).__name__})") from None
    if not (isinstance(body, list) and len(body) == 6):
        raise Rejected("bad_reply", "summary is not an array of 6 fields")
    round_, rows, live, digests, addrs, peers = body
    if not (
        _is_int(round_)
        and -1 <= round_ <= MAX_ROUND
        and _is_round(rows)
        and _is_round(live)
        and isinstance(digests, list)
        and len(digests) <= MAX_SUMMARY_DIGESTS
        and _is_addr_list(addrs)
        and isinstance(peers, list)
        and len(peers) <= MAX_SUMMARY_PEERS
    ):
        raise Rejected("bad_reply", "bad summary fields")
    buckets: dict[int, tuple[int, bytes]] = {}
    for item in digests:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and _is_round(item[0])
            and item[0] <= MAX_ROUND // BUCKET_ROUNDS
            and item[0] not in buckets
            and _is_round(item[1])
            and isinstance(item[2], bytes)
            and len(item[2]) == BUCKET_HASH_BYTES
        ):
            raise Rejected("bad_reply", "bad summary digest")
        buckets[item[0]] = (item[1], item[2])
    named: dict[bytes, list[str]] = {}
    for item in peers:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], bytes)
            and 0 < len(item[0]) <= MAX_PEER_ID_BYTES
            and _is_addr_list(item[1])
        ):
            raise Rejected("bad_reply", "bad summary peer")
        named[item[0]] = item[1]
    return Summary(round_, rows, live, buckets, addrs, named)


# ------------------------------------------------------------------------------ audits
#
# Audit record, GossipSub payload on the run's audit topic, msgpack array:
#
#     [version: int = 3, run_tag: bin(4), accused: bin(1..64), round: uint, scalars: bin(2k),
#      at: uint]
#
# `scalars` are the auditor's recomputation of the accused's update for `round`, as
# float16. `at` is the auditor's training round when it published (it fixes from which
# settled state a vouch counts, algorithm/probation.py); a record of an older version has
# no `at` (5 fields) and is read with at = -1. The auditor is the envelope's signer
# (strict signing), never in the payload. 57 + 2k bytes for a 38-byte Ed25519 peer id and
# rounds below 2^16. A record is dropped for the update's reasons (oversized past
# MAX_AUDIT_BYTES, malformed, bad_version, wrong_run, non_finite, out_of_window for a
# round or `at` past MAX_ROUND) and one more:
#
#     self_audit     the auditor names itself as the accused (it would vote on its own case)
#
# What records decide (bans, voided updates) is `algorithm/audit.py:judge`.

MAX_AUDIT_BYTES = 128
AUDIT_DROP_REASONS = ("self_audit",)


def audit_topic_for(run_id: str) -> str:
    return topic_for(run_id) + "/audit"


def encode_audit(
    run_id: str, accused: bytes, round_: int, scalars: Sequence[float], at: int = -1
) -> bytes:
    """An audit payload; `at` -1 (unknown) leaves the field out (the older 5-field form)."""
    packer = msgpack.Packer(use_bin_type=True)
    body = [PROTOCOL_VERSION, run_tag(run_id), accused, round_, pack_scalars(tuple(scalars))]
    return packer.pack(body + ([at] if at >= 0 else []))


def decode_audit(
    data: bytes, run_id: str, auditor: bytes, directions: int | None = None
) -> AuditRecord:
    """Parse and check an audit payload signed by `auditor`; raises Rejected only."""
    if len(data) > MAX_AUDIT_BYTES:
        raise Rejected("oversized", f"{len(data)} bytes > {MAX_AUDIT_BYTES}")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_PEER_ID_BYTES,
            max_str_len=64,
            max_array_len=8,
            max_map_len=0,
        )
    except Exception as exc:
        raise Rejected("malformed", f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, list) or len(body) < 1 or not _is_int(body[0]):
        raise Rejected("malformed", "not a versioned array")
    if body[0] != PROTOCOL_VERSION:
        raise Rejected("bad_version", f"version {body[0]}, expected {PROTOCOL_VERSION}")
    if len(body) not in (5, 6):
        raise Rejected("malformed", f"{len(body)} fields, expected 5 or 6")
    _, tag, accused, round_, packed, *rest = body
    _check_run_tag(tag, run_id)
    if not isinstance(accused, bytes) or not 0 < len(accused) <= MAX_PEER_ID_BYTES:
        raise Rejected("malformed", "accused is not a peer id")
    scalars = _check_round_and_scalars(round_, packed, directions)
    at = rest[0] if rest else -1
    if rest and not _is_int(at):
        raise Rejected("malformed", "at is not an integer")
    if rest and not 0 <= at <= MAX_ROUND:
        raise Rejected("out_of_window", f"at {at} outside 0..{MAX_ROUND}")
    if accused == auditor:
        raise Rejected("self_audit")
    return AuditRecord(accused, round_, auditor, scalars, at)


def check_audit_envelope(
    record: AuditRecord,
    envelope: Envelope,
    run_id: str,
    verify: Callable[[bytes, bytes, bytes, str, bytes], bool],
) -> AuditRecord:
    """A stored or repaired audit record must carry its auditor's valid signature, on the
    audit topic, over exactly this record: `bad_signature` or `mismatch` otherwise. Returns
    the record as the envelope carries it (its `at` too: a repair row does not carry it
    outside the envelope; a record whose `at` is set must agree with the envelope's)."""
    if not verify(
        record.auditor, envelope.data, envelope.seqno, audit_topic_for(run_id), envelope.signature
    ):
        raise Rejected("bad_signature", f"audit of round {record.round}")
    decoded = decode_audit(envelope.data, run_id, record.auditor)
    if (
        decoded.accused != record.accused
        or decoded.round != record.round
        or not same_scalars(decoded.scalars, record.scalars)
        or (record.at >= 0 and record.at != decoded.at)
    ):
        raise Rejected("mismatch", f"audit of round {record.round}")
    return decoded


# -- audit repair --------------------------------------------------------------
#
# Audit records are repaired like updates (`AUDIT_ROWS` below, network/gossip/repair.py), so a
# peer that missed some (a late joiner, a partition) ends with the same audit table, hence
# the same verdicts (`judge` is a pure function of the table and the updates). Per row the
# `bad_key`, `not_allowed`, `bad_signature`, `mismatch` and audit payload rules apply, with
# update repair's budgets (MAX_EXCHANGE_PAGES, the deadline, the digest's claimed counts,
# SERVE_BYTES_RATE).

# -- repair rows: one codec for every repairable table ------------------------------------
#
# Anti-entropy (network/gossip/repair.py) repairs two tables, updates and audit records, with one
# protocol. Each table has a `RowKind`: its row shape, the order rows are served in (the
# row key, which is also the fetch cursor), its limits and its two request names.
#
#     digest  [run_id, 64]                                -> [[bucket, count, sha256], ...]
#     fetch   [run_id, *cursor, max_round, limit]         -> up to `limit` rows after the
#                                                            cursor, through `max_round`
#     row     [round, *ids, scalars, data, seqno, signature]
#
#     kind     requests                         ids               cursor (= row key)
#     update   seedflood.digest, .fetch         peer              (round, peer)
#     audit    seedflood.audit_digest,          accused, auditor  (round, accused, auditor,
#              .audit_fetch                                        packed scalars)
#
# A row is the record with the signed GossipSub envelope it arrived in. A fetch reply is
# `bad_reply` unless it is a msgpack list of at most `limit` rows, each of the kind's
# length, the round in 0..MAX_ROUND, every other field bytes, each id 1..64 bytes, the
# scalars 1..16 float16 values (a non-finite one: `non_finite`), the envelope's payload
# at most the kind's `max_payload`; and unless its rows come strictly after the cursor,
# ascending by key, through `max_round` (`check_rows_follow`). A fetch request is answered
# empty unless it is exactly that array: a string run id, the cursor's round in
# -1..MAX_ROUND and its other fields bytes (packed scalars at most 32 bytes), max_round in
# 0..MAX_ROUND, limit in 1..the kind's `page_rows`. A bucket of the audit table holds the
# records of the accused updates' rounds in it.

Record = Any  # an UpdateMessage or an AuditRecord: a RowKind's records
Row = tuple[Any, Envelope]  # a record with its signed envelope


@dataclass(frozen=True)
class RowKind:
    """The wire form of one repairable table's rows (see the section comment above)."""

    name: str  # "update" or "audit": drop details and logs
    digest_rpc: str  # the request names it is repaired with
    fetch_rpc: str
    ids: int  # peer ids after the round: 1 (peer), 2 (accused, auditor)
    max_payload: int  # bytes of the envelope's payload (the gossiped message)
    page_rows: int  # rows a fetch reply may hold at most (the request's `limit`)
    key_has_scalars: bool  # the key ends with the packed scalars (not unique without them)
    ids_of: Callable[[Any], tuple[bytes, ...]]
    make: Callable[[int, tuple[bytes, ...], tuple[float, ...]], Any]

    @property
    def fields(self) -> int:
        return self.ids + 5

    def key(self, record: Record) -> tuple:
        """The order rows are served in, and a fetch cursor, compared as SQLite compares
        them (bytes: memcmp, then length)."""
        tail = (pack_scalars(record.scalars),) if self.key_has_scalars else ()
        return (record.round, *self.ids_of(record), *tail)

    def first_cursor(self, round_: int) -> tuple:
        """The cursor before every row of rounds >= `round_`."""
        tail = (b"\xff" * (2 * MAX_SCALARS),) if self.key_has_scalars else ()
        return (round_ - 1, *[b"\xff" * MAX_PEER_ID_BYTES] * self.ids, *tail)

    def encode_rows(self, rows: Sequence[Row]) -> bytes:
        packer = msgpack.Packer(use_bin_type=True)
        return packer.pack(
            [
                [r.round, *self.ids_of(r), pack_scalars(r.scalars), e.data, e.seqno, e.signature]
                for r, e in rows
            ]
        )

    def decode_rows(self, data: bytes, max_rows: int) -> list[Row]:
        """Rows from a fetch reply (shape only; signatures: `check_envelope`,
        `check_audit_envelope`). Rejected ("bad_reply", "non_finite") only."""
        fields, ids = self.fields, self.ids
        try:
            rows = msgpack.unpackb(data, raw=False, max_array_len=max(max_rows, fields))
        except Exception as exc:
            raise Rejected(
                "bad_reply", f"{self.name} rows not msgpack ({type(exc).__name__})"
            ) from None
        if not isinstance(rows, list) or len(rows) > max_rows:
            raise Rejected(
                "bad_reply", f"{self.name} rows are not a list of at most the rows asked for"
            )
        out = []
        for row in rows:
            if not (
                isinstance(row, list)
                and len(row) == fields
                and _is_round(row[0])
                and all(isinstance(x, bytes) for x in row[1:])
                and all(0 < len(peer) <= MAX_PEER_ID_BYTES for peer in row[1 : 1 + ids])
                and 2 <= len(row[1 + ids]) <= 2 * MAX_SCALARS
                and len(row[1 + ids]) % 2 == 0
                and len(row[2 + ids]) <= self.max_payload
            ):
                raise Rejected("bad_reply", f"bad {self.name} row")
            scalars = unpack_scalars(row[1 + ids])
            if not all(math.isfinite(x) for x in scalars):
                raise Rejected("non_finite", f"{self.name} row")
            record = self.make(row[0], tuple(row[1 : 1 + ids]), scalars)
            out.append((record, Envelope(row[2 + ids], row[3 + ids], row[4 + ids])))
        return out

    def check_rows_follow(self, rows: Sequence[Row], cursor: tuple, max_round: int) -> None:
        """Fetch rows must come strictly after `cursor`, ascending, up to `max_round`: else a
        peer could keep us paging forever or hand us rows we did not ask for."""
        last = cursor
        for record, _ in rows:
            key = self.key(record)
            if key <= last or record.round > max_round:
                raise Rejected(
                    "bad_reply", f"{self.name} row {key[0]} out of order or past round {max_round}"
                )
            last = key

    def encode_fetch_request(self, run_id: str, cursor: tuple, max_round: int, limit: int) -> bytes:
        return msgpack.packb([run_id, *cursor, max_round, limit], use_bin_type=True)

    def decode_fetch_request(self, data: bytes) -> tuple[str, tuple, int, int] | None:
        """(run id, cursor, max round, limit) of a well-formed fetch request, else None."""
        body = _unpack_request(data, self.ids + 4 + self.key_has_scalars)
        if body is None:
            return None
        run_id, round_, *rest, max_round, limit = body
        if not (
            isinstance(run_id, str)
            and _is_int(round_)
            and -1 <= round_ <= MAX_ROUND
            and all(isinstance(x, bytes) for x in rest)
            and (not self.key_has_scalars or len(rest[-1]) <= 2 * MAX_SCALARS)
            and _is_round(max_round)
            and _is_int(limit)
            and 1 <= limit <= self.page_rows
        ):
            return None
        return run_id, (round_, *rest), max_round, limit


AUDIT_FETCH_LIMIT = 2048  # rows per audit fetch reply: < 300 B each, under the 960 KiB cap

UPDATE_ROWS = RowKind(
    name="update",
    digest_rpc="seedflood.digest",
    fetch_rpc="seedflood.fetch",
    ids=1,
    max_payload=MAX_UPDATE_BYTES,
    page_rows=FETCH_LIMIT,
    key_has_scalars=False,  # one row per (round, peer)
    ids_of=lambda m: (m.peer,),
    make=lambda round_, ids, scalars: UpdateMessage(round_, ids[0], scalars),
)
AUDIT_ROWS = RowKind(
    name="audit",
    digest_rpc="seedflood.audit_digest",
    fetch_rpc="seedflood.audit_fetch",
    ids=2,
    max_payload=MAX_AUDIT_BYTES,
    page_rows=AUDIT_FETCH_LIMIT,
    key_has_scalars=True,  # an auditor may log several recomputations of one update
    ids_of=lambda r: (r.accused, r.auditor),
    make=lambda round_, ids, scalars: AuditRecord(ids[0], round_, ids[1], scalars),
)


# ---------------------------------------------------------------------------------------------
# Checkpoint download (network/transfer/checkpoints.py)
#
#   seedflood.ckpt_offer  request [run_id]                      reply nil (none) or
#       [meta_json: str, size: int, file_sha256: bin(32), chunk_hashes: [bin(32)]]
#   seedflood.ckpt_chunk  request [run_id, file_sha256: bin(32), index: int]
#       reply the chunk's bytes (CHECKPOINT_CHUNK_BYTES, the last one shorter), or b"" (none)
#
# A served checkpoint is a link of the run's deterministic checkpoint chain
# (algorithm/chain.py): every honest peer whose ledger holds the same rows builds the same
# file, so a joiner takes an offer only when at least CHECKPOINT_QUORUM distinct peers make
# exactly it (same meta JSON, same file hash), and fetches its chunks from all of them at
# once. An offer reply that breaks the shape below is `bad_reply`; so is a chunk whose length
# or SHA-256 differs from the offer's (the chunk is asked of another offerer). Serving is
# bounded per requester: CHECKPOINT_SERVE_RATE bytes a second in bursts of
# CHECKPOINT_SERVE_BURST, and a reply is at most one chunk (under serve_bytes' 1 MiB).

CHECKPOINT_CHUNK_BYTES = 512 << 10
MAX_CHECKPOINT_CHUNKS = 4096  # files up to 2 GiB (SmolLM2-135M's trainable fp32: ~405 MiB)
MAX_CHECKPOINT_META_BYTES = 64 << 10
CHECKPOINT_SERVE_RATE = 16 << 20  # checkpoint bytes per second to one requester ...
CHECKPOINT_SERVE_BURST = 64 << 20  # ... in bursts of this
CHECKPOINT_QUORUM = QUORUM_PEERS  # distinct peers that must offer the very same checkpoint
HASH_BYTES = 32


@dataclass(frozen=True)
class CheckpointOffer:
    """What a peer offers: the checkpoint's JSON (algorithm/chain.py) and its file's hashes."""

    meta_json: str
    size: int
    file_sha256: bytes
    chunk_hashes: tuple[bytes, ...]

    @property
    def meta(self) -> dict:
        import json

        return json.loads(self.meta_json)

    @property
    def key(self) -> tuple[str, bytes]:
        """Two offers are the same checkpoint iff their keys are equal."""
        return self.meta_json, self.file_sha256

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * CHECKPOINT_CHUNK_BYTES
        return start, min(start + CHECKPOINT_CHUNK_BYTES, self.size)


def encode_checkpoint_offer(offer: CheckpointOffer | None) -> bytes:
    if offer is None:
        return msgpack.packb(None)
    return msgpack.packb([offer.meta_json, offer.size, offer.file_sha256, list(offer.chunk_hashes)])


def decode_checkpoint_offer(data: bytes, run_id: str) -> CheckpointOffer | None:
    """An offer reply: None (the peer has no checkpoint to serve), or the offer. Rejected
    ("bad_reply") for anything else, including meta JSON of another run or without the
    fields a checkpoint of the chain has."""
    import json

    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=MAX_CHECKPOINT_META_BYTES,
            max_bin_len=HASH_BYTES,
            max_array_len=MAX_CHECKPOINT_CHUNKS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception:
        raise Rejected("bad_reply", "checkpoint offer is not msgpack") from None
    if body is None:
        return None
    if not (isinstance(body, list) and len(body) == 4):
        raise Rejected("bad_reply", "checkpoint offer is not [meta, size, sha256, chunks]")
    meta_json, size, file_sha256, chunks = body
    if not (isinstance(meta_json, str) and _is_int(size) and size > 0):
        raise Rejected("bad_reply", "checkpoint offer: bad meta or size")
    if not (isinstance(file_sha256, bytes) and len(file_sha256) == HASH_BYTES):
        raise Rejected("bad_reply", "checkpoint offer: file hash is not 32 bytes")
    count = -(-size // CHECKPOINT_CHUNK_BYTES)
    if not (
        isinstance(chunks, list)
        and len(chunks) == count <= MAX_CHECKPOINT_CHUNKS
        and all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in chunks)
    ):
        raise Rejected("bad_reply", "checkpoint offer: chunk hashes do not match its size")
    try:
        meta = json.loads(meta_json)
    except Exception:
        raise Rejected("bad_reply", "checkpoint offer: meta is not JSON") from None
    if not (
        isinstance(meta, dict)
        and meta.get("run_id") == run_id
        and _is_round(meta.get("round"))
        and _is_int(meta.get("ledger_messages"))
        and isinstance(meta.get("ledger_digest"), str)
        and isinstance(meta.get("weights_sha256"), str)
        and isinstance(meta.get("ledger_cut"), dict)
    ):
        raise Rejected("bad_reply", "checkpoint offer: meta of another run or incomplete")
    return CheckpointOffer(meta_json, size, file_sha256, tuple(chunks))


def encode_checkpoint_offer_request(run_id: str) -> bytes:
    return msgpack.packb([run_id])


def decode_checkpoint_offer_request(data: bytes) -> str | None:
    body = _unpack_request(data, 1)
    return body[0] if body is not None and isinstance(body[0], str) else None


def encode_chunk_request(run_id: str, file_sha256: bytes, index: int) -> bytes:
    return msgpack.packb([run_id, file_sha256, index])


def decode_chunk_request(data: bytes) -> tuple[str, bytes, int] | None:
    body = _unpack_request(data, 3)
    if body is None:
        return None
    run_id, file_sha256, index = body
    if not (
        isinstance(run_id, str)
        and isinstance(file_sha256, bytes)
        and len(file_sha256) == HASH_BYTES
        and _is_int(index)
        and 0 <= index < MAX_CHECKPOINT_CHUNKS
    ):
        return None
    return run_id, file_sha256, index


def check_chunk_bytes(
    data: bytes, index: int, size: int, chunk_bytes: int, expected: bytes, what: str
) -> None:
    """Rejected ("bad_reply") unless `data` is chunk `index` of a `size`-byte file cut in
    `chunk_bytes` chunks: its length (the last chunk shorter) and its SHA-256 `expected`.
    The rule for checkpoint chunks and run assets alike (network/transfer/chunks.py)."""
    import hashlib

    start = index * chunk_bytes
    if len(data) != min(start + chunk_bytes, size) - start:
        raise Rejected("bad_reply", f"{what} {index}: {len(data)} bytes")
    if hashlib.sha256(data).digest() != expected:
        raise Rejected("bad_reply", f"{what} {index}: SHA-256 differs from the offer")


def check_chunk(offer: CheckpointOffer, index: int, data: bytes) -> None:
    """Rejected ("bad_reply") unless `data` is chunk `index` of `offer`: its length and
    SHA-256 as the offer states them."""
    check_chunk_bytes(
        data,
        index,
        offer.size,
        CHECKPOINT_CHUNK_BYTES,
        offer.chunk_hashes[index],
        "checkpoint chunk",
    )
