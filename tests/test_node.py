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
