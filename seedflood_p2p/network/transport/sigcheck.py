"""GossipSub signatures checked in bulk, in worker processes.

Repair pages, a late joiner's sync and a restarted peer's ledger check verify thousands of
rows (`identity.verify_pubsub_signature`, ~50-100 us each on these CPUs: `verify_ed25519`).
An Ed25519 check holds the GIL, so a thread does not free the event loop: it only
shares the interpreter with it, 5 ms at a time. `SignaturePool` sends large batches to
worker processes instead (each a bare `python -c`, importing only this module: no torch,
no hivemind), split across as many as the machine has cores, and checks small ones inline.
`check_many` is the same check for a batch in one process, with the signed bytes encoded
by hand (`signed_bytes`, byte for byte what
go-libp2p-pubsub signs: the tests compare it with the protobuf library's encoding).
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from nacl.bindings import crypto_sign_open

SIGN_PREFIX = b"libp2p-pubsub:"
ED25519_PREFIX = bytes.fromhex("002408011220")  # = core.checks.ED25519_PEER_ID_PREFIX
MIN_POOL_BATCH = 64  # rows: fewer are checked inline (a round trip costs ~1 ms)
MAX_WORKERS = 8
IDLE_SECONDS = 30.0  # workers unused this long are ended (a swarm's daemons keep none)

# (sender peer id, payload, seqno, topic, signature): `verify_pubsub_signature`'s arguments
Item = tuple[bytes, bytes, bytes, str, bytes]


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, value: bytes) -> bytes:
    return bytes([tag]) + _uvarint(len(value)) + value


def signed_bytes(sender: bytes, data: bytes, seqno: bytes, topic: str) -> bytes:
    """What go-libp2p-pubsub signs: the prefix + Message{from, data, seqno, topicIDs} in
    field order (proto2: empty fields are written too)."""
    body = (
        _field(0x0A, sender) + _field(0x12, data) + _field(0x1A, seqno)
        + _field(0x22, topic.encode())
    )  # fmt: skip
    return SIGN_PREFIX + body


def verify_ed25519(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Is `signature` `public_key`'s Ed25519 signature of `message`, by OpenSSL's rule
    (pyca/cryptography, the rule this project has always applied)?

    libsodium (PyNaCl) checks first: 43.9 us a row on this machine against OpenSSL's 87.4
    (bench/results/ed25519.md). Both test the same cofactorless equation against the given
    R bytes and refuse S >= L; libsodium also refuses small-order and non-canonical points.
    So what it accepts, OpenSSL accepts too: its yes is final, and only its no (a forged
    or odd signature: rare, and bounded by the callers' budgets) is asked of OpenSSL, so
    the answer is OpenSSL's for every input (tests/test_ed25519.py: the edge cases)."""
    if len(signature) == 64:  # crypto_sign_open reads the signature off the front
        try:
            crypto_sign_open(signature + message, public_key)
            return True
        except Exception:  # BadSignatureError, or a key length it refuses: OpenSSL decides
            pass
    return _openssl_verify(public_key, signature, message)


def _openssl_verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def check_many(items: Sequence[Item]) -> list[bool]:
    """Each item's signature check (`identity.verify_pubsub_signature`'s answer). Only
    Ed25519 peer ids can be checked offline."""
    out = []
    for sender, data, seqno, topic, signature in items:
        if len(sender) != 38 or not sender.startswith(ED25519_PREFIX):
            out.append(False)
            continue
        out.append(verify_ed25519(sender[6:], signature, signed_bytes(sender, data, seqno, topic)))
    return out


# -- worker processes ----------------------------------------------------------------------
_LEN = struct.Struct(">I")


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def serve(stdin=None, stdout=None) -> None:
    """A worker's loop: read a batch (msgpack list of items), answer one byte per item."""
    import msgpack

    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    while True:
        try:
            (size,) = _LEN.unpack(_read_exact(stdin, 4))
            items = msgpack.unpackb(_read_exact(stdin, size))
        except EOFError:
            return
        answer = bytes(check_many([tuple(item) for item in items]))
        stdout.write(_LEN.pack(len(answer)) + answer)
        stdout.flush()


class _Worker:
    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[3])  # importable however we were
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p
        )}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from seedflood_p2p.network.transport.sigcheck import "
             "serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )  # fmt: skip

    def send(self, items: Sequence[Item]) -> None:
        import msgpack

        payload = msgpack.packb(items)  # tuples pack as arrays: no per-item list copy
        self.proc.stdin.write(_LEN.pack(len(payload)) + payload)
        self.proc.stdin.flush()

    def receive(self, n: int) -> list[bool]:
        (size,) = _LEN.unpack(_read_exact(self.proc.stdout, 4))
        answer = _read_exact(self.proc.stdout, size)
        if size != n:
            raise EOFError
        return [b == 1 for b in answer]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def default_workers() -> int:
    """One worker per core this process may run on (at most MAX_WORKERS)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


class SignaturePool:
    """`check_many` in worker processes, started on the first large batch and kept until
    `close` or until idle for `idle` seconds (~20 MB each). A worker that dies is replaced;
    its share is then checked inline, so a batch always gets its answers. One batch at a
    time (callers from several threads queue)."""

    def __init__(
        self,
        workers: int | None = None,
        min_batch: int = MIN_POOL_BATCH,
        idle: float | None = IDLE_SECONDS,
    ) -> None:
        self.size = workers if workers is not None else default_workers()
        self.min_batch = min_batch
        self.idle = idle
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._used = 0  # batches sent to workers: the idle timer ends them if unchanged
        self.pooled = 0  # rows checked by workers (the tests read it)

    def check(self, items: Sequence[Item]) -> list[bool]:
        """Each item's signature check; blocks until all are answered."""
        if len(items) < self.min_batch or self.size < 1:
            return check_many(items)
        with self._lock:
            while len(self._workers) < self.size:
                self._workers.append(_Worker())
            n = len(self._workers)
            step = -(-len(items) // n)
            chunks = [items[i : i + step] for i in range(0, len(items), step)]
            sent: list[bool] = []
            for worker, chunk in zip(self._workers, chunks, strict=False):
                try:
                    worker.send(chunk)
                    sent.append(True)
                except OSError:
                    sent.append(False)
            out: list[bool] = []
            dead = []
            for i, chunk in enumerate(chunks):
                worker = self._workers[i]
                try:
                    if not sent[i]:
                        raise EOFError
                    out += worker.receive(len(chunk))
                    self.pooled += len(chunk)
                except (EOFError, OSError, struct.error):
                    dead.append(worker)
                    out += check_many(chunk)
            for worker in dead:
                worker.close()
                self._workers.remove(worker)
            self._used += 1
            self._arm_idle()
            return out

    def _arm_idle(self) -> None:
        """(Under the lock.) End the workers if no batch comes within `idle` seconds."""
        if self.idle is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        used = self._used

        def end_if_idle() -> None:
            with self._lock:
                if self._used == used:
                    self._close_workers()

        self._timer = threading.Timer(self.idle, end_if_idle)
        self._timer.daemon = True
        self._timer.start()

    def _close_workers(self) -> None:
        for worker in self._workers:
            worker.close()
        self._workers = []

    @property
    def workers(self) -> int:
        """Worker processes running now."""
        return len(self._workers)

    async def check_async(self, items: Sequence[Item]) -> list[bool]:
        """`check` from the event loop: the waiting thread holds no GIL, the workers no
        share of this interpreter, so gossip goes on meanwhile."""
        if len(items) < self.min_batch:
            return check_many(items)
        return await asyncio.to_thread(self.check, items)

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._close_workers()

    def __enter__(self) -> SignaturePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
