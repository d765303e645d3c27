"""The run page: /run.json over a real ledger (paging, bounds, bad requests), the page's
self-containment, the run-wide status line, and the page in headless Chromium on a live
tiny-model run."""

import asyncio
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from bootstrap.evaluator import LedgerEvaluator
from harness.cluster import RUN, start_bootstrap, start_peer
from seedflood.cli import main
from seedflood_p2p import __version__
from seedflood_p2p.apps.status import format_run_line, format_status
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, serve_http
from seedflood_p2p.network.monitoring.runpage import (
    MAX_LIMIT,
    Observed,
    RunPage,
    add_routes,
    page_html,
)
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.storage.ledger import Ledger

PEERS = [bytes([0, 36, 8, 1, 18, 32]) + bytes([i]) * 32 for i in (1, 2, 3)]  # Ed25519-shaped


def _page(tmp_path: Path, rounds: int = 30) -> RunPage:
    ledger = Ledger(tmp_path / "ledger.sqlite", "run-x")
    # peer 0 trains every round, peer 1 from round 5, peer 2 only the even rounds
    ledger.add(
        UpdateMessage(r, p, (0.5,))
        for r in range(rounds)
        for i, p in enumerate(PEERS)
        if i == 0 or (i == 1 and r >= 5) or (i == 2 and r % 2 == 0)
    )
    ledger.add_audits([AuditRecord(PEERS[1], 7, PEERS[0], (0.5,))])
    seen = {"round": rounds - 1}

    def observe() -> Observed:
        return Observed(
            round=seen["round"],
            state="serving",
            peers_alive={PEERS[0]: seen["round"], PEERS[1]: seen["round"]},
            bytes_in=1000 + seen["round"],
            bytes_out=0,
            banned=[{"peer": "12D3KooBanned", "reason": "equivocation", "since": 1.0}],
            network={"state": "connected", "connected_peers": 2, "known_peers": 3},
        )

    page = RunPage(ledger, {"model": "tiny-llama"}, "12D3KooServer", "bootstrap", observe, "none")
    page.sample(now=100.0)
    page.record_eval(0, 0.7, 0.5, 0.69)
    page.record_eval(20, 0.6, 0.75, 0.55)
    return page


def test_snapshot_pages_the_ledger_by_rounds(tmp_path):
    page = _page(tmp_path)
    first = page.snapshot(0, 10)
    assert first["window"] == {"since_round": 0, "until_round": 9, "limit": 10}
    assert first["next_since_round"] == 10
    assert [r for r, _ in first["updates"]] == list(range(10))
    names = [p["id"] for p in first["peers"]]
    by_round = {r: sorted(names[i] for i in ids) for r, ids in first["updates"]}
    assert len(by_round[4]) == 2 and len(by_round[5]) == 1 + 1 and len(by_round[6]) == 3
    rows = {p["id"]: p for p in first["peers"]}
    assert sorted(p["rows"] for p in rows.values()) == [0, 15, 25, 30]  # + the banned one
    states = sorted(p["state"] for p in rows.values())
    assert states == ["alive", "alive", "banned (equivocation)", "silent"]
    assert first["audits"] == [[7, 1]]
    assert first["evals"] == [{"round": 0, "loss": 0.7, "accuracy": 0.5, "train_loss": 0.69}]
    assert first["run"]["latest_heldout"]["accuracy"] == 0.75
    assert first["run"]["round"] == 29 and first["run"]["peers_alive"] == 2
    last = page.snapshot(25, MAX_LIMIT)
    assert last["next_since_round"] is None
    assert [r for r, _ in last["updates"]] == [25, 26, 27, 28, 29]
    assert last["evals"] == [] and last["audits"] == []
    with pytest.raises(ValueError, match="usage"):
        page.snapshot(0, MAX_LIMIT + 1)


def test_a_crowded_run_lists_the_alive_and_busiest_peers(tmp_path, monkeypatch):
    from seedflood_p2p.network.monitoring import runpage

    monkeypatch.setattr(runpage, "MAX_PEERS", 2)
    page = _page(tmp_path)
    data = page.snapshot(0, 10)
    assert len(data["peers"]) == 2 and data["peers_omitted"] == 2
    assert data["run"]["peers_known"] == 4
    assert all(p["state"] == "alive" for p in data["peers"])
    assert {i for _, ids in data["updates"] for i in ids} == {-1, 0, 1}  # -1: not listed


def test_a_peer_heard_lately_but_far_behind_is_lagging(tmp_path):
    page = _page(tmp_path)
    slow = bytes([0, 36, 8, 1, 18, 32]) + bytes([9]) * 32
    page.ledger.add(UpdateMessage(r, slow, (0.5,)) for r in range(21))
    seen = page.observe()
    seen.peers_alive[slow] = 20  # heard within the liveness window, 9 rounds behind 29
    page.observe = lambda: seen
    page.sample(now=200.0)
    page._totals = None
    states = {p["id"]: p["state"] for p in page.snapshot(0, 10)["peers"]}
    assert sorted(states.values()) == [
        "alive",
        "alive",
        "banned (equivocation)",
        "lagging (9 rounds behind)",
        "silent",
    ]


def test_samples_are_taken_when_the_round_moves_or_every_ten_seconds(tmp_path):
    page = _page(tmp_path)
    page.sample(now=101.0)  # same round, 1 s later: nothing new
    assert len(page.samples) == 1
    page.sample(now=111.0)
    assert len(page.samples) == 2
    assert page.samples[0]["ledger"] == 70 and page.samples[0]["peers_alive"] == 2


async def test_run_endpoints_answer_bad_requests_with_4xx_and_keep_serving(tmp_path):
    page = _page(tmp_path)
    http = await serve_http(
        "127.0.0.1",
        0,
        NodeMetrics(),
        lambda: {"round": 29},
        routes=lambda app: add_routes(app, lambda: page),
    )
    base = f"http://127.0.0.1:{http.port}"
    bad = [
        "?since_round=-1",
        "?since_round=x",
        "?since_round=1.5",
        "?since_round=" + "9" * 19,  # past the largest round
        "?since_round=" + "9" * 400,
        "?since_round=%EF%BC%91",  # a full-width digit: not ASCII
        "?limit=0",
        f"?limit={MAX_LIMIT + 1}",
        "?limit=",
        "?round=3",
        "?since_round=1&since_round=2",
    ]
    try:
        async with aiohttp.ClientSession() as session:
            for query in bad:
                async with session.get(f"{base}/run.json{query}") as r:
                    assert r.status == 400, query
                    assert "usage: GET /run.json" in await r.text(), query
            async with session.get(f"{base}/run?since_round=3") as r:
                assert r.status == 400
            for method in ("POST", "PUT", "DELETE"):
                for path in ("/run", "/run.json"):
                    async with session.request(method, base + path) as r:
                        assert r.status == 405 and r.headers["Allow"] == "GET"
            async with session.get(f"{base}/run.json/../../etc/passwd") as r:
                assert r.status == 404 and "/run.json" in await r.text()
            async with session.get(f"{base}/run.json?since_round={'1' * 20000}") as r:
                assert r.status in (400, 414)  # aiohttp refuses the request line itself
            # still serving, and the good request answers
            async with session.get(f"{base}/run.json?since_round=28&limit=5") as r:
                assert r.status == 200 and r.headers["Cache-Control"] == "no-cache"
                data = await r.json()
                assert [u[0] for u in data["updates"]] == [28, 29]
            async with session.get(f"{base}/run") as r:
                assert r.status == 200 and r.content_type == "text/html"
                assert "connect-src 'self'" in r.headers["Content-Security-Policy"]
                assert await r.read() == page_html()
            async with session.get(f"{base}/status") as r:
                assert r.status == 200 and await r.json() == {"round": 29}
    finally:
        await http.close()
        page.ledger.close()


async def test_a_node_without_a_run_yet_answers_503(tmp_path):
    http = await serve_http(
        "127.0.0.1", 0, NodeMetrics(), dict, routes=lambda app: add_routes(app, lambda: None)
    )
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{http.port}/run.json") as r:
                assert r.status == 503 and r.headers["Retry-After"] == "5"
    finally:
        await http.close()


def test_the_page_ships_whole_and_fetches_only_its_json():
    html = page_html().decode()
    assert len(html.encode()) < 20_000
    assert not re.search(r"https?://|//[a-z0-9]", html.replace("http://www.w3.org", ""))
    assert "<link" not in html and "src=" not in html and "@import" not in html
    assert re.findall(r"fetch\(\s*\"([^\"]*)", html) == ["run.json?since_round="]
    for plot in ("heldout", "trainloss", "updates", "peers", "bytes", "audits", "partition"):
        assert f'id="plot-{plot}"' in html


def test_status_screen_has_the_run_wide_line():
    run = {
        "round": 41,
        "peers_alive": 3,
        "peers_known": 4,
        "latest_heldout": {"round": 40, "loss": 0.61, "accuracy": 0.8125},
    }
    screen = format_status({"peer_id": "P", "run_id": "R", "run": run})
    assert "run-wide    round 41, 3 peers alive of 4 in the ledger, held-out accuracy 0.812 " in (
        screen
    )
    assert "n/a" in format_run_line({**run, "latest_heldout": None})
    assert "run-wide" not in format_status({"peer_id": "P"})


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, *args: str) -> str:
    """Load `url` in headless Chromium for 8 s of (virtual) page time; its stdout."""
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    command += ["--virtual-time-budget=8000", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs Chromium (.ci/run installs it)")
def test_page_of_a_live_run_in_headless_chromium(tmp_path, capsys):
    boot, address = start_bootstrap(
        tmp_path, ["--metrics-port", "0", "--page-eval-every", "3", "--page-eval-examples", "32"]
    )
    flags = ["--metrics-port", "0", "--round-interval", "0.5", "--until-round", "400"]
    own = ["--run-page", "--eval-every", "4", "--eval-examples", "16"]  # p0's own page
    peers = [start_peer(tmp_path, f"p{i}", address, flags + own * (i == 0)) for i in range(3)]
    try:
        for peer in peers:
            peer.wait_round(8)
        base = f"http://127.0.0.1:{(tmp_path / 'bootstrap' / 'status_port').read_text()}"
        # bad requests while the run trains: 4xx, and the run goes on
        before = max(p.last_round() for p in peers)
        for query in ("?since_round=-1", "?limit=100000", "?x=1", "?since_round=" + "9" * 5000):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{base}/run.json{query}", timeout=10)
            assert refused.value.code in (400, 414)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/nothing", timeout=10)
        assert refused.value.code == 404
        data = json.loads(urllib.request.urlopen(f"{base}/run.json", timeout=10).read())
        ids = {p["id"] for p in data["peers"]}
        assert len(ids) == 3 and data["run"]["peers_alive"] == 3
        assert [e["round"] for e in data["evals"]][:1] == [0]  # the base model, scored

        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert re.search(r"^seedflood_eval_accuracy 0\.\d+", metrics, re.M)  # page evals
        own_port = (tmp_path / "p0" / "status_port").read_text()
        mine = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{own_port}/run.json").read())
        assert mine["node"]["role"] == "peer" and len(mine["train_loss"]) >= 5
        rounds = [e["round"] for e in mine["evals"]]  # its own: the base, at ready, every 4
        assert rounds[0] == 0 and len(rounds) >= 2 and rounds == sorted(set(rounds)), rounds
        assert all(0 <= e["accuracy"] <= 1 for e in mine["evals"])
        other = (tmp_path / "p1" / "status_port").read_text()
        with pytest.raises(urllib.error.HTTPError) as refused:  # a peer without --run-page
            urllib.request.urlopen(f"http://127.0.0.1:{other}/run.json", timeout=10)
        assert refused.value.code == 404

        dom = chromium(f"{base}/run", "--dump-dom")
        assert 'data-ready="1"' in dom, dom[-3000:]
        points = dict(re.findall(r'<canvas id="plot-([a-z]+)"[^>]*data-points="(\d+)"', dom))
        for plot in ("heldout", "trainloss", "updates", "peers", "bytes", "partition", "ledger"):
            assert int(points.get(plot, 0)) > 0, (plot, points)
        assert int(points["updates"]) >= 3 * 6  # one bar per peer per round, rounds 1..8
        rows = set(re.findall(r'<tr data-peer="([1-9A-HJ-NP-Za-km-z]+)"', dom))
        assert rows == ids and 'data-rows="3"' in dom
        assert re.search(r'id="error">\s*<', dom)  # no error shown

        shot = tmp_path / "run-page.png"
        chromium(f"{base}/run", f"--screenshot={shot}", "--window-size=1400,1500")
        assert shot.stat().st_size > 20_000

        assert main(["status", base.removeprefix("http://")]) == 0
        screen = capsys.readouterr().out
        assert re.search(rf"seedflood {re.escape(__version__)}, up \d+(\.\d+)? s", screen), screen
        line = r"run-wide    round \d+, 3 peers alive of 3 in the ledger, held-out accuracy 0"
        assert re.search(line, screen), screen
        for peer in peers:
            peer.wait_round(before + 2)  # training went on
            assert peer.alive
        assert boot.alive
    finally:
        for peer in peers:
            peer.stop()
        boot.stop()


def test_grafana_dashboard_uses_only_metrics_the_nodes_export():
    from prometheus_client import generate_latest

    metrics = NodeMetrics()
    exported = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            exported |= {name, *(name + s for s in ("_bucket", "_sum", "_count"))}
            if kind == "counter":
                exported.add(name)
    dashboard = json.loads(
        (Path(__file__).parents[1] / "deploy/grafana/seedflood-run.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\b(seedflood_[a-z_]+)", e)}
    assert len(dashboard["panels"]) >= 12 and len(used) >= 20
    assert used <= exported, used - exported


async def test_bootstrap_page_evaluations_score_base_plus_ledger(tmp_path):
    page = _page(tmp_path, rounds=3)
    page.evals.clear()
    evaluator = LedgerEvaluator(RUN, page.ledger, every=2, examples=16)
    assert len(evaluator.pending) == len(page.ledger)  # the rows already held, then accepts
    newest = {"round": 2}
    task = asyncio.create_task(evaluator.run(page, lambda: newest["round"], poll=0.05))
    try:
        for _ in range(600):
            if page.evals:
                break
            await asyncio.sleep(0.1)
        assert [e["round"] for e in page.evals] == [3]  # rounds 0..2 applied
        evaluator.receive([UpdateMessage(3, PEERS[0], (0.5,)), UpdateMessage(4, PEERS[0], (0.5,))])
        newest["round"] = 4
        for _ in range(600):
            if len(page.evals) == 2:
                break
            await asyncio.sleep(0.1)
        assert [e["round"] for e in page.evals] == [3, 5]
        assert 0 <= page.evals[-1]["accuracy"] <= 1 and page.evals[-1]["train_loss"] > 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    wrong = LedgerEvaluator(RUN.replace(base_sha256="0" * 64), page.ledger, 2, 16)
    await wrong.run(page, lambda: 0)  # returns: the failure is on the page, not raised
    assert "stopped at this node" in page.heldout_source and "base weights" in page.heldout_source
