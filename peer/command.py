"""`seedflood peer`: its flags (peer and network settings) and the call into the daemon.

The `seedflood` command line names this module in its command table and imports
it only when `seedflood peer` runs, so the library never imports the daemon.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from seedflood_p2p.apps.lean_imports import defer_scipy_optimize
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import check_unknown, read_toml, settings_of

# Before transformers and hivemind are imported: both load scipy.optimize, which a peer
# never calls (about 37 MiB of RSS per daemon; apps/lean_imports.py).
defer_scipy_optimize()

from peer.daemon import PeerSettings, run_peer  # noqa: E402
from seedflood_p2p.apps.daemon_flags import NODE_FIELDS, add_daemon_flags, daemon_settings  # noqa: E402

PEER_FIELDS = settings_of(PeerSettings)
__all__ = ["NODE_FIELDS", "PEER_FIELDS", "add_arguments", "run", "settings_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file; keys are the flag names")
    add_daemon_flags(parser, PEER_FIELDS, "peer settings")


def settings_from_args(args: argparse.Namespace) -> PeerSettings:
    """The peer's settings from its flags and `--config` TOML file (e.g. the bootstrap list
    as `bootstrap = ["/ip4/.../p2p/A", "/ip4/.../p2p/B"]`; a --bootstrap flag replaces it)."""
    table = read_toml(args)
    check_unknown(table, PEER_FIELDS + NODE_FIELDS, args)
    return daemon_settings(PeerSettings, PEER_FIELDS, args, table)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if not settings.bootstrap:
        raise UserError(
            "no bootstrap address: pass --bootstrap /ip4/HOST/tcp/PORT/p2p/PEER_ID "
            "(the address a bootstrap node prints when it starts)"
        )
    if settings.history_sync == "background" and settings.checkpoint_fetch == "never":
        raise UserError(
            "--history-sync background trusts a fetched checkpoint link: it needs "
            "--checkpoint-fetch auto or always, not never"
        )
    from seedflood_p2p.workload.models import check_device  # imports torch: not for --help

    check_device(settings.device)
    run_peer(settings)
    # The daemon has closed its ledger and host. Freeze what is left so the interpreter's
    # last collections at exit skip it: they took 2.7-8 s per peer exit on 2 cores.
    gc.freeze()
    return 0
