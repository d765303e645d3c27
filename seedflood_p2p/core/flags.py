"""The one loader of settings: dataclass fields as flags, TOML keys and environment variables.

Every field of a settings dataclass (`RunConfig`, the peer's, bootstrap's and network
settings, the simulator's `SimConfig`, the demo's `DemoSettings`) is a flag of the same
name (`--refresh-period`), a key of the same name in a TOML file (`--config`,
`refresh_period = 20`) and an environment variable (`SEEDFLOOD_REFRESH_PERIOD=20`).
Values come from the dataclass defaults, then the command's own defaults, the file, the
environment, the flags, and are checked against the field's type (resolved by
`typing.get_type_hints`, never parsed from text) and bounds: anything wrong is one
`UserError` line, not a traceback. A field's `metadata` may add `help`, `choices` and
`flag` (another flag name). Nested dataclasses (`node`) are loaded on their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from seedflood_p2p.core.config import MAX_ROUND, RunConfig
from seedflood_p2p.core.errors import UserError

ENV_PREFIX = "SEEDFLOOD_"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One settings field as the loader sees it: its name and its resolved type."""

    field: dataclasses.Field
    kind: type  # int, float, str, Path or bool
    is_list: bool
    optional: bool  # None is a valid value

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag", "--" + self.name.replace("_", "-"))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def settings_of(cls: type, exclude: Sequence[str] = ()) -> list[Setting]:
    """The loadable fields of settings dataclass `cls` (nested dataclasses and `exclude` left
    out), with their annotations resolved to types."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if f.name in exclude or dataclasses.is_dataclass(kind):
            continue
        optional = False
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            members = [a for a in typing.get_args(kind) if a is not type(None)]
            optional, kind = len(members) < len(typing.get_args(kind)), members[0]
        is_list = typing.get_origin(kind) is list
        if is_list:
            (kind,) = typing.get_args(kind)
        if kind not in (int, float, str, Path, bool):
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for type {kind!r}")
        out.append(Setting(f, kind, is_list, optional))
    return out


RUN_FIELDS = settings_of(RunConfig, exclude=("extra", "base_sha256"))

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
    "checkpoint_bandwidth": (0, 1e9, "Mbit/s", True),
    "checkpoint_settle": (0, MAX_INT, "a number of rounds", False),
    # network
    "max_ahead": (0, MAX_INT, "a number of rounds", False),
    "max_behind": (0, MAX_INT, "a number of rounds", False),
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


def add_flags(
    parser: argparse.ArgumentParser,
    settings: list[Setting],
    title: str,
    defaults: dict[str, Any] | None = None,
) -> None:
    """One flag per setting; `defaults` are this command's own, shown in --help. Flags
    default to None: `settings_values` fills in what was not given."""
    group = parser.add_argument_group(title)
    for s in settings:
        default = (defaults or {}).get(s.name, s.default)
        text = s.field.metadata.get("help", "")
        text = f"{text} (default: {default})" if text else f"default: {default}"
        if s.kind is bool:
            action, kind = argparse.BooleanOptionalAction, None
        elif s.is_list:
            action, kind, text = "append", s.kind, "repeatable"
        else:
            action, kind = "store", s.kind
        extra = {"type": kind} if kind is not None else {}
        if "choices" in s.field.metadata:
            extra["choices"] = s.field.metadata["choices"]
        group.add_argument(
            s.flag, dest=s.name, action=action, default=None, help=text.replace("%", "%%"), **extra
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
    settings: list[Setting],
    table: dict[str, Any],
    defaults: dict[str, Any],
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Values for `settings` from `defaults`, then the TOML `table`, the environment
    (`SEEDFLOOD_NAME`; default os.environ), then flags; type- and range-checked."""
    env = os.environ if env is None else env
    values = dict(defaults)
    by_name = {s.name: s for s in settings}
    values.update({k: v for k, v in table.items() if k in by_name})
    for s in settings:
        if s.env in env:
            values[s.name] = _from_env(s, env[s.env])
        value = getattr(args, s.name, None)
        if value is not None:
            values[s.name] = value
    for name, value in values.items():
        s = by_name[name]
        if not _has_type(s, value):
            expected = f"a list of {s.kind.__name__}" if s.is_list else s.kind.__name__
            raise UserError(f"setting '{name}' must be {expected}, got {_short(value)}")
        if name in SETTING_RANGES and value is not None:
            _check_range(name, value)
        if s.kind is Path and value is not None:
            values[name] = [Path(v) for v in value] if s.is_list else Path(value)
    return values


def _has_type(s: Setting, value: Any) -> bool:
    if value is None:
        return s.optional
    if s.is_list and not isinstance(value, list):
        return False
    for v in value if s.is_list else [value]:
        if isinstance(v, bool) and s.kind is not bool:
            return False  # True is an int to Python, not to a settings file
        ok = {float: (int, float), Path: (str, Path)}.get(s.kind, s.kind)
        if not isinstance(v, ok):
            return False
    return True


def _from_env(s: Setting, text: str) -> Any:
    """An environment variable's text as the setting's type; lists are comma-separated."""
    try:
        if s.kind is bool:
            words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
            return words[text.strip().lower()]
        if s.is_list:
            return [s.kind(item) for item in text.split(",") if item]
        return s.kind(text)
    except (KeyError, ValueError):
        raise UserError(
            f"environment variable {s.env} must be {s.kind.__name__}, got {_short(text)}"
        ) from None


def to_toml(config: RunConfig) -> str:
    """The run settings as a TOML file `--config` reads back to the same `RunConfig`: how a
    program hands run settings to the processes it starts, instead of rebuilding flags."""
    lines = []
    for s in RUN_FIELDS:
        # JSON's strings, integers and finite floats are valid TOML values; bools are lower
        # case in both. RunConfig refuses non-finite floats.
        lines.append(f"{s.name} = {json.dumps(getattr(config, s.name))}")
    if config.extra:  # e.g. the run's audit settings (extra.audit)
        lines.append(f"extra = {_toml_inline(config.extra)}")
    return "\n".join(lines) + "\n"


def _toml_inline(value: Any) -> str:
    """A JSON-shaped value (RunConfig.extra) as a TOML inline value: tables with quoted
    keys, arrays, and JSON's scalars (valid TOML as they are)."""
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{json.dumps(k)} = {_toml_inline(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_inline(v) for v in value) + "]"
    return json.dumps(value)


def check_unknown(table: dict[str, Any], fields: list[Setting], args: argparse.Namespace) -> None:
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
    extra_fields: Sequence[Setting] = (),
) -> RunConfig:
    """Settings from `RunConfig` defaults, then `defaults`, the TOML file, flags; validated."""
    table = read_toml(args)
    extra = table.pop("extra", {})  # free-form run settings (a table), e.g. extra.audit
    check_unknown(table, RUN_FIELDS + list(extra_fields), args)
    if not isinstance(extra, dict):
        raise UserError(f"config file {args.config}: extra must be a table")
    return RunConfig(**settings_values(args, RUN_FIELDS, table, defaults or {}), extra=extra)


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
