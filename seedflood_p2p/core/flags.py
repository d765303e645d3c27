"""Settings dataclasses as command-line flags and TOML keys.

Every field of a settings dataclass (`RunConfig`, the daemons' settings) is a flag
of the same name (`--refresh-period`) and a key of the same name in a TOML file
(`--config`, `refresh_period = 20`). Values come from the defaults, then the file,
then the flags, and are type-checked against the field's annotation: a wrong type
is one `UserError` line, not a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seedflood_p2p.core.config import MAX_ROUND, RunConfig
from seedflood_p2p.core.errors import UserError

RUN_FIELDS = [f for f in dataclasses.fields(RunConfig) if f.name not in ("extra", "base_sha256")]
_SCALARS = {"int": int, "float": float, "str": str, "Path": Path}

MAX_INT = MAX_ROUND  # no integer setting means anything beyond a round number
MAX_SECONDS = 1e9  # ~31 years: beyond this, sleeps and deadlines overflow C conversions
# Bounds of the daemons' numeric settings (PeerSettings, NodeSettings, BootstrapSettings), by
# name: (low, high, what it is, low excluded); NaN and infinities are refused. Run settings
# are checked by RunConfig itself. tests/test_cli.py checks that every numeric daemon
# setting is listed here.
SETTING_RANGES: dict[str, tuple[float, float, str, bool]] = {
    # peer
    "until_round": (0, MAX_INT, "a round (0: the run's total_rounds, or never)", False),
    "max_staleness": (0, MAX_INT, "a number of rounds", False),
    "round_deadline": (0, MAX_SECONDS, "seconds", False),
    "liveness_timeout": (0, MAX_SECONDS, "seconds", False),
    "min_peers": (0, 1 << 20, "a number of peers", False),
    "startup_wait": (0, MAX_SECONDS, "seconds", False),
    "round_interval": (0, MAX_SECONDS, "seconds", False),
    "linger": (0, MAX_SECONDS, "seconds", False),
    "linger_max": (0, MAX_SECONDS, "seconds", False),
    "eval_every": (0, MAX_INT, "a number of rounds (0: never)", False),
    "eval_examples": (1, 1 << 30, "a number of examples", False),
    "metrics_port": (0, 65535, "a TCP port (0: any free port)", False),
    "threads": (0, 4096, "a number of threads (0: torch's default)", False),
    # network
    "max_ahead": (0, MAX_INT, "a number of rounds", False),
    "repair_interval": (0, MAX_SECONDS, "seconds", True),
    "call_timeout": (0, MAX_SECONDS, "seconds", True),
    "drop_incoming": (0, 1, "a fraction", False),
    "publish_rate": (0, 1e9, "messages per second", True),
    "daemon_start_timeout": (0, MAX_SECONDS, "seconds", True),
    "redial_min": (0, MAX_SECONDS, "seconds", True),
    "redial_max": (0, MAX_SECONDS, "seconds", True),
    "summary_interval": (0, MAX_SECONDS, "seconds", True),
    "island_after": (0, MAX_SECONDS, "seconds", False),
    "connect_retries": (0, 1 << 20, "a number of attempts (0: once)", False),
}


def _field_kind(f: dataclasses.Field) -> tuple[str, bool]:
    """('int' | 'float' | 'str' | 'Path' | 'bool', is_list) of a settings field."""
    text = str(f.type).replace(" | None", "")
    if text.startswith("list["):
        return text[5:-1], True
    return text, False


def add_flags(
    parser: argparse.ArgumentParser,
    fields: list[dataclasses.Field],
    title: str,
    defaults: dict[str, Any] | None = None,
) -> None:
    """One flag per settings field; `defaults` are this command's own, shown in --help."""
    group = parser.add_argument_group(title)
    for f in fields:
        kind, is_list = _field_kind(f)
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else "[]"
        default = (defaults or {}).get(f.name, default)
        if kind == "bool":
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"default: {default}",
            )
        elif is_list:
            group.add_argument(
                flag,
                dest=f.name,
                action="append",
                type=_SCALARS[kind],
                default=None,
                help="repeatable",
            )
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=_SCALARS.get(kind, str),
                default=None,
                help=f"default: {default}",
            )


def add_run_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """`--config FILE` and one flag per `RunConfig` field."""
    parser.add_argument("--config", type=Path, help="TOML file; keys are the flag names")
    add_flags(parser, RUN_FIELDS, "run settings", defaults)


def read_toml(args: argparse.Namespace) -> dict[str, Any]:
    """The `--config` file's table with keys in field spelling (`refresh_period`); {} if none."""
    if getattr(args, "config", None) is None:
        return {}
    try:
        text = Path(args.config).read_text()
    except FileNotFoundError:
        raise UserError(f"config file {args.config} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"cannot read config file {args.config} ({exc}): pass a TOML file"
        ) from None
    return parse_toml(text, args.config)


def parse_toml(text: str, source: object) -> dict[str, Any]:
    """A TOML file's table, keys in field spelling; anything wrong is one UserError line."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {source} is not valid TOML: {exc}") from None
    except RecursionError:
        raise UserError(
            f"config file {source} nests arrays or tables too deeply; flatten it"
        ) from None
    except ValueError:  # tomllib lets int()'s limit of 4300 digits through
        raise UserError(
            f"config file {source} holds a number too long to read; fix the value"
        ) from None
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in out:
            raise UserError(f"config file {source} sets '{name}' twice (as - and _ spellings)")
        out[name] = value
    return out


def settings_values(
    args: argparse.Namespace,
    fields: list[dataclasses.Field],
    table: dict[str, Any],
    defaults: dict[str, Any],
) -> dict[str, Any]:
    """Values for `fields` from `defaults`, then the TOML `table`, then flags; type-checked."""
    values = dict(defaults)
    names = {f.name: f for f in fields}
    values.update({k: v for k, v in table.items() if k in names})
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    for name, value in values.items():
        kind, is_list = _field_kind(names[name])
        items = value if is_list and isinstance(value, list) else [value]
        ok = (not is_list or isinstance(value, list)) and all(
            {
                "int": isinstance(v, int) and not isinstance(v, bool),
                "float": isinstance(v, (int, float)) and not isinstance(v, bool),
                "bool": isinstance(v, bool),
                "str": isinstance(v, str),
                "Path": isinstance(v, (str, Path)),
            }.get(kind, True)
            for v in items
        )
        if not ok:
            expected = f"a list of {kind}" if is_list else kind
            raise UserError(f"setting '{name}' must be {expected}, got {_short(value)}")
        if name in SETTING_RANGES and value is not None:
            _check_range(name, value)
        if kind == "Path":
            values[name] = [Path(v) for v in value] if is_list else Path(value)
    return values


def check_unknown(
    table: dict[str, Any], fields: list[dataclasses.Field], args: argparse.Namespace
) -> None:
    """Refuse a TOML key that is no field of `fields` (a typo must not be ignored)."""
    known = {f.name for f in fields}
    unknown = sorted(set(table) - known)
    if unknown:
        raise UserError(
            f"config file {args.config}: unknown setting(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )


def run_config_from_args(
    args: argparse.Namespace,
    defaults: dict[str, Any] | None = None,
    extra_fields: Sequence[dataclasses.Field] = (),
) -> RunConfig:
    """Settings from `RunConfig` defaults, then `defaults`, the TOML file, flags; validated."""
    table = read_toml(args)
    check_unknown(table, RUN_FIELDS + list(extra_fields), args)
    return RunConfig(**settings_values(args, RUN_FIELDS, table, defaults or {}))


def _check_range(name: str, value: int | float) -> None:
    """A daemon setting within its bounds (SETTING_RANGES): a number, finite."""
    low, high, what, open_low = SETTING_RANGES[name]
    try:
        ok = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    except OverflowError:  # an int beyond float's range
        ok = False
    if not ok:
        bounds = f"above {_num(low)} and at most" if open_low else f"from {_num(low)} to"
        flag = "--" + name.replace("_", "-")
        raise UserError(
            f"setting '{name}' must be {what}, {bounds} {_num(high)} (got {_short(value)}): "
            f"fix {flag} or its line in the config file"
        )


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _short(value: object, limit: int = 60) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits
        text = "<a huge integer>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
