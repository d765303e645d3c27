"""FloodNode on two real p2pd daemons (127.0.0.1): what one node guarantees on its own."""

import asyncio
import time

import pytest

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_own_update_logged_but_never_sent_is_published_again(spawn, tmp_path):
    a = await spawn()
    b = await spawn(initial_peers=[str((await a.get_visible_maddrs())[0])])
    config = RunConfig(salt="test-node")
    ledgers = [Ledger(tmp_path / f"{n}.sqlite", config.run_id) for n in "ab"]
    own = UpdateMessage(3, a.peer_id.to_bytes(), (0.25,))
    ledgers[0].add([own])  # logged, then killed before publishing: no signed envelope
    settings = NodeSettings(repair_interval=0.3)
    nodes = [
        FloodNode(p2p, ledger, config, NodeMetrics(), settings)
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
        n: FloodNode(p2p, ledgers[n], config, NodeMetrics(), settings)
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
            # and signed by its own echo before the next row: an unsigned one would be
            # published again with it (CI under load: 2, not 1)
            await _until(lambda: not ledgers["a"].unsigned(author))
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


@pytest.mark.slow
async def test_stop_leaves_a_task_that_ignores_cancellation_behind(spawn, tmp_path, monkeypatch):
    """A task stuck in a call that swallows its cancellation (seen once: a daemon that never
    checkpointed after its last round) costs `stop` STOP_SECONDS, not forever."""
    from seedflood_p2p.network.gossip import flood

    monkeypatch.setattr(flood, "STOP_SECONDS", 0.5)
    p2p = await spawn()
    config = RunConfig(salt="test-node-stop")
    ledger = Ledger(tmp_path / "l.sqlite", config.run_id)
    node = FloodNode(p2p, ledger, config, NodeMetrics(), NodeSettings())
    await node.start()
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue  # what a stuck library call may do

    node._tasks.append(asyncio.create_task(stubborn(), name="stubborn"))
    started = time.monotonic()
    await asyncio.wait_for(node.stop(), timeout=20)
    assert time.monotonic() - started < 10
    release.set()
    node._tasks[-1].cancel()
    ledger.close()


async def test_a_control_request_p2pd_never_answers_fails_with_a_clear_error(tmp_path):
    """A daemon socket that accepts a request and never answers: the call gives up after the
    client's timeout, naming the request, and frees the shared connection."""
    import types

    from seedflood_p2p.network.transport.pubsub import PubSubClient, TransportError

    path = str(tmp_path / "p2pd.sock")
    held = []

    async def silent(reader, writer):
        held.append(writer)  # read nothing back, answer nothing
        await reader.read()

    server = await asyncio.start_unix_server(silent, path)
    fake_daemon = types.SimpleNamespace(peer_id=None, daemon_listen_maddr={"unix": path})
    client = PubSubClient(fake_daemon, timeout=0.5)
    try:
        started = time.monotonic()
        try:
            await client.list_peers("some-topic")
        except TransportError as exc:
            assert "did not answer LIST_PEERS within 0.5 s" in str(exc)
        else:
            raise AssertionError("an unanswered request returned")
        assert time.monotonic() - started < 5
        assert client._conn is None  # the next call opens a fresh connection
    finally:
        for writer in held:
            writer.close()
        server.close()
        await client.close()
