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
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError

RUN_FIELDS = [f for f in dataclasses.fields(RunConfig) if f.name not in ("extra", "base_sha256")]
_SCALARS = {"int": int, "float": float, "str": str, "Path": Path}


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
        table = tomllib.loads(Path(args.config).read_text())
    except FileNotFoundError:
        raise UserError(f"config file {args.config} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {args.config} is not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"cannot read config file {args.config} ({exc}): pass a TOML file"
        ) from None
    return {key.replace("-", "_"): value for key, value in table.items()}


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
            raise UserError(f"setting '{name}' must be {expected}, got {value!r}")
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
