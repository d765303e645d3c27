"""The flood node's peer table (network/gossip/peer_table.py) and the waiting round's look
on it (`Pacing.behind`): each answer equals a pass over every peer, on random histories
of updates heard, forgotten peers, clock steps and timeouts."""

import random

import pytest

from peer.rounds import Pacing
from peer.settings import PeerSettings
from seedflood_p2p.network.gossip.peer_table import PeerTable
from seedflood_p2p.network.monitoring.metrics import NodeMetrics


def _live_by_pass(table: PeerTable, now: float, timeout: float) -> dict:
    return {p: st for p, st in table.items() if now - st.last_seen < timeout}


def _random_history(rng: random.Random, table: PeerTable, steps: int, check) -> None:
    """Updates heard (alive or by repair), peers forgotten, the clock moving on in steps
    short and long against the timeout; `check(now)` after each step."""
    peers = [bytes([i]) * 38 for i in range(40)]
    now = 1000.0
    for _ in range(steps):
        kind = rng.random()
        peer = rng.choice(peers)
        if kind < 0.6:
            round_ = rng.randrange(0, 30)
            table.heard(peer, round_, now if rng.random() < 0.8 else None)
        elif kind < 0.65:
            table.forget(peer)
        now += rng.choice([0.0, 0.1, 1.0, 5.0, 20.0])
        check(now)


@pytest.mark.parametrize("seed", range(4))
def test_the_live_peers_and_their_rounds_equal_a_pass_over_every_peer(seed):
    rng = random.Random(seed)
    table = PeerTable()
    timeouts = [10.0, 10.0, 10.0, 3.0]  # mostly one timeout; another rebuilds the index

    def check(now: float) -> None:
        timeout = rng.choice(timeouts)
        expected = _live_by_pass(table, now, timeout)
        assert table.live(now, timeout) == expected
        assert table.live_count(now, timeout) == len(expected)
        rounds = {}
        for p, st in expected.items():
            rounds.setdefault(st.round, set()).add(p)
        assert list(table.live_rounds(now, timeout)) == sorted(rounds.items())
        probe = rng.choice(list(table) or [b"x" * 38])
        assert table.is_live(probe, now, timeout) == (probe in expected)

    _random_history(rng, table, 600, check)


def test_a_peer_heard_only_by_repair_is_known_but_not_live():
    table = PeerTable()
    table.heard(b"r" * 38, 7)  # history by repair: its round, no sign of life
    assert table[b"r" * 38].round == 7 and table.live_count(100.0, 60.0) == 0
    table.heard(b"r" * 38, 5, now=100.0)  # gossip of an older round: alive, round kept
    assert table[b"r" * 38].round == 7 and table.live(130.0, 60.0) == {b"r" * 38: table[b"r" * 38]}
    assert table.live_count(160.0, 60.0) == 0  # 60 s unheard: no longer live


def _behind_by_pass(pacing: Pacing, table: PeerTable, now: float, oldest: int, in_step: int):
    """What `Pacing.wait_ready` computed before the index: every live peer, filtered."""
    live = {
        p: st
        for p, st in _live_by_pass(table, now, pacing.s.liveness_timeout).items()
        if not pacing.banned(p) and not pacing.probationer(p)
    }
    laggards = {p for p in pacing.laggards if p in live and live[p].round < in_step}
    behind = {p for p, st in live.items() if st.round < oldest and p not in laggards}
    slowest = min((st.round for st in live.values()), default=None)
    return behind, slowest, laggards


@pytest.mark.parametrize("seed", range(4))
def test_the_waiting_rounds_look_equals_a_pass_over_every_live_peer(seed):
    """Who is behind (live, not banned, not on probation, not a laggard), the slowest round
    and the laggards kept: the same as a pass over every peer."""
    rng = random.Random(100 + seed)
    table = PeerTable()
    banned: set[bytes] = set()
    probation: set[bytes] = set()
    settings = PeerSettings(liveness_timeout=10.0, max_staleness=2)
    pacing = Pacing(
        settings,
        NodeMetrics(),
        lambda: table,
        lambda: False,
        banned=banned.__contains__,
        probationer=probation.__contains__,
    )

    def check(now: float) -> None:
        known = list(table)
        for group in (banned, probation, pacing.laggards):
            if known and rng.random() < 0.3:
                group.add(rng.choice(known))
            if group and rng.random() < 0.2:
                group.discard(rng.choice(sorted(group)))
        round_ = rng.randrange(5, 32)
        oldest, in_step = round_ - 1 - settings.max_staleness, round_ - 1
        expected, slowest, laggards = _behind_by_pass(pacing, table, now, oldest, in_step)
        behind, found = pacing.behind(now, oldest, in_step)
        assert (set(behind), found, pacing.laggards) == (expected, slowest, laggards)
        assert len(behind) == len(set(behind))

    _random_history(rng, table, 600, check)
