"""The compared methods on one setup: SeedFlood (one shared live model + per-peer
backlogs), DZSGD and DSGD (n models mixed with neighbours), centralized ZO-SGD."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.subcge import (
    NaiveSeedReplay,
    SubCGE,
    ZerothOrderEstimator,
    trainable_tensors,
)
from seedflood_p2p.algorithm.trainable import TrainableMatrix
from seedflood_p2p.algorithm.trainer import batch_seed, evaluate, zo_step
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.update import encode_update
from seedflood_p2p.sim.backlog import CoreBacklog, MessageBacklog
from seedflood_p2p.sim.config import SimConfig
from seedflood_p2p.sim.network import GOSSIPSUB_OVERHEAD_BYTES, FloodNetwork
from seedflood_p2p.sim.topology import Topology, make_topology, metropolis_hastings
from seedflood_p2p.workload.batching import make_batch, sample_batch
from seedflood_p2p.workload.data import Task

log = logging.getLogger("seedflood.simulate")

FLOAT32_BYTES = 4
# Gossip baselines hold several (n x d) float32 stacks; refuse runs that would not fit.
GOSSIP_MEMORY_LIMIT = 8 << 30


@dataclass
class Setup:
    """What every method of a run shares: topology, data shards, peer ids, tokenizer."""

    config: SimConfig
    topology: Topology
    task: Task
    shards: list[Task]
    peer_ids: list[bytes]
    tokenizer: Any


def partition(task: Task, n: int, kind: str, alpha: float, seed: int) -> list[Task]:
    """Split the training set into n shards: IID, or non-IID by label (Dirichlet(alpha))."""
    if len(task.train) < n:
        raise UserError(f"{len(task.train)} training examples cannot be split among {n} peers")
    rng = np.random.default_rng([seed, 0xDA7A])
    if kind == "iid" or task.kind != "classification":
        parts = [list(p) for p in np.array_split(rng.permutation(len(task.train)), n)]
    else:
        parts = [[] for _ in range(n)]
        labels = np.array([ex.label for ex in task.train])
        for label in np.unique(labels):
            idx = rng.permutation(np.nonzero(labels == label)[0])
            cuts = (np.cumsum(rng.dirichlet(np.full(n, alpha)))[:-1] * len(idx)).astype(int)
            for peer, piece in enumerate(np.split(idx, cuts)):
                parts[peer].extend(piece.tolist())
        for peer in range(n):  # no empty shard: borrow from the largest
            if not parts[peer]:
                donor = max(range(n), key=lambda p: len(parts[p]))
                parts[peer].append(parts[donor].pop())
    return [
        Task(
            task.name,
            task.kind,
            [task.train[i] for i in p],
            task.test,
            task.template,
            task.label_words,
        )
        for p in parts
    ]


def _flatten(matrices: list[TrainableMatrix]) -> torch.Tensor:
    return torch.cat([m.weight.detach().reshape(-1) for m in matrices])


@torch.no_grad()
def _load(matrices: list[TrainableMatrix], flat: torch.Tensor) -> None:
    offset = 0
    for m in matrices:
        size = m.weight.numel()
        m.weight.copy_(flat[offset : offset + size].view_as(m.weight))
        offset += size


def differentiable_loss(model: torch.nn.Module, batch: dict, kind: str) -> torch.Tensor:
    """`objective.batch_loss` with autograd (that one runs under no_grad)."""
    if kind == "classification":
        hidden = model.base_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0]), batch["target_positions"]]
        logits = model.get_output_embeddings()(last)[:, batch["label_word_ids"]].float()
        return F.cross_entropy(logits, batch["labels"])
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    return out.loss.float()


class Simulation:
    """One method on one setup. `step(t)` runs round t for every peer."""

    holds_models = 1  # whole model copies kept (for the report)

    def __init__(self, setup: Setup, model: torch.nn.Module) -> None:
        self.setup = setup
        self.config = setup.config
        self.n = setup.config.peers
        self.model = model
        self.forward_passes = 0
        self.backward_passes = 0
        self.bytes_sent = np.zeros(self.n, dtype=np.int64)
        self.bytes_by_round: dict[int, int] = defaultdict(int)
        self.state_bytes = 0  # largest extra state seen (backlogs, model stacks)

    def step(self, round_: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate_peer(self, peer: int) -> tuple[float, float | None]:
        raise NotImplementedError

    def evaluate_reference(self) -> tuple[float, float | None]:
        """The model peers agree on: S for SeedFlood, the average for gossip."""
        raise NotImplementedError

    def deviation_rows(self) -> list[torch.Tensor] | None:
        """Per matrix, (n, numel) peer models minus any common offset; None: all identical."""
        return None

    def extra(self) -> dict:
        return {}

    def _evaluate(self) -> tuple[float, float | None]:
        s = self.setup
        return evaluate(self.model, s.tokenizer, s.task, self.config.run, self.config.eval_examples)


class SeedFloodSimulation(Simulation):
    """SeedFlood: flooded (peer, round, scalar) messages; one shared model plus backlogs."""

    def __init__(self, setup: Setup, model: torch.nn.Module, naive: bool = False) -> None:
        super().__init__(setup, model)
        config = self.config
        run = config.run.replace(estimator="naive" if naive else "subcge")
        if naive:
            self.engine: ZerothOrderEstimator = NaiveSeedReplay(model, run)
            self.backlog: CoreBacklog | MessageBacklog = MessageBacklog(self.engine, self.n)
        else:
            # Keep every epoch's bases (tiny next to the model): stale views need old ones.
            epochs = config.rounds // run.refresh_period + 2
            self.engine = SubCGE(model, run, basis_cache=epochs)
            self.backlog = CoreBacklog(self.engine, self.n)
        self.live = LiveModel(self.engine)  # the shared model S
        self.network = FloodNetwork(setup.topology, config.delay, config.loss, config.seed)
        self.bytes_sent = self.network.bytes_sent
        self.bytes_by_round = self.network.bytes_by_round
        self._sent_rounds: list[int] = []

    @torch.no_grad()
    def _snapshot(self) -> list[torch.Tensor]:
        return [m.weight.detach().clone() for m in self.engine.matrices]

    @torch.no_grad()
    def _restore(self, snapshot: list[torch.Tensor]) -> None:
        for matrix, saved in zip(self.engine.matrices, snapshot):
            matrix.weight.copy_(saved)

    def step(self, round_: int) -> dict[str, float]:
        s = self.setup
        t0 = time.perf_counter()
        view_seconds = 0.0
        snapshot = None
        messages = []
        for peer in range(self.n):
            if self.backlog.has_missing(peer):
                tv = time.perf_counter()
                snapshot = snapshot or self._snapshot()
                self.backlog.apply_view(peer)
                view_seconds += time.perf_counter() - tv
                message, _ = zo_step(
                    self.engine, s.tokenizer, s.shards[peer], s.peer_ids[peer], round_
                )
                tv = time.perf_counter()
                self._restore(snapshot)
                view_seconds += time.perf_counter() - tv
            else:
                message, _ = zo_step(
                    self.engine, s.tokenizer, s.shards[peer], s.peer_ids[peer], round_
                )
            messages.append(message)
        self.forward_passes += 2 * self.n
        t1 = time.perf_counter()
        self.live.apply(messages)  # S holds every message sent so far
        t2 = time.perf_counter()
        run_id = self.engine.config.run_id
        sizes = [
            len(encode_update(run_id, m.round, m.scalars)) + GOSSIPSUB_OVERHEAD_BYTES
            for m in messages
        ]
        late = self.network.post(round_, np.array(sizes))
        self.backlog.add(round_, messages, late)
        self.backlog.remove(self.network.deliver(round_))
        self._sent_rounds.append(round_)
        for sent in [r for r in self._sent_rounds if self.network.round_finished(r)]:
            self.backlog.forget(sent)
            self._sent_rounds.remove(sent)
        self.state_bytes = max(self.state_bytes, self.backlog.nbytes())
        t3 = time.perf_counter()
        return {
            "seconds": t3 - t0,
            "estimate_seconds": t1 - t0 - view_seconds,
            "view_seconds": view_seconds,
            "apply_seconds": t2 - t1,
            "network_seconds": t3 - t2,
        }

    def evaluate_peer(self, peer: int) -> tuple[float, float | None]:
        if not self.backlog.has_missing(peer):
            return self._evaluate()
        snapshot = self._snapshot()
        self.backlog.apply_view(peer)
        try:
            return self._evaluate()
        finally:
            self._restore(snapshot)

    def evaluate_reference(self) -> tuple[float, float | None]:
        return self._evaluate()

    def deviation_rows(self) -> list[torch.Tensor] | None:
        if not any(self.backlog.has_missing(p) for p in range(self.n)):
            return None
        return self.backlog.deviation_rows()

    def extra(self) -> dict:
        net = self.network
        return {
            "flood": {
                "transmissions": net.transmissions,
                "delivered_pairs": net.delivered_pairs,
                "undelivered_pairs": net.lost_pairs,
                "bytes_per_transmission": int(GOSSIPSUB_OVERHEAD_BYTES)
                + len(
                    encode_update(
                        self.engine.config.run_id,
                        max(self.config.rounds - 1, 0),
                        (1.0,) * self.engine.config.directions,
                    )
                ),
            },
            "peers_behind_at_end": int(sum(self.backlog.has_missing(p) for p in range(self.n))),
        }


class GossipSimulation(Simulation):
    """DZSGD (zeroth-order) or DSGD (first-order): local step, then neighbour averaging."""

    def __init__(self, setup: Setup, model: torch.nn.Module, first_order: bool) -> None:
        super().__init__(setup, model)
        config = self.config
        self.first_order = first_order
        if first_order:
            self.engine = None
            self.matrices = trainable_tensors(model, config.run)
            for matrix in self.matrices:
                matrix.weight.requires_grad_(True)
        else:
            # Each peer steps its own model at the full learning rate (n_ref = 1);
            # averaging with neighbours takes the place of SeedFlood's 1/n.
            estimator = "naive" if config.dzsgd_direction == "gaussian" else "subcge"
            run = config.run.replace(n_ref=1, estimator=estimator)
            epochs = config.rounds // run.refresh_period + 2
            self.engine = (
                NaiveSeedReplay(model, run) if estimator == "naive" else SubCGE(model, run, epochs)
            )
            self.matrices = self.engine.matrices
        self.dim = sum(m.weight.numel() for m in self.matrices)
        lag = config.delay  # rounds a model takes to reach a neighbour
        self.holds_models = self.n * (lag + 1)
        need = self.holds_models * self.dim * FLOAT32_BYTES
        if need > GOSSIP_MEMORY_LIMIT:
            raise UserError(
                f"{'DSGD' if first_order else 'DZSGD'} holds one model per peer: {self.n} peers x "
                f"{self.dim / 1e6:.1f}M parameters x {lag + 1} copies needs {need / 2**30:.1f} GiB "
                f"(limit {GOSSIP_MEMORY_LIMIT / 2**30:.0f} GiB). Use fewer peers or a smaller model"
            )
        self.models = _flatten(self.matrices).unsqueeze(0).repeat(self.n, 1)  # (n, d)
        self.history = [self.models.clone() for _ in range(lag)]  # sent, not yet arrived
        self.state_bytes = need
        self.rng = np.random.default_rng([config.seed, 0x6055])
        self.link_bytes = self.dim * FLOAT32_BYTES

    def _local_step(self, peer: int, round_: int) -> torch.Tensor:
        s, run = self.setup, self.config.run
        _load(self.matrices, self.models[peer])
        if self.first_order:
            shard = s.shards[peer]
            seed = batch_seed(run.run_key, s.peer_ids[peer], round_)
            batch = make_batch(
                sample_batch(shard, seed, run.batch_size), s.tokenizer, shard, run.max_length
            )
            with torch.enable_grad():
                loss = differentiable_loss(self.model, batch, shard.kind)
                grads = torch.autograd.grad(loss, [m.weight for m in self.matrices])
            self.forward_passes += 1
            self.backward_passes += 1
            return self.models[peer] - self.config.fo_lr * torch.cat([g.reshape(-1) for g in grads])
        message, _ = zo_step(self.engine, s.tokenizer, s.shards[peer], s.peer_ids[peer], round_)
        self.forward_passes += 2
        self.engine.accumulate([message])
        self.engine.commit()
        return _flatten(self.matrices)

    @torch.no_grad()
    def step(self, round_: int) -> dict[str, float]:
        t0 = time.perf_counter()
        stepped = torch.stack([self._local_step(p, round_) for p in range(self.n)])
        t1 = time.perf_counter()
        topo = self.setup.topology
        alive = None
        if self.config.loss > 0:
            alive = self.rng.random(len(topo.edges)) >= self.config.loss
        weights = metropolis_hastings(topo, alive)
        self.history.append(stepped)
        arrived = self.history.pop(0)  # neighbours' models sent `delay` rounds ago
        index, values = weights.indices(), weights.values()
        own = index[0] == index[1]
        diagonal = torch.zeros(self.n).index_add_(0, index[0][own], values[own])
        others = torch.sparse_coo_tensor(
            index[:, ~own], values[~own], (self.n, self.n), check_invariants=True
        )
        self.models = diagonal[:, None] * stepped + torch.sparse.mm(others, arrived)
        sent = topo.degrees * self.link_bytes
        self.bytes_sent += sent
        self.bytes_by_round[round_] += int(sent.sum())
        t2 = time.perf_counter()
        return {
            "seconds": t2 - t0,
            "estimate_seconds": t1 - t0,
            "view_seconds": 0.0,
            "apply_seconds": 0.0,
            "network_seconds": t2 - t1,
        }

    def evaluate_peer(self, peer: int) -> tuple[float, float | None]:
        _load(self.matrices, self.models[peer])
        return self._evaluate()

    def evaluate_reference(self) -> tuple[float, float | None]:
        _load(self.matrices, self.models.mean(dim=0))
        return self._evaluate()

    def deviation_rows(self) -> list[torch.Tensor]:
        rows, offset = [], 0
        for m in self.matrices:
            size = m.weight.numel()
            rows.append(self.models[:, offset : offset + size])
            offset += size
        return rows


class CentralizedSimulation(Simulation):
    """MeZO-style ZO-SGD on one model: the round's n steps applied one after another."""

    def __init__(self, setup: Setup, model: torch.nn.Module) -> None:
        super().__init__(setup, model)
        epochs = self.config.rounds // self.config.run.refresh_period + 2
        self.engine = SubCGE(model, self.config.run.replace(estimator="subcge"), epochs)

    def step(self, round_: int) -> dict[str, float]:
        s = self.setup
        t0 = time.perf_counter()
        apply = 0.0
        for peer in range(self.n):
            message, _ = zo_step(self.engine, s.tokenizer, s.task, s.peer_ids[peer], round_)
            ta = time.perf_counter()
            # each step the size it has in a round of n (round-sized step rules)
            self.engine.accumulate([message], {round_: self.n})
            self.engine.commit()
            apply += time.perf_counter() - ta
        self.forward_passes += 2 * self.n
        t1 = time.perf_counter()
        return {
            "seconds": t1 - t0,
            "estimate_seconds": t1 - t0 - apply,
            "view_seconds": 0.0,
            "apply_seconds": apply,
            "network_seconds": 0.0,
        }

    def evaluate_peer(self, peer: int) -> tuple[float, float | None]:
        return self._evaluate()

    def evaluate_reference(self) -> tuple[float, float | None]:
        return self._evaluate()


def make_setup(config: SimConfig, tokenizer: Any, task: Task) -> Setup:
    topology = make_topology(config)
    shards = partition(task, config.peers, config.partition, config.alpha, config.seed)
    peer_ids = [f"sim-{i}".encode() for i in range(config.peers)]
    return Setup(config, topology, task, shards, peer_ids, tokenizer)


def make_simulation(setup: Setup, model: torch.nn.Module) -> Simulation:
    method = setup.config.method
    if method == "seedflood":
        return SeedFloodSimulation(setup, model)
    if method == "seedflood-naive":
        return SeedFloodSimulation(setup, model, naive=True)
    if method == "dzsgd":
        return GossipSimulation(setup, model, first_order=False)
    if method == "dsgd":
        return GossipSimulation(setup, model, first_order=True)
    return CentralizedSimulation(setup, model)
