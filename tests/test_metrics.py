"""The metrics and status endpoint, and metric values, in process (no daemon)."""

import socket
from pathlib import Path

import aiohttp
import pytest

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, serve_http, value


def test_value_reads_counters_gauges_and_labelled_children():
    metrics = NodeMetrics()
    metrics.bytes_out.inc(18)
    metrics.bytes_out.inc(14)
    metrics.loss.set(0.625)
    metrics.dropped.labels("malformed").inc(2)
    metrics.accepted.labels("gossip").inc()
    assert value(metrics.bytes_out) == 32
    assert value(metrics.loss) == 0.625
    assert value(metrics.bytes_in) == 0
    assert metrics.drop_counts()["malformed"] == 2 and metrics.drop_counts()["duplicate"] == 0
    assert metrics.accepted_counts() == {"gossip": 1, "repair": 0, "own": 0}


async def test_endpoints_serve_status_metrics_and_finish():
    metrics = NodeMetrics()
    metrics.dropped.labels("wrong_run").inc()
    asked = []

    def finish_after(round_: int) -> dict:
        asked.append(round_)
        return {"final_round": round_ + 1}

    status = {"round": 3, "data_dir": Path("/tmp/x")}  # not JSON by itself: sent as str
    http = await serve_http("127.0.0.1", 0, metrics, lambda: status, finish_after)
    base = f"http://127.0.0.1:{http.port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/status") as r:
                assert r.status == 200 and await r.json() == {"round": 3, "data_dir": "/tmp/x"}
            async with session.get(f"{base}/metrics") as r:
                text = await r.text()
                assert r.status == 200 and r.content_type == "text/plain"
                assert 'seedflood_messages_dropped_total{reason="wrong_run"} 1.0' in text
            for method, path in [("GET", "/"), ("GET", "/finish"), ("GET", "/nothing")]:
                async with session.request(method, base + path) as r:
                    assert r.status == 404 and await r.text() == "try /status or /metrics\n"
            for query in ["", "?after_round=", "?after_round=-1", "?after_round=x", "?round=2"]:
                async with session.post(f"{base}/finish{query}") as r:
                    assert r.status == 400 and "usage" in await r.text()
            for huge in [str(10**26), "1" * 5000, str(2**62)]:  # beyond any round: not a 500
                async with session.post(f"{base}/finish?after_round={huge}") as r:
                    assert r.status == 400 and "after_round must be 0.." in await r.text()
            assert asked == []
            async with session.post(f"{base}/finish?after_round=7") as r:
                assert r.status == 200 and await r.json() == {"final_round": 8}
            assert asked == [7]
    finally:
        await http.close()
    with socket.socket() as s:  # closed: the port is free again
        s.bind(("127.0.0.1", http.port))


async def test_without_finish_there_is_no_finish_endpoint():
    http = await serve_http("127.0.0.1", 0, NodeMetrics(), lambda: {"role": "bootstrap"})
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{http.port}/finish?after_round=1") as r:
                assert r.status == 404
    finally:
        await http.close()


async def test_a_port_in_use_is_one_readable_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(UserError, match="the port is in use"):
            await serve_http("127.0.0.1", s.getsockname()[1], NodeMetrics(), dict)
