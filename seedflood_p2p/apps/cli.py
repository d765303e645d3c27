"""The `seedflood` command: the table of subcommands, and dispatch.

Each subcommand is a pair of functions in some module: one adds its flags to a
parser, one runs it and returns the exit status. The table names modules, not
objects, and a module is imported only when its command runs (or its --help is
asked for). So `seedflood --help` and `seedflood status` load neither torch nor
the network stack, and the `peer` and `bootstrap` commands come from the
top-level daemon packages without this package importing them.

Run settings are `RunConfig` fields, as flags and TOML keys (`core/flags.py`).
A `UserError` anywhere prints one line, `error: ...`, and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass

# Before torch is imported anywhere: OpenMP's default spin-wait makes torch's intra-op
# parallel kernels crawl when the cores are shared (the peer's own event loop and p2pd,
# other processes). Replaying SmolLM2 on 2 busy cores (load average ~5): 5.1 s per epoch
# with 2 threads and the default policy, 0.29 s with OMP_WAIT_POLICY=PASSIVE, 0.16-0.21 s
# with 1 thread.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from seedflood_p2p.core.errors import UserError  # noqa: E402
from seedflood_p2p.core.logs import setup_logging  # noqa: E402


@dataclass(frozen=True)
class Command:
    help: str
    module: str  # imported when the command is chosen
    add_arguments: str  # name of `f(parser) -> None` in `module`
    run: str  # name of `f(args) -> int` (exit status) in `module`


_LOCAL = "seedflood_p2p.apps.local"
# In the order `seedflood --help` lists them.
COMMANDS: dict[str, Command] = {
    "train": Command(
        "train on this machine with simulated peers", _LOCAL, "add_train_arguments", "cmd_train"
    ),
    "eval": Command(
        "held-out loss and accuracy of a model", _LOCAL, "add_eval_arguments", "cmd_eval"
    ),
    "replay": Command(
        "rebuild a model from base weights plus a ledger",
        _LOCAL,
        "add_replay_arguments",
        "cmd_replay",
    ),
    "export": Command(
        "write a run's model as a Hugging Face directory with a model card",
        "seedflood_p2p.apps.export",
        "add_export_arguments",
        "cmd_export",
    ),
    "peer": Command(
        "join a run: train and flood updates with other peers",
        "peer.command",
        "add_arguments",
        "run",
    ),
    "demo": Command(
        "a real multi-peer run on this machine, with a plot",
        "seedflood_p2p.apps.demo",
        "add_demo_arguments",
        "cmd_demo",
    ),
    "simulate": Command(
        "many virtual peers on a topology, against baselines",
        "seedflood_p2p.sim.simulator",
        "add_simulate_arguments",
        "run_simulate",
    ),
    "doctor": Command(
        "check that this machine can join a run, and say what to fix",
        "peer.doctor",
        "add_arguments",
        "run",
    ),
    "status": Command(
        "one screen of a running peer's state",
        "seedflood_p2p.apps.status",
        "add_status_arguments",
        "cmd_status",
    ),
    "id": Command(
        "print this machine's peer id (making its key if there is none)",
        _LOCAL,
        "add_id_arguments",
        "cmd_id",
    ),
    "ticket": Command(
        "sign a join ticket for a ticketed run (with the run creator's key)",
        _LOCAL,
        "add_ticket_arguments",
        "cmd_ticket",
    ),
    "bootstrap": Command(
        "start a run: serve its manifest and an entry point",
        "bootstrap.command",
        "add_arguments",
        "run",
    ),
}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `commands`, only those subcommands get their flags (and imports)."""
    parser = argparse.ArgumentParser(
        prog="seedflood",
        description="Peer-to-peer zeroth-order fine-tuning of language models (SeedFlood/SubCGE).",
    )
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if commands is None or name in commands:
            module = importlib.import_module(command.module)
            getattr(module, command.add_arguments)(p)
            p.set_defaults(func=getattr(module, command.run))
    return parser


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names, if any: the first argument that is a command's name.

    Exact for every valid command line: only the global options come before the
    command, and their values (text, json, DEBUG, ...) are no command's name."""
    return next((arg for arg in argv if arg in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = chosen_command(argv)
    args = build_parser([command] if command else []).parse_args(argv)
    setup_logging(args.log_format, args.log_level)
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
