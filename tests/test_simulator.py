"""The simulator: flood timing, bitwise consensus, byte counts, mixing weights, learning."""

import math

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.subcge import SubCGE
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.protocol.update import encode_update
from seedflood_p2p.sim.config import SimConfig
from seedflood_p2p.sim.methods import SeedFloodSimulation, make_setup, partition
from seedflood_p2p.sim.network import GOSSIPSUB_OVERHEAD_BYTES, FloodNetwork
from seedflood_p2p.sim.simulator import consensus_distance, simulate
from seedflood_p2p.sim.topology import complete, metropolis_hastings, random_regular, ring, torus
from seedflood_p2p.workload.data import load_task
from seedflood_p2p.workload.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def task():
    return load_task("synthetic-sentiment")


def _sim_config(**kw) -> SimConfig:
    run = kw.pop("run", {})
    peers = kw.get("peers", 4)
    base = dict(peers=peers, rounds=4, eval_every=0, eval_examples=32, eval_peers=2)
    base.update(kw)
    # scalars as sent, as `seedflood simulate` does by default (SIM_RUN_DEFAULTS)
    run = {"lr": 1e-3, "n_ref": peers, "batch_size": 8, "normalize": "none", **run}
    return SimConfig(run=RunConfig(**run), **base)


def _seedflood(config: SimConfig, task) -> SeedFloodSimulation:
    model, tokenizer = load_model(config.run.model)
    return SeedFloodSimulation(make_setup(config, tokenizer, task), model)


# -- topology and flooding ------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16, 33])
def test_flood_on_a_ring_with_delay_one_reaches_everyone_after_ceil_half_rounds(n):
    net = FloodNetwork(ring(n), delay=1, loss=0.0)
    late = net.post(0, np.full(n, 20))
    holders = np.eye(n, dtype=bool)  # holders[p, q]: q holds p's message of round 0
    expected = math.ceil((n - 1) / 2)
    for round_ in range(expected + 3):
        for batch in net.deliver(round_):
            assert not holders[batch.senders, batch.receivers].any(), "delivered twice"
            holders[batch.senders, batch.receivers] = True
        assert holders.all() == (round_ >= expected), round_
    assert sum(len(b.senders) for b in late) == n * (n - 1)
    assert net.delivered_pairs == n * (n - 1) and net.lost_pairs == 0


def test_hop_distances_of_the_topologies():
    assert torus(64).describe() == {
        "name": "torus8x8",
        "peers": 64,
        "edges": 128,
        "degree_min": 4,
        "degree_max": 4,
        "diameter": 8,
        "connected": True,
    }
    assert complete(9).describe()["diameter"] == 1
    rr = random_regular(50, 3, seed=1).describe()
    assert rr["degree_min"] == rr["degree_max"] == 3 and rr["connected"]


def test_lossy_flood_reaches_peers_through_surviving_paths_only():
    n, loss = 12, 0.3
    net = FloodNetwork(ring(n), delay=1, loss=loss, seed=3)
    late = net.post(0, np.full(n, 20))
    for round_ in range(n):
        net.deliver(round_)
    assert net.delivered_pairs + net.lost_pairs == n * (n - 1)
    assert 0 < net.lost_pairs < n * (n - 1)  # on a ring one lost link cuts one path
    unreachable = sum(len(b.senders) for b in late if b.round == 0) - net.delivered_pairs
    assert unreachable == net.lost_pairs


def test_flood_bytes_match_the_encoded_update_sizes(task):
    """Every peer sends to all neighbours once it has a message, except back to its sender."""
    n, rounds = 9, 3
    config = _sim_config(peers=n, rounds=rounds, topology="torus", delay=1)
    sim = _seedflood(config, task)
    sent = []
    accumulate = sim.engine.accumulate
    sim.engine.accumulate = lambda ms: (sent.extend(ms), accumulate(ms))[1]
    for t in range(rounds):
        sim.step(t)
    for t in range(rounds, rounds + 4):  # let the floods finish
        sim.network.deliver(t)
    topo = sim.setup.topology
    run_id = sim.engine.config.run_id
    size = {(m.round, m.peer): len(encode_update(run_id, m.round, m.scalars)) for m in sent}
    assert all(13 <= s <= 18 for s in size.values())
    per_message_hops = topo.degrees.sum() - (n - 1)  # 2E - (n - 1) transmissions
    expected_total = sum((s + GOSSIPSUB_OVERHEAD_BYTES) * per_message_hops for s in size.values())
    assert int(sim.bytes_sent.sum()) == expected_total
    assert sim.network.transmissions == len(sent) * per_message_hops
    # On a regular graph each peer originates one message per round and forwards
    # everyone else's (degree - 1) times.
    deg = int(topo.degrees[0])
    me = sim.setup.peer_ids[0]
    per_peer = sum(
        (s + GOSSIPSUB_OVERHEAD_BYTES) * (deg if sender == me else deg - 1)
        for (_, sender), s in size.items()
    )
    assert int(sim.bytes_sent[0]) == per_peer


def test_gossip_bytes_are_the_float32_models_sent_to_each_neighbour(task):
    config = _sim_config(method="dsgd", peers=6, rounds=2, topology="ring", fo_lr=0.01)
    result = simulate(config)
    d = result["trainable_parameters"]
    assert result["bytes"]["per_round"] == [6 * 2 * d * 4] * 2
    assert result["bytes"]["per_peer_max"] == 2 * 2 * d * 4


@pytest.mark.parametrize("topology", [ring(7), torus(12), complete(5), random_regular(10, 3)])
def test_metropolis_hastings_matrix_is_symmetric_and_doubly_stochastic(topology):
    rng = np.random.default_rng(0)
    for alive in (None, rng.random(len(topology.edges)) > 0.4):
        w = metropolis_hastings(topology, alive).to_dense().double()
        ones = torch.ones(topology.n, dtype=torch.float64)
        torch.testing.assert_close(w @ ones, ones, atol=1e-6, rtol=0)
        torch.testing.assert_close(ones @ w, ones, atol=1e-6, rtol=0)
        assert (w >= 0).all() and torch.equal(w, w.T)
        for i, j in topology.edges[alive if alive is not None else slice(None)]:
            assert w[i, j] > 0
        off_graph = torch.ones_like(w, dtype=torch.bool)
        off_graph.fill_diagonal_(False)
        off_graph[topology.edges[:, 0], topology.edges[:, 1]] = False
        off_graph[topology.edges[:, 1], topology.edges[:, 0]] = False
        assert (w[off_graph] == 0).all()


def test_dirichlet_shards_are_skewed_and_cover_the_training_set(task):
    shards = partition(task, 8, "dirichlet", alpha=0.1, seed=0)
    assert sum(len(s.train) for s in shards) == len(task.train)
    fractions = [np.mean([ex.label for ex in s.train]) for s in shards]
    assert max(fractions) - min(fractions) > 0.5
    iid = partition(task, 8, "iid", alpha=0.1, seed=0)
    assert max(len(s.train) for s in iid) - min(len(s.train) for s in iid) <= 1


def test_consensus_distance_of_known_points():
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    c = consensus_distance([x[:, :1], x[:, 1:]], 4)
    assert c["mean_to_average"] == pytest.approx(math.sqrt(2))
    assert c["max_pairwise"] == pytest.approx(math.sqrt(8))
    assert c["mean_pairwise"] == pytest.approx((4 * 2 + 2 * math.sqrt(8)) / 6)
    same = torch.full((5, 3), 0.1234567)
    assert consensus_distance([same], 5)["max_pairwise"] == 0.0


# -- SeedFlood state ------------------------------------------------------------------


def _weights(sim: SeedFloodSimulation) -> list[torch.Tensor]:
    return [m.weight.detach().clone() for m in sim.engine.matrices]


def test_zero_delay_keeps_every_peer_bitwise_identical(task):
    sim = _seedflood(_sim_config(peers=6, rounds=3, topology="ring", delay=0), task)
    for t in range(3):
        sim.step(t)
        assert not any(sim.backlog.has_missing(p) for p in range(6))
        assert sim.backlog.cores == {}
    shared = _weights(sim)
    for peer in range(6):  # each peer's own model is S, untouched by views
        snapshot = sim._snapshot()
        if sim.backlog.has_missing(peer):
            sim.backlog.apply_view(peer)
        assert all(torch.equal(a, b) for a, b in zip(_weights(sim), shared))
        sim._restore(snapshot)
    assert consensus_distance(sim.deviation_rows(), 6)["max_pairwise"] == 0.0


@pytest.mark.parametrize(
    "settings", [{}, {"directions": 4, "train_norms": True}], ids=["k1", "k4-norms"]
)
def test_delayed_peers_hold_base_plus_exactly_the_messages_they_received(task, settings):
    """A peer's view equals a fresh replay of the messages that reached it; quiet -> S."""
    n, rounds, delay = 6, 5, 1
    run = {"lr": 0.05, **settings}
    config = _sim_config(peers=n, rounds=rounds, topology="ring", delay=delay, run=run)
    sim = _seedflood(config, task)
    sent = []
    accumulate = sim.engine.accumulate
    sim.engine.accumulate = lambda ms: (sent.extend(ms), accumulate(ms))[1]
    hops = sim.setup.topology.hop_distances()
    index = {pid: i for i, pid in enumerate(sim.setup.peer_ids)}
    for t in range(rounds):
        sim.step(t)
    assert sim.backlog.has_missing(0)
    fresh, _ = load_model(config.run.model)
    for peer in (0, 3):
        received = [m for m in sent if m.round + hops[index[m.peer], peer] * delay <= rounds - 1]
        assert len(received) < len(sent)
        replay = SubCGE(fresh, sim.engine.config)
        base = [m.weight.detach().clone() for m in replay.matrices]
        replay.accumulate(sorted(received))
        replay.commit()
        snapshot = sim._snapshot()
        sim.backlog.apply_view(peer)
        for mine, theirs in zip(sim.engine.matrices, replay.matrices):
            torch.testing.assert_close(mine.weight, theirs.weight, atol=1e-6, rtol=0)
        sim._restore(snapshot)
        replay.close()
        for m, w in zip(replay.matrices, base):
            m.weight.data.copy_(w)
    # Once every flood has arrived, all peers hold exactly S again.
    for t in range(rounds, rounds + n):
        sim.backlog.remove(sim.network.deliver(t))
    assert not any(sim.backlog.has_missing(p) for p in range(n)) and sim.backlog.cores == {}


@pytest.mark.parametrize("step_rule", ["round_mean", "round_sqrt"])
def test_centralized_steps_each_update_at_its_rounds_size(task, step_rule):
    """The centralized baseline applies a round's n updates one after another, each the
    step it has in a round of n (lr / n at n_ref 1), not in a round of one."""
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.sim.methods import CentralizedSimulation

    run = dict(step_rule=step_rule, n_ref=1, normalize="unit", lr=1e-2)
    config = _sim_config(method="centralized", peers=4, rounds=1, run=run)
    model, tokenizer = load_model(config.run.model)
    sim = CentralizedSimulation(make_setup(config, tokenizer, task), model)
    sent = []
    accumulate = sim.engine.accumulate

    def recording(messages, sizes=None):  # what the baseline applied, for the replay
        sent.extend(messages)
        return accumulate(messages, sizes)

    sim.engine.accumulate = recording
    sim.step(0)
    assert len(sent) == 4
    expected, _ = load_model(config.run.model)
    replay(expected, config.run.replace(estimator="subcge"), sorted(sent, key=lambda m: m.peer))
    trained = dict(model.named_parameters())
    for name, w in expected.named_parameters():
        torch.testing.assert_close(trained[name], w, atol=1e-6, rtol=0, msg=name)


# -- learning -------------------------------------------------------------------------

# Settings measured to lower the held-out loss steadily (see the test below).
LEARNS = {
    "seedflood": dict(rounds=60, run={"lr": 4e-4}),
    "seedflood-naive": dict(rounds=60, run={"lr": 4e-4}),
    "dzsgd": dict(rounds=60, run={"lr": 4e-4}),
    "centralized": dict(rounds=60, run={"lr": 4e-4}),
    "dsgd": dict(rounds=30, fo_lr=0.003),
}


@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=() if m == "seedflood" else pytest.mark.slow) for m in LEARNS],
)
def test_a_tiny_run_of_each_method_lowers_held_out_loss(method):
    settings = dict(LEARNS[method])
    config = _sim_config(
        method=method,
        peers=4,
        topology="ring",
        delay=1,
        eval_examples=100,
        eval_every=settings["rounds"] // 3,
        run={"batch_size": 16, **settings.pop("run", {})},
        **settings,
    )
    result = simulate(config)
    losses = [e["loss"] for e in result["evals"]]
    assert losses[-1] < losses[0] - 0.005, losses
    assert np.mean(losses[1:]) < losses[0], losses
