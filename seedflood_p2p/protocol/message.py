"""The update message: who, which round, k scalars (one per direction). The directions
are derived from (run, peer, round), so they are not sent."""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np

# Every float16 value as a Python float, made once. A decoded scalar is one of these shared
# objects, not a new float per row: a peer holds every row it applied (audit_duty.applied),
# and a float is 24 bytes of a row's ~250 at 16 directions. The values are float16's own.
_FLOAT16 = tuple(np.arange(1 << 16, dtype=np.uint16).view("<f2").astype(np.float64).tolist())
# One bytes object per peer id for the rows we keep, instead of a copy per row (71 bytes);
# cleared when full, so many identities cost a bounded table, never a wrong id.
_PEER_IDS: dict[bytes, bytes] = {}
PEER_IDS_KEPT = 1 << 16


def quantize_scalars(values) -> tuple[float, ...]:
    """Round to float16, the precision carried on the wire (2 bytes per direction, so a
    message of 16 directions stays under 64 bytes).

    A sender applies these values, never its unrounded estimates, so that it applies
    exactly what every receiver decodes. Values past float16's range saturate to
    +-65504 rather than becoming infinite.
    """
    x = np.clip(np.asarray(values, dtype=np.float64).reshape(-1), -65504.0, 65504.0)
    return tuple(map(_FLOAT16.__getitem__, x.astype("<f2").view("<u2").tolist()))


def pack_scalars(scalars: tuple[float, ...]) -> bytes:
    """The wire (and ledger) bytes of a message's scalars: little-endian float16.

    By `struct` ('e' rounds to nearest, ties to even, as numpy does), a few times cheaper
    than a numpy array for a handful of values (it runs for every row written and hashed);
    what struct refuses (a value past float16's range) goes through numpy, as before."""
    try:
        return _halves(len(scalars), "e").pack(*scalars)
    except (OverflowError, struct.error):
        return np.asarray(scalars, dtype="<f2").tobytes()


def unpack_scalars(data: bytes) -> tuple[float, ...]:
    """The scalars of wire bytes, each one of the shared float16 values (`_FLOAT16`)."""
    if len(data) % 2:
        raise ValueError(f"scalars take 2 bytes each, got {len(data)} bytes")
    return tuple(map(_FLOAT16.__getitem__, _halves(len(data) // 2, "H").unpack(data)))


@functools.cache
def _halves(count: int, code: str) -> struct.Struct:
    return struct.Struct(f"<{count}{code}")


def shared_peer_id(peer: bytes) -> bytes:
    """`peer` as the one bytes object kept for that id (`_PEER_IDS`)."""
    peer = bytes(peer)
    kept = _PEER_IDS.get(peer)
    if kept is None:
        if len(_PEER_IDS) >= PEER_IDS_KEPT:
            _PEER_IDS.clear()
        kept = _PEER_IDS[peer] = peer
    return kept


@dataclass(frozen=True, order=True, slots=True)  # slots: a peer keeps one per row applied
class UpdateMessage:
    """One zeroth-order update. Field order is the canonical order: (round, peer)."""

    round: int
    peer: bytes
    scalars: tuple[float, ...]  # projected gradients, one per direction, float16-exact

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        if not self.scalars:
            raise ValueError("a message carries at least one scalar")
        if not all(math.isfinite(s) for s in self.scalars):
            raise ValueError("scalars must be finite")

    def negated(self) -> UpdateMessage:
        """The message that takes this one back (updates are linear in the scalars)."""
        return UpdateMessage(self.round, self.peer, tuple(-s for s in self.scalars))


@dataclass(frozen=True)
class Envelope:
    """The signed GossipSub message an update arrived in, kept so others can verify it.

    The signature (by the sender's Ed25519 key, over payload, seqno and topic) lets
    any peer check a repaired update really came from its sender.
    """

    data: bytes
    seqno: bytes
    signature: bytes


@dataclass(frozen=True, order=True)
class AuditRecord:
    """One audit published to the run: `auditor` recomputed the update (accused, round) and
    got `scalars`. Against the claimed scalars it is an accusation (a mismatch) or a
    vouching re-check (a match); `algorithm/audit_rules.py:judge` decides what a set of them
    means. The auditor is the signer of the envelope it travels in, not in the payload.

    `at`: the auditor's training round when it published the record (-1: not carried, a
    record of an older version). It fixes the first settled state a vouch takes effect in
    (`algorithm/probation.py`), as an update's round fixes the settled states it is in."""

    accused: bytes
    round: int
    auditor: bytes
    scalars: tuple[float, ...]  # the auditor's recomputation, float16-exact
    at: int = -1

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        if self.at < -1:
            raise ValueError(f"at must be >= -1, got {self.at}")
        if not self.scalars or not all(math.isfinite(s) for s in self.scalars):
            raise ValueError("an audit carries at least one finite scalar")
