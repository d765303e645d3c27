"""`seedflood bootstrap`: its flags (run, bootstrap, network settings) and the call into the node.

The `seedflood` command line names this module in its command table and imports
it only when `seedflood bootstrap` runs, so the library never imports the node.
"""

from __future__ import annotations

import argparse

from bootstrap.node import BootstrapSettings, run_bootstrap
from seedflood_p2p.core.flags import (
    add_flags,
    add_run_flags,
    read_toml,
    run_config_from_args,
    settings_of,
    settings_values,
)
from seedflood_p2p.network.settings import NodeSettings

BOOTSTRAP_FIELDS = settings_of(BootstrapSettings)
NODE_FIELDS = settings_of(NodeSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser)
    add_flags(parser, BOOTSTRAP_FIELDS, "bootstrap settings")
    add_flags(parser, NODE_FIELDS, "network settings")


def run(args: argparse.Namespace) -> int:
    table = read_toml(args)
    config = run_config_from_args(args, extra_fields=BOOTSTRAP_FIELDS + NODE_FIELDS)
    settings = BootstrapSettings(
        **settings_values(args, BOOTSTRAP_FIELDS, table, {}),
        node=NodeSettings(**settings_values(args, NODE_FIELDS, table, {})),
    )
    return run_bootstrap(settings, config)
