"""The one loader of settings: dataclass fields as flags, TOML keys and environment variables.

Every field of a settings dataclass (`RunConfig`, the peer's, bootstrap's and network
settings, `SimConfig`, `DemoSettings`) is a flag (`--refresh-period`), a key of a TOML file
(`--config`; `refresh_period = 20`) and an environment variable (`SEEDFLOOD_REFRESH_PERIOD`).
A field's `metadata` may add `help`, `choices`, `bounds` (`bounded`) and `flag` (another
flag name); nested dataclasses (`node`) are loaded on their own. argparse declares the
flags; pydantic-settings loads and checks the values, through a model built from the
dataclass (`_model`); its errors become one `UserError` line (`_one_line`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import tomllib
import types
import typing
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from annotated_types import Ge, Gt, Le
from pydantic import Field, Strict
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    SettingsConfigDict,
)

from seedflood_p2p.core.checks import short_repr
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
    def bounds(self) -> Bounds | None:
        return self.field.metadata.get("bounds")

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


RUN_FIELDS = settings_of(
    RunConfig, exclude=("extra", "base_sha256", "dataset_sha256", "basis_sha256")
)

MAX_INT = MAX_ROUND  # no integer setting means anything beyond a round number
MAX_SECONDS = 1e9  # ~31 years: beyond this, sleeps and deadlines overflow C conversions


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Where a numeric setting's value may lie: `low` to `high` (above `low` if `open_low`);
    `what` says what the number is, for the error line. NaN and infinities are refused."""

    low: float
    high: float
    what: str
    open_low: bool = False


def bounded(default: Any, low: float, high: float, what: str, *, open_low: bool = False) -> Any:
    """A numeric settings field whose bounds sit next to its default (run settings are checked
    by `RunConfig` itself; tests/test_cli.py checks every numeric daemon setting has bounds)."""
    return dataclasses.field(
        default=default, metadata={"bounds": Bounds(low, high, what, open_low)}
    )


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
        elif s.is_list and "nargs" in s.field.metadata:
            action, kind = "extend", s.kind
        elif s.is_list:
            action, kind, text = "append", s.kind, "repeatable"
        else:
            action, kind = "store", s.kind
        extra: dict[str, Any] = {"type": kind} if kind is not None else {}
        if action == "extend":
            extra["nargs"] = s.field.metadata["nargs"]
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


class _Settings(BaseSettings):
    """Base of the settings models: strict types (`true` is no int, `"4"` in a file no int),
    and the sources in order of precedence."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, strict=True, extra="forbid")
    by_name: typing.ClassVar[dict[str, Setting]] = {}

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_):
        table, defaults = _LAYERS.get()
        return (
            init_settings,  # the flags given
            _Environment(settings_cls),
            InitSettingsSource(settings_cls, table),  # the --config file
            InitSettingsSource(settings_cls, defaults),  # the command's own
        )  # then the fields' defaults


# The TOML table and the command's defaults of the load under way.
_LAYERS: ContextVar[tuple[dict[str, Any], dict[str, Any]]] = ContextVar("_LAYERS")


class _Environment(EnvSettingsSource):
    """`SEEDFLOOD_NAME` variables, parsed by pydantic as text of the setting's type (a bool:
    1/true/yes/on or 0/false/no/off); a list setting's variable is comma-separated."""

    def prepare_field_value(self, field_name, field, value, value_is_complex):
        if value is None:
            return None
        s = self.settings_cls.by_name[field_name]
        items = [item for item in value.split(",") if item] if s.is_list else [value]
        try:
            parsed = [pydantic.TypeAdapter(s.kind).validate_strings(item) for item in items]
        except pydantic.ValidationError:
            raise UserError(
                f"environment variable {s.env} must be {s.kind.__name__}, got {short_repr(value)}"
            ) from None
        return parsed if s.is_list else parsed[0]


@functools.cache
def _model(settings: tuple[Setting, ...]) -> type[_Settings]:
    """The pydantic-settings model of `settings`, its defaults the dataclass fields'."""
    fields = {}
    for s in settings:
        f = s.field
        factory = f.default_factory
        default = f.default if factory is dataclasses.MISSING else Field(default_factory=factory)
        fields[s.name] = (_annotation(s), default)
    model = pydantic.create_model("Settings", __base__=_Settings, **fields)
    model.by_name = {s.name: s for s in settings}
    return model


def _annotation(s: Setting) -> Any:
    """A setting's type for pydantic, with its choices and its bounds (finite)."""
    kind: Any = s.kind
    if "choices" in s.field.metadata:
        kind = Literal[tuple(s.field.metadata["choices"])]
    elif kind is Path:
        kind = Annotated[Path, Strict(False)]  # a file's string is a path
    elif kind is float:
        kind = int | float  # an int stays an int: `lr = 1` hashes as it always did
    if (b := s.bounds) is not None:
        bounds = (Gt(b.low) if b.open_low else Ge(b.low), Le(b.high))
        if s.kind is float:
            kind = Annotated[int, *bounds] | Annotated[float, *bounds, Field(allow_inf_nan=False)]
        else:
            kind = Annotated[kind, *bounds]
    kind = list[kind] if s.is_list else kind
    return kind | None if s.optional else kind


def settings_values(
    args: argparse.Namespace,
    settings: list[Setting],
    table: dict[str, Any],
    defaults: dict[str, Any],
) -> dict[str, Any]:
    """Values for `settings`: the fields' defaults, then `defaults`, the TOML `table`, the
    environment (`SEEDFLOOD_NAME`), the flags given; later ones win. Checked by pydantic."""
    model = _model(tuple(settings))
    flags = {s.name: v for s in settings if (v := getattr(args, s.name, None)) is not None}
    token = _LAYERS.set(({k: v for k, v in table.items() if k in model.by_name}, defaults))
    try:
        loaded = model(**flags)
    except pydantic.ValidationError as exc:
        raise _one_line(exc, model.by_name) from None
    finally:
        _LAYERS.reset(token)
    return {s.name: getattr(loaded, s.name) for s in settings}


def _one_line(exc: pydantic.ValidationError, by_name: dict[str, Setting]) -> Exception:
    """pydantic's report as one UserError line: the first wrong setting, what it must be."""
    error = exc.errors()[0]
    s = by_name.get(error["loc"][0]) if error["loc"] else None
    if s is None:  # not a setting's value: a bug, keep pydantic's report
        return exc
    got, b = short_repr(error["input"]), s.bounds
    if b is not None:
        where = f"above {_num(b.low)} and at most" if b.open_low else f"from {_num(b.low)} to"
        return UserError(
            f"setting '{s.name}' must be {b.what}, {where} {_num(b.high)} (got {got}): "
            f"fix {s.flag} or its line in the config file"
        )
    if "choices" in s.field.metadata:
        expected = "one of " + ", ".join(map(repr, s.field.metadata["choices"]))
    else:
        expected = f"a list of {s.kind.__name__}" if s.is_list else s.kind.__name__
    return UserError(f"setting '{s.name}' must be {expected}, got {got}")


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


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
