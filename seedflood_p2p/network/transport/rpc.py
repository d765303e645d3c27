"""Request/response: unary calls multiplexed over hivemind's persistent daemon connection.

GossipSub gives no delivery guarantee, so what a peer missed is fetched with these calls
(repair, manifest, summaries). Sizes are capped both ways.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID

from seedflood_p2p.network.transport.p2pd import RemoteCallError

DEFAULT_RPC_LIMIT = 1 << 20  # request/response size limit for serve_bytes / call_bytes


async def serve_bytes(
    p2p: P2P,
    name: str,
    handler: Callable[[PeerID, bytes], Awaitable[bytes]],
    *,
    max_request: int = DEFAULT_RPC_LIMIT,
    max_response: int = DEFAULT_RPC_LIMIT,
) -> None:
    """Answer `call_bytes(..., name, ...)` from other peers with ``await handler(peer, request)``.

    Oversized requests are rejected without calling the handler; an exception in the handler
    or an oversized response reaches the caller as RemoteCallError.
    """

    async def unary(request: BytesValue, context: P2PContext) -> BytesValue:
        if len(request.value) > max_request:
            raise ValueError(f"request of {len(request.value)} bytes exceeds {max_request}")
        response = await handler(context.remote_id, request.value)
        if len(response) > max_response:
            raise ValueError(f"response of {len(response)} bytes exceeds {max_response}")
        return BytesValue(value=bytes(response))

    await p2p.add_protobuf_handler(name, unary, BytesValue)


async def call_bytes(
    p2p: P2P,
    peer_id: PeerID | str,
    name: str,
    request: bytes,
    timeout: float,
    *,
    max_request: int = DEFAULT_RPC_LIMIT,
    max_response: int = DEFAULT_RPC_LIMIT,
) -> bytes:
    """Send `request` to handler `name` on `peer_id`, return its response bytes.

    Raises ValueError for an oversized request and RemoteCallError for everything that can go
    wrong on the way (unreachable peer, no such handler, handler error, timeout, size limit).
    """
    if isinstance(peer_id, str):
        peer_id = PeerID.from_base58(peer_id)
    if len(request) > max_request:
        raise ValueError(f"request of {len(request)} bytes exceeds {max_request}")
    try:
        call = p2p.call_protobuf_handler(peer_id, name, BytesValue(value=request), BytesValue)
        response = (await asyncio.wait_for(call, timeout)).value
    except TimeoutError as e:
        raise RemoteCallError(f"call {name!r} to {peer_id} timed out after {timeout} s") from e
    except Exception as e:
        raise RemoteCallError(f"call {name!r} to {peer_id} failed: {e}") from e
    if len(response) > max_response:
        raise RemoteCallError(f"response of {len(response)} bytes from {peer_id} exceeds limit")
    return response
