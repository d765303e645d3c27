"""Counter-based random numbers that are bit-identical on every machine.

torch's generators are not portable (CPU and CUDA streams differ; CUDA randn
depends on the device), so every random quantity that peers must agree on is
drawn here instead: Philox4x32-10 (Salmon et al., SC'11, the generator behind
cuRAND and Random123) evaluated with NumPy's unsigned integer arithmetic on the
CPU. Results are integers or exactly representable floats (+1/-1), so they do
not depend on the torch version, device or math library. Keys are derived with
SHA-256 from readable domain strings, so different uses never share a stream.

It sits in the core layer because both the algorithm (directions, bases, batches) and
the workload (the built-in models' weights, `portable_uniform`) draw from it.
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def philox4x32(counters: np.ndarray, key: tuple, rounds: int = 10) -> np.ndarray:
    """Philox4x32-R on a batch of 128-bit counters.

    counters: array of shape (n, 4) holding 32-bit words (any integer dtype).
    key: two 32-bit words, each an int or an array of shape (n,) (one key per
    counter). Returns a uint32 array of shape (n, 4).
    """
    c = np.asarray(counters, dtype=np.uint64) & _MASK32
    if c.ndim != 2 or c.shape[1] != 4:
        raise ValueError(f"counters must have shape (n, 4), got {c.shape}")
    c0, c1, c2, c3 = (c[:, i].copy() for i in range(4))
    k0 = np.asarray(key[0], dtype=np.uint64) & _MASK32
    k1 = np.asarray(key[1], dtype=np.uint64) & _MASK32
    for _ in range(rounds):
        p0 = _M0 * c0  # 32x32 -> 64 bit products cannot overflow uint64
        p1 = _M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> _SHIFT32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> _SHIFT32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def philox4x32_grid(keys: np.ndarray, streams: int, blocks: int, rounds: int = 10) -> np.ndarray:
    """Philox4x32-R of every counter (i, j, 0, 0), i < blocks, j < streams, under each of
    n keys: a uint32 array of shape (n, streams, blocks, 4).

    Bit-identical to `philox4x32` on those counters (tests/test_rng.py). The counters are
    never built: each word is kept at the shape it depends on, so numpy broadcasting does
    the work of a round only where it varies (the first round's products depend on i
    alone, the second's on (key, i) or (key, j)): the first three rounds cost about one.
    keys: shape (n, 2), 32-bit words.
    """
    keys = np.asarray(keys, dtype=np.uint64) & _MASK32
    n = keys.shape[0]
    k0 = keys[:, 0].reshape(n, 1, 1)
    k1 = keys[:, 1].reshape(n, 1, 1)
    c0 = np.arange(blocks, dtype=np.uint64).reshape(1, 1, blocks)
    c1 = np.arange(streams, dtype=np.uint64).reshape(1, streams, 1)
    c2 = c3 = np.zeros((1, 1, 1), dtype=np.uint64)
    for _ in range(rounds):  # the same round as philox4x32's, on broadcastable words
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> _SHIFT32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> _SHIFT32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    out = np.empty((n, streams, blocks, 4), dtype=np.uint32)
    for i, word in enumerate((c0, c1, c2, c3)):
        out[..., i] = word
    return out


def derive_key(*parts: bytes | str | int) -> tuple[int, int]:
    """A 64-bit Philox key from SHA-256 of length-prefixed parts (unambiguous)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, str):
            data = part.encode()
        elif isinstance(part, (bytes, bytearray)):
            data = bytes(part)
        else:  # Python or numpy integer; anything else is a bug, not a seed
            data = operator.index(part).to_bytes(8, "little", signed=False)
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    digest = h.digest()
    return int.from_bytes(digest[0:4], "little"), int.from_bytes(digest[4:8], "little")


def random_words(key: tuple[int, int], stream: int, count: int) -> np.ndarray:
    """`count` uint32 words from counters (i, stream, 0, 0), i = 0, 1, ..."""
    blocks = -(-count // 4)
    counters = np.zeros((blocks, 4), dtype=np.uint64)
    counters[:, 0] = np.arange(blocks, dtype=np.uint64)
    counters[:, 1] = stream
    return philox4x32(counters, key).reshape(-1)[:count]


def random_signs(key: tuple[int, int], stream: int, count: int) -> np.ndarray:
    """`count` values in {-1.0, +1.0} (float32), one bit each, little-endian bit order."""
    words = random_words(key, stream, -(-count // 32))
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")[:count]
    return (bits.astype(np.float32) * 2.0 - 1.0).astype(np.float32)


def portable_uniform(key: tuple[int, int], count: int, std: float) -> np.ndarray:
    """`count` float32 values, uniform on [-std*sqrt(3), std*sqrt(3)) (so of std `std`),
    bit-identical on every machine: 24 random bits give u = k / 2^24 exactly, 2u - 1 is
    exact in float32, and the one multiplication by the float32 scale is IEEE-rounded.
    No log or cos (Box-Muller), whose last bit depends on the math library."""
    words = random_words(key, 0, count)
    u = (words >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    scale = np.float32(std * 3.0**0.5)
    return ((u * np.float32(2.0) - np.float32(1.0)) * scale).astype(np.float32)
