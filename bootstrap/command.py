"""`seedflood bootstrap`: its flags (run, bootstrap, network settings) and the call into the node.

The `seedflood` command line names this module in its command table and imports
it only when `seedflood bootstrap` runs, so the library never imports the node.
"""

from __future__ import annotations

import argparse

from bootstrap.node import BootstrapSettings, run_bootstrap
from seedflood_p2p.apps.daemon_flags import NODE_FIELDS, add_daemon_flags, daemon_settings
from seedflood_p2p.core.flags import add_run_flags, read_toml, run_config_from_args, settings_of

BOOTSTRAP_FIELDS = settings_of(BootstrapSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser)
    add_daemon_flags(parser, BOOTSTRAP_FIELDS, "bootstrap settings")


def run(args: argparse.Namespace) -> int:
    table = read_toml(args)
    config = run_config_from_args(args, extra_fields=BOOTSTRAP_FIELDS + NODE_FIELDS)
    settings = daemon_settings(BootstrapSettings, BOOTSTRAP_FIELDS, args, table)
    return run_bootstrap(settings, config)
