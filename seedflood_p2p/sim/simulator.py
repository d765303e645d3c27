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
import dataclasses
import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.subcge import (
    NaiveSeedReplay,
    SubCGE,
    ZerothOrderEstimator,
    message_coordinates,
    trainable_tensors,
)
from seedflood_p2p.algorithm.trainable import TrainableMatrix
from seedflood_p2p.algorithm.trainer import batch_seed, evaluate, zo_step
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.protocol.wire import encode_update
from seedflood_p2p.workload.data import Task, load_task, make_batch, sample_batch
from seedflood_p2p.workload.models import load_model

log = logging.getLogger("seedflood.simulate")

METHODS = ("seedflood", "seedflood-naive", "dzsgd", "dsgd", "centralized")
TOPOLOGIES = ("ring", "torus", "random-regular", "complete", "file")
# Measured on this project's p2pd GossipSub (bench/results/network.md, byte-counting
# proxy): a signed (Ed25519) 18-byte update on the run's topic costs 192 bytes per hop.
# (bench/results/sim_* were computed with the earlier figure, 186 - 30 = 156.)
GOSSIPSUB_OVERHEAD_BYTES = 192 - 18
FLOAT32_BYTES = 4
# Gossip baselines hold several (n x d) float32 stacks; refuse runs that would not fit.
GOSSIP_MEMORY_LIMIT = 8 << 30


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. `run` holds the model, data and estimator settings."""

    method: str = "seedflood"
    peers: int = 16
    rounds: int = 40
    topology: str = "ring"
    degree: int = 4  # random-regular only
    edges_file: str = ""  # topology "file": one "i j" pair per line (0-based)
    delay: int = 1  # rounds per hop
    loss: float = 0.0  # per-link, per-transmission loss probability
    partition: str = "iid"  # iid | dirichlet (non-IID by label)
    alpha: float = 0.5  # Dirichlet concentration (smaller: more skewed shards)
    eval_every: int = 10
    eval_examples: int = 200
    eval_peers: int = 4  # peers whose own model is evaluated (evenly spaced)
    fo_lr: float = 0.03  # DSGD learning rate
    dzsgd_direction: str = "subcge"  # subcge | gaussian
    seed: int = 0  # topology, shards and link losses
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        problems = []
        if self.method not in METHODS:
            problems.append(f"method must be one of {', '.join(METHODS)} (got {self.method!r})")
        if self.topology not in TOPOLOGIES:
            problems.append(f"topology must be one of {', '.join(TOPOLOGIES)}")
        if self.topology == "file" and not self.edges_file:
            problems.append("topology 'file' needs an edges file (--edges)")
        if self.peers < 1 or self.rounds < 0:
            problems.append("peers must be >= 1 and rounds >= 0")
        if self.delay < 0:
            problems.append(f"delay must be >= 0 rounds (got {self.delay})")
        if not 0.0 <= self.loss < 1.0:
            problems.append(f"loss must be in [0, 1) (got {self.loss})")
        if self.partition not in ("iid", "dirichlet"):
            problems.append(f"partition must be 'iid' or 'dirichlet' (got {self.partition!r})")
        if not self.alpha > 0:
            problems.append(f"alpha must be > 0 (got {self.alpha})")
        if self.dzsgd_direction not in ("subcge", "gaussian"):
            problems.append("dzsgd_direction must be 'subcge' or 'gaussian'")
        if self.eval_every < 0 or self.eval_examples < 1 or self.eval_peers < 1:
            problems.append("eval_every must be >= 0, eval_examples and eval_peers >= 1")
        if problems:
            raise UserError("invalid simulation settings: " + "; ".join(problems))

    def replace(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        body = dataclasses.asdict(self)
        body["run"] = json.loads(self.run.to_json())
        return body


# ----------------------------------------------------------------------------- topology


@dataclass
class Topology:
    """An undirected simple graph on peers 0..n-1."""

    name: str
    n: int
    edges: np.ndarray  # (E, 2) int64, i < j, sorted, unique

    def __post_init__(self) -> None:
        e = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        e = np.sort(e, axis=1)
        e = e[e[:, 0] != e[:, 1]]
        self.edges = np.unique(e, axis=0) if len(e) else e
        if len(self.edges) and (self.edges.min() < 0 or self.edges.max() >= self.n):
            raise UserError(f"topology '{self.name}': peer ids must be in 0..{self.n - 1}")
        self.degrees = np.bincount(self.edges.ravel(), minlength=self.n)
        # Directed arcs (both directions), the links a flood or a gossip exchange uses.
        self.arc_src = np.concatenate([self.edges[:, 0], self.edges[:, 1]])
        self.arc_dst = np.concatenate([self.edges[:, 1], self.edges[:, 0]])

    def neighbours(self, peer: int) -> np.ndarray:
        return np.sort(self.arc_dst[self.arc_src == peer])

    def hop_distances(self, sources: np.ndarray | None = None) -> np.ndarray:
        """(S, n) hop distances from each source (all peers by default); -1: unreachable."""
        sources = np.arange(self.n) if sources is None else np.asarray(sources)
        return bfs_hops(self.n, self.arc_src, self.arc_dst, sources)

    def describe(self) -> dict:
        hops = self.hop_distances()
        return {
            "name": self.name,
            "peers": self.n,
            "edges": len(self.edges),
            "degree_min": int(self.degrees.min()),
            "degree_max": int(self.degrees.max()),
            "diameter": int(hops.max()),
            "connected": bool((hops >= 0).all()),
        }


def bfs_hops(
    n: int,
    arc_src: np.ndarray,
    arc_dst: np.ndarray,
    sources: np.ndarray,
    alive: np.ndarray | None = None,
) -> np.ndarray:
    """Breadth-first hop distances from many sources at once, in NumPy.

    alive: optional (S, arcs) bool mask, one per source (its message's surviving
    links). Returns (S, n) int32 distances, -1 where a peer is unreachable.
    """
    sources = np.asarray(sources, dtype=np.int64)
    rows = np.arange(len(sources))
    dist = np.full((len(sources), n), -1, dtype=np.int32)
    dist[rows, sources] = 0
    if len(arc_src) == 0:
        return dist
    order = np.argsort(arc_dst, kind="stable")
    src, dst = arc_src[order], arc_dst[order]
    starts = np.minimum(np.searchsorted(dst, np.arange(n)), len(dst) - 1)
    has_in = np.bincount(dst, minlength=n) > 0
    alive = None if alive is None else alive[:, order]
    frontier = dist == 0
    hop = 0
    while frontier.any():
        hop += 1
        via = frontier[:, src]
        if alive is not None:
            via &= alive
        reached = np.logical_or.reduceat(via, starts, axis=1) & has_in
        frontier = reached & (dist < 0)
        dist[frontier] = hop
    return dist


def ring(n: int) -> Topology:
    i = np.arange(n)
    return Topology("ring", n, np.stack([i, (i + 1) % n], axis=1) if n > 1 else np.zeros((0, 2)))


def torus(n: int) -> Topology:
    """A rows x cols wrap-around grid, rows the largest divisor of n not above sqrt(n)."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    cols = n // rows
    r, c = np.divmod(np.arange(n), cols)
    right = r * cols + (c + 1) % cols
    down = ((r + 1) % rows) * cols + c
    i = np.arange(n)
    edges = np.concatenate([np.stack([i, right], 1), np.stack([i, down], 1)])
    return Topology(f"torus{rows}x{cols}", n, edges)


def complete(n: int) -> Topology:
    i, j = np.triu_indices(n, k=1)
    return Topology("complete", n, np.stack([i, j], axis=1))


def random_regular(n: int, degree: int, seed: int = 0) -> Topology:
    """A connected random `degree`-regular graph (networkx, which torch depends on)."""
    import networkx as nx

    if degree >= n or (n * degree) % 2:
        raise UserError(
            f"no {degree}-regular graph on {n} peers: need degree < peers and peers * degree even"
        )
    for attempt in range(100):
        graph = nx.random_regular_graph(degree, n, seed=seed + attempt)
        if nx.is_connected(graph):
            return Topology(f"random-regular{degree}", n, np.array(list(graph.edges)))
    raise UserError(f"could not draw a connected {degree}-regular graph on {n} peers")


def edges_from_file(path: str | Path, n: int) -> Topology:
    """Edges "i j" (0-based peer ids), one per line; '#' starts a comment."""
    pairs = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read edges file {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].replace(",", " ").split()
        if not text:
            continue
        if len(text) != 2 or not all(t.lstrip("-").isdigit() for t in text):
            raise UserError(f"{path}, line {number}: expected two peer ids 'i j'")
        pairs.append((int(text[0]), int(text[1])))
    return Topology(Path(path).stem, n, np.array(pairs, dtype=np.int64).reshape(-1, 2))


def make_topology(config: SimConfig) -> Topology:
    n = config.peers
    if config.topology == "ring":
        topo = ring(n)
    elif config.topology == "torus":
        topo = torus(n)
    elif config.topology == "complete":
        topo = complete(n)
    elif config.topology == "random-regular":
        topo = random_regular(n, config.degree, config.seed)
    else:
        topo = edges_from_file(config.edges_file, n)
    if n > 1 and not (topo.hop_distances(np.array([0])) >= 0).all():
        raise UserError(f"topology '{topo.name}' on {n} peers is not connected")
    return topo


def metropolis_hastings(topology: Topology, alive_edges: np.ndarray | None = None) -> torch.Tensor:
    """The gossip averaging matrix (n x n, sparse COO, float32).

    W_ij = 1 / (1 + max(deg_i, deg_j)) on each live edge, W_ii = 1 - sum_j W_ij.
    Degrees are those of the full topology, so dropping a link moves its
    weight to the diagonal: W stays symmetric and doubly stochastic.
    """
    edges = topology.edges if alive_edges is None else topology.edges[alive_edges]
    deg = topology.degrees.astype(np.float64)
    w = 1.0 / (1.0 + np.maximum(deg[edges[:, 0]], deg[edges[:, 1]]))
    diag = 1.0 - np.bincount(edges.ravel(), weights=np.repeat(w, 2), minlength=topology.n)
    i = np.concatenate([edges[:, 0], edges[:, 1], np.arange(topology.n)])
    j = np.concatenate([edges[:, 1], edges[:, 0], np.arange(topology.n)])
    values = np.concatenate([w, w, diag])
    index = torch.from_numpy(np.stack([i, j]))
    return torch.sparse_coo_tensor(
        index,
        torch.from_numpy(values).float(),
        (topology.n, topology.n),
        check_invariants=True,
    ).coalesce()


# ------------------------------------------------------------------------------ network


@dataclass
class Deliveries:
    """Message (round, sender) pairs reaching receivers: parallel index arrays."""

    round: int
    senders: np.ndarray
    receivers: np.ndarray


class FloodNetwork:
    """Floods one message per peer per round; tracks deliveries and bytes sent.

    `post` returns the (sender, receiver) pairs that do not hold a message by
    the end of its own round (later arrivals and never-arrivals); `deliver`
    returns the pairs that arrive at the end of a given round.
    """

    def __init__(self, topology: Topology, delay: int, loss: float, seed: int = 0) -> None:
        self.topology = topology
        self.n = topology.n
        self.delay = delay
        self.loss = loss
        self.rng = np.random.default_rng([seed, 0x5EED])
        self.bytes_sent = np.zeros(self.n, dtype=np.int64)  # per peer, cumulative
        self.bytes_by_round: dict[int, int] = defaultdict(int)
        self.transmissions = 0
        self.delivered_pairs = 0
        self.lost_pairs = 0  # (message, peer) pairs with no surviving path
        self._due: dict[int, list[Deliveries]] = defaultdict(list)
        self._sizes: dict[int, np.ndarray] = {}
        self._last_due: dict[int, int] = {}
        if loss == 0:
            # Without loss every round floods along the same shortest paths:
            # compute the pairs per hop once and share them between rounds.
            hops = topology.hop_distances()
            self._lossless_groups = self._group(hops)

    @staticmethod
    def _group(hops: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{hop: (senders, receivers)} for hop >= 1, and -1 for unreachable pairs."""
        groups = {}
        for h in np.unique(hops):
            if h == 0:
                continue
            senders, receivers = np.nonzero(hops == h)
            groups[int(h)] = (senders, receivers)
        return groups

    def post(self, round_: int, sizes: np.ndarray) -> list[Deliveries]:
        """Flood peer p's message of `round_` (sizes[p] bytes per hop) from every peer."""
        sizes = np.asarray(sizes, dtype=np.int64)
        if self.loss == 0:
            groups = self._lossless_groups
        else:
            alive = self.rng.random((self.n, len(self.topology.arc_src))) >= self.loss
            hops = bfs_hops(
                self.n, self.topology.arc_src, self.topology.arc_dst, np.arange(self.n), alive
            )
            groups = self._group(hops)
        self._sizes[round_] = sizes
        self._count(round_, np.arange(self.n), self.topology.degrees, sizes)
        late, last = [], round_
        for hop, (senders, receivers) in sorted(groups.items()):
            batch = Deliveries(round_, senders, receivers)
            if hop < 0:
                self.lost_pairs += len(senders)
                late.append(batch)
            elif hop * self.delay == 0:
                self._arrive(round_, batch)
            else:
                self._due[round_ + hop * self.delay].append(batch)
                last = max(last, round_ + hop * self.delay)
                late.append(batch)
        self._last_due[round_] = last
        return late

    def deliver(self, round_: int) -> list[Deliveries]:
        """Pairs whose message arrives at the end of `round_` (they forward it then)."""
        arrived = self._due.pop(round_, [])
        for batch in arrived:
            self._arrive(round_, batch)
        for sent in [s for s, last in self._last_due.items() if last <= round_]:
            del self._last_due[sent], self._sizes[sent]
        return arrived

    def _arrive(self, round_: int, batch: Deliveries) -> None:
        """Receivers forward to every neighbour but the one they got it from."""
        self.delivered_pairs += len(batch.receivers)
        copies = self.topology.degrees[batch.receivers] - 1
        self._count(round_, batch.receivers, copies, self._sizes[batch.round][batch.senders])

    def _count(self, round_: int, peers: np.ndarray, copies: np.ndarray, sizes: np.ndarray) -> None:
        volume = copies * sizes
        self.transmissions += int(copies.sum())
        self.bytes_sent += np.bincount(peers, weights=volume, minlength=self.n).astype(np.int64)
        self.bytes_by_round[round_] += int(volume.sum())

    def round_finished(self, sent_round: int) -> bool:
        """True once no delivery of `sent_round`'s messages is still scheduled."""
        return sent_round not in self._last_due


# ----------------------------------------------------------------------------- backlogs


class CoreBacklog:
    """SubCGE: for each peer, the r x r cores of the messages it has not received yet.

    The shared model S holds every message sent so far. `commit` subtracts
    U C V^T, so peer q's own model is S + sum_e U_e D_q,e V_e^T, where D_q,e
    folds q's missing messages of epoch e exactly as `accumulate` folds them
    (same coordinates, same coefficients). Memory: n * L * r^2 floats per
    epoch in flight, whatever the model size. When a peer's count of missing
    messages in an epoch reaches zero its core is reset to exact zeros, so
    once the network is quiet every peer's model is bitwise S again.
    """

    def __init__(self, engine: SubCGE, n: int) -> None:
        self.engine = engine
        self.n = n
        self.layers = len(engine.matrices)
        self.rank = engine.config.rank
        self.size = self.layers * self.rank * self.rank
        self.cores: dict[int, np.ndarray] = {}  # epoch -> (n, L * r * r) float64
        self.counts: dict[int, np.ndarray] = {}  # epoch -> (n,) messages missing
        self._terms: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # round -> index, value

    def add(self, round_: int, messages: list[UpdateMessage], late: list[Deliveries]) -> None:
        if not late:
            return
        config, r = self.engine.config, self.rank
        n, k = len(messages), config.directions
        a, b, sign = message_coordinates(
            config.run_key,
            [m.peer for m in messages],
            [m.round for m in messages],
            self.layers,
            r,
            k,
        )
        coef = np.stack([self.engine.coefficients(m) for m in messages])  # (n, k)
        index = np.arange(self.layers) * r * r + a * r + b  # (n, k, L) into a peer's core row
        value = sign * coef[:, :, None]
        self._terms[round_] = (index.reshape(n, k * self.layers), value.reshape(n, -1))
        self._fold(late, +1)

    def remove(self, arrived: list[Deliveries]) -> None:
        self._fold(arrived, -1)

    def forget(self, round_: int) -> None:
        self._terms.pop(round_, None)

    def _fold(self, batches: list[Deliveries], direction: int) -> None:
        by_epoch: dict[int, list[Deliveries]] = defaultdict(list)
        for batch in batches:
            by_epoch[self.engine.config.epoch_of(batch.round)].append(batch)
        for epoch, group in by_epoch.items():
            flat, weights, receivers = [], [], []
            for batch in group:
                index, value = self._terms[batch.round]
                flat.append((batch.receivers[:, None] * self.size + index[batch.senders]).ravel())
                weights.append(value[batch.senders].ravel())
                receivers.append(batch.receivers)
            total = np.bincount(
                np.concatenate(flat), np.concatenate(weights), minlength=self.n * self.size
            ).reshape(self.n, self.size)
            count = np.bincount(np.concatenate(receivers), minlength=self.n)
            if epoch not in self.cores:
                self.cores[epoch] = np.zeros((self.n, self.size))
                self.counts[epoch] = np.zeros(self.n, dtype=np.int64)
            self.cores[epoch] += direction * total
            self.counts[epoch] += direction * count
            if direction < 0:
                self.cores[epoch][self.counts[epoch] == 0] = 0.0
                if not self.counts[epoch].any():
                    del self.cores[epoch], self.counts[epoch]

    def has_missing(self, peer: int) -> bool:
        return any(count[peer] for count in self.counts.values())

    def nbytes(self) -> int:
        return sum(c.nbytes + self.counts[e].nbytes for e, c in self.cores.items())

    @torch.no_grad()
    def apply_view(self, peer: int) -> None:
        """Turn S into peer's model: add back U D V^T of its missing messages (O(r*d))."""
        r = self.rank
        for epoch, core in self.cores.items():
            if not self.counts[epoch][peer]:
                continue
            bases = self.engine.basis(epoch)
            for i, matrix in enumerate(self.engine.matrices):
                c = core[peer, i * r * r : (i + 1) * r * r]
                if c.any():
                    u, v = bases[i]
                    c = torch.from_numpy(c.reshape(r, r)).to(u.device, u.dtype)
                    matrix.as_2d().addmm_(u @ c, v.T)

    @torch.no_grad()
    def deviation_rows(self) -> list[torch.Tensor]:
        """Per matrix, the (n, m*k) differences between each peer's model and S."""
        r = self.rank
        rows = []
        for i, matrix in enumerate(self.engine.matrices):
            m, k = matrix.shape
            block = torch.zeros(self.n, m, k, dtype=torch.float32)
            for epoch, core in self.cores.items():
                u, v = self.engine.basis(epoch)[i]
                c = torch.from_numpy(core[:, i * r * r : (i + 1) * r * r].reshape(-1, r, r))
                block += torch.einsum("mr,nrs,ks->nmk", u.float(), c.float(), v.float())
            rows.append(block.reshape(self.n, m * k))
        return rows


class MessageBacklog:
    """Naive replay: for each peer, the messages it has not received yet.

    A peer's view is S minus its missing messages, applied by the engine
    itself (accumulate the negated messages, commit): O(missing * d) per view.
    """

    def __init__(self, engine: NaiveSeedReplay, n: int) -> None:
        self.engine = engine
        self.n = n
        self.missing: list[dict[tuple[int, int], UpdateMessage]] = [{} for _ in range(n)]
        self._messages: dict[int, list[UpdateMessage]] = {}

    def add(self, round_: int, messages: list[UpdateMessage], late: list[Deliveries]) -> None:
        if not late:
            return
        self._messages[round_] = messages
        for batch in late:
            for p, q in zip(batch.senders.tolist(), batch.receivers.tolist()):
                self.missing[q][(round_, p)] = messages[p]

    def remove(self, arrived: list[Deliveries]) -> None:
        for batch in arrived:
            for p, q in zip(batch.senders.tolist(), batch.receivers.tolist()):
                del self.missing[q][(batch.round, p)]

    def forget(self, round_: int) -> None:
        self._messages.pop(round_, None)

    def has_missing(self, peer: int) -> bool:
        return bool(self.missing[peer])

    def nbytes(self) -> int:
        return 64 * sum(len(m) for m in self.missing)  # rough: one small object per entry

    def apply_view(self, peer: int) -> None:
        back = [m.negated() for m in sorted(self.missing[peer].values())]
        self.engine.accumulate(back)
        self.engine.commit()

    @torch.no_grad()
    def deviation_rows(self) -> list[torch.Tensor]:
        shared = [m.weight.detach().clone() for m in self.engine.matrices]
        rows = [torch.zeros(self.n, m.weight.numel()) for m in self.engine.matrices]
        for peer in range(self.n):
            if not self.has_missing(peer):
                continue
            self.apply_view(peer)
            for block, matrix, s in zip(rows, self.engine.matrices, shared):
                block[peer] = (matrix.weight - s).reshape(-1).float()
                matrix.weight.copy_(s)
        return rows


# ------------------------------------------------------------------------------ methods


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
            self.engine.accumulate([message])
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


def simulate(config: SimConfig, progress: Any = None) -> dict:
    """Run one method; returns the JSON-ready result (see `write_outputs`)."""
    started = time.perf_counter()
    run = config.run
    model, tokenizer = load_model(run.model)
    task = load_task(run.dataset, text_column=run.text_column, label_column=run.label_column)
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


# ------------------------------------------------------------------------------ outputs


def _fmt_bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return str(value)


def markdown_table(results: list[dict]) -> str:
    """One row per run: final accuracy and loss, consensus, bytes, time."""
    head = (
        "| topology | peers | delay | loss | method | lr | rounds | accuracy | "
        "loss (start -> end) | reference acc | consensus mean / max | total bytes | "
        "bytes / peer | fwd passes | s / round | apply ms / round |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results:
        first, last = r["evals"][0], r["final"]
        acc = "-" if last["accuracy"] is None else f"{last['accuracy']:.3f}"
        ref = "-" if last["reference_accuracy"] is None else f"{last['reference_accuracy']:.3f}"
        cons = last["consensus"]
        lr = r["config"]["fo_lr"] if r["method"] == "dsgd" else r["config"]["run"]["lr"]
        lines.append(
            f"| {r['topology']['name']} | {r['topology']['peers']} | {r['config']['delay']} | "
            f"{r['config']['loss']:g} | {r['method']} | {lr:g} | "
            f"{last['round']} | {acc} | {first['loss']:.4f} -> {last['loss']:.4f} | {ref} | "
            f"{cons['mean_to_average']:.2e} / {cons['max_to_average']:.2e} | "
            f"{_fmt_bytes(r['bytes']['total'])} | {_fmt_bytes(r['bytes']['per_peer_mean'])} | "
            f"{last['forward_passes']} | {r['timing']['seconds_per_round']:.2f} | "
            f"{r['timing']['apply_ms_per_round']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


METHOD_COLOURS = {
    "seedflood": "tab:red",
    "seedflood-naive": "tab:purple",
    "dzsgd": "tab:green",
    "dsgd": "tab:orange",
    "centralized": "tab:blue",
}


def default_label(result: dict) -> str:
    return f"{result['method']} (n={result['topology']['peers']})"


def plot_runs(results: list[dict], path: Path, title: str, label: Any = default_label) -> None:
    """Accuracy and loss vs rounds, accuracy vs total bytes (log), consensus vs rounds.

    Colour: method; line style: the other settings (as told by `label`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_acc, ax_loss), (ax_bytes, ax_cons) = axes
    variants: dict[str, str] = {}
    for r in results:
        name = label(r)
        variant = name.split("(", 1)[-1]
        style = variants.setdefault(variant, ["-", "--", ":", "-."][len(variants) % 4])
        look = dict(color=METHOD_COLOURS.get(r["method"]), linestyle=style, marker="o", ms=3)
        ev = r["evals"]
        x = [e["round"] for e in ev]
        acc = [e["accuracy"] if e["accuracy"] is not None else np.nan for e in ev]
        ax_acc.plot(x, acc, label=name, **look)
        ax_loss.plot(x, [e["loss"] for e in ev], label=name, **look)
        sent = [e["bytes_total"] for e in ev]
        if any(sent):
            ax_bytes.plot(sent[1:], acc[1:], label=name, **look)
        cons = [e["consensus"]["mean_to_average"] for e in ev]
        if any(c > 0 for c in cons):
            ax_cons.plot(x, [c if c > 0 else np.nan for c in cons], label=name, **look)
    ax_acc.set(xlabel="round", ylabel="held-out accuracy (mean of sampled peers)")
    ax_loss.set(xlabel="round", ylabel="held-out loss (mean of sampled peers)")
    ax_bytes.set(xlabel="total bytes sent (all peers)", ylabel="held-out accuracy", xscale="log")
    ax_cons.set(xlabel="round", ylabel="consensus distance: mean ||x_i - avg||", yscale="log")
    ax_cons.text(
        0.02,
        0.02,
        "not drawn: methods whose peers are identical (0)",
        transform=ax_cons.transAxes,
        fontsize=8,
    )
    for ax in (ax_acc, ax_bytes, ax_cons):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_name(result: dict) -> str:
    cfg = result["config"]
    return f"{cfg['topology']}_n{cfg['peers']}_{result['method']}"


def write_outputs(results: list[dict], out: Path, prefix: str = "sim_") -> list[Path]:
    """JSON per run, one markdown table, and one PNG per topology."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for result in results:
        path = out / f"{prefix}{run_name(result)}.json"
        path.write_text(json.dumps(result, indent=1))
        written.append(path)
    table = out / f"{prefix}table.md"
    table.write_text(markdown_table(results))
    written.append(table)
    by_topology: dict[str, list[dict]] = defaultdict(list)
    for result in results:
        by_topology[result["config"]["topology"]].append(result)
    for topology, group in by_topology.items():
        path = out / f"{prefix}{topology}.png"
        plot_runs(
            group,
            path,
            f"{topology}: {group[0]['config']['run']['model']} on "
            f"{group[0]['config']['run']['dataset']}",
        )
        written.append(path)
    return written


# ---------------------------------------------------------------------------------- CLI

# RunConfig defaults for `seedflood simulate` (tiny model, synthetic task).
SIM_RUN_DEFAULTS = {"lr": 1e-3, "batch_size": 16}


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `seedflood simulate` (run settings too, as `seedflood train` has)."""
    from seedflood_p2p.core.flags import add_run_flags as _add_run_flags

    _add_run_flags(parser)
    d = SimConfig()
    g = parser.add_argument_group("simulation")
    g.add_argument(
        "--method",
        action="append",
        choices=METHODS,
        help="method to run (repeat for several; default: all)",
    )
    g.add_argument("--peers", type=int, default=d.peers, help=f"default {d.peers}")
    g.add_argument("--rounds", type=int, default=d.rounds, help=f"default {d.rounds}")
    g.add_argument("--topology", choices=TOPOLOGIES, default=d.topology)
    g.add_argument("--degree", type=int, default=d.degree, help="random-regular degree")
    g.add_argument("--edges", dest="edges_file", default="", help="edge list file ('i j' lines)")
    g.add_argument("--delay", type=int, default=d.delay, help="rounds per hop (default 1)")
    g.add_argument("--loss", type=float, default=d.loss, help="per-link loss rate (default 0)")
    g.add_argument("--partition", choices=["iid", "dirichlet"], default=d.partition)
    g.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet concentration")
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--eval-examples", type=int, default=d.eval_examples)
    g.add_argument("--eval-peers", type=int, default=d.eval_peers)
    g.add_argument("--fo-lr", type=float, default=d.fo_lr, help="DSGD learning rate")
    g.add_argument("--dzsgd-direction", choices=["subcge", "gaussian"], default=d.dzsgd_direction)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: 1 for tiny models)")
    g.add_argument("--out", type=Path, default=Path("runs/simulate"), help="output directory")


def sim_config_from_args(args: argparse.Namespace, method: str) -> SimConfig:
    from seedflood_p2p.core.flags import run_config_from_args

    run = run_config_from_args(args, defaults=SIM_RUN_DEFAULTS)
    if getattr(args, "n_ref", None) is None:
        run = run.replace(n_ref=args.peers)
    return SimConfig(
        method=method,
        peers=args.peers,
        rounds=args.rounds,
        topology=args.topology,
        degree=args.degree,
        edges_file=args.edges_file,
        delay=args.delay,
        loss=args.loss,
        partition=args.partition,
        alpha=args.alpha,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        eval_peers=args.eval_peers,
        fo_lr=args.fo_lr,
        dzsgd_direction=args.dzsgd_direction,
        seed=args.seed,
        run=run,
    )


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
        _fmt_bytes(record["bytes_total"]),
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
