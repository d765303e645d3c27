"""The flags both daemons share (`seedflood peer`, `seedflood bootstrap`): their own
settings dataclass plus the network settings (`NodeSettings`, nested as its `node`), from
defaults, the `--config` TOML file, `SEEDFLOOD_*` variables and flags, in that order."""

from __future__ import annotations

import argparse
from typing import Any

from seedflood_p2p.core.flags import Setting, add_flags, settings_of, settings_values
from seedflood_p2p.network.settings import NodeSettings

NODE_FIELDS = settings_of(NodeSettings)


def add_daemon_flags(parser: argparse.ArgumentParser, fields: list[Setting], title: str) -> None:
    """The daemon's own flags (`fields`, under `title`), then the network settings'."""
    add_flags(parser, fields, title)
    add_flags(parser, NODE_FIELDS, "network settings")


def daemon_settings(
    cls: type, fields: list[Setting], args: argparse.Namespace, table: dict[str, Any]
) -> Any:
    """`cls` (a daemon's settings dataclass with a `node: NodeSettings` field) from the
    flags in `args` and the TOML `table`."""
    return cls(
        **settings_values(args, fields, table, {}),
        node=NodeSettings(**settings_values(args, NODE_FIELDS, table, {})),
    )
