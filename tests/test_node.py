"""FloodNode on two real p2pd daemons (127.0.0.1): what one node guarantees on its own."""

import asyncio
import time

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.flood import FloodNode, NodeSettings
from seedflood_p2p.network.metrics import NodeMetrics
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


async def test_own_update_logged_but_never_sent_is_published_again(spawn, tmp_path):
    a = await spawn()
    b = await spawn(initial_peers=[str((await a.get_visible_maddrs())[0])])
    config = RunConfig(salt="test-node")
    ledgers = [Ledger(tmp_path / f"{n}.sqlite", config.run_id) for n in "ab"]
    own = UpdateMessage(3, a.peer_id.to_bytes(), (0.25,))
    ledgers[0].add([own])  # logged, then killed before publishing: no signed envelope
    settings = NodeSettings(repair_interval=0.3)
    nodes = [
        FloodNode(p2p, ledger, config.to_json(), NodeMetrics(), settings)
        for p2p, ledger in zip([a, b], ledgers, strict=True)
    ]
    try:
        for node in nodes:
            await node.start()
        for node in nodes:
            while not await node.connected_peers():
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # repair alone cannot help: an unsigned row is not served
        assert ledgers[1].scalars_of(own.peer, own.round) is None
        assert await nodes[0].republish_unsigned() == 1
        await _until(lambda: ledgers[1].scalars_of(own.peer, own.round) == own.scalars)
        await _until(lambda: not ledgers[0].unsigned(own.peer))  # the echo signed our row
        assert await nodes[0].republish_unsigned() == 0
        assert ledgers[0].digest() == ledgers[1].digest()
    finally:
        for node in nodes:
            await node.stop()
        for ledger in ledgers:
            ledger.close()


async def test_a_joiner_checks_what_it_fetched_against_every_source(spawn, tmp_path):
    """Issue 14: a joiner that synced from a source withholding a row finds, by comparing
    its ledger with every source's digests, that another source holds more; it fetches
    the row from that one, and reports the withholding source as lacking it."""
    import sqlite3

    a = await spawn()
    b = await spawn(initial_peers=[str((await a.get_visible_maddrs())[0])])
    entry = [str((await p.get_visible_maddrs())[0]) for p in (a, b)]
    j = await spawn(initial_peers=entry)
    config = RunConfig(salt="test-sources")
    ledgers = {n: Ledger(tmp_path / f"{n}.sqlite", config.run_id) for n in "abj"}
    settings = NodeSettings(repair_interval=3600.0)  # no anti-entropy: the test drives repair
    nodes = {
        n: FloodNode(p2p, ledgers[n], config.to_json(), NodeMetrics(), settings)
        for n, p2p in zip("abj", (a, b, j), strict=True)
    }
    author = a.peer_id.to_bytes()
    # rounds 1..65 in steps the receivers' window admits: bucket 0 (rounds 0-63) is
    # settled once bucket 1 holds a row
    rounds = list(range(1, 66, 8))
    try:
        for name in "ab":
            await nodes[name].start()
        await _until(lambda: len(ledgers["b"]) == 0)
        while not await nodes["a"].connected_peers():
            await asyncio.sleep(0.1)
        for round_ in rounds:
            ledgers["a"].add([UpdateMessage(round_, author, (0.25,))])
            assert await nodes["a"].republish_unsigned() == 1
            await _until(lambda r=round_: ledgers["b"].scalars_of(author, r) is not None)
        await _until(lambda: not ledgers["a"].unsigned(author))  # every row signed by its echo
        # b withholds round 1: what a source that drops rows would serve
        with sqlite3.connect(ledgers["b"].path) as db:
            db.execute("DELETE FROM messages WHERE round = 1")
            assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == len(rounds) - 1

        await nodes["j"].start()
        peers = {n: p.peer_id for n, p in (("a", a), ("b", b))}
        await nodes["j"].sync_round([peers["b"]])  # j's first source is the withholding one
        assert ledgers["j"].scalars_of(author, 1) is None
        check = await nodes["j"].cross_check([peers["a"], peers["b"]])
        assert ledgers["j"].scalars_of(author, 1) == (0.25,)  # fetched from a after the check
        assert ledgers["j"].digest() == ledgers["a"].digest()
        assert check.agree == [peers["a"].to_bytes()]
        assert check.lacking == {peers["b"].to_bytes(): 1}
        assert check.compared == 2 and not check.ahead and not check.unanswered
    finally:
        for node in nodes.values():
            await node.stop()
        for ledger in ledgers.values():
            ledger.close()
