"""A file fetched by digest, chunk by chunk, from several peers at once, resumable.

The one download loop behind run assets (network/transfer/assets.py) and checkpoints
(network/transfer/checkpoints.py). The caller opens the partial file (`NAME.part`, sized to the
file) and says how one chunk is asked of one peer; `fetch_chunks` hands the missing
chunks out from one queue, so a fast peer serves more. Every chunk is checked as it
arrives (`protocol.checkpoint.check_chunk_bytes`): its length (`chunk_bytes`, the last one shorter)
and its SHA-256 against the list the offer or listing named. A chunk that fails
(`Rejected("bad_reply")`) or a call that fails (`RemoteCallError`) goes back in the
queue and that peer is not asked again during this download; the caller's `on_failure`
counts and logs it. Chunks of a partial file that already hash right are kept
(`present_chunks`); the caller checks the whole file's SHA-256 at the end
(`file_sha256`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from seedflood_p2p.network.transport.rpc import RemoteCallError
from seedflood_p2p.protocol.checkpoint import check_chunk_bytes
from seedflood_p2p.protocol.framing import Rejected


def chunk_span(index: int, size: int, chunk_bytes: int) -> tuple[int, int]:
    """(start, end) of chunk `index` of a `size`-byte file."""
    start = index * chunk_bytes
    return start, min(start + chunk_bytes, size)


def present_chunks(fd: int, size: int, chunk_bytes: int, hashes: list[bytes]) -> set[int]:
    """Chunks of a partial file that already hash right (a resumed download)."""
    present = set()
    for index, expected in enumerate(hashes):
        start, end = chunk_span(index, size, chunk_bytes)
        data = os.pread(fd, end - start, start)
        if len(data) == end - start and hashlib.sha256(data).digest() == expected:
            present.add(index)
    return present


async def fetch_chunks(
    fd: int,
    size: int,
    chunk_bytes: int,
    hashes: list[bytes],
    peers: list,
    get: Callable[[Any, int], Awaitable[bytes]],
    on_failure: Callable[[Any, int, Exception], None],
    what: str,
) -> tuple[set[int], int, int]:
    """Fetch every chunk not yet present into `fd` from `peers` at once; `get(peer, index)`
    asks one peer for one chunk (it may raise RemoteCallError or Rejected). Returns (the
    chunks present before, the chunks still missing, the bytes fetched)."""
    have = await asyncio.to_thread(present_chunks, fd, size, chunk_bytes, hashes)
    missing = deque(i for i in range(len(hashes)) if i not in have)
    healthy = list(peers)
    fetched = 0

    async def worker(peer) -> None:
        nonlocal fetched
        while missing and peer in healthy:
            index = missing.popleft()
            try:
                data = await get(peer, index)
                check_chunk_bytes(data, index, size, chunk_bytes, hashes[index], what)
            except (Rejected, RemoteCallError) as exc:
                missing.append(index)
                healthy.remove(peer)  # a bad or missing chunk: not asked again
                on_failure(peer, index, exc)
                return
            os.pwrite(fd, data, index * chunk_bytes)
            fetched += len(data)

    while missing and healthy:  # a chunk put back after the others had finished
        await asyncio.gather(*(worker(p) for p in list(healthy)))
    return have, len(missing), fetched


def file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.digest()
