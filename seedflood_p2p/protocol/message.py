"""The update message: who, which round, one scalar. The direction is derived."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass


def quantize_scalar(value: float) -> float:
    """Round to float32, the precision carried on the wire.

    A sender applies this value, never its unrounded estimate, so that it applies
    exactly what every receiver decodes.
    """
    return struct.unpack("<f", struct.pack("<f", value))[0]


@dataclass(frozen=True, order=True)
class UpdateMessage:
    """One zeroth-order update. Field order is the canonical order: (round, peer)."""

    round: int
    peer: bytes
    scalar: float  # projected gradient, float32-representable

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        if not math.isfinite(self.scalar):
            raise ValueError("scalar must be finite")


@dataclass(frozen=True)
class Envelope:
    """The signed GossipSub message an update arrived in, kept so others can verify it.

    The signature (by the sender's Ed25519 key, over payload, seqno and topic) lets
    any peer check a repaired update really came from its sender.
    """

    data: bytes
    seqno: bytes
    signature: bytes
