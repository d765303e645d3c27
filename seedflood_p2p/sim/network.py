"""The simulated network: which peer holds which flooded message when (hop distance x
delay, per-link loss) and the bytes those transmissions cost."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from seedflood_p2p.sim.topology import Topology, bfs_hops

# Measured on this project's p2pd GossipSub (bench/results/network.md, byte-counting
# proxy): a signed (Ed25519) 18-byte update on the run's topic costs 192 bytes per hop.
# (bench/results/sim_* were computed with the earlier figure, 186 - 30 = 156.)
GOSSIPSUB_OVERHEAD_BYTES = 192 - 18


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
