"""A peer that comes back on its address is dialled at once, not after p2pd's backoff.

libp2p's swarm backs off a peer's addresses after a failed dial (5 s + tries^2 s, up to
5 minutes) and answers "dial backoff" meanwhile; p2pd's control protocol cannot clear it.
The 30-minute partition bench found every node in that 5-minute backoff when the
partition healed (first reconnection ~3 minutes after the heal). So the Reconnector
probes the TCP addresses of a peer that failed, and asks the daemon to dial only once one
answers: the daemon's backoff does not grow while the peer is away. Real p2pd daemons on
127.0.0.1.
"""

from __future__ import annotations

import asyncio

import pytest

from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.reconnect import Reconnector, tcp_answers
from seedflood_p2p.network.settings import NodeSettings


@pytest.mark.slow
async def test_a_peer_back_on_its_address_is_dialled_at_once(spawn, tmp_path):
    key = tmp_path / "b.key"
    b = await spawn(identity_path=key)
    b_id = b.peer_id.to_base58()
    addr = next(str(a).split("/p2p/")[0] for a in await b.get_visible_maddrs())
    await b.shutdown()
    (tmp_path / "a").mkdir()
    a = await spawn()
    reconnector = Reconnector(a, tmp_path / "a", [], NodeSettings(), NodeMetrics())
    for _ in range(3):  # the peer is gone: every dial fails
        assert await reconnector._dial(b_id, [addr]) != ""
    await spawn(identity_path=key, host_maddrs=[addr])  # back, same id and address
    # Dialled through the daemon every time, the second and third failures were "dial
    # backoff" and so is this one (the daemon waits 6 s+ after its first failure).
    assert await reconnector._dial(b_id, [addr]) == ""
    assert b_id in await reconnector.refresh_connected()


async def test_tcp_answers_tells_a_listening_port_from_a_closed_one():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    assert await tcp_answers([f"/ip4/127.0.0.1/tcp/{port}"]) is True
    server.close()
    await server.wait_closed()
    assert await tcp_answers([f"/ip4/127.0.0.1/tcp/{port}"]) is False
    # Not plain TCP (relayed, DNS): only the daemon can tell.
    relayed = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWA/p2p-circuit"
    assert await tcp_answers([relayed]) is None
    assert await tcp_answers(["/dns4/example.org/tcp/4001"]) is None
