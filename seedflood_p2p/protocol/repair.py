"""Repair (anti-entropy) messages: bucket digests and fetched rows, with their budgets.

Anti-entropy (network/gossip/repair.py) repairs two tables, updates and audit records, with
one protocol. Each table has a `RowKind`: its row shape, the order rows are served in (the
row key, which is also the fetch cursor), its limits and its two request names.

    digest  [run_id, 64]                                -> [[bucket, count, sha256], ...]
    fetch   [run_id, *cursor, max_round, limit]         -> up to `limit` rows after the
                                                           cursor, through `max_round`
    row     [round, *ids, scalars, data, seqno, signature]

    kind     requests                         ids               cursor (= row key)
    update   seedflood.digest, .fetch         peer              (round, peer)
    audit    seedflood.audit_digest,          accused, auditor  (round, accused, auditor,
             .audit_fetch                                        packed scalars)

A row is the record with the signed GossipSub envelope it arrived in; what a row itself
must pass is its family's rule (`protocol/update.py`, `protocol/audit_record.py`). A
bucket holds BUCKET_ROUNDS rounds; a bucket of the audit table holds the records of the
accused updates' rounds in it.

Repair replies themselves are checked before any row is looked at; a reply that fails
is dropped whole, counted as `bad_reply`, and that peer is not asked further this pass:

    bad_reply      digest reply not a list of [bucket, count, 32-byte hash] with buckets in
                   range, each listed once; fetch reply not a list of well-formed rows;
                   rows not strictly after the requested cursor, not ascending, or past
                   the requested round; a page holding a row with a bad signature or
                   payload (the whole exchange ends, the peer is backed off)

In detail, a fetch reply is `bad_reply` unless it is a msgpack list of at most `limit`
rows, each of the kind's length, the round in 0..MAX_ROUND, every other field bytes, each
id 1..64 bytes, the scalars 1..16 float16 values (a non-finite one: `non_finite`), the
envelope's payload at most the kind's `max_payload`; and unless its rows come strictly
after the cursor, ascending by key, through `max_round` (`check_rows_follow`).

Requests a peer serves are checked the same way, and answered empty when they fail: a
digest request for an unknown run or a bucket size other than BUCKET_ROUNDS; a fetch
request that is not exactly the array above: a string run id, the cursor's round in
-1..MAX_ROUND and its other fields bytes (a peer id; packed scalars at most 32 bytes),
max_round in 0..MAX_ROUND, limit in 1..the kind's `page_rows` (FETCH_LIMIT for updates).

Repair budgets (network/gossip/repair.py applies them): an exchange with one peer fetches
at most `MAX_EXCHANGE_PAGES` pages, stops after EXCHANGE_BASE_SECONDS plus PAGE_SECONDS
per page its digest claimed, and takes at most the rows the digest claimed per bucket
(more is not an offence: an honest server's bucket grows while the run goes on; the rest
waits for the next exchange); a fetch reply is at most `MAX_FETCH_REPLY_BYTES`. A server
answers each requester at most `SERVE_BYTES_RATE` bytes per second (burst
`SERVE_BYTES_BURST`), so an 82-byte request cannot buy unbounded replies. A bucket's
digest is SHA-256 over its rows' sorted SHA-256 hashes (storage/ledger.py), so a fork
cannot hide behind a collided digest (the XOR of 64-bit hashes it replaced could be
collided with ~2^32 work).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from seedflood_p2p.core.checks import is_int
from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.protocol.audit_record import MAX_AUDIT_BYTES
from seedflood_p2p.protocol.framing import (
    MAX_PEER_ID_BYTES,
    MAX_SCALARS,
    Rejected,
    is_round,
    unpack_request,
)
from seedflood_p2p.protocol.message import (
    AuditRecord,
    Envelope,
    UpdateMessage,
    pack_scalars,
    unpack_scalars,
)
from seedflood_p2p.protocol.update import MAX_UPDATE_BYTES

BUCKET_ROUNDS = 64  # rounds per digest bucket in anti-entropy
BUCKET_HASH_BYTES = 32  # SHA-256 set digest per bucket
FETCH_LIMIT = 4096  # rows per fetch reply: ~146 B each, under the daemon's 1 MiB cap
AUDIT_FETCH_LIMIT = 2048  # rows per audit fetch reply: < 300 B each, under the 960 KiB cap
MAX_FETCH_REPLY_BYTES = 960 * 1024  # below serve_bytes' 1 MiB; a valid Ed25519 row is < 215 B
MAX_EXCHANGE_PAGES = 32  # fetch pages per exchange with one peer (131,072 rows)
EXCHANGE_BASE_SECONDS = 10.0  # an exchange may take this ...
PAGE_SECONDS = 2.0  # ... plus this per page its digest claimed (at most MAX_EXCHANGE_PAGES)
SERVE_BYTES_RATE = 2 << 20  # repair bytes served per second to one requester ...
SERVE_BYTES_BURST = 32 << 20  # ... in bursts of this (a late join of ~150,000 rows)


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
            and is_round(item[0])
            and item[0] <= MAX_ROUND // BUCKET_ROUNDS
            and is_round(item[1])
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
    body = unpack_request(data, 2)
    if body is None:
        return None
    run_id, bucket_rounds = body
    if not (isinstance(run_id, str) and is_int(bucket_rounds) and bucket_rounds == BUCKET_ROUNDS):
        return None  # 64.0 and `true` are not integers
    return run_id


Record = Any  # an UpdateMessage or an AuditRecord: a RowKind's records
Row = tuple[Any, Envelope]  # a record with its signed envelope


@dataclass(frozen=True)
class RowKind:
    """The wire form of one repairable table's rows (see the module docstring)."""

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
                and is_round(row[0])
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
        body = unpack_request(data, self.ids + 4 + self.key_has_scalars)
        if body is None:
            return None
        run_id, round_, *rest, max_round, limit = body
        if not (
            isinstance(run_id, str)
            and is_int(round_)
            and -1 <= round_ <= MAX_ROUND
            and all(isinstance(x, bytes) for x in rest)
            and (not self.key_has_scalars or len(rest[-1]) <= 2 * MAX_SCALARS)
            and is_round(max_round)
            and is_int(limit)
            and 1 <= limit <= self.page_rows
        ):
            return None
        return run_id, (round_, *rest), max_round, limit


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
