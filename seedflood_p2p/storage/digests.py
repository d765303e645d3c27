"""The ledger's digests, pure functions of its update rows and audit records: the run's
ledger digest (`digest_of`, SHA-256 over 8-byte row hashes in canonical order) and the set
digests of repair's buckets (`set_digest`, `audit_set_digest`: SHA-256 over the sorted
member hashes, so independent of order). `storage/ledger.py` keeps them per bucket."""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterable

from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, pack_scalars


def digest_of(messages: Iterable[UpdateMessage]) -> str:
    """The ledger digest of `messages` (canonical order): what `Ledger.digest` returns."""
    digest = RunningDigest()
    for m in messages:
        digest.add(m)
    return digest.hexdigest()


def digest_within(
    messages: Iterable[UpdateMessage], covered: Container[tuple[bytes, int]]
) -> tuple[int, str]:
    """(count, `digest_of`) of the messages (canonical order) whose (peer, round) is in
    `covered` (a cut): what a trusted link's rows are checked against."""
    inside = RunningDigest()
    for m in messages:
        if (m.peer, m.round) in covered:
            inside.add(m)
    return inside.count, inside.hexdigest()


class RunningDigest:
    """`digest_of`, fed one message at a time (canonical order), for a pass that does
    other work with each row too (a restart's, `LiveModel.restore`)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def add(self, message: UpdateMessage) -> None:
        self.add_hash(_message_hash(message))

    def add_hash(self, h: bytes) -> None:
        """Add a row by its `row_digest` (computed once for several digests)."""
        self._h.update(h)
        self.count += 1

    def copy(self) -> RunningDigest:
        """This digest so far, to be fed on apart (a chain link's, `ChainTail`)."""
        other = RunningDigest()
        other._h, other.count = self._h.copy(), self.count
        return other

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def row_digest(m: UpdateMessage) -> bytes:
    """A row's part of the ledger digest (`digest_of`: SHA-256 over these, in order)."""
    return _message_hash(m)


def _message_hash(m: UpdateMessage) -> bytes:
    body = m.round.to_bytes(8, "little") + len(m.peer).to_bytes(2, "little") + m.peer
    return hashlib.sha256(body + pack_scalars(m.scalars)).digest()[:8]


def _set_member_hash(m: UpdateMessage) -> bytes:
    """Full SHA-256 of one message, as a member of a bucket's set digest."""
    return row_member_hash(m.round, m.peer, pack_scalars(m.scalars))


def row_member_hash(round_: int, peer: bytes, scalars: bytes) -> bytes:
    """`_set_member_hash` of a row as stored: its scalars are the wire's float16 bytes."""
    body = round_.to_bytes(8, "little") + len(peer).to_bytes(2, "little") + peer
    return hashlib.sha256(body + scalars).digest()


def set_digest(messages: Iterable[UpdateMessage]) -> bytes:
    """The set digest `bucket_digests` gives a bucket holding exactly `messages`."""
    return member_set_digest(_set_member_hash(m) for m in messages)


def audit_member_hash(r: AuditRecord) -> bytes:
    """Full SHA-256 of one audit record, as a member of an audit bucket's set digest. It
    covers `at` (-1: not carried): two ledgers that kept copies differing only in `at`
    differ here, so repair brings them the smaller (`Ledger.add_audits`)."""
    body = r.round.to_bytes(8, "little")
    for peer in (r.accused, r.auditor):
        body += len(peer).to_bytes(2, "little") + peer
    at = r.at.to_bytes(8, "little", signed=True)
    return hashlib.sha256(body + pack_scalars(r.scalars) + at).digest()


def audit_set_digest(records: Iterable[AuditRecord]) -> bytes:
    """The set digest `audit_bucket_digests` gives a bucket holding exactly `records`."""
    return member_set_digest(audit_member_hash(r) for r in records)


def member_set_digest(member_hashes: Iterable[bytes]) -> bytes:
    """SHA-256 over sorted member hashes: a set digest, independent of order."""
    return hashlib.sha256(b"".join(sorted(member_hashes))).digest()
