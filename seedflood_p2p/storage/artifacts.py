"""Run artifacts on disk: files named by the SHA-256 of their bytes, written crash-safe.

The ledger names artifacts (a basis schedule: which digest shapes which epochs, in its
`meta` table); this store holds their bytes in `<ledger file>.artifacts/`. Reading checks
the digest again, so a file damaged on disk is refused, never applied.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from seedflood_p2p.core.errors import UserError

SCHEDULE_KEY = "basis_schedule"  # ledger meta: JSON [[first epoch, sha256], ...]


class ArtifactStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @classmethod
    def beside(cls, ledger_path: str | Path) -> ArtifactStore:
        return cls(Path(str(ledger_path) + ".artifacts"))

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise UserError(f"artifact name {sha256[:80]!r} is not a SHA-256 digest")
        return self.directory / f"{sha256}.safetensors"

    def put(self, body: bytes) -> str:
        digest = hashlib.sha256(body).hexdigest()
        target = self.path(digest)
        if not target.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        return digest

    def get(self, sha256: str) -> bytes:
        target = self.path(sha256)
        if not target.exists():
            raise UserError(
                f"run artifact {sha256[:16]} is missing from {self.directory}: copy it from "
                "the run's organiser or a peer (files are named by their SHA-256)"
            )
        body = target.read_bytes()
        if hashlib.sha256(body).hexdigest() != sha256:
            raise UserError(f"run artifact {target} does not match its name: it is damaged")
        return body

    def has(self, sha256: str) -> bool:
        return self.path(sha256).exists()


def read_schedule(ledger) -> list[tuple[int, str]]:
    """The ledger's basis schedule ([] when it has none)."""
    text = ledger.get_meta(SCHEDULE_KEY)
    if not text:
        return []
    try:
        raw = json.loads(text)
        return [(int(e), str(s)) for e, s in raw]
    except (ValueError, TypeError) as exc:
        raise UserError(f"the ledger's {SCHEDULE_KEY} is corrupt ({exc})") from None


def write_schedule(ledger, entries: list[tuple[int, str]]) -> None:
    ledger.set_meta(SCHEDULE_KEY, json.dumps(sorted([int(e), s] for e, s in entries)))


def save_basis(ledger, first_epoch: int, artifact) -> None:
    """Store a basis artifact's bytes (`.body`, named by `.sha256`), then name it in the
    ledger's schedule from `first_epoch` on; in that order, so a ledger never names bytes
    that are not on disk."""
    ArtifactStore.beside(ledger.path).put(artifact.body)
    write_schedule(ledger, [*read_schedule(ledger), (first_epoch, artifact.sha256)])
