"""The run page: the whole run as one node sees it, as JSON (`GET /run.json`) and as a
self-contained HTML page (`GET /run`) that is a client of that JSON.

Sources, all local to the serving node (no new trust, no scraping of other peers):

- its ledger: updates per round by peer (who contributed what), each peer's newest round
  and row count, audit records per round;
- what the node itself observes, sampled every few seconds (`RunPage.sample`): peers
  alive (heard within the liveness window), payload bytes in and out, ledger rows, bans,
  connected and known peers, and the island view (partitioned or connected);
- the node's own evaluations: a training peer records its own training loss per round
  and its held-out evaluations; the bootstrap node, which does not train, evaluates only
  if started with `--page-eval-every N` (it then keeps a model equal to base + its ledger,
  like any peer, and scores it). Peers do not publish their losses or evaluations, so
  no run-wide held-out figure exists anywhere else; the JSON names its `heldout_source`.

Paging: `since_round` (default 0) and `limit` (rounds, default and max `MAX_LIMIT`) bound
every answer to the rounds [since_round, since_round + limit); `next_since_round` is set
when later rounds exist. A client polls with `since_round` a few rounds behind the newest
it holds, so rows that arrive late (repair) replace what it drew.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import base58
from aiohttp import web

from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.storage.ledger import Ledger

MAX_LIMIT = 500  # rounds per answer: ~16 peers x 500 rounds stays well under 100 KB
MAX_PEERS = 1000  # peers listed per answer
MAX_SAMPLES = 20_000  # observations kept in memory (one per round change or per 10 s)
SAMPLE_EVERY = 10.0  # seconds: a sample even when the round did not move
SAMPLER_PERIOD = 2.0  # seconds between two looks at the node's state
LAGGING_ROUNDS = 4  # an alive peer this many rounds behind the run's newest is "lagging"
LIVENESS_SECONDS = 60.0  # a peer heard within this is alive (the peer's liveness_timeout)
# Seconds a per-peer aggregate over the whole ledger (a scan: ~80 ms at 80,000 rows) is
# reused: the contribution column lags by this much at most, whatever the number of viewers.
PEER_TOTALS_TTL = 10.0
USAGE = (
    f"usage: GET /run.json?since_round=R&limit=N (R: a round >= 0, N: 1..{MAX_LIMIT} rounds); "
    "the page is GET /run\n"
)


@dataclass
class Observed:
    """What the node sees now, handed to `RunPage.sample` (from the daemon's state)."""

    round: int
    state: str
    peers_alive: dict[bytes, int]  # peer -> newest round heard, within the liveness window
    bytes_in: int
    bytes_out: int
    banned: list[dict]  # BanStore.status(): {"peer", "reason", "since"}
    network: dict | None  # IslandView.as_status() (network/peers/islands.py)
    audits: dict | None = None  # PeerAudits summary, if the run has audits


@dataclass
class RunPage:
    """Keeps the node's observations and answers /run.json from them and the ledger."""

    ledger: Ledger
    manifest: dict[str, Any]
    node_id: str
    role: str  # "bootstrap" or "peer"
    observe: Callable[[], Observed]
    heldout_source: str
    started: float = field(default_factory=time.time)
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    evals: list[dict] = field(default_factory=list)
    train_loss: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    _last: Observed | None = None
    _totals: tuple[float, int, dict] | None = None  # (time, ledger length, totals)

    # -- recording (on the daemon's event loop) ---------------------------------------
    def sample(self, now: float | None = None) -> None:
        """Record what the node sees, if the round moved or SAMPLE_EVERY passed."""
        now = time.time() if now is None else now
        seen = self.observe()
        self._last = seen
        if self.samples:
            last = self.samples[-1]
            if last["round"] == seen.round and now - last["t"] < SAMPLE_EVERY:
                return
        network = seen.network or {}
        self.samples.append(
            {
                "t": round(now, 1),
                "round": seen.round,
                "peers_alive": len(seen.peers_alive),
                "bytes_in": seen.bytes_in,
                "bytes_out": seen.bytes_out,
                "ledger": len(self.ledger),
                "banned": len(seen.banned),
                "connected": network.get("connected_peers"),
                "partitioned": int(network.get("state") == "partitioned"),
                "audit_verdicts": (seen.audits or {}).get("verdicts", 0),
            }
        )

    def record_eval(
        self,
        round_: int,
        loss: float,
        accuracy: float | None,
        train_loss: float | None = None,
    ) -> None:
        """A held-out evaluation by this node of its model after `round_` rounds."""
        row = {"round": round_, "loss": round(loss, 5), "accuracy": accuracy}
        if accuracy is not None:
            row["accuracy"] = round(accuracy, 4)
        if train_loss is not None:
            row["train_loss"] = round(train_loss, 5)
        if self.evals and self.evals[-1]["round"] == round_:
            self.evals[-1] = row
        else:
            self.evals.append(row)
        del self.evals[:-MAX_SAMPLES]

    def record_train_loss(self, round_: int, loss: float) -> None:
        """This node's own training loss of round `round_` (training peers only)."""
        self.train_loss.append({"round": round_, "loss": round(loss, 5)})

    # -- answering ----------------------------------------------------------------------
    def latest_heldout(self) -> dict | None:
        return self.evals[-1] if self.evals else None

    def summary(self) -> dict[str, Any]:
        """The run-wide line of /status (and `seedflood status`): the same numbers as the
        head of /run.json, without the per-round series."""
        seen = self._last if self._last is not None else self.observe()
        return {
            "round": max(self.ledger.max_round(), seen.round),
            "peers_alive": len(seen.peers_alive),
            "peers_known": len(self._peer_totals()),
            "latest_heldout": self.latest_heldout(),
            "heldout_source": self.heldout_source,
        }

    def _peer_totals(self) -> dict[bytes, tuple[int, int, int]]:
        """{peer: (rows, first round, newest round)} over the whole ledger, recomputed at
        most every PEER_TOTALS_TTL seconds and only when the ledger grew."""
        now = time.monotonic()
        size = len(self.ledger)
        if self._totals is not None:
            at, was, totals = self._totals
            if was == size or now - at < PEER_TOTALS_TTL:
                return totals
        totals = self.ledger.peer_totals()
        self._totals = (now, size, totals)
        return totals

    def snapshot(self, since_round: int = 0, limit: int = MAX_LIMIT) -> dict[str, Any]:
        """The /run.json answer for rounds [since_round, since_round + limit)."""
        if not 0 <= since_round <= MAX_ROUND or not 1 <= limit <= MAX_LIMIT:
            raise ValueError(USAGE)
        upper = min(since_round + limit - 1, MAX_ROUND)
        seen = self._last if self._last is not None else self.observe()
        totals = self._peer_totals()
        run_round = max(self.ledger.max_round(), seen.round)
        banned = {b["peer"]: b["reason"] for b in seen.banned}
        alive = {_b58(p): r for p, r in seen.peers_alive.items()}
        ids = {_b58(p): p for p in totals}
        names = sorted(set(ids) | set(alive) | set(banned))
        known = len(names)
        if known > MAX_PEERS:  # an open run can hold many identities: list the busiest
            rows_of = {name: totals[p][0] for name, p in ids.items()}
            busiest = sorted(names, key=lambda n: (n not in alive, -rows_of.get(n, 0), n))
            names = sorted(busiest[:MAX_PEERS])
        index = {name: i for i, name in enumerate(names)}
        peers = []
        for name in names:
            rows, first, newest = totals[ids[name]] if name in ids else (0, None, None)
            heard = max((r for r in (alive.get(name), newest) if r is not None), default=None)
            if name in banned:
                state = f"banned ({banned[name]})"
            elif name not in alive:
                state = "silent"
            elif heard is not None and run_round - heard > LAGGING_ROUNDS:
                state = f"lagging ({run_round - heard} rounds behind)"
            else:
                state = "alive"
            peers.append(
                {
                    "id": name,
                    "round": heard,
                    "rows": rows,
                    "first_round": first,
                    "newest_round": newest,
                    "state": state,
                }
            )
        updates: dict[int, list[int]] = {}
        by_bytes = {peer: index.get(_b58(peer), -1) for peer in totals}
        for round_, peer in self.ledger.round_peers(since_round, upper):
            i = by_bytes.get(peer)
            if i is None:  # a row newer than the cached totals
                i = by_bytes[peer] = index.get(_b58(peer), -1)
            updates.setdefault(round_, []).append(i)
        audits = self.ledger.audit_counts(since_round, upper)

        def in_window(rows: Iterable[dict]) -> list[dict]:
            return [r for r in rows if since_round <= r["round"] <= upper]

        latest = self.latest_heldout()
        return {
            "version": 1,
            "node": {"id": self.node_id, "role": self.role, "state": seen.state},
            "generated": round(time.time(), 1),
            "uptime_s": round(time.time() - self.started, 1),
            "manifest": self.manifest,
            "run": {
                "id": self.ledger.run_id,
                "round": run_round,
                "peers_alive": len(alive),
                "peers_known": known,
                "ledger_messages": len(self.ledger),
                "banned": len(banned),
                "network": seen.network,
                "latest_heldout": latest,
            },
            "heldout_source": self.heldout_source,
            "window": {"since_round": since_round, "until_round": upper, "limit": limit},
            "next_since_round": upper + 1 if run_round > upper else None,
            "peers": peers,  # at most MAX_PEERS: the alive ones, then the most rows
            "peers_omitted": known - len(peers),
            "updates": [[r, ids] for r, ids in sorted(updates.items())],
            "audits": [[r, n] for r, n in audits],
            "samples": in_window(self.samples)[-limit * 2 :],
            "evals": in_window(self.evals),
            "train_loss": in_window(self.train_loss),
        }


async def run_sampler(page: RunPage, period: float = SAMPLER_PERIOD) -> None:
    """Sample the node's state every `period` seconds, until cancelled."""
    while True:
        page.sample()
        await asyncio.sleep(period)


def page_html() -> bytes:
    """The page: one file, inline script and styles, nothing fetched but /run.json."""
    return (
        resources.files("seedflood_p2p.network.monitoring").joinpath("run_page.html").read_bytes()
    )


def parse_window(query: dict[str, str]) -> tuple[int, int]:
    """(since_round, limit) from a request's query; ValueError (with USAGE) if malformed."""
    unknown = set(query) - {"since_round", "limit"}
    if unknown:
        raise ValueError(f"unknown parameter {sorted(unknown)[0][:40]!r}; " + USAGE)
    values = []
    for key, default, top in (("since_round", 0, MAX_ROUND), ("limit", MAX_LIMIT, MAX_LIMIT)):
        text = query.get(key, str(default))
        if not (text.isascii() and text.isdigit() and len(text) <= 19) or int(text) > top:
            raise ValueError(f"{key} must be an integer in 0..{top}; " + USAGE)
        values.append(int(text))
    if values[1] < 1:
        raise ValueError("limit must be at least 1; " + USAGE)
    return values[0], values[1]


def add_routes(app: web.Application, page: Callable[[], RunPage | None]) -> None:
    """GET /run (the page) and GET /run.json (its data) on the node's status server;
    `page()` is None until the node knows its run (a peer that has not joined yet)."""
    html = page_html()

    async def get_page(request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="only GET\n", headers={"Allow": "GET"})
        if request.query:
            return web.Response(status=400, text="the page takes no parameters; " + USAGE)
        return web.Response(
            body=html,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Cache-Control": "no-cache",
                # The page fetches /run.json from its own origin and nothing else.
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:",
            },
        )

    async def get_json(request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="only GET\n", headers={"Allow": "GET"})
        if len(request.query) != len(set(request.query.keys())):
            return web.Response(status=400, text="each parameter at most once; " + USAGE)
        try:
            since, limit = parse_window(dict(request.query))
        except ValueError as exc:
            return web.Response(status=400, text=str(exc))
        current = page()
        if current is None:
            return web.Response(
                status=503,
                text="this node has not joined a run yet\n",
                headers={"Retry-After": "5"},
            )
        return web.json_response(
            current.snapshot(since, limit), headers={"Cache-Control": "no-cache"}
        )

    app.router.add_route("*", "/run", get_page)
    app.router.add_route("*", "/run.json", get_json)


def _b58(peer: bytes) -> str:
    return base58.b58encode(peer).decode()
