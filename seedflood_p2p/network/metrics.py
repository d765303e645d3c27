"""Counters and gauges of a node, exported for Prometheus and as a JSON status page.

One small asyncio HTTP server per daemon: `GET /metrics` (Prometheus text
format) and `GET /status` (JSON, read by `seedflood status`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest

from seedflood_p2p.protocol.wire import DROP_REASONS

log = logging.getLogger("seedflood.metrics")


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Gauge("seedflood_round", "current training round", registry=r)
        self.accepted = Counter(
            "seedflood_messages_accepted", "update messages accepted", ["source"], registry=r
        )
        self.dropped = Counter(
            "seedflood_messages_dropped", "update messages dropped", ["reason"], registry=r
        )
        self.published = Counter("seedflood_messages_published", "own updates", registry=r)
        self.bytes_in = Counter("seedflood_bytes_in", "payload bytes received", registry=r)
        self.bytes_out = Counter("seedflood_bytes_out", "payload bytes published", registry=r)
        self.peers = Gauge("seedflood_peers_alive", "training peers heard recently", registry=r)
        self.loss = Gauge("seedflood_train_loss", "last training loss", registry=r)
        self.eval_accuracy = Gauge("seedflood_eval_accuracy", "last held-out accuracy", registry=r)
        self.round_seconds = Gauge("seedflood_round_seconds", "last round's duration", registry=r)
        self.staleness = Gauge(
            "seedflood_staleness_rounds", "own round minus slowest live peer's", registry=r
        )
        self.ledger_size = Gauge("seedflood_ledger_messages", "messages in the ledger", registry=r)
        # SHA-256 of the live weights, updated when the peer is ready, at each eval and at
        # the checkpoint (hashing every round would cost ~0.5 s on SmolLM2).
        self.model = Info("seedflood_model", "live model weights hash", registry=r)
        self.repaired = Counter(
            "seedflood_messages_repaired", "messages fetched by anti-entropy", registry=r
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for source in ("gossip", "repair", "own"):
            self.accepted.labels(source)

    def drop_counts(self) -> dict[str, int]:
        return {r: int(value(self.dropped.labels(r))) for r in DROP_REASONS}

    def accepted_counts(self) -> dict[str, int]:
        return {s: int(value(self.accepted.labels(s))) for s in ("gossip", "repair", "own")}


def value(metric: Counter | Gauge) -> float:
    """Current value of an unlabelled (or already labelled) metric."""
    return metric._value.get()  # prometheus_client has no public getter


async def serve_http(
    host: str,
    port: int,
    metrics: NodeMetrics,
    status: Callable[[], dict[str, Any]],
    finish_after: Callable[[int], dict[str, Any]] | None = None,
) -> asyncio.Server:
    """Serve GET /metrics and /status on (host, port); port 0 picks a free port.

    `POST /finish?after_round=N` (from this machine only) asks the peer to stop gracefully
    after round N: the demo uses it to end every peer at the same round."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            for _ in range(100):  # headers are skipped; a client sending more is cut off
                if await asyncio.wait_for(reader.readline(), 5) in (b"\r\n", b"\n", b""):
                    break
            else:
                return
            parts = request.split()
            method = parts[0].decode() if parts else "GET"
            path = parts[1].decode() if len(parts) > 1 else "/"
            client = (writer.get_extra_info("peername") or ("",))[0]
            if method == "POST" and path.startswith("/finish") and finish_after is not None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
                if client not in ("127.0.0.1", "::1"):
                    body, code = b"only from this machine\n", "403 Forbidden"
                    kind = "text/plain"
                elif "after_round" not in query or not (
                    query["after_round"][0].isascii() and query["after_round"][0].isdigit()
                ):
                    body, code = b"usage: POST /finish?after_round=N\n", "400 Bad Request"
                    kind = "text/plain"
                else:
                    reply = finish_after(int(query["after_round"][0]))
                    body, kind, code = json.dumps(reply).encode(), "application/json", "200 OK"
            elif path.startswith("/metrics"):
                body, kind, code = generate_latest(metrics.registry), "text/plain", "200 OK"
            elif path.startswith("/status"):
                body = json.dumps(status(), default=str).encode()
                kind, code = "application/json", "200 OK"
            else:
                body, kind, code = b"try /status or /metrics\n", "text/plain", "404 Not Found"
            head = f"HTTP/1.1 {code}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except Exception as exc:  # a bad HTTP client must not hurt the daemon
            log.debug("http request failed: %s", exc)
        finally:
            writer.close()

    try:
        return await asyncio.start_server(handle, host, port)
    except OSError as exc:
        from seedflood_p2p.core.errors import UserError

        raise UserError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror}): the port is in use; "
            "choose another with --metrics-port or 0 for any free port"
        ) from None
