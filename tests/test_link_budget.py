"""A node keeps links to `max_links` peers it chose, not to every peer it hears of.

In a run of a thousand, dialling every peer heard of meant a dial and a repair pass per
peer, and p2pd's connection manager trims past 512 connections, which the reconnect loop
would redial. `choose_links` is the rule; the last test runs it on real p2pd daemons on
127.0.0.1 and floods a message over the sparse links it made.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque

import pytest

from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.reconnect import Reconnector, choose_links
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.network.transport.pubsub import PubSubClient

PEERS = [f"peer{i:03d}" for i in range(40)]


def test_a_node_chooses_max_links_peers_in_its_own_stable_order():
    first = choose_links("me", PEERS, set(), set(), [], 5)
    assert len(first) == 5 and set(first) <= set(PEERS)
    assert choose_links("me", list(reversed(PEERS)), set(), set(), [], 5) == first  # stable
    assert choose_links("you", PEERS, set(), set(), [], 5) != first  # each node its own
    assert sorted(choose_links("me", PEERS, set(), set(), [], 100)) == PEERS  # room for all


def test_a_failing_peer_is_still_redialled_and_the_next_takes_its_place():
    first = choose_links("me", PEERS, set(), set(), [], 5)
    failing = {first[0], first[2]}
    chosen = choose_links("me", PEERS, set(), failing, [], 5)
    assert failing <= set(chosen)  # still dialled (on its backoff)
    assert len([p for p in chosen if p not in failing]) == 5  # and 5 that answer
    # a failing peer that is connected again holds its place
    assert choose_links("me", PEERS, {first[0]}, failing, [], 5)[:2] == first[:2]


def test_the_bootstrap_is_dialled_only_while_the_node_has_too_few_connections():
    boot = ["bootstrap"]
    alone = choose_links("me", [*PEERS, *boot], set(), set(), boot, 5)
    assert "bootstrap" in alone
    linked = choose_links("me", PEERS, set(PEERS[:5]), set(), boot, 5)
    assert "bootstrap" not in linked  # 5 connections: no need of it
    # connections others made do not change its own choice
    assert linked == choose_links("me", PEERS, set(), set(), [], 5)


def test_the_links_of_many_nodes_form_one_connected_graph():
    rng = random.Random(7)
    nodes = [f"{rng.getrandbits(64):016x}" for _ in range(300)]
    edges: dict[str, set[str]] = {n: set() for n in nodes}
    for node in nodes:
        others = [n for n in nodes if n != node]
        for peer in choose_links(node, others, set(), set(), [], 3):
            edges[node].add(peer)
            edges[peer].add(node)
    degrees = sorted(len(e) for e in edges.values())
    assert degrees[0] >= 3 and sum(degrees) / len(degrees) < 7  # ~2 x 3, no hub
    seen, todo = {nodes[0]}, deque([nodes[0]])
    while todo:
        for peer in edges[todo.popleft()] - seen:
            seen.add(peer)
            todo.append(peer)
    assert len(seen) == len(nodes)


@pytest.mark.slow
async def test_daemons_with_a_link_budget_stay_sparse_and_gossip_reaches_everyone(spawn, tmp_path):
    n, budget = 8, 2
    # The kad DHT's routing-table refresh (a peer's daemons run it as a server) connects
    # every pair at this size whatever the reconnector dials (bench/results/mesh.md:
    # "connections/node"), so here it runs as a client: what is left is what we dialled.
    daemons = [await spawn(dht_mode="client") for _ in range(n)]
    ids = [d.peer_id.to_base58() for d in daemons]
    addrs = [
        [next(str(a).split("/p2p/")[0] for a in await d.get_visible_maddrs())] for d in daemons
    ]
    settings = NodeSettings(max_links=budget)
    reconnectors = []
    for i, daemon in enumerate(daemons):
        (tmp_path / str(i)).mkdir()
        r = Reconnector(daemon, tmp_path / str(i), [], settings, NodeMetrics())
        # heard of every other peer, as peer exchange would tell it
        r.add_hints({ids[j]: addrs[j] for j in range(n) if j != i}, "summary")
        reconnectors.append(r)
    for _ in range(2):
        for r in reconnectors:
            await r.dial_due()
    connected = [await r.refresh_connected() for r in reconnectors]
    dialled = [set(r.chosen(c)) for r, c in zip(reconnectors, connected, strict=True)]
    assert all(len(d) == budget for d in dialled)
    links = {frozenset((ids[i], p)) for i in range(n) for p in connected[i]}
    assert len(links) <= n * budget < n * (n - 1) // 2  # not every pair
    assert all(dialled[i] <= connected[i] for i in range(n))

    topic = "sf/linkbudget0000"
    clients = [PubSubClient(d) for d in daemons]
    subs = [await c.subscribe(topic) for c in clients]
    await asyncio.sleep(1.5)  # a few 0.2 s heartbeats graft the mesh
    await clients[0].publish(topic, b"one update")
    got = await asyncio.wait_for(asyncio.gather(*(sub.__anext__() for sub in subs[1:])), timeout=20)
    assert all(m.data == b"one update" for m in got)
    for c in clients:
        await c.close()
