"""Discrete-round simulator: n virtual peers on a topology, SeedFlood versus gossip baselines.

Every method runs the library's own code on one model, one task and the same
budget of forward passes; only how updates travel and combine differs.

Rounds. In round t every peer takes one local step on its current model and
its own data shard. A SeedFlood message (peer p, round t) is flooded over the
topology: a peer at hop distance h from p holds it from the end of round
t + h * delay (so with delay 0 every peer holds every message of round t
before round t + 1). With a per-link loss rate each transmission of a message
over a link is lost independently; the message then reaches a peer through
any path of surviving links (never, if there is none: the simulator does not
model the daemon's anti-entropy repair). Gossip baselines exchange whole
models with their neighbours once per round, under the same rule: a model
sent at the end of round t is mixed in at the end of round t + delay (delay
0 is plain DSGD; delay 1 mixes one-round-old neighbour models), and a lost
link drops that exchange (its weight moves to the diagonal, so the mixing
stays doubly stochastic).

Methods (`METHODS`):

* ``seedflood``: SubCGE (`subcge.SubCGE`). Memory does not grow with n: one
  shared model S holds every message sent so far (a `live.LiveModel`, applying each
  round's messages once per round, as a live peer does), and each
  peer keeps only the r x r cores of the messages it has not received yet
  (its backlog, `CoreBacklog`). Peer q's model is S + sum_e U_e D_q,e V_e^T;
  it is materialised only while q computes its step or is evaluated, then S
  is restored bit for bit. With delay 0 and no loss the backlogs stay empty
  and all peers hold the bitwise-identical model S.
* ``seedflood-naive``: the same messages with full-size Gaussian directions
  (`subcge.NaiveSeedReplay`); a backlog is a list of messages, so a stale
  peer's view costs O(missing * d): use it with small n or delay 0.
* ``dzsgd``: decentralized zeroth-order SGD: each peer takes the same
  two-point step (`trainer.zo_step`, SubCGE or Gaussian directions) on its
  own model at the full learning rate (n_ref = 1), then averages whole
  models with its neighbours (Metropolis-Hastings weights). Holds n models.
* ``dsgd``: the same with first-order gradients (autograd). Holds n models.
* ``centralized``: MeZO-style ZO-SGD on one model with the same samples per
  round (n steps of one batch each, drawn from the whole training set, each
  applied before the next: the same messages, sequential, no staleness).

Bytes are counted from the real wire encodings: a SeedFlood transmission is
``len(protocol.encode_update(...))`` plus the measured GossipSub overhead
per hop (`GOSSIPSUB_OVERHEAD_BYTES`); the originator sends to each neighbour
and every peer that receives a message forwards it once to each neighbour
except the one it came from (lost transmissions were still sent). A gossip
round sends each neighbour the float32 trainable tensors of the model.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seedflood_p2p.algorithm.subcge import trainable_tensors
from seedflood_p2p.core.flags import (
    add_flags,
    add_run_flags,
    read_toml,
    run_config_from_args,
    settings_of,
    settings_values,
)
from seedflood_p2p.sim.config import METHODS, SimConfig
from seedflood_p2p.sim.methods import make_setup, make_simulation
from seedflood_p2p.sim.report import fmt_bytes, markdown_table, write_outputs
from seedflood_p2p.workload.models import load_model
from seedflood_p2p.workload.tasks import load_run_task

log = logging.getLogger("seedflood.simulate")

# ------------------------------------------------------------------------------ metrics


def consensus_distance(rows: list[torch.Tensor] | None, n: int) -> dict[str, float]:
    """Mean and max L2 distance of peer models from their average and between pairs.

    rows: per weight matrix, an (n, numel) block of the peers' parameters (any
    offset common to all rows cancels). Uses the n x n Gram matrix of the
    centred rows, so memory is O(n^2) plus one block.
    """
    zero = {
        "mean_to_average": 0.0,
        "max_to_average": 0.0,
        "mean_pairwise": 0.0,
        "max_pairwise": 0.0,
    }
    if rows is None or n < 2:
        return zero
    gram = torch.zeros(n, n, dtype=torch.float64)
    for block in rows:
        relative = (block - block[:1]).float()  # exact zeros where models are identical
        gram += (relative @ relative.T).double()
    mean = gram.mean(dim=0, keepdim=True)
    gram = gram - mean - mean.T + gram.mean()  # Gram of the rows minus their average
    sq = gram.diagonal()
    to_average = sq.clamp_min(0).sqrt()
    i, j = torch.triu_indices(n, n, offset=1)
    pairwise = (sq[i] + sq[j] - 2 * gram[i, j]).clamp_min(0).sqrt()
    return {
        "mean_to_average": float(to_average.mean()),
        "max_to_average": float(to_average.max()),
        "mean_pairwise": float(pairwise.mean()),
        "max_pairwise": float(pairwise.max()),
    }


def eval_peer_ids(n: int, k: int) -> list[int]:
    """k peers spread evenly over 0..n-1 (the same ones for every method)."""
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, min(k, n))})


def simulate(config: SimConfig, progress: Any = None) -> dict:
    """Run one method; returns the JSON-ready result (see `write_outputs`)."""
    started = time.perf_counter()
    run = config.run
    model, tokenizer = load_model(run.model)
    task = load_run_task(run)
    setup = make_setup(config, tokenizer, task)
    sim = make_simulation(setup, model)
    watch = eval_peer_ids(config.peers, config.eval_peers)
    evals: list[dict] = []
    rounds: dict[str, list[float]] = defaultdict(list)
    eval_seconds = 0.0

    def measure(done: int) -> None:
        nonlocal eval_seconds
        t0 = time.perf_counter()
        per_peer = [sim.evaluate_peer(p) for p in watch]
        ref_loss, ref_acc = sim.evaluate_reference()
        losses = [x[0] for x in per_peer]
        accs = [x[1] for x in per_peer if x[1] is not None]
        record = {
            "round": done,
            "loss": float(np.mean(losses)),
            "accuracy": float(np.mean(accs)) if accs else None,
            "peer_loss": losses,
            "peer_accuracy": [x[1] for x in per_peer],
            "reference_loss": ref_loss,
            "reference_accuracy": ref_acc,
            "consensus": consensus_distance(sim.deviation_rows(), config.peers),
            "bytes_total": int(sum(v for r, v in sim.bytes_by_round.items() if r < done)),
            "forward_passes": sim.forward_passes,
            "backward_passes": sim.backward_passes,
        }
        eval_seconds += time.perf_counter() - t0
        record["wall_seconds"] = time.perf_counter() - started
        evals.append(record)
        if progress is not None:
            progress(config, record)

    measure(0)
    for t in range(config.rounds):
        for key, value in sim.step(t).items():
            rounds[key].append(value)
        done = t + 1
        if done == config.rounds or (config.eval_every and done % config.eval_every == 0):
            measure(done)
    bytes_sent = sim.bytes_sent
    result = {
        "method": config.method,
        "config": config.to_dict(),
        "topology": setup.topology.describe(),
        "trainable_parameters": sum(m.weight.numel() for m in trainable_tensors(model, run)),
        "eval_peers": watch,
        "evals": evals,
        "final": evals[-1],
        "bytes": {
            "total": int(bytes_sent.sum()),
            "per_peer_mean": float(bytes_sent.mean()),
            "per_peer_max": int(bytes_sent.max()),
            "per_round": [int(sim.bytes_by_round.get(t, 0)) for t in range(config.rounds)],
        },
        "rounds": dict(rounds),
        "timing": {
            "seconds_per_round": float(np.mean(rounds["seconds"])) if config.rounds else 0.0,
            "apply_ms_per_round": 1e3 * float(np.mean(rounds["apply_seconds"]))
            if config.rounds
            else 0.0,
            "eval_seconds": eval_seconds,
            "total_seconds": time.perf_counter() - started,
        },
        "memory": {"model_copies": sim.holds_models, "extra_state_bytes": sim.state_bytes},
        **sim.extra(),
    }
    engine = getattr(sim, "engine", None)
    if engine is not None:
        engine.close()
    return result


# ---------------------------------------------------------------------------------- CLI

# RunConfig defaults for `seedflood simulate` (tiny model, synthetic task).
# The simulator's published comparison (bench/bench_simulator.py) applies scalars as sent;
# `--normalize unit` (the daemons' default) is there too.
SIM_RUN_DEFAULTS = {"lr": 1e-3, "batch_size": 16, "normalize": "none"}


SIM_FIELDS = settings_of(SimConfig, exclude=("method",))


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `seedflood simulate`: run settings (as `seedflood train` has), one flag per
    `SimConfig` field, and which methods to run."""
    add_run_flags(parser, SIM_RUN_DEFAULTS)
    add_flags(parser, SIM_FIELDS, "simulation")
    g = parser.add_argument_group("simulate command")
    g.add_argument(
        "--method",
        action="append",
        choices=METHODS,
        help="method to run (repeat for several; default: all)",
    )
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: 1 for tiny models)")
    g.add_argument("--out", type=Path, default=Path("runs/simulate"), help="output directory")


def sim_config_from_args(args: argparse.Namespace, method: str) -> SimConfig:
    values = settings_values(args, SIM_FIELDS, read_toml(args), {})
    run = run_config_from_args(args, defaults=SIM_RUN_DEFAULTS, extra_fields=SIM_FIELDS)
    if getattr(args, "n_ref", None) is None:
        run = run.replace(n_ref=values.get("peers", SimConfig.peers))
    return SimConfig(method=method, run=run, **values)


def _log_progress(config: SimConfig, record: dict) -> None:
    acc = record["accuracy"]
    log.info(
        "%s n=%d %s round %d: loss %.4f%s, consensus %.2e, %s sent",
        config.topology,
        config.peers,
        config.method,
        record["round"],
        record["loss"],
        "" if acc is None else f", accuracy {acc:.3f}",
        record["consensus"]["mean_to_average"],
        fmt_bytes(record["bytes_total"]),
    )


def run_simulate(args: argparse.Namespace) -> int:
    """`seedflood simulate`: run the chosen methods on one setup, write JSON, table, plots."""
    methods = args.method or list(METHODS)
    configs = [sim_config_from_args(args, m) for m in dict.fromkeys(methods)]
    threads = args.threads or (1 if configs[0].run.model.startswith("tiny") else 0)
    if threads:
        torch.set_num_threads(threads)
    results = []
    for config in configs:
        log.info(
            "simulating %s on %s with %d peers, %d rounds, delay %d, loss %.3g",
            config.method,
            config.topology,
            config.peers,
            config.rounds,
            config.delay,
            config.loss,
        )
        results.append(simulate(config, progress=_log_progress))
    written = write_outputs(results, args.out)
    print(markdown_table(results))
    log.info("wrote %s", ", ".join(str(p) for p in written))
    return 0
