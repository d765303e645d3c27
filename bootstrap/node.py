"""The bootstrap node: a stable entry point that holds the run manifest and a full ledger.

It never trains. It creates the run (settings + SHA-256 of the base weights,
hashed into the run id), answers `seedflood.manifest`, and takes part in the
flood and in repair like any peer, so late joiners can sync even when every
trainer is offline. On restart it keeps its identity and its run, and when it knows
the run has others (its ledger's rows, its peer book, --bootstrap) it syncs with one
of them before it serves the manifest to joiners (network/peers/reconnect.py:catch_up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from seedflood_p2p import __version__
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import MAX_INT, bounded
from seedflood_p2p.core.heap import freeze_startup_heap
from seedflood_p2p.network.host import HostSettings, NetworkHost
from seedflood_p2p.network.monitoring.metrics import value
from seedflood_p2p.network.monitoring.runpage import (
    LIVENESS_SECONDS,
    Observed,
    RunPage,
    add_routes,
    run_sampler,
)
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.storage.ledger import Ledger

if TYPE_CHECKING:
    from bootstrap.evaluator import LedgerEvaluator

log = logging.getLogger("seedflood.bootstrap")


# Frozen once loaded (as PeerSettings and NodeSettings): a change is a new one
# (dataclasses.replace), so every reader sees the same settings.
@dataclass(frozen=True)
class BootstrapSettings:
    data_dir: Path = Path("seedflood-bootstrap")
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce: list[str] = field(default_factory=list)
    # Other nodes of the run to keep connected to (another bootstrap node, or peers); the
    # peers met are remembered in DATA_DIR/peers.json and redialled as well.
    bootstrap: list[str] = field(default_factory=list)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = bounded(None, 0, 65535, "a TCP port (0: any free port)")
    # the run page, GET /run and /run.json on the metrics server (docs/MONITORING.md)
    run_page: bool = True
    # the page's held-out figures: keep base + ledger and score it every N rounds (loads
    # the model; 0: never, the page then says no held-out figures exist at this node)
    page_eval_every: int = bounded(0, 0, MAX_INT, "a number of rounds (0: never)")
    page_eval_examples: int = bounded(200, 1, 1 << 30, "a number of examples")
    node: NodeSettings = field(default_factory=NodeSettings)


def resolve_manifest(settings: BootstrapSettings, config: RunConfig) -> RunConfig:
    """The run this node serves: the stored one on restart, else a new one from `config`."""
    if problem := config.daemon_problem():
        raise UserError(f"cannot serve this run: {problem}")
    path = settings.data_dir / "ledger.sqlite"
    if path.exists():
        with Ledger.open_existing(path) as stored:
            stored_config = stored.config
        same = config.replace(
            base_sha256=stored_config.base_sha256,
            dataset_sha256=stored_config.dataset_sha256,
            basis_sha256=stored_config.basis_sha256,
        )
        if same != stored_config:
            raise UserError(
                f"{settings.data_dir} already serves run {stored_config.run_id[:12]} with other "
                f"settings ({settings_diff(stored_config, same)}): start with the run's "
                "settings, or use a new --data-dir for a new run"
            )
        if stored_config.basis_sha256 and not basis_store(settings).has(stored_config.basis_sha256):
            raise UserError(
                f"{settings.data_dir} serves run {stored_config.run_id[:12]}, whose basis "
                f"artifact {stored_config.basis_sha256[:16]}... is missing from "
                f"{basis_store(settings).directory}: restore the file (peers hold copies "
                "beside their ledgers) or use a new --data-dir for a new run"
            )
        return stored_config
    from seedflood_p2p.workload.data import examples_sha256
    from seedflood_p2p.workload.models import load_model, weights_sha256
    from seedflood_p2p.workload.tasks import load_run_task

    log.info("hashing the base weights of %s and the examples of %s", config.model, config.dataset)
    model, tokenizer = load_model(config.model)
    task = load_run_task(config)
    config = config.replace(base_sha256=weights_sha256(model), dataset_sha256=examples_sha256(task))
    if config.data_basis and not config.basis_sha256:
        config = config.replace(
            basis_sha256=publish_basis(settings, config, model, tokenizer, task)
        )
    return config


def settings_diff(stored: RunConfig, given: RunConfig, limit: int = 4) -> str:
    """The settings that differ, as `name: run's X, given Y` (the first `limit` of them)."""
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    diff = [
        f"{name}: run's {getattr(stored, name)!r}, given {getattr(given, name)!r}"
        for name in fields
        if getattr(stored, name) != getattr(given, name)
    ]
    more = f"; and {len(diff) - limit} more" if len(diff) > limit else ""
    return "; ".join(diff[:limit]) + more


def basis_store(settings: BootstrapSettings):
    """Where this node keeps run artifacts: beside its ledger, as every ledger's are."""
    from seedflood_p2p.storage.artifacts import ArtifactStore

    return ArtifactStore.beside(settings.data_dir / "ledger.sqlite")


def publish_basis(settings: BootstrapSettings, config: RunConfig, model, tokenizer, task) -> str:
    """The run's one basis artifact, computed here at the base weights on the first
    `basis_examples` training prompts (labels unused, but for a K-FAC basis's U sides) and
    stored by its SHA-256, which the manifest then carries: every peer fetches these bytes
    and none recomputes them."""
    from seedflood_p2p.algorithm.subcge import SubCGE
    from seedflood_p2p.algorithm.trainer import make_basis

    started = time.monotonic()
    engine = SubCGE(model, config)
    try:
        artifact = make_basis(engine, tokenizer, task, 0)
    finally:
        engine.close()
    digest = basis_store(settings).put(artifact.body)
    log.info(
        "%s basis computed in %.1f s: %s (%d bytes, %d matrices)",
        config.basis,
        time.monotonic() - started,
        digest[:16],
        artifact.size,
        len(artifact.v),
        extra={"fields": {"event": "basis", "sha256": digest, "bytes": artifact.size}},
    )
    return digest


async def serve_assets(p2p, node, config: RunConfig, basis_path: Path | None = None) -> None:
    """Serve the organiser's model directory and data file, when the run names them by a
    local path, and the run's basis artifact (at `basis_path`), to joiners that fetch them
    by digest (network/transfer/assets.py)."""
    from seedflood_p2p.network.transfer.assets import AssetError, AssetServer
    from seedflood_p2p.workload.tasks import local_assets

    kinds = local_assets(config)
    if not kinds:
        return
    server = AssetServer(p2p, config.run_id, lambda peer: node.refuses(peer) is None)
    await server.start()
    paths = {"model": config.model, "dataset": config.dataset, "basis": basis_path}
    for kind in kinds:
        path = Path(paths[kind]).expanduser()
        try:
            await server.publish(kind, path)
        except (AssetError, OSError) as exc:
            log.warning(
                "not serving the run's %s to joiners (%s): each volunteer needs a copy", kind, exc
            )


def open_run_warning(config: RunConfig) -> str | None:
    """What a run creator should know when anyone may join and nobody vouches: each new
    identity's updates count at once (audits still sample them), so many keys of one
    attacker count until each is caught (docs/SYBIL.md). None when the run has founders (or
    an allow-list) or is ticketed."""
    probation = config.probation
    if probation.enabled or config.join.creator is not None:  # the creator picks who joins
        return None
    if probation.off:
        why = "extra.probation = false"
    else:
        why = "it names no founders"
    return (
        f"run {config.run_id[:12]} has no probation ({why}): every new identity's updates "
        "count at once, so one attacker with many keys moves the model until audits ban "
        "each key; restart with a new --data-dir and --founders ID,... (your own peers, "
        "`seedflood id --data-dir DIR` prints each one's id) to put newcomers on probation"
    )


async def serve(settings: BootstrapSettings, config: RunConfig) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    config = await asyncio.to_thread(resolve_manifest, settings, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host_settings = HostSettings(
        node=settings.node,
        listen=settings.listen,
        announce=settings.announce,
        bootstrap=settings.bootstrap,
        data_dir=settings.data_dir,
        serve_relay=True,  # the DHT's first node and the NATed peers' relay
    )
    async with NetworkHost(host_settings) as host:
        p2p = host.p2p
        state = {"state": "starting"}
        ledger = Ledger(settings.data_dir / "ledger.sqlite", config.run_id)
        ledger.claim(config, "use a new --data-dir for a new run")
        evaluator = None
        if settings.run_page and settings.metrics_port is not None and settings.page_eval_every:
            from bootstrap.evaluator import LedgerEvaluator

            evaluator = LedgerEvaluator(
                config, ledger, settings.page_eval_every, settings.page_eval_examples
            )
        node = host.flood_node(
            ledger,
            config,
            on_accept=evaluator.receive if evaluator is not None else lambda msgs: None,
        )
        others = host.known_others(ledger)
        if others and not settings.node.allow_alone:
            # A restarted bootstrap node's ledger is stale: a joiner served from it alone
            # would start rounds behind (seen: "ready at round 13" with 56 rows at round 74).
            node.not_ready = "restarted: syncing with the run's other nodes first"
        freeze_startup_heap()  # everything loaded: the collector need not walk it again
        await host.start_node(round_of=lambda: node.newest_round)
        if config.basis_sha256:
            from seedflood_p2p.storage.artifacts import write_schedule

            write_schedule(ledger, [(0, config.basis_sha256)])  # replay needs its bytes too
        basis = basis_store(settings).path(config.basis_sha256) if config.basis_sha256 else None
        await serve_assets(p2p, node, config, basis)
        suffix = f"/p2p/{p2p.peer_id.to_base58()}"
        addresses = [
            str(a) if str(a).endswith(suffix) else f"{a}{suffix}"
            for a in await p2p.get_visible_maddrs()
        ]
        # Written whole, then renamed: a reader polling for the file never sees it empty.
        partial = settings.data_dir / "address.txt.partial"
        partial.write_text("\n".join(addresses) + "\n")
        partial.replace(settings.data_dir / "address.txt")
        if settings.metrics_port is not None:
            await serve_status(settings, config, host, evaluator, state)
        log.info(
            "run %s: model %s, dataset %s, base sha256 %s",
            config.run_id[:12],
            config.model,
            config.dataset,
            config.base_sha256[:16],
        )
        if warning := open_run_warning(config):
            log.warning(warning, extra={"fields": {"event": "open_run"}})
        print("bootstrap address (pass to peers with --bootstrap):", flush=True)
        for address in addresses:
            print(f"  {address}", flush=True)
        if node.not_ready is not None:
            state["state"] = "syncing"
            catching_up = asyncio.create_task(
                host.catch_up(others, stop.is_set, lambda why: state.__setitem__("state", why))
            )
            await asyncio.wait(
                [catching_up, asyncio.create_task(stop.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
            if catching_up.done():
                catching_up.result()
            else:
                catching_up.cancel()
            node.not_ready = None
            log.info("serving joiners: ledger holds %d messages", len(ledger))
        state["state"] = "serving"
        await stop.wait()
        log.info("stopping: ledger holds %d messages", len(ledger))


async def serve_status(
    settings: BootstrapSettings,
    config: RunConfig,
    host: NetworkHost,
    evaluator: LedgerEvaluator | None,
    state: dict,
) -> None:
    """/status and /metrics, and the run page with its sampler (and the page's evaluator,
    if any) as the host's background tasks."""
    p2p, node, metrics, reconnector = host.p2p, host.node, host.metrics, host.reconnector
    ledger, discovery = node.ledger, host.discovery
    page = None
    started = time.time()

    def status() -> dict:
        return {
            "role": "bootstrap",
            "state": state["state"],
            "version": __version__,
            "uptime_s": round(time.time() - started, 1),
            "network": reconnector.islands.view.as_status(),
            "nat": reconnector.links.nat_status(),
            "run_id": config.run_id,
            "peer_id": p2p.peer_id.to_base58(),
            "round": node.newest_round,
            "peers_alive": len(node.peers),
            "ledger_messages": len(ledger),
            "accepted": metrics.accepted_counts(),
            "dropped": metrics.drop_counts(),
            "admissions": metrics.admission_counts(),
            "banned": node.bans.status(),
            "discovery": discovery.status() if discovery else None,
            "run": page.summary() if page is not None else None,
        }

    if settings.run_page:

        def observe() -> Observed:
            now = time.monotonic()
            return Observed(
                round=node.newest_round,
                state=state["state"],
                peers_alive={
                    p: st.round
                    for p, st in node.peers.items()
                    if now - st.last_seen < LIVENESS_SECONDS
                },
                bytes_in=int(value(metrics.bytes_in)),
                bytes_out=int(value(metrics.bytes_out)),
                banned=node.bans.status(),
                network=reconnector.islands.view.as_status(),
            )

        source = (
            f"this bootstrap node's own evaluations: it keeps base + its ledger and "
            f"scores it every {settings.page_eval_every} rounds on the first "
            f"{settings.page_eval_examples} held-out examples (peers do not publish "
            "their evaluations)"
            if evaluator is not None
            else "none at this node: peers do not publish their evaluations and this "
            "bootstrap node does not evaluate (start it with --page-eval-every N)"
        )
        page = RunPage(
            ledger,
            json.loads(config.to_json()),
            p2p.peer_id.to_base58(),
            "bootstrap",
            observe,
            source,
        )
        host.spawn(run_sampler(page), name="run-page")
        if evaluator is not None:

            def show_accuracy(accuracy: float | None) -> None:
                if accuracy is not None:
                    metrics.eval_accuracy.set(accuracy)

            host.spawn(
                evaluator.run(page, lambda: node.newest_round, show_accuracy), name="page-eval"
            )
    port = await host.serve_status(
        settings.metrics_host,
        settings.metrics_port,
        status,
        routes=(lambda app: add_routes(app, lambda: page)) if page is not None else None,
    )
    log.info(
        "metrics and status on http://%s:%d/status%s",
        settings.metrics_host,
        port,
        ", the run page on /run" if page is not None else "",
        extra={"fields": {"event": "http", "port": port}},
    )


def run_bootstrap(settings: BootstrapSettings, config: RunConfig) -> int:
    try:
        import uvloop

        uvloop.run(serve(settings, config))
    except ImportError:
        asyncio.run(serve(settings, config))
    sys.stdout.flush()
    return 0
