"""The `seedflood` command: every subcommand is wired here, and only here.

Run settings are `RunConfig` fields; each is a flag of the same name
(`--refresh-period`) and a key of the same name in a TOML file (`--config`,
`refresh_period = 20`). Flags override the file. A `UserError` anywhere prints
one line, `error: ...`, and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

# Before torch is imported anywhere: OpenMP's default spin-wait makes torch's intra-op
# parallel kernels crawl when the cores are shared (the peer's own event loop and p2pd,
# other processes). Replaying SmolLM2 on 2 busy cores (load average ~5): 5.1 s per epoch
# with 2 threads and the default policy, 0.29 s with OMP_WAIT_POLICY=PASSIVE, 0.16-0.21 s
# with 1 thread.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from seedflood_p2p.core.config import RunConfig  # noqa: E402
from seedflood_p2p.core.errors import UserError  # noqa: E402

log = logging.getLogger("seedflood")

_RUN_FIELDS = [f for f in dataclasses.fields(RunConfig) if f.name not in ("extra", "base_sha256")]
_SCALARS = {"int": int, "float": float, "str": str, "Path": Path}


def _field_kind(f: dataclasses.Field) -> tuple[str, bool]:
    """('int' | 'float' | 'str' | 'Path' | 'bool', is_list) of a settings field."""
    text = str(f.type).replace(" | None", "")
    if text.startswith("list["):
        return text[5:-1], True
    return text, False


def _add_flags(
    parser: argparse.ArgumentParser,
    fields: list,
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


def _add_run_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    parser.add_argument("--config", type=Path, help="TOML file; keys are the flag names")
    _add_flags(parser, _RUN_FIELDS, "run settings", defaults)


def _read_toml(args: argparse.Namespace) -> dict[str, Any]:
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


def _settings_values(
    args: argparse.Namespace, fields: list, table: dict[str, Any], defaults: dict[str, Any]
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


def _check_unknown(table: dict[str, Any], fields: list, args: argparse.Namespace) -> None:
    known = {f.name for f in fields}
    unknown = sorted(set(table) - known)
    if unknown:
        raise UserError(
            f"config file {args.config}: unknown setting(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )


def run_config_from_args(
    args: argparse.Namespace, defaults: dict[str, Any] | None = None, extra_fields: list = ()
) -> RunConfig:
    """Settings from `RunConfig` defaults, then `defaults`, the TOML file, flags; validated."""
    table = _read_toml(args)
    _check_unknown(table, _RUN_FIELDS + list(extra_fields), args)
    return RunConfig(**_settings_values(args, _RUN_FIELDS, table, defaults or {}))


def _setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    from seedflood_p2p.core.logs import setup_logging

    setup_logging(fmt, level)


# -- train / eval / replay ----------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import evaluate, train_local
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model, save_model, weights_sha256

    config = run_config_from_args(args)
    model, tokenizer = load_model(config.model)
    task = load_task(
        config.dataset, text_column=config.text_column, label_column=config.label_column
    )
    config = config.replace(
        base_sha256=weights_sha256(model),
        n_ref=args.peers if getattr(args, "n_ref", None) is None else config.n_ref,
    )
    out = Path(args.out or f"runs/{config.run_id[:12]}")
    out.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(args.ledger or out / "ledger.sqlite", config.run_id)
    ledger.claim(config.to_json(), "use another --out or --ledger")
    engine = make_estimator(model, config)
    log.info(
        "run %s: model %s (%.1fM trainable params in %d matrices), dataset %s "
        "(%d train / %d test), %d simulated peers, %d rounds, estimator %s",
        config.run_id[:12],
        config.model,
        engine.num_parameters / 1e6,
        len(engine.matrices),
        config.dataset,
        len(task.train),
        len(task.test),
        args.peers,
        args.rounds,
        config.estimator,
    )
    if len(ledger):
        from seedflood_p2p.algorithm.replay import replay

        log.info("resuming: replaying %d ledger messages", len(ledger))
        replay(model, config, ledger.messages())
    loss, acc = evaluate(model, tokenizer, task, config, args.eval_examples)
    log.info("start: eval loss %.4f%s", loss, "" if acc is None else f"  accuracy {acc:.3f}")
    started = time.perf_counter()

    def show(r) -> None:
        line = f"round {r.round + 1}/{args.rounds}  train loss {r.train_loss:.4f}"
        if r.eval_loss is not None:
            line += f"  eval loss {r.eval_loss:.4f}"
        if r.eval_accuracy is not None:
            line += f"  accuracy {r.eval_accuracy:.3f}"
        log.info("%s  (%.2f s/round)", line, r.seconds)

    train_local(
        engine,
        tokenizer,
        task,
        peers=args.peers,
        rounds=args.rounds,
        ledger=ledger,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        on_round=show,
    )
    engine.close()
    save_model(model, tokenizer, out / "model")
    log.info(
        "done in %.1f s: %d messages in %s; model saved to %s; weights sha256 %s",
        time.perf_counter() - started,
        len(ledger),
        ledger.path,
        out / "model",
        weights_sha256(model),
    )
    ledger.close()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.trainer import evaluate
    from seedflood_p2p.workload.data import load_task
    from seedflood_p2p.workload.models import load_model

    config = run_config_from_args(args)
    model, tokenizer = load_model(args.model_path or config.model)
    task = load_task(
        config.dataset, text_column=config.text_column, label_column=config.label_column
    )
    loss, acc = evaluate(model, tokenizer, task, config, args.examples)
    shown = min(args.examples, len(task.test))
    print(
        f"{config.dataset}: {shown} held-out examples  loss {loss:.4f}"
        + ("" if acc is None else f"  accuracy {acc:.4f}")
    )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model, save_model, weights_sha256

    ledger = Ledger.open_existing(args.ledger)
    config = RunConfig.from_json(ledger.get_meta("manifest"))
    model, tokenizer = load_model(args.base or config.model)
    base_hash = weights_sha256(model)
    if config.base_sha256 and base_hash != config.base_sha256:
        raise UserError(
            f"base weights '{args.base or config.model}' have SHA-256 {base_hash[:16]}..., but "
            f"the run was trained from {config.base_sha256[:16]}...: pass the run's base model"
        )
    started = time.perf_counter()
    total = len(ledger)

    def progress(done: int, epoch: int) -> None:
        log.info("replayed %d/%d messages (epoch %d)", done, total, epoch)

    count = replay(model, config, ledger.messages(), progress=progress if total > 50_000 else None)
    save_model(model, tokenizer, args.out)
    digest = weights_sha256(model)
    log.info(
        "replayed %d messages of run %s in %.2f s; model written to %s",
        count,
        config.run_id[:12],
        time.perf_counter() - started,
        args.out,
    )
    print(digest)
    return 0


# -- peer / bootstrap ------------------------------------------------------------
def _peer_fields() -> tuple[list, list]:
    from peer.daemon import PeerSettings
    from seedflood_p2p.network.flood import NodeSettings

    own = [f for f in dataclasses.fields(PeerSettings) if f.name != "node"]
    return own, list(dataclasses.fields(NodeSettings))


def _bootstrap_fields() -> tuple[list, list]:
    from bootstrap.node import BootstrapSettings
    from seedflood_p2p.network.flood import NodeSettings

    own = [f for f in dataclasses.fields(BootstrapSettings) if f.name != "node"]
    return own, list(dataclasses.fields(NodeSettings))


def cmd_peer(args: argparse.Namespace) -> int:
    from peer.daemon import PeerSettings, run_peer
    from seedflood_p2p.network.flood import NodeSettings

    own, node = _peer_fields()
    table = _read_toml(args)
    _check_unknown(table, own + node, args)
    settings = PeerSettings(
        **_settings_values(args, own, table, {}),
        node=NodeSettings(**_settings_values(args, node, table, {})),
    )
    if not settings.bootstrap:
        raise UserError(
            "no bootstrap address: pass --bootstrap /ip4/HOST/tcp/PORT/p2p/PEER_ID "
            "(the address a bootstrap node prints when it starts)"
        )
    run_peer(settings)
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from bootstrap.node import BootstrapSettings, run_bootstrap
    from seedflood_p2p.network.flood import NodeSettings

    own, node = _bootstrap_fields()
    table = _read_toml(args)
    config = run_config_from_args(args, extra_fields=own + node)
    settings = BootstrapSettings(
        **_settings_values(args, own, table, {}),
        node=NodeSettings(**_settings_values(args, node, table, {})),
    )
    return run_bootstrap(settings, config)


# -- demo / status -----------------------------------------------------------------
# The demo's built-in default: see README ("Why this default") for the measurements.
DEMO_DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "dataset": "mr",
    "rank": 32,
    "refresh_period": 20,
    "lr": 3e-4,
}


def cmd_demo(args: argparse.Namespace) -> int:
    from seedflood_p2p.apps.demo import run_demo

    config = run_config_from_args(args, defaults={**DEMO_DEFAULTS, "n_ref": args.peers})
    if args.peers < 1 or args.rounds < 1 or args.minutes <= 0:
        raise UserError("--peers and --rounds must be >= 1 and --minutes > 0")
    work = args.work_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    result = run_demo(
        config,
        peers=args.peers,
        rounds=args.rounds,
        minutes=args.minutes,
        work=work,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        round_interval=args.round_interval,
    )
    return 0 if result["ledgers_identical"] else 1


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    url = args.address if "://" in args.address else f"http://{args.address}"
    url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/status") else "/status")
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            status = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise UserError(
            f"cannot read a peer's status at {url} ({exc}): start the peer with "
            "--metrics-port PORT and pass HOST:PORT"
        ) from None
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(format_status(status))
    return 0


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"peer        {status.get('peer_id')}  ({status.get('role', 'peer')}, "
        f"seedflood {status.get('version', '?')}, up {status.get('uptime_s', '?')} s)",
        f"run         {status.get('run_id')}",
        f"round       {status.get('round')}",
        f"peers alive {status.get('peers_alive')}",
        f"ledger      {status.get('ledger_messages')} messages",
    ]
    accepted = status.get("accepted", {})
    lines.append("accepted    " + "  ".join(f"{k} {v}" for k, v in accepted.items()))
    dropped = {k: v for k, v in status.get("dropped", {}).items() if v}
    lines.append("dropped     " + ("  ".join(f"{k} {v}" for k, v in dropped.items()) or "none"))
    if "bytes_out" in status:
        lines.append(f"bytes       out {status['bytes_out']}  in {status['bytes_in']}")
    if status.get("loss") is not None:
        lines.append(f"train loss  {status['loss']:.4f}")
    if status.get("eval"):
        loss, accuracy = status["eval"]
        lines.append(
            f"held-out    loss {loss:.4f}"
            + ("" if accuracy is None else f"  accuracy {accuracy:.3f}")
        )
    if status.get("peer_rounds"):
        lines.append(
            "peer rounds " + "  ".join(f"..{k}: {v}" for k, v in status["peer_rounds"].items())
        )
    if status.get("model_sha256"):
        lines.append(f"model       sha256 {status['model_sha256']}")
    return "\n".join(lines)


# -- wiring ------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seedflood",
        description="Peer-to-peer zeroth-order fine-tuning of language models (SeedFlood/SubCGE).",
    )
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train on this machine with simulated peers")
    _add_run_flags(p, {"n_ref": "--peers"})
    p.add_argument("--peers", type=int, default=1, help="simulated peers (default 1)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-examples", type=int, default=200)
    p.add_argument("--ledger", type=Path, help="ledger file (default OUT/ledger.sqlite)")
    p.add_argument("--out", type=Path, help="output directory (default runs/RUN_ID)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="held-out loss and accuracy of a model")
    _add_run_flags(p)
    p.add_argument("model_path", nargs="?", help="model directory or name (default --model)")
    p.add_argument("--examples", type=int, default=1000)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("replay", help="rebuild a model from base weights plus a ledger")
    p.add_argument("--ledger", type=Path, required=True)
    p.add_argument("--base", help="base model (default: the run's model)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("peer", help="join a run: train and flood updates with other peers")
    p.add_argument("--config", type=Path, help="TOML file; keys are the flag names")
    own, node = _peer_fields()
    _add_flags(p, own, "peer settings")
    _add_flags(p, node, "network settings")
    p.set_defaults(func=cmd_peer)

    p = sub.add_parser("demo", help="a real multi-peer run on this machine, with a plot")
    _add_run_flags(p, {**DEMO_DEFAULTS, "n_ref": "--peers"})
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    p.add_argument("--eval-every", type=int, default=15, help="peer0 scores the model")
    p.add_argument("--eval-examples", type=int, default=200)
    p.add_argument("--round-interval", type=float, default=0.0)
    p.add_argument("--work-dir", type=Path, help="default runs/demo-TIMESTAMP")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("simulate", help="many virtual peers on a topology, against baselines")
    from seedflood_p2p.sim.simulator import add_simulate_arguments, run_simulate

    add_simulate_arguments(p)
    p.set_defaults(func=run_simulate)

    p = sub.add_parser("status", help="one screen of a running peer's state")
    p.add_argument("address", help="HOST:PORT of a peer's --metrics-port")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("bootstrap", help="start a run: serve its manifest and an entry point")
    _add_run_flags(p)
    own, node = _bootstrap_fields()
    _add_flags(p, own, "bootstrap settings")
    _add_flags(p, node, "network settings")
    p.set_defaults(func=cmd_bootstrap)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_format, args.log_level)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
