"""Checks on plain values that settings and wire decoding share, each defined once.

Values here come from manifests, TOML files and the network, so every check is total:
it answers for any object (a bool, a 5000-digit int, NaN) and never raises."""

from __future__ import annotations

import math
from collections.abc import Sequence

ED25519_PEER_ID_PREFIX = bytes.fromhex("002408011220")  # identity multihash of an Ed25519 key


def is_int(x: object) -> bool:
    """An integer that is not a bool (JSON's `true` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float's range
        return False


def short_repr(value: object, limit: int = 60) -> str:
    """repr of a value for an error line, cut to `limit` characters."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int of more than 4300 digits, a deep structure
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def peer_ids_problem(name: str, peers: Sequence[str], limit: int) -> str | None:
    """Why `peers` (setting `name`) is not a list of distinct base58 Ed25519 peer ids (what
    `seedflood` prints as a peer's id), at most `limit` of them; None if it is."""
    import base58

    if len(peers) > limit:
        return f"{name} lists {len(peers)} peers, more than {limit}"
    if len(set(peers)) != len(peers):
        return f"{name} lists a peer twice"
    for peer in peers:
        try:
            raw = base58.b58decode(peer) if len(peer) <= 64 else b""
        except ValueError:
            raw = b""
        if len(raw) != 38 or not raw.startswith(ED25519_PEER_ID_PREFIX):
            return f"{name} entry {short_repr(peer)} is not a base58 Ed25519 peer id (12D3Koo...)"
    return None
