"""Checkpoint download for late joiners: offers, chunks, several peers at once.

A peer serves the newest link of the run's checkpoint chain (algorithm/chain.py), which
every honest peer holding the same rows builds bit for bit alike. A joiner asks every peer
it is connected to for its offer (`seedflood.ckpt_offer`), groups identical offers (same
meta JSON, same file hash), and takes the newest checkpoint that at least
`protocol.checkpoint.CHECKPOINT_QUORUM` distinct peers offer: that is why it trusts it
without replaying the rows it covers (one peer's forged or damaged file has no second
offerer; two colluding identities could forge one, as they can move the quorum round). Then
it fetches the chunks from all of those peers at once (`seedflood.ckpt_chunk`), each chunk
checked against the offer's SHA-256 as it arrives and the whole file at the end. A chunk
that fails is `bad_reply` (counted, held against its sender, which is asked no further) and
is asked of another offerer. The partial file is kept (`<file sha256>.part`): a joiner
restarted mid download re-hashes what it has and fetches only the missing chunks. The caller
then restores from it with `LiveModel.restore`, which refuses it (and replays) unless the
ledger's rows inside its cut digest as it says and its tensors hash as it says.

Serving is bounded like repair (protocol/checkpoint.py): banned and unlisted requesters get
nothing, each requester at most CHECKPOINT_SERVE_RATE bytes a second in bursts of
CHECKPOINT_SERVE_BURST, one chunk (512 KiB) per reply. No torch here (network layer).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from seedflood_p2p.network.peers.reputation import PeerBuckets, short_id
from seedflood_p2p.network.transfer.chunks import fetch_chunks, file_sha256, present_chunks
from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes, serve_bytes
from seedflood_p2p.protocol.checkpoint import (
    CHECKPOINT_CHUNK_BYTES,
    CHECKPOINT_QUORUM,
    CHECKPOINT_SERVE_BURST,
    CHECKPOINT_SERVE_RATE,
    MAX_CHECKPOINT_CHUNKS,
    MAX_CHECKPOINT_META_BYTES,
    CheckpointOffer,
    decode_checkpoint_offer,
    decode_checkpoint_offer_request,
    decode_chunk_request,
    encode_checkpoint_offer,
    encode_checkpoint_offer_request,
    encode_chunk_request,
)
from seedflood_p2p.protocol.framing import Rejected
from seedflood_p2p.storage.checkpoint import META_FILE, WEIGHTS_FILE

log = logging.getLogger("seedflood.checkpoints")

SERVED_LINKS = 2  # links kept open for joiners mid download when a newer one appears


def file_offer(directory: Path) -> CheckpointOffer:
    """The offer for the checkpoint in `directory`: its JSON (canonical) and file hashes."""
    directory = Path(directory)
    meta = json.loads((directory / META_FILE).read_text())
    whole = hashlib.sha256()
    chunks = []
    size = 0
    with open(directory / WEIGHTS_FILE, "rb") as f:
        while block := f.read(CHECKPOINT_CHUNK_BYTES):
            whole.update(block)
            chunks.append(hashlib.sha256(block).digest())
            size += len(block)
    if not 0 < len(chunks) <= MAX_CHECKPOINT_CHUNKS:
        raise ValueError(f"checkpoint of {size} bytes cannot be served")
    meta_json = json.dumps(meta, sort_keys=True)
    if len(meta_json.encode()) > MAX_CHECKPOINT_META_BYTES:
        raise ValueError(
            f"its meta is {len(meta_json.encode()):,} bytes (the cut of "
            f"{len(meta.get('ledger_cut', {})):,} peers), over an offer's "
            f"{MAX_CHECKPOINT_META_BYTES:,}"
        )
    return CheckpointOffer(meta_json, size, whole.digest(), tuple(chunks))


class CheckpointServer:
    """Answers offers and chunk requests for the links it was given (`publish`)."""

    def __init__(self, node, served: Callable[[bytes], bytes] = lambda data: data) -> None:
        self.node = node  # FloodNode: run id, refusals, reputation, metrics
        # a chunk as it is sent, from the file's bytes (the peer's Behaviour: unchanged, but
        # for a test's peer that serves bad bytes; peer/behaviour.py)
        self.served = served
        self._links: dict[bytes, tuple[CheckpointOffer, object]] = {}  # file sha -> (offer, file)
        self._newest: CheckpointOffer | None = None
        self._served = PeerBuckets(CHECKPOINT_SERVE_RATE, CHECKPOINT_SERVE_BURST)

    async def start(self) -> None:
        await serve_bytes(self.node.p2p, "seedflood.ckpt_offer", self._serve_offer)
        await serve_bytes(self.node.p2p, "seedflood.ckpt_chunk", self._serve_chunk)

    async def publish(self, directory: Path) -> CheckpointOffer:
        """Serve the checkpoint in `directory` from now on. The file is held open, so a
        newer link renamed over it later does not change the bytes a joiner is fetching."""
        offer = await asyncio.to_thread(file_offer, directory)
        if offer.file_sha256 not in self._links:
            handle = open(Path(directory) / WEIGHTS_FILE, "rb")  # noqa: SIM115 - kept open
            self._links[offer.file_sha256] = (offer, handle)
            while len(self._links) > SERVED_LINKS:  # the oldest link is let go
                self._links.pop(next(iter(self._links)))[1].close()
        self._newest = offer
        return offer

    def close(self) -> None:
        for _, handle in self._links.values():
            handle.close()
        self._links.clear()
        self._newest = None

    async def _serve_offer(self, peer, request: bytes) -> bytes:
        if decode_checkpoint_offer_request(request) != self.node.run_id:
            return encode_checkpoint_offer(None)
        if not self.node.may_serve(peer, 0):
            return encode_checkpoint_offer(None)
        return encode_checkpoint_offer(self._newest)

    async def _serve_chunk(self, peer, request: bytes) -> bytes:
        fields = decode_chunk_request(request)
        if fields is None or fields[0] != self.node.run_id or not self.node.may_serve(peer, 0):
            return b""
        _, file_sha256, index = fields
        link = self._links.get(file_sha256)
        if link is None or index >= len(link[0].chunk_hashes):
            return b""
        offer, handle = link
        start, end = offer.chunk_range(index)
        requester = peer.to_bytes()
        if not self._served.allow(requester, end - start):
            self.node.metrics.served_refused.labels("rate_limited").inc()
            self.node.reputation.penalize(requester, "rate_limited")
            return b""
        return self.served(os.pread(handle.fileno(), end - start, start))


@dataclass
class FetchResult:
    offer: CheckpointOffer
    peers: list[str]  # the offerers it was fetched from (base58)
    bytes_fetched: int
    chunks_resumed: int
    seconds: float
    refused: dict[str, int] = field(default_factory=dict)  # reason -> count


class FetchFailed(Exception):
    """No checkpoint could be fetched; the message says why (the caller replays)."""

    def __init__(self, why: str, refused: dict[str, int]) -> None:
        super().__init__(why)
        self.refused = refused


async def gather_offers(node, peers: list, timeout: float) -> tuple[dict, dict[str, int]]:
    """Every peer's offer, grouped: {offer key: (offer, [peer ids])}, and refusals."""
    refused: dict[str, int] = {}

    async def ask(peer_id):
        try:
            request = encode_checkpoint_offer_request(node.run_id)
            reply = await call_bytes(node.p2p, peer_id, "seedflood.ckpt_offer", request, timeout)
            return peer_id, decode_checkpoint_offer(reply, node.run_id)
        except Rejected as exc:
            node.admission.drop_reply(exc, peer_id.to_bytes())
            refused["bad_offer"] = refused.get("bad_offer", 0) + 1
        except RemoteCallError as exc:
            log.debug("checkpoint offer from %s: %s", peer_id, exc)
        return peer_id, None

    groups: dict[tuple[str, bytes], tuple[CheckpointOffer, list]] = {}
    for peer_id, offer in await asyncio.gather(*(ask(p) for p in peers)):
        if offer is not None and node.refuses(peer_id.to_bytes()) is None:
            groups.setdefault(offer.key, (offer, []))[1].append(peer_id)
    return groups, refused


def pick_offer(groups: dict, quorum: int = CHECKPOINT_QUORUM):
    """The newest checkpoint offered identically by at least `quorum` distinct peers (ties:
    more offerers), or None; and how many offers were refused for lack of a quorum."""
    backed = [(o, p) for o, p in groups.values() if len({x.to_bytes() for x in p}) >= quorum]
    lone = sum(1 for o, p in groups.values() if len({x.to_bytes() for x in p}) < quorum)
    if not backed:
        return None, lone
    return max(backed, key=lambda g: (g[0].meta["round"], len(g[1]))), lone


async def download(
    node, offer: CheckpointOffer, peers: list, directory: Path, timeout: float
) -> FetchResult:
    """Fetch `offer`'s file from `peers` at once into `directory` (WEIGHTS_FILE + META_FILE).

    Chunks are handed out from one queue, so a fast peer serves more; a peer whose chunk
    fails its hash (bad_reply) or whose call fails stops being asked and the chunk goes
    back into the queue. Resumes from `<file sha256>.part`."""
    started = time.monotonic()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    part = directory / (offer.file_sha256.hex() + ".part")
    count = len(offer.chunk_hashes)
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
    refused: dict[str, int] = {}

    async def get(peer_id, index: int) -> bytes:
        request = encode_chunk_request(node.run_id, offer.file_sha256, index)
        return await call_bytes(node.p2p, peer_id, "seedflood.ckpt_chunk", request, timeout)

    def on_failure(peer_id, index: int, exc: Exception) -> None:
        if isinstance(exc, Rejected):
            refused["bad_chunk"] = refused.get("bad_chunk", 0) + 1
            node.admission.drop_reply(exc, peer_id.to_bytes())
            log.warning(
                "checkpoint chunk %d from %s refused (%s): not asking it again",
                index,
                short_id(peer_id.to_bytes()),
                exc,
                extra={"fields": {"event": "checkpoint_refused", "why": "bad_chunk"}},
            )
        else:
            log.info("checkpoint chunk %d from %s failed: %s", index, peer_id, exc)

    try:
        if os.fstat(fd).st_size != offer.size:
            os.ftruncate(fd, offer.size)
        have, missing, fetched = await fetch_chunks(
            fd,
            offer.size,
            CHECKPOINT_CHUNK_BYTES,
            list(offer.chunk_hashes),
            peers,
            get,
            on_failure,
            "checkpoint chunk",
        )
        if missing:
            raise FetchFailed(f"{missing} of {count} chunks could not be fetched", refused)
        os.fsync(fd)
        whole = await asyncio.to_thread(file_sha256, part)
        if whole != offer.file_sha256:  # every chunk matched, so only a forged offer
            raise FetchFailed("the file does not hash as its offer says", refused)
    finally:
        os.close(fd)
    part.replace(directory / WEIGHTS_FILE)
    (directory / META_FILE).write_text(offer.meta_json)
    return FetchResult(
        offer,
        [p.to_base58() for p in peers],
        fetched,
        len(have),
        time.monotonic() - started,
        refused,
    )


def _chunks_present(fd: int, offer: CheckpointOffer) -> set[int]:
    """Chunks of a partial checkpoint file that already hash right (a resumed download)."""
    return present_chunks(fd, offer.size, CHECKPOINT_CHUNK_BYTES, list(offer.chunk_hashes))


OFFER_ATTEMPTS = 3  # asks for offers when they disagree (a peer just made a newer link)
OFFER_RETRY_SECONDS = 2.0


async def fetch_checkpoint(
    node, peers: list, directory: Path, timeout: float, choose, retry_wait: float = 0.0
) -> FetchResult:
    """Ask `peers` for offers, pick one backed by a quorum, and let `choose(offer)` (the
    caller's rule: checkpoint or replay, from the sizes) decide; then download it.
    FetchFailed says why nothing was fetched.

    Each peer offers its newest link, so two honest peers disagree for a moment when one
    has just made the next link, or made one the others have not yet (seen in CI: "2
    distinct offers"): with `retry_wait` > 0, offers without a quorum are asked for
    again, up to OFFER_ATTEMPTS times; only the last answer's refusals count."""
    for attempt in range(OFFER_ATTEMPTS if retry_wait > 0 else 1):
        if attempt:
            await asyncio.sleep(retry_wait)
        groups, refused = await gather_offers(node, peers, timeout)
        picked, lone = pick_offer(groups)
        if picked is not None or not groups:
            break  # a quorum, or no offer at all: nothing to wait for
    if lone:
        refused["no_quorum"] = lone
        log.warning(
            "%d checkpoint offer(s) refused: not offered identically by %d distinct peers "
            "(forged, damaged or just not shared)",
            lone,
            CHECKPOINT_QUORUM,
            extra={"fields": {"event": "checkpoint_refused", "why": "no_quorum", "count": lone}},
        )
    if picked is None:
        raise FetchFailed(
            f"no checkpoint offered by {CHECKPOINT_QUORUM} distinct peers "
            f"({len(groups)} distinct offer(s) from {len(peers)} peer(s))",
            refused,
        )
    offer, offerers = picked
    why_not = choose(offer)
    if why_not:
        raise FetchFailed(why_not, refused)
    try:
        result = await download(node, offer, offerers, directory, timeout)
    except FetchFailed as exc:  # what the offers had refused counts too
        raise FetchFailed(str(exc), _merged(refused, exc.refused)) from None
    result.refused = _merged(refused, result.refused)
    return result


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}
