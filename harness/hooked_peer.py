"""A peer daemon that misbehaves on purpose, for the tests and benchmarks that show the
honest peers catch it or cope: `seedflood peer` run with a `Behaviour` of its own
(peer/behaviour.py). `seedflood peer` has no switch for any of this; this program,
outside the product, is the only way to run such a peer.

    python harness/hooked_peer.py [--log-format json] peer
        [--cheat HOW] [--checkpoint corrupt|forge|forge-far] [--drop-incoming F]
        [--equivocate ROUND[:LATER]] [--trace-memory FILE] FLAGS...

FLAGS are those of `seedflood peer`. The misbehaviours:

    --cheat flip|random|x3   publish a cheater's scalars instead of its own (the
                             simulator's cheats, sim/audit_sim.py:cheat); it still audits
                             honestly
    --cheat turn             honest while on probation, then "flip" from the first update
                             after its own ledger's standing has it established, for good
    --cheat-from R           cheat only in rounds >= R (honest before: its rows below R
                             count, in the model and in the chain's links)
    --checkpoint corrupt     serve checkpoint chunks with a flipped byte
    --checkpoint forge       offer a forged chain link (a tensor shifted, hashes consistent)
    --checkpoint forge-far   ... with every tensor shifted far: a model whose updates an
                             audit tells from the run's (a joiner's self-check refuses it)
    --drop-incoming F        discard this fraction of incoming gossip (repair fills it in)
    --equivocate R[:L]       sign a second update for the first round >= R whose honest
                             first scalar is positive (`twin`: every scalar made smaller,
                             so `protocol.update.keeps_new` keeps it everywhere, and the
                             first one's sign flipped, so it moves the model another way
                             even under normalize "unit") and flood it L rounds after
                             the honest one (0: at once, right behind it), counted in
                             the run's rounds (the other peers' quorum round in our
                             ledger), not our own: a lagging or hurried equivocator
                             still floods it when the others train round R + L. p2pd's
                             pubsub has no send to one peer, so both copies reach every
                             peer; with L > 0 the peers hold, and train on, the first
                             copy for L rounds before the second replaces it

And one diagnosis, not a misbehaviour:

    --trace-memory FILE      trace Python allocations (tracemalloc, 4 frames) and append,
                             every 60 s, the 40 source lines holding the most memory and
                             the 40 that grew most since the last dump, to FILE as a JSON
                             line: what grows in a long run (the soak)

harness/cluster.py:start_hooked_peer starts one.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import sys
import threading
import time
import tracemalloc
from pathlib import Path

# As the `seedflood` command does, before torch is imported (seedflood/cli.py says why).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from peer import command  # noqa: E402
from peer.behaviour import Behaviour  # noqa: E402
from peer.daemon import run_peer  # noqa: E402
from seedflood_p2p.core.errors import UserError  # noqa: E402
from seedflood_p2p.core.logs import setup_logging  # noqa: E402
from seedflood_p2p.protocol.message import UpdateMessage  # noqa: E402
from seedflood_p2p.protocol.update import encode_update, quorum_round  # noqa: E402
from seedflood_p2p.sim.audit_sim import cheat  # noqa: E402
from seedflood_p2p.storage.ledger import Ledger  # noqa: E402

CHEATS = {"flip": "sign-flip", "random": "random", "x3": "scale3", "turn": "sign-flip"}
RANDOM_POOL_ROUNDS = 4  # "random" draws among others' claims of this many recent rounds
_TURNED: set[bytes] = set()  # "turn" peers of this process that have turned
log = logging.getLogger("seedflood.hooked")


def cheated(how: str, message: UpdateMessage, ledger: Ledger) -> UpdateMessage:
    """`message` (the honest update) as the `--cheat HOW` cheater sends it. "random" picks
    one of the other peers' claims of the last few rounds (the size of an honest scalar),
    seeded by (peer, round) so a rerun cheats the same way. "turn" sends the honest update
    until the ledger's standing (as `seedflood replay` judges it) has this peer
    established, then negates for good."""
    if how == "turn" and not _turned(message.peer, ledger):
        return message
    pool = [
        m.scalars
        for m in ledger.messages(max(0, message.round - RANDOM_POOL_ROUNDS), message.round - 1)
        if m.peer != message.peer
    ]
    rng = random.Random(f"{message.peer.hex()}/{message.round}")
    return UpdateMessage(
        message.round, message.peer, cheat(CHEATS[how], message.scalars, pool, rng)
    )


def _turned(peer: bytes, ledger: Ledger) -> bool:
    """Has the "turn" cheater been established in its own ledger's view?"""
    if peer not in _TURNED:
        from seedflood_p2p.algorithm.probation import standing_of_ledger

        config = ledger.config
        probation = config.probation
        st = standing_of_ledger(ledger, config.audit, probation)
        if probation.enabled and peer in st.established and peer not in st.founders:
            _TURNED.add(peer)
    return peer in _TURNED


def forge_link(directory: Path, far: bool = False) -> Path:
    """A copy of the chain link in `directory` with one tensor shifted by 0.01 (`far`:
    every tensor by 0.5), its hashes made consistent (DIRECTORY/forged)."""
    from seedflood_p2p.storage.checkpoint import (
        read_checkpoint_meta,
        read_checkpoint_weights,
        tensors_sha256,
        write_checkpoint,
    )

    weights = read_checkpoint_weights(directory, "cpu")
    names = [n for n in sorted(weights) if weights[n].is_floating_point()]  # not a summary
    for name in names if far else names[:1]:
        weights[name] = weights[name] + (0.5 if far else 0.01)
    meta = read_checkpoint_meta(directory)
    meta["weights_sha256"] = tensors_sha256(weights)
    forged = directory / "forged"
    forged.mkdir(exist_ok=True)
    write_checkpoint(forged, weights, meta)
    return forged


def twin(scalars: tuple[float, ...]) -> tuple[float, ...]:
    """The equivocator's second update for a round: each scalar below every value the
    honest one could take there (-|s| - 1 < s), so the fixed rule keeps the twin
    (`keeps_new`: the smaller scalars) whichever copy a peer saw first, and the
    honest copy is the one every peer takes back."""
    return tuple(-abs(s) - 1.0 for s in scalars)


def parse_equivocation(text: str) -> tuple[int, int]:
    """ROUND[:LATER] -> (round, rounds later the twin is flooded)."""
    head, _, tail = text.partition(":")
    try:
        round_, later = int(head), int(tail or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not ROUND or ROUND:LATER") from None
    if round_ < 0 or later < 0:
        raise argparse.ArgumentTypeError(f"{text}: rounds are not negative")
    return round_, later


def install_equivocation(round_: int, later: int) -> None:
    """Make this process's node sign and flood `twin` of its update of the first round
    >= `round_` whose first scalar is positive (with one scalar under normalize "unit" a
    twin of a negative one would only rescale it: no other model, nothing to see),
    `later` rounds after the honest one: at once for 0, else once the other peers train
    round R + `later` (their quorum round in our ledger, + 1). The run's rounds, not our
    own: an equivocator slowed by its machine would otherwise flood the twin after the
    others had audited every update trained on the first copy. Logs event "equivocated"
    with the round.

    The honest daemon refuses to sign a second update for a round (`FloodNode.publish`),
    so this wraps that method in this process only: the honest copy goes through it as
    always (logged, flooded, its echo signs our row); the twin is flooded through the
    same signed pubsub client, with the honest copy's held-state digest, and never
    logged here first (its echo meets our own row: `keeps_new` decides there too)."""
    from seedflood_p2p.network.gossip import flood

    honest_publish = flood.FloodNode.publish
    done: list[int] = []  # one round only (every peer bans us once it has both copies)
    tasks: set[asyncio.Task] = set()

    async def flood_twin(node, r: int, scalars: tuple[float, ...], held: int | None) -> None:
        while later:
            rounds = node.ledger.peer_rounds()
            rounds.pop(node.peer_id, None)
            if quorum_round(rounds.values()) + 1 >= r + later:
                break
            await asyncio.sleep(0.05)
        await node._pubsub.publish(node.topic, encode_update(node.run_id, r, scalars, held))
        log.warning(
            "equivocating: signed a second update for round %d, %r (first: %r)",
            r,
            scalars,
            node.ledger.scalars_of(node.peer_id, r),
            extra={"fields": {"event": "equivocated", "round": r, "at": node.ledger.max_round()}},
        )

    async def publish(self, message: UpdateMessage, held: int | None = None) -> None:
        await honest_publish(self, message, held)
        if not done and message.round >= round_ and message.scalars[0] > 0:
            done.append(message.round)
            task = asyncio.ensure_future(
                flood_twin(self, message.round, twin(message.scalars), held)
            )
            tasks.add(task)  # held: a task with no reference may be collected mid-run
            if not later:
                await task

    flood.FloodNode.publish = publish


class Hooked(Behaviour):
    """The misbehaviours the flags ask for; honest in everything else."""

    def __init__(
        self,
        cheat: str = "",
        checkpoint: str = "",
        drop_incoming: float = 0.0,
        cheat_from: int = 0,
    ):
        self.cheat = cheat
        self.cheat_from = cheat_from
        self.checkpoint = checkpoint
        self.drop_incoming = drop_incoming
        self.losses = random.Random()

    def update(self, message: UpdateMessage, ledger: Ledger) -> UpdateMessage:
        if not self.cheat or message.round < self.cheat_from:
            return message
        return cheated(self.cheat, message, ledger)

    async def served_link(self, directory: Path) -> Path:
        if self.checkpoint in ("forge", "forge-far"):
            return await asyncio.to_thread(forge_link, directory, self.checkpoint == "forge-far")
        return directory

    def served_chunk(self, data: bytes) -> bytes:
        if self.checkpoint == "corrupt":
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def hears(self) -> bool:
        return self.losses.random() >= self.drop_incoming


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction from 0 to 1")
    return value


def trace_memory(path: Path, every_s: float = 60.0, top: int = 40) -> None:
    """Start tracemalloc and a daemon thread appending to `path`, every `every_s`, the `top`
    source lines holding the most memory and the `top` that grew most since the last dump
    (what grows in a long run is often small per line and far from the largest)."""
    tracemalloc.start(4)
    started = time.monotonic()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]

    def lines(stats: list, size: str, count: str) -> list[dict]:
        return [
            {
                "where": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                "kib": round(getattr(s, size) / 1024, 1),
                "count": getattr(s, count),
            }
            for s in stats[:top]
        ]

    def dump() -> None:
        last = None
        while True:
            time.sleep(every_s)
            snapshot = tracemalloc.take_snapshot().filter_traces(ignore)
            stats = snapshot.statistics("lineno")
            record = {
                "t": round(time.monotonic() - started, 1),
                "traced_kib": round(sum(s.size for s in stats) / 1024, 1),
                "top": lines(stats, "size", "count"),
            }
            if last is not None:
                grew = sorted(
                    snapshot.compare_to(last, "lineno"), key=lambda d: d.size_diff, reverse=True
                )
                record["grew"] = lines(grew, "size_diff", "count_diff")
            last = snapshot
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    threading.Thread(target=dump, name="trace-memory", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hooked_peer", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument("command", choices=["peer"], help="as `seedflood peer`")
    parser.add_argument("--cheat", choices=sorted(CHEATS), default="")
    parser.add_argument("--cheat-from", type=int, default=0, metavar="R")
    parser.add_argument("--checkpoint", choices=["corrupt", "forge", "forge-far"], default="")
    parser.add_argument("--drop-incoming", type=fraction, default=0.0)
    parser.add_argument("--equivocate", type=parse_equivocation, default=None)
    parser.add_argument("--trace-memory", type=Path, default=None, metavar="FILE")
    command.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, "INFO")
    if args.trace_memory is not None:
        trace_memory(args.trace_memory)
    behaviour = Hooked(args.cheat, args.checkpoint, args.drop_incoming, args.cheat_from)
    if args.equivocate is not None:
        install_equivocation(*args.equivocate)
    try:
        run_peer(command.settings_from_args(args), behaviour)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gc.freeze()  # as `seedflood peer` does (peer/command.py): a fast exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
