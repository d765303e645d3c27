"""Counters and gauges of a node, exported for Prometheus and as a JSON status page.

One small aiohttp server per daemon, on the daemon's event loop: `GET /metrics`
(Prometheus text format), `GET /status` (JSON, read by `seedflood status` and the
demo) and, on a peer, `POST /finish?after_round=N`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.protocol.framing import DROP_REASONS

# Where an update can come from, and how its admission can end (network/gossip/admission.py:
# Source and Outcome hold the same strings; admission imports this module, not the reverse).
SOURCES = ("gossip", "repair", "own")
OUTCOMES = ("accepted", "replaced", "duplicate", "echo", "dropped")
# The two repair requests, as timed by the asking side (round trip) and the serving side.
REPAIR_REQUESTS = ("digest", "fetch")
# Seconds: a signature check is ~100 us, a gossip batch's ledger commit a few ms, a fetch
# round trip tens of ms, a round's apply on SmolLM2 up to seconds.
DURATION_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


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
        # Audits (stay 0 in a run without extra.audit)
        self.audits_done = Gauge("seedflood_audits_done", "updates recomputed", registry=r)
        self.audit_mismatches = Gauge(
            "seedflood_audit_mismatches", "own audits that contradicted the claim", registry=r
        )
        self.audit_verdicts = Gauge(
            "seedflood_audit_verdicts", "audit cases the ledger decides", registry=r
        )
        self.audit_banned = Gauge(
            "seedflood_audit_banned", "peers the ledger's audit records ban", registry=r
        )
        self.probation = Gauge(
            "seedflood_probation",
            "probation (a run with founders): established identities, identities on "
            "probation, vouched updates, waiting updates (kept, not counted yet), backlog "
            "(probationers' updates due for an audit our budget did not cover)",
            ["what"],
            registry=r,
        )
        self.audit_cpu_seconds = Gauge(
            "seedflood_audit_cpu_seconds",
            "CPU seconds of the model thread spent on audits and on our own training steps",
            ["work"],
            registry=r,
        )
        # SHA-256 of the live weights, updated when the peer is ready, at each eval and at
        # the checkpoint (hashing every round would cost ~0.5 s on SmolLM2).
        self.model = Info("seedflood_model", "live model weights hash", registry=r)
        self.repaired = Counter(
            "seedflood_messages_repaired", "messages fetched by anti-entropy", registry=r
        )
        # Reconnection and island detection (network/peers/reconnect.py).
        self.connected = Gauge(
            "seedflood_connected_peers", "libp2p peers this node is connected to", registry=r
        )
        # Peers behind NAT (network/peers/links.py): how each connected peer is reached.
        self.links = Gauge(
            "seedflood_links",
            "connected peers by how they are reached: direct, or relayed (only through a "
            "circuit relay)",
            ["kind"],
            registry=r,
        )
        self.new_links = Counter(
            "seedflood_new_links",
            "new connections to peers, by kind (direct or relayed)",
            ["kind"],
            registry=r,
        )
        self.hole_punches = Counter(
            "seedflood_hole_punches",
            "peers reached only through a relay that then got a direct connection too "
            "(DCUtR hole punch, or a direct dial that started to work)",
            registry=r,
        )
        self.relayed_bytes = Gauge(
            "seedflood_relayed_bytes",
            "bytes this node's relay service carried for others (p2pd's own counter)",
            registry=r,
        )
        self.relay_reservations = Gauge(
            "seedflood_relay_reservations",
            "relays this node holds a reservation on (announces a /p2p-circuit address of)",
            registry=r,
        )
        self.unreachable = Gauge(
            "seedflood_unreachable_peers",
            "peers met recently (or named by reachable peers) that cannot be dialled",
            registry=r,
        )
        self.diverged = Gauge(
            "seedflood_diverged_peers",
            "connected peers whose settled ledger buckets differ from ours for long",
            registry=r,
        )
        self.partitioned = Gauge(
            "seedflood_partitioned", "1 while this node knows of peers it cannot reach", registry=r
        )
        self.redials = Counter(
            "seedflood_redials", "dials to known peers, by result", ["result"], registry=r
        )
        # Every update through admission, once, by where it came from and how it ended
        # (network/gossip/admission.py); `accepted` and `dropped` above are views of the same.
        self.admissions = Counter(
            "seedflood_admissions",
            "updates through admission, by source and outcome",
            ["source", "outcome"],
            registry=r,
        )
        # Where the time goes, per stage (the network benchmark reads these; a Prometheus
        # server can too): sum / count is the mean, the buckets give percentiles.
        self.decode_seconds = self._histogram("decode", "decoding one gossip payload")
        self.verify_seconds = self._histogram("verify", "signature check of one repair row")
        self.admit_seconds = self._histogram(
            "admit", "policy + ledger transaction + hand-on of one admission batch", ["source"]
        )
        self.apply_seconds = self._histogram("apply", "applying one round's updates to the model")
        self.repair_call_seconds = self._histogram(
            "repair_call", "round trip of one repair request to a peer", ["request"]
        )
        self.repair_serve_seconds = self._histogram(
            "repair_serve", "answering one repair request of a peer", ["request"]
        )
        self.repair_bytes_in = Counter(
            "seedflood_repair_bytes_in", "repair reply bytes received", ["request"], registry=r
        )
        # Peers banned by this node (network/peers/reputation.py), by the reason of the ban.
        self.banned = Counter(
            "seedflood_peers_banned", "peers banned, by reason", ["reason"], registry=r
        )
        self.repair_aborted = Counter(
            "seedflood_repair_exchanges_aborted",
            "repair exchanges ended early: bad page, over budget, deadline",
            ["why"],
            registry=r,
        )
        # Checkpoint download (network/transfer/checkpoints.py): offers or chunks refused, by reason
        # (no_quorum, bad_offer, bad_chunk, ledger: its cut or tensors did not check out).
        self.checkpoint_refused = Counter(
            "seedflood_checkpoint_refused", "fetched checkpoints refused", ["why"], registry=r
        )
        self.served_refused = Counter(
            "seedflood_requests_refused",
            "repair requests refused: banned, not allowed, over the byte rate",
            ["why"],
            registry=r,
        )
        self.discovery_rejected = Counter(
            "seedflood_discovery_rejected",
            "DHT discovery records refused: forged, unsigned, expired, malformed",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for source in SOURCES:
            self.accepted.labels(source)
            self.admit_seconds.labels(source)
            for outcome in OUTCOMES:
                self.admissions.labels(source, outcome)
        for request in REPAIR_REQUESTS:
            self.repair_call_seconds.labels(request)
            self.repair_serve_seconds.labels(request)
            self.repair_bytes_in.labels(request)

    def _histogram(self, stage: str, what: str, labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(
            f"seedflood_{stage}_seconds",
            f"seconds {what}",
            list(labels),
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )

    def drop_counts(self) -> dict[str, int]:
        return {r: int(value(self.dropped.labels(r))) for r in DROP_REASONS}

    def discovery_rejected_counts(self) -> dict[str, int]:
        return _labelled_counts(self.discovery_rejected)

    def count_ban(self, reason: str) -> None:
        self.banned.labels(reason).inc()

    def ban_counts(self) -> dict[str, int]:
        return _labelled_counts(self.banned)

    def accepted_counts(self) -> dict[str, int]:
        return {s: int(value(self.accepted.labels(s))) for s in SOURCES}

    def admission_counts(self) -> dict[str, dict[str, int]]:
        """{source: {outcome: count}}, every outcome listed."""
        return {s: {o: int(value(self.admissions.labels(s, o))) for o in OUTCOMES} for s in SOURCES}


@contextmanager
def timed(histogram: Histogram) -> Iterator[None]:
    """Observe the duration of the `with` block (perf_counter: steady, sub-microsecond)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        histogram.observe(time.perf_counter() - start)


def histogram_totals(histogram: Histogram) -> dict[str, dict[str, float]]:
    """{label value ('' if unlabelled): {"count": n, "sum_s": seconds}} of a histogram with
    at most one label; what a benchmark reads to get mean durations per stage."""
    out: dict[str, dict[str, float]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            key = next(iter(sample.labels.values()), "")  # _count and _sum carry no `le`
            if sample.name == family.name + "_count":
                out.setdefault(key, {})["count"] = int(sample.value)
            elif sample.name == family.name + "_sum":
                out.setdefault(key, {})["sum_s"] = sample.value
    return out


def _labelled_counts(counter: Counter) -> dict[str, int]:
    """{label value: count} of a counter with one label, the labels seen so far."""
    out = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[next(iter(sample.labels.values()))] = int(sample.value)
    return out


def value(metric: Counter | Gauge) -> float:
    """Current value of an unlabelled (or already labelled) counter or gauge."""
    for family in metric.collect():
        for sample in family.samples:
            # A counter's value is its `_total` sample (`_created` is a timestamp).
            if sample.name in (family.name, family.name + "_total"):
                return sample.value
    raise ValueError(f"{metric!r} has no value sample")


class HttpEndpoint:
    """The running metrics/status server: its port, and `close()` to stop it."""

    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self._runner = runner
        self.port = port

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve_http(
    host: str,
    port: int,
    metrics: NodeMetrics,
    status: Callable[[], dict[str, Any]],
    finish_after: Callable[[int], dict[str, Any]] | None = None,
    routes: Callable[[web.Application], None] | None = None,
) -> HttpEndpoint:
    """Serve GET /metrics and /status on (host, port); port 0 picks a free port.

    `POST /finish?after_round=N` (from this machine only) asks the peer to stop gracefully
    after round N: the demo uses it to end every peer at the same round. Handlers run on
    the caller's event loop, so `status` and `finish_after` see the daemon's state as it is
    between two awaits. `routes`, if given, adds more (the run page:
    network/monitoring/runpage.py)."""

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def get_status(request: web.Request) -> web.Response:
        return web.json_response(status(), dumps=lambda obj: json.dumps(obj, default=str))

    async def post_finish(request: web.Request) -> web.Response:
        if request.remote not in ("127.0.0.1", "::1"):
            return web.Response(status=403, text="only from this machine\n")
        after = request.query.get("after_round", "")
        if not (after.isascii() and after.isdigit()):
            return web.Response(status=400, text="usage: POST /finish?after_round=N\n")
        if len(after) > len(str(MAX_ROUND)) or int(after) > MAX_ROUND:
            return web.Response(status=400, text=f"after_round must be 0..{MAX_ROUND}\n")
        return web.json_response(finish_after(int(after)))

    async def not_found(request: web.Request) -> web.Response:
        paths = "/status or /metrics" if routes is None else "/run, /run.json, /status or /metrics"
        return web.Response(status=404, text=f"try {paths}\n")

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/status", get_status)
    if finish_after is not None:
        app.router.add_post("/finish", post_finish)
    if routes is not None:
        routes(app)
    app.router.add_route("*", "/{tail:.*}", not_found)
    # No access log: the demo polls /status every few seconds, and these logs are read
    # line by line by people and by the demo.
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise UserError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror}): the port is in use; "
            "choose another with --metrics-port or 0 for any free port"
        ) from None
    return HttpEndpoint(runner, runner.addresses[0][1])
