"""Run assets from peers: the organiser's model directory, data file and activation basis
(a run artifact, see algorithm/basis.py), fetched by digest.

A run may name a model directory or data file of the organiser's machine; a joiner never
opens such a path (workload/tasks.py:run_sources). It asks the peers it is connected to
for their listing of the asset (`seedflood.asset_offer`): file names, sizes, SHA-256 of
each file and of each 1 MiB chunk. Identical listings are grouped and tried most offered
first; the files are fetched chunk by chunk from all of a listing's offerers at once
(`seedflood.asset_chunk`), each chunk checked against the listing as it arrives, each file
as a whole at the end, and partial files are kept (`NAME.part`) so a restarted joiner
fetches only what it lacks. The caller's `verify` then checks the result against the
run's own digests (base_sha256, dataset_sha256: they are part of the run id), and a
listing that fails is deleted and the next one tried.

Only data travels: safetensors, JSON and tokenizer files of a model directory (no
pickles, no code: nothing fetched is ever executed), a .jsonl/.csv data file, a basis
.safetensors file; plain file
names only (no directories, no "..", no hidden files). Sizes are bounded (MAX_ASSET_BYTES,
MAX_ASSET_FILES) and serving is rate-limited per requester like checkpoint chunks. No
torch here (network layer).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import msgpack

from seedflood_p2p.network.peers.reputation import PeerBuckets
from seedflood_p2p.network.transfer.chunks import fetch_chunks, file_sha256
from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes, serve_bytes
from seedflood_p2p.protocol.checkpoint import CHECKPOINT_SERVE_BURST, CHECKPOINT_SERVE_RATE

log = logging.getLogger("seedflood.assets")

ASSET_KINDS = ("model", "dataset", "basis")
ASSET_CHUNK_BYTES = 1 << 20
MAX_ASSET_BYTES = 16 << 30  # a 4B-parameter fp32 model; its chunk hashes take 512 KiB
MAX_ASSET_FILES = 64
MAX_LISTING_BYTES = (1 << 20) - 4096
RPC_LIMIT = (1 << 20) + 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_SUFFIXES = (".safetensors", ".json", ".txt", ".model")  # tokenizer.model, merges.txt
DATASET_SUFFIXES = (".jsonl", ".csv")
FILE_SUFFIXES = {"dataset": DATASET_SUFFIXES, "basis": (".safetensors",)}  # one-file kinds

Listing = list[tuple[str, int, bytes, list[bytes]]]  # (name, size, sha256, chunk sha256s)


class AssetError(Exception):
    """No asset could be fetched or served; the message says why."""


def allowed_name(kind: str, name: str) -> bool:
    """A file of this kind that may travel: a plain name with a data suffix."""
    suffixes = MODEL_SUFFIXES if kind == "model" else FILE_SUFFIXES.get(kind, ())
    return (
        _NAME.fullmatch(name) is not None and ".." not in name and name.lower().endswith(suffixes)
    )


def asset_files(kind: str, path: Path) -> list[Path]:
    """The files of an asset that travel: a data file itself, or the allowed files at the
    top of a model directory (others, such as pickled weights or code, never do)."""
    path = Path(path)
    if kind in FILE_SUFFIXES:
        if not (path.is_file() and allowed_name(kind, path.name)):
            wanted = "/".join(FILE_SUFFIXES[kind])
            raise AssetError(f"{path} is not a {wanted} file with a plain name")
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and allowed_name(kind, p.name))
    if not any(p.suffix == ".safetensors" for p in files):
        raise AssetError(f"{path} holds no .safetensors weights: save it with save_pretrained")
    return files


def make_listing(kind: str, path: Path) -> Listing:
    listing: Listing = []
    total = 0
    for file in asset_files(kind, path):
        whole, chunks, size = hashlib.sha256(), [], 0
        with open(file, "rb") as f:
            while block := f.read(ASSET_CHUNK_BYTES):
                whole.update(block)
                chunks.append(hashlib.sha256(block).digest())
                size += len(block)
        listing.append((file.name, size, whole.digest(), chunks))
        total += size
    if total > MAX_ASSET_BYTES or len(listing) > MAX_ASSET_FILES:
        raise AssetError(f"{path}: {total} bytes in {len(listing)} files is too large to serve")
    return listing


def encode_listing(listing: Listing) -> bytes:
    return msgpack.packb([[n, s, h, c] for n, s, h, c in listing])


def decode_listing(kind: str, data: bytes) -> Listing | None:
    """A listing from a peer, or None when it is malformed or breaks a bound."""
    if not data or len(data) > MAX_LISTING_BYTES:
        return None
    try:
        raw = msgpack.unpackb(data)
        listing: Listing = []
        total, names = 0, set()
        for name, size, sha, chunks in raw:
            ok = (
                isinstance(name, str)
                and allowed_name(kind, name)
                and name not in names
                and isinstance(size, int)
                and 0 <= size <= MAX_ASSET_BYTES
                and isinstance(sha, bytes)
                and len(sha) == 32
                and isinstance(chunks, list)
                and len(chunks) == -(-size // ASSET_CHUNK_BYTES)
                and all(isinstance(c, bytes) and len(c) == 32 for c in chunks)
            )
            if not ok:
                return None
            names.add(name)
            total += size
            listing.append((name, size, sha, chunks))
    except Exception:  # msgpack's errors, wrong shapes
        return None
    if not listing or total > MAX_ASSET_BYTES or len(listing) > MAX_ASSET_FILES:
        return None
    if kind in FILE_SUFFIXES and len(listing) != 1:
        return None
    return listing


class AssetServer:
    """Serves this peer's copies of the run's assets (`publish`) to joiners."""

    def __init__(
        self, p2p, run_id: str, may_serve: Callable[[bytes], bool] = lambda peer: True
    ) -> None:
        self.p2p, self.run_id, self.may_serve = p2p, run_id, may_serve
        self._assets: dict[str, tuple[bytes, dict[str, tuple[Path, int]]]] = {}
        self._served = PeerBuckets(CHECKPOINT_SERVE_RATE, CHECKPOINT_SERVE_BURST)
        self.chunks_served = 0

    async def start(self) -> None:
        await serve_bytes(self.p2p, "seedflood.asset_offer", self._offer)
        await serve_bytes(self.p2p, "seedflood.asset_chunk", self._chunk, max_response=RPC_LIMIT)

    async def publish(self, kind: str, path: Path) -> None:
        listing = await asyncio.to_thread(make_listing, kind, path)
        files = {
            name: (Path(path) / name if kind == "model" else Path(path), size)
            for name, size, _, _ in listing
        }
        self._assets[kind] = (encode_listing(listing), files)
        log.info("serving the run's %s (%d file(s)) to joiners", kind, len(files))

    def _request(self, peer, request: bytes) -> list | None:
        try:
            fields = msgpack.unpackb(request)
        except Exception:
            return None
        if not (isinstance(fields, list) and fields and fields[0] == self.run_id):
            return None
        if not self.may_serve(peer.to_bytes()):
            return None
        return fields

    async def _offer(self, peer, request: bytes) -> bytes:
        fields = self._request(peer, request)
        if fields is None or len(fields) != 2 or fields[1] not in self._assets:
            return b""
        return self._assets[fields[1]][0]

    async def _chunk(self, peer, request: bytes) -> bytes:
        fields = self._request(peer, request)
        if fields is None or len(fields) != 4 or fields[1] not in self._assets:
            return b""
        _, kind, name, index = fields
        entry = self._assets[kind][1].get(name) if isinstance(name, str) else None
        if entry is None or not isinstance(index, int) or index < 0:
            return b""
        path, size = entry
        start = index * ASSET_CHUNK_BYTES
        if start >= size:
            return b""
        length = min(ASSET_CHUNK_BYTES, size - start)
        if not self._served.allow(peer.to_bytes(), length):
            return b""
        self.chunks_served += 1
        with open(path, "rb") as f:
            return os.pread(f.fileno(), length, start)


async def fetch_asset(
    p2p,
    peers: list,
    run_id: str,
    kind: str,
    root: Path,
    verify: Callable[[Path], str | None],
    timeout: float = 30.0,
) -> Path:
    """Fetch the run's `kind` asset from `peers` into a folder under `root`; returns the
    data file or the model directory. `verify(path)` (run in a thread) returns None when
    the result holds what the run expects, else why not: that listing is deleted and the
    next one tried. AssetError when none gives the run's asset."""

    async def ask(peer):
        try:
            data = await call_bytes(
                p2p, peer, "seedflood.asset_offer", msgpack.packb([run_id, kind]), timeout
            )
        except RemoteCallError as exc:
            log.debug("asset offer from %s: %s", peer, exc)
            return peer, None
        return peer, decode_listing(kind, data)

    groups: dict[bytes, tuple[Listing, list]] = {}
    for peer, listing in await asyncio.gather(*(ask(p) for p in peers)):
        if listing is not None:
            key = hashlib.sha256(encode_listing(listing)).digest()
            groups.setdefault(key, (listing, []))[1].append(peer)
    if not groups:
        raise AssetError(
            f"no peer reached ({len(peers)}) serves the run's {kind}: the organiser's "
            "bootstrap node or a peer that has it must be running"
        )
    why = []
    for key, (listing, offerers) in sorted(groups.items(), key=lambda g: -len(g[1][1])):
        folder = Path(root) / f"{kind}-{key.hex()[:16]}"
        try:
            await _download(p2p, run_id, kind, listing, offerers, folder, timeout)
        except AssetError as exc:
            why.append(str(exc))
            continue
        target = folder / listing[0][0] if kind in FILE_SUFFIXES else folder
        problem = await asyncio.to_thread(verify, target)
        if problem is None:
            log.info(
                "fetched the run's %s from %d peer(s): %d file(s), %d bytes",
                kind,
                len(offerers),
                len(listing),
                sum(s for _, s, _, _ in listing),
            )
            return target
        why.append(f"a listing from {len(offerers)} peer(s) gave other contents ({problem})")
        shutil.rmtree(folder, ignore_errors=True)
    raise AssetError(f"could not fetch the run's {kind}: {'; '.join(why)[:600]}")


async def _download(
    p2p, run_id: str, kind: str, listing: Listing, peers: list, folder: Path, timeout: float
) -> None:
    """All files of `listing` into `folder`, chunks from `peers` at once, resumable."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, size, sha, chunks in listing:
        final = folder / name
        if final.is_file() and final.stat().st_size == size:
            if await asyncio.to_thread(file_sha256, final) == sha:
                continue
        part = folder / (name + ".part")
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)

        async def get(peer, index: int, name=name) -> bytes:
            request = msgpack.packb([run_id, kind, name, index])
            return await call_bytes(
                p2p, peer, "seedflood.asset_chunk", request, timeout, max_response=RPC_LIMIT
            )

        def on_failure(peer, index: int, exc: Exception, name=name) -> None:
            log.info("asset chunk %s/%d from %s failed: %s", name, index, peer, exc)

        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            _, missing, _ = await fetch_chunks(
                fd, size, ASSET_CHUNK_BYTES, chunks, peers, get, on_failure, "asset chunk"
            )
            if missing:
                raise AssetError(f"{missing} chunk(s) of {name} could not be fetched")
            os.fsync(fd)
        finally:
            os.close(fd)
        if await asyncio.to_thread(file_sha256, part) != sha:
            part.unlink()
            raise AssetError(f"{name} does not hash as its listing says")
        part.replace(final)
