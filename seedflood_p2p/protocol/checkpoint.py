"""Checkpoint download: offers and chunks, and their rules (network/transfer/checkpoints.py).

    seedflood.ckpt_offer  request [run_id]                      reply nil (none) or
        [meta_json: str, size: int, file_sha256: bin(32), chunk_hashes: [bin(32)]]
    seedflood.ckpt_chunk  request [run_id, file_sha256: bin(32), index: int]
        reply the chunk's bytes (CHECKPOINT_CHUNK_BYTES, the last one shorter), or b"" (none)

A served checkpoint is a link of the run's deterministic checkpoint chain
(algorithm/chain.py): every honest peer whose ledger holds the same rows builds the same
file, so a joiner takes an offer only when at least CHECKPOINT_QUORUM distinct peers make
exactly it (same meta JSON, same file hash), and fetches its chunks from all of them at
once. An offer reply that breaks the shape below is `bad_reply`; so is a chunk whose length
or SHA-256 differs from the offer's (the chunk is asked of another offerer). A request
that breaks its shape is answered empty. Serving is bounded per requester:
CHECKPOINT_SERVE_RATE bytes a second in bursts of CHECKPOINT_SERVE_BURST, and a reply is
at most one chunk (under serve_bytes' 1 MiB).

An offer is well-formed when: its size is positive, its file hash 32 bytes, its chunk
hashes 32 bytes each and exactly as many as the size needs (at most
MAX_CHECKPOINT_CHUNKS), its meta at most MAX_CHECKPOINT_META_BYTES of JSON naming this
run, with the fields every checkpoint of the chain has (`decode_checkpoint_offer`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import msgpack

from seedflood_p2p.core.checks import is_int
from seedflood_p2p.protocol.framing import Rejected, is_round, unpack_request
from seedflood_p2p.protocol.update import QUORUM_PEERS

CHECKPOINT_CHUNK_BYTES = 512 << 10
MAX_CHECKPOINT_CHUNKS = 4096  # files up to 2 GiB (SmolLM2-135M's trainable fp32: ~405 MiB)
# The meta carries the link's cut, ~92 bytes a peer (its base58 id and its rounds as
# ranges): 64 KiB refused the offers of a 1,000-peer run (92 KB, bench_join_history.py).
# 768 KiB, with up to 128 KiB of chunk hashes, stays under serve_bytes' 1 MiB reply:
# about 8,000 peers whose rounds have no gaps.
MAX_CHECKPOINT_META_BYTES = 768 << 10
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
    if not (isinstance(meta_json, str) and is_int(size) and size > 0):
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
        and is_round(meta.get("round"))
        and is_int(meta.get("ledger_messages"))
        and isinstance(meta.get("ledger_digest"), str)
        and isinstance(meta.get("weights_sha256"), str)
        and isinstance(meta.get("ledger_cut"), dict)
    ):
        raise Rejected("bad_reply", "checkpoint offer: meta of another run or incomplete")
    return CheckpointOffer(meta_json, size, file_sha256, tuple(chunks))


def encode_checkpoint_offer_request(run_id: str) -> bytes:
    return msgpack.packb([run_id])


def decode_checkpoint_offer_request(data: bytes) -> str | None:
    body = unpack_request(data, 1)
    return body[0] if body is not None and isinstance(body[0], str) else None


def encode_chunk_request(run_id: str, file_sha256: bytes, index: int) -> bytes:
    return msgpack.packb([run_id, file_sha256, index])


def decode_chunk_request(data: bytes) -> tuple[str, bytes, int] | None:
    body = unpack_request(data, 3)
    if body is None:
        return None
    run_id, file_sha256, index = body
    if not (
        isinstance(run_id, str)
        and isinstance(file_sha256, bytes)
        and len(file_sha256) == HASH_BYTES
        and is_int(index)
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
