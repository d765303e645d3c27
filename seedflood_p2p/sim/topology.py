"""Peer graphs of the simulator: ring, torus, complete, random-regular or an edge list;
hop distances (how far a flooded message travels per round) and the gossip
baselines' Metropolis-Hastings mixing matrix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.sim.config import SimConfig


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
