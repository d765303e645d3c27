"""`seedflood keygen`: an identity for a run that asks for identity work.

A run whose manifest sets `extra.identity_work.difficulty = d` admits only peers whose peer
id carries d bits of work bound to the run id (core/extra_settings.py `IdentityWork`):
this command draws Ed25519 keys until one does, showing progress, and writes it as a
libp2p key file (`seedflood peer --data-dir DIR` signs with DIR/identity.key). Each bit
doubles the expected CPU time (bench/results/identity-work.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import MAX_WORK_DIFFICULTY, IdentityWork


def add_keygen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", required=True, help="the run's id (64 hex digits)")
    p.add_argument(
        "--difficulty",
        type=int,
        required=True,
        help="the run's extra.identity_work.difficulty (leading zero bits)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the key file to write (new; e.g. DATA_DIR/identity.key for `seedflood peer`)",
    )


def cmd_keygen(args: argparse.Namespace) -> int:
    """Grind a qualifying key, write it to OUT, print its peer id and the CPU seconds."""
    import base58

    from seedflood_p2p.network.transport.identity import grind_identity, write_identity

    run_id = args.run_id.strip().lower()
    if len(run_id) != 64 or any(c not in "0123456789abcdef" for c in run_id):
        raise UserError("--run-id must be the run's id: 64 hex digits (`seedflood status`)")
    if not 1 <= args.difficulty <= MAX_WORK_DIFFICULTY:
        raise UserError(f"--difficulty must be 1..{MAX_WORK_DIFFICULTY} (leading zero bits)")
    out = Path(args.out).expanduser()
    if out.exists():
        raise UserError(f"{out} exists: move it aside first (it is another identity)")
    if not out.parent.is_dir():
        raise UserError(f"directory {out.parent} for the key does not exist; create it")
    work = IdentityWork(args.difficulty, bytes.fromhex(run_id))
    expected = 1 << args.difficulty
    cpu, wall = time.process_time(), time.monotonic()

    def progress(tries: int) -> None:
        spent = time.process_time() - cpu
        print(
            f"  {tries:,} keys tried ({tries / expected:.1f}x the expected {expected:,}), "
            f"{spent:.1f} CPU s",
            file=sys.stderr,
            flush=True,
        )

    print(
        f"grinding an Ed25519 key with {args.difficulty} bits of identity work for run "
        f"{run_id[:12]} (~{expected:,} keys expected)",
        file=sys.stderr,
        flush=True,
    )
    blob, peer, tries = grind_identity(work, progress)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    write_identity(out, blob)
    print(f"peer id {base58.b58encode(peer).decode()} written to {out}")
    print(f"{tries:,} keys tried, {cpu:.2f} CPU seconds ({wall:.2f} s wall)")
    return 0
