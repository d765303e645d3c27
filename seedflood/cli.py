"""The `seedflood` command: the table of subcommands, and dispatch.

Each subcommand is a pair of functions in some module: one adds its flags to a
parser, one runs it and returns the exit status. The table holds, per command, a
loader that imports its module and returns the pair; a module is imported only when
its command runs (or its --help is asked for), so `seedflood --help` and `seedflood
status` load neither torch nor the network stack. This module sits in the daemon layer
(tools/import_graph.py), so the `peer`, `doctor` and `bootstrap` commands are plain
imports of `peer/` and `bootstrap/`, seen by the layer check like every other import.

Run settings are `RunConfig` fields, as flags and TOML keys (`core/flags.py`).
A `UserError` anywhere prints one line, `error: ...`, and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass

# Before torch is imported anywhere: OpenMP's default spin-wait makes torch's intra-op
# parallel kernels crawl when the cores are shared (the peer's own event loop and p2pd,
# other processes). Replaying SmolLM2 on 2 busy cores (load average ~5): 5.1 s per epoch
# with 2 threads and the default policy, 0.29 s with OMP_WAIT_POLICY=PASSIVE, 0.16-0.21 s
# with 1 thread.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from seedflood_p2p.core.errors import UserError  # noqa: E402
from seedflood_p2p.core.logs import setup_logging  # noqa: E402

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]  # the exit status


@dataclass(frozen=True)
class Command:
    help: str
    load: Callable[[], tuple[AddArguments, Run]]  # imports the module: when it is chosen


def _train():
    from seedflood_p2p.apps.local import add_train_arguments, cmd_train

    return add_train_arguments, cmd_train


def _eval():
    from seedflood_p2p.apps.local import add_eval_arguments, cmd_eval

    return add_eval_arguments, cmd_eval


def _replay():
    from seedflood_p2p.apps.local import add_replay_arguments, cmd_replay

    return add_replay_arguments, cmd_replay


def _export():
    from seedflood_p2p.apps.export import add_export_arguments, cmd_export

    return add_export_arguments, cmd_export


def _peer():
    from peer import command

    return command.add_arguments, command.run


def _demo():
    from seedflood_p2p.apps.demo import add_demo_arguments, cmd_demo

    return add_demo_arguments, cmd_demo


def _simulate():
    from seedflood_p2p.sim.simulator import add_simulate_arguments, run_simulate

    return add_simulate_arguments, run_simulate


def _doctor():
    from peer import doctor

    return doctor.add_arguments, doctor.run


def _status():
    from seedflood_p2p.apps.status import add_status_arguments, cmd_status

    return add_status_arguments, cmd_status


def _id():
    from seedflood_p2p.apps.local import add_id_arguments, cmd_id

    return add_id_arguments, cmd_id


def _ticket():
    from seedflood_p2p.apps.local import add_ticket_arguments, cmd_ticket

    return add_ticket_arguments, cmd_ticket


def _keygen():
    from seedflood_p2p.apps.keygen import add_keygen_arguments, cmd_keygen

    return add_keygen_arguments, cmd_keygen


def _bootstrap():
    from bootstrap import command

    return command.add_arguments, command.run


# In the order `seedflood --help` lists them.
COMMANDS: dict[str, Command] = {
    "train": Command("train on this machine with simulated peers", _train),
    "eval": Command("held-out loss and accuracy of a model", _eval),
    "replay": Command("rebuild a model from base weights plus a ledger", _replay),
    "export": Command("write a run's model as a Hugging Face directory with a model card", _export),
    "peer": Command("join a run: train and flood updates with other peers", _peer),
    "demo": Command("a real multi-peer run on this machine, with a plot", _demo),
    "simulate": Command("many virtual peers on a topology, against baselines", _simulate),
    "doctor": Command("check that this machine can join a run, and say what to fix", _doctor),
    "status": Command("one screen of a running peer's state", _status),
    "id": Command("print this machine's peer id (making its key if there is none)", _id),
    "ticket": Command(
        "sign a join ticket for a ticketed run (with the run creator's key)", _ticket
    ),
    "keygen": Command("make a key with a run's identity work (extra.identity_work)", _keygen),
    "bootstrap": Command("start a run: serve its manifest and an entry point", _bootstrap),
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
            add_arguments, run = command.load()
            add_arguments(p)
            p.set_defaults(func=run)
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
