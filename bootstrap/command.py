"""`seedflood bootstrap`: its flags (run, bootstrap, network settings) and the call into the node.

The `seedflood` command line names this module in its command table and imports
it only when `seedflood bootstrap` runs, so the library never imports the node.
"""

from __future__ import annotations

import argparse
import gc

from seedflood_p2p.apps.lean_imports import defer_scipy_optimize
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import add_run_flags, read_toml, run_config_from_args, settings_of

# Before transformers and hivemind are imported: both load scipy.optimize, which a bootstrap node
# never calls (about 37 MiB of RSS per daemon; apps/lean_imports.py).
defer_scipy_optimize()

from bootstrap.node import BootstrapSettings, run_bootstrap  # noqa: E402
from seedflood_p2p.apps.daemon_flags import NODE_FIELDS, add_daemon_flags, daemon_settings  # noqa: E402

BOOTSTRAP_FIELDS = settings_of(BootstrapSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser)
    parser.add_argument(
        "--founders",
        default=None,
        metavar="ID[,ID...]",
        help="the run creator's own peers (base58 peer ids, `seedflood id` prints one): "
        "every other identity is on probation until they vouch for it (docs/SYBIL.md); "
        "the manifest's extra.probation.founders",
    )
    add_daemon_flags(parser, BOOTSTRAP_FIELDS, "bootstrap settings")


def with_founders(config: RunConfig, founders: str | None) -> RunConfig:
    """`config` with `--founders` written into its manifest (`extra.probation.founders`).
    A bad id, or founders given both here and in the config file, is one UserError line."""
    if founders is None:
        return config
    ids = [f.strip() for f in founders.split(",") if f.strip()]
    if not ids:
        raise UserError("--founders is empty: pass one or more peer ids, comma-separated")
    return config.with_founders(ids)  # checked as every RunConfig is, when it is built


def run(args: argparse.Namespace) -> int:
    table = read_toml(args)
    config = run_config_from_args(args, extra_fields=BOOTSTRAP_FIELDS + NODE_FIELDS)
    config = with_founders(config, args.founders)
    settings = daemon_settings(BootstrapSettings, BOOTSTRAP_FIELDS, args, table)
    code = run_bootstrap(settings, config)
    gc.freeze()  # as a peer's exit (peer/command.py): skip the last collections at exit
    return code
