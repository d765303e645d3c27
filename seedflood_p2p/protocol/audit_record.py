"""The audit record, gossiped on the run's audit topic and repaired, and its rules.

Audit record, GossipSub payload on the run's audit topic (`audit_topic_for`), msgpack
array:

    [version: int = 3, run_tag: bin(4), accused: bin(1..64), round: uint, scalars: bin(2k),
     at: uint]

`scalars` are the auditor's recomputation of the accused's update for `round`, as
float16. `at` is the auditor's training round when it published (it fixes from which
settled state a vouch counts, algorithm/probation.py); a record of an older version has
no `at` (5 fields) and is read with at = -1. The auditor is the envelope's signer
(strict signing), never in the payload. 57 + 2k bytes for a 38-byte Ed25519 peer id and
rounds below 2^16. A record is dropped for the update's reasons (oversized past
MAX_AUDIT_BYTES, malformed, bad_version, wrong_run, non_finite, out_of_window for a
round or `at` past MAX_ROUND) and one more:

    self_audit     the auditor names itself as the accused (it would vote on its own case)

What records decide (bans, voided updates) is `algorithm/audit_rules.py:judge`.

Audit repair: audit records are repaired like updates (`AUDIT_ROWS` in
`protocol/repair.py`, network/gossip/repair.py), so a peer that missed some (a late
joiner, a partition) ends with the same audit table, hence the same verdicts (`judge` is
a pure function of the table and the updates). Per row the `bad_key`, `not_allowed`,
`no_work`, `bad_signature`, `mismatch` and audit payload rules apply, with update
repair's budgets (MAX_EXCHANGE_PAGES, the deadline, the digest's claimed counts,
SERVE_BYTES_RATE).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgpack

from seedflood_p2p.core.checks import is_int
from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.protocol.framing import (
    MAX_PEER_ID_BYTES,
    PROTOCOL_VERSION,
    Rejected,
    check_round_and_scalars,
    check_run_tag,
    run_tag,
    same_scalars,
    topic_for,
)
from seedflood_p2p.protocol.message import AuditRecord, Envelope, pack_scalars

MAX_AUDIT_BYTES = 128


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
    if not isinstance(body, list) or len(body) < 1 or not is_int(body[0]):
        raise Rejected("malformed", "not a versioned array")
    if body[0] != PROTOCOL_VERSION:
        raise Rejected("bad_version", f"version {body[0]}, expected {PROTOCOL_VERSION}")
    if len(body) not in (5, 6):
        raise Rejected("malformed", f"{len(body)} fields, expected 5 or 6")
    _, tag, accused, round_, packed, *rest = body
    check_run_tag(tag, run_id)
    if not isinstance(accused, bytes) or not 0 < len(accused) <= MAX_PEER_ID_BYTES:
        raise Rejected("malformed", "accused is not a peer id")
    scalars = check_round_and_scalars(round_, packed, directions)
    at = rest[0] if rest else -1
    if rest and not is_int(at):
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
