"""The peer daemon: the one place where network, ledger and model meet.

    gossip, repair, own update -> admission (network/admission.py: validate, ledger)
        -> LiveModel.receive -> (once per round) LiveModel.apply
    train: estimate on this round's batch -> admission -> publish; applied next round

Model work runs on one dedicated thread, so the event loop keeps receiving,
validating and repairing while a forward pass runs, and the model is only
ever touched from that thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch

from peer.audits import PeerAudits, cheated, check_test_cheat
from seedflood_p2p import __version__
from seedflood_p2p.algorithm.audit import AuditSettings
from seedflood_p2p.algorithm.chain import CHAIN_DIR, CheckpointChain, chain_period, link_round
from seedflood_p2p.algorithm.live import LedgerCut, LiveModel
from seedflood_p2p.algorithm.probation import ProbationSettings
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import MAX_INT, MAX_SECONDS, bounded
from seedflood_p2p.network.assets import AssetServer
from seedflood_p2p.network.checkpoints import CheckpointServer, FetchFailed, fetch_checkpoint
from seedflood_p2p.network.discovery import Discovery, run_discovery
from seedflood_p2p.network.flood import FloodNode
from seedflood_p2p.network.identity import verify_pubsub_signature
from seedflood_p2p.network.metrics import NodeMetrics, serve_http, timed, value
from seedflood_p2p.network.p2pd import create_p2p, host_port, remove_stale_sockets
from seedflood_p2p.network.reconnect import Reconnector, catch_up
from seedflood_p2p.network.rpc import RemoteCallError, call_bytes
from seedflood_p2p.network.runpage import Observed, RunPage, add_routes, run_sampler
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.network.tickets import ticket_creator
from seedflood_p2p.protocol.wire import audit_topic_for, encode_audit, quorum_round
from seedflood_p2p.storage.checkpoint import unchanged_rows
from seedflood_p2p.storage.ledger import Ledger, digest_of, peer_name

log = logging.getLogger("seedflood.peer")

MAX_CLOCK_SKEW = 300.0  # seconds; beyond this the peer refuses to join


@dataclass
class PeerSettings:
    bootstrap: list[str] = field(default_factory=list)  # full multiaddrs of bootstrap nodes
    # a new peer gives up after this many rounds of dials (backoff)
    connect_retries: int = bounded(5, 0, 1 << 20, "a number of attempts (0: once)")
    data_dir: Path = Path("seedflood-peer")
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)
    # rounds to train, then leave
    until_round: int = bounded(0, 0, MAX_INT, "a round (0: the run's total_rounds, or never)")
    # may start round t once live peers published t - 1 - this
    max_staleness: int = bounded(2, 0, MAX_INT, "a number of rounds")
    # seconds to wait for slow peers before going on (once: a peer that made us wait it out
    # is not waited for again until it keeps pace)
    round_deadline: float = bounded(30.0, 0, MAX_SECONDS, "seconds")
    # a peer unheard this long is not waited for
    liveness_timeout: float = bounded(60.0, 0, MAX_SECONDS, "seconds")
    # wait (up to startup_wait) for this many topic peers before round 1
    min_peers: int = bounded(0, 0, 1 << 20, "a number of peers")
    startup_wait: float = bounded(30.0, 0, MAX_SECONDS, "seconds")
    # minimum seconds per round (pacing for demos and tests)
    round_interval: float = bounded(0.0, 0, MAX_SECONDS, "seconds")
    # after the last round: quiet this long, stragglers done, or give up after linger_max
    linger: float = bounded(5.0, 0, MAX_SECONDS, "seconds")
    linger_max: float = bounded(120.0, 0, MAX_SECONDS, "seconds")
    eval_every: int = bounded(0, 0, MAX_INT, "a number of rounds (0: never)")
    eval_examples: int = bounded(200, 1, 1 << 30, "a number of examples")
    metrics_host: str = "127.0.0.1"
    # None: no HTTP endpoint
    metrics_port: int | None = bounded(None, 0, 65535, "a TCP port (0: any free port)")
    # also serve the run page (GET /run, /run.json) on the metrics server, as this peer sees
    # the run: its ledger, its observations, its own losses and evaluations
    run_page: bool = False
    device: str = "cpu"
    # This machine's copy of the run's model directory / data file, for a run whose
    # manifest names a path of the organiser's machine (never opened here); each is
    # checked against the manifest's base_sha256 / dataset_sha256.
    model_dir: Path | None = None
    dataset_file: Path | None = None
    # torch threads for this peer (0: torch's default, all cores)
    threads: int = bounded(0, 0, 4096, "a number of threads (0: torch's default)")
    # TEST HOOK, not a feature (peer/audits.py:check_test_cheat; refused unless the
    # environment sets SEEDFLOOD_TEST_HOOKS=1): "flip", "random" or "x3" makes this peer a
    # cheater, so tests can show audits catch it (tests/test_audit_daemon.py).
    test_cheat: str = ""
    # Late join: fetch a checkpoint of the run's chain from peers instead of
    # replaying the rows it covers: "auto" when the download (at checkpoint_bandwidth Mbit/s)
    # is estimated faster than the replay, "always", or "never".
    checkpoint_fetch: str = field(default="auto", metadata={"choices": ("auto", "always", "never")})
    # Mbit/s this peer expects to download at
    checkpoint_bandwidth: float = bounded(100.0, 0, 1e9, "Mbit/s", open_low=True)
    # build chain link R once the own round is R + this
    checkpoint_settle: int = bounded(32, 0, MAX_INT, "a number of rounds")
    # TEST HOOK, not a feature: "corrupt" serves checkpoint chunks with a flipped byte,
    # "forge" offers a forged link (other weights, consistent hashes): tests of the joiner.
    test_checkpoint: str = field(default="", metadata={"choices": ("", "corrupt", "forge")})
    node: NodeSettings = field(default_factory=NodeSettings)


def check_manifest_reply(reply: dict, now: float, version: str) -> RunConfig:
    """The run's settings from a `seedflood.manifest` reply, if this peer can join it."""
    skew = reply["time"] - now
    if not abs(skew) <= MAX_CLOCK_SKEW:  # NaN too
        raise UserError(
            f"this machine's clock differs from the bootstrap node's by {skew:+.0f} s: "
            "enable time sync (e.g. `timedatectl set-ntp true`) and restart"
        )
    check_version(reply["version"], version)
    config = RunConfig.from_json(reply["manifest"])
    if problem := config.daemon_problem():
        raise UserError(f"cannot join run {config.run_id[:12]}: {problem}")
    return config


def check_version(run_version: str, version: str) -> None:
    """Refuse a run made with another seedflood major.minor version, naming the fix."""
    if run_version.split(".")[:2] != version.split(".")[:2]:
        raise UserError(
            f"the run uses seedflood-p2p {run_version}, this is {version}: "
            f"install the run's version (pip install seedflood-p2p=={run_version})"
        )


class NotReady(RemoteCallError):
    """A node of the run that does not serve joiners yet (it is syncing); `run_id` is its
    run, so the manifest can be read from the DHT's signed records instead."""

    def __init__(self, why: str, run_id: str | None) -> None:
        super().__init__(f"not serving joiners yet ({why[:120]})")
        self.run_id = run_id


def start_round(ledger: Ledger, peer_id: bytes) -> int:
    """The round to train first after a (re)start or late join: after our own last update,
    and not behind the round a quorum of distinct other peers reached in the ledger. A pure
    function of the ledger; not the highest round in it, which one identity could set."""
    rounds = ledger.peer_rounds()
    own = rounds.pop(peer_id, -1)
    return max(own + 1, quorum_round(rounds.values()), 0)


class PeerDaemon:
    def __init__(self, settings: PeerSettings) -> None:
        self.s = settings
        self.metrics = NodeMetrics()
        self.stopping = False
        self.round = 0
        self.model_hash = ""
        self.last_eval: tuple[float, float | None] | None = None
        self.last_eval_round = -1
        self.final_round: int | None = None  # last round to train (None: open-ended)
        self.until_round: int | None = None  # --until-round or the run's total: a hard cap
        self.done_training = False  # past linger: the final round can no longer move
        self.in_round = False  # between the start of round `self.round` and its end
        self.started = time.time()
        self.laggards: set[bytes] = set()  # live peers not waited for (see wait_ready)
        self.state = "starting"  # what the peer is doing, or why it waits (/status, logs)
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.audits: PeerAudits | None = None  # the run's audits (manifest extra.audit)
        self.discovery: Discovery | None = None  # DHT records (NodeSettings.discovery)
        self.chain: CheckpointChain | None = None  # the run's checkpoint chain (if it has one)
        self.checkpoint_server: CheckpointServer | None = None
        self.chain_round = 0  # the newest link built and served
        self.checkpoint_info: dict = {"fetched": None, "refused": {}}
        # The run's model dir / data file on this machine, when the manifest names paths:
        # fetched from peers or the peer's own copies (get_assets); served to joiners.
        self.asset_paths: dict[str, Path] = {}
        self.assets: AssetServer | None = None
        self.page: RunPage | None = None  # the run as this peer sees it (/status, /run)
        check_test_cheat(settings.test_cheat, os.environ)

    # -- helpers ------------------------------------------------------------
    async def in_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("stop requested: finishing the current round, then checkpointing")
        self.stopping = True

    def status(self) -> dict:
        now = time.monotonic()
        node = getattr(self, "node", None)
        alive = self._live_peers(now) if node else {}
        return {
            "peer_id": self.p2p.peer_id.to_base58() if hasattr(self, "p2p") else None,
            "state": self.state,
            "run_id": self.config.run_id if hasattr(self, "config") else None,
            "version": __version__,
            "round": self.round,
            "peers_alive": len(alive),
            "peer_rounds": {k.hex()[-12:]: v.round for k, v in alive.items()},
            "ledger_messages": len(node.ledger) if node else 0,
            "accepted": self.metrics.accepted_counts(),
            "dropped": self.metrics.drop_counts(),
            "admissions": self.metrics.admission_counts(),
            "banned": node.bans.status() if node else [],
            "audits": self.audit_status(),
            "checkpoint": {**self.checkpoint_info, "chain_round": self.chain_round},
            "laggards": len(self.laggards),
            "bytes_out": int(value(self.metrics.bytes_out)),
            "bytes_in": int(value(self.metrics.bytes_in)),
            "loss": value(self.metrics.loss),
            "eval": self.last_eval,
            "model_sha256": self.model_hash,
            "uptime_s": round(time.time() - self.started, 1),
            "network": self.reconnector.view.as_status() if hasattr(self, "reconnector") else None,
            "nat": self.reconnector.nat_status() if hasattr(self, "reconnector") else None,
            "discovery": self.discovery.status() if self.discovery else None,
            "run": self.page.summary() if self.page is not None else None,
        }

    def observe(self) -> Observed:
        """What the run page samples (network/runpage.py)."""
        alive = self._live_peers(time.monotonic())
        return Observed(
            round=self.round,
            state=self.state,
            peers_alive={p: st.round for p, st in alive.items()},
            bytes_in=int(value(self.metrics.bytes_in)),
            bytes_out=int(value(self.metrics.bytes_out)),
            banned=self.node.bans.status(),
            network=self.reconnector.view.as_status(),
            audits=self.audit_status(),
        )

    def audit_status(self) -> dict | None:
        """Audits done, mismatches found, verdicts in the ledger, peers it bans (None: the
        run has no audits)."""
        audits = getattr(self, "audits", None)
        if audits is None:
            return None
        m = self.metrics
        m.audits_done.set(audits.counts["audits"])
        m.audit_mismatches.set(audits.counts["mismatches"])
        m.audit_verdicts.set(audits.verdicts)
        m.audit_banned.set(len(audits.banned))
        for work in ("audit", "train"):
            m.audit_cpu_seconds.labels(work).set(audits.cpu_seconds[work])
        probation = audits.probation_status()
        if probation is not None:
            for key in ("established", "on_probation", "vouched_updates", "backlog"):
                m.probation.labels(key).set(probation[key])
            m.probation.labels("waiting_updates").set(probation["waiting_updates"])
        return {
            "probation": probation,
            "done": audits.counts["audits"],
            "mismatches": audits.counts["mismatches"],
            "published": audits.counts["published"],
            # recomputations on the states a sender may honestly have had instead
            "retries": {
                k: audits.counts[k]
                for k in ("ban_state_retries", "late_state_retries", "late_state_matches")
            },
            "records": dict(audits.intake.counts),
            "verdicts": audits.verdicts,
            "banned": sorted(peer_name(p) for p in audits.banned),
            "rate": audits.rate,
            "cpu_seconds": {k: round(v, 3) for k, v in sorted(audits.cpu_seconds.items())},
        }

    def _live_peers(self, now: float) -> dict:
        return {
            p: st
            for p, st in self.node.peers.items()
            if now - st.last_seen < self.s.liveness_timeout
        }

    # -- startup -------------------------------------------------------------
    async def ask_manifest(self, peer: str) -> RunConfig:
        """The run's settings from `peer`'s `seedflood.manifest`, if this peer can join it.
        RemoteCallError (unreachable, not ready, not a manifest) lets the caller go on."""
        from hivemind.p2p import PeerID

        reply = await call_bytes(
            self.p2p, PeerID.from_base58(peer), "seedflood.manifest", b"", 15.0
        )
        try:
            reply = msgpack.unpackb(reply)
            if isinstance(reply, dict) and isinstance(reply.get("not_ready"), str):
                run_id = reply.get("run_id")
                valid = isinstance(run_id, str) and len(run_id) == 64
                raise NotReady(reply["not_ready"], run_id if valid else None)
            fields = (reply["time"], reply["version"], reply["manifest"])
        except RemoteCallError:
            raise
        except Exception as exc:
            raise RemoteCallError(f"malformed manifest reply ({type(exc).__name__})") from None
        if not all(isinstance(f, t) for f, t in zip(fields, (float, str, str), strict=True)):
            raise RemoteCallError("malformed manifest reply")
        return check_manifest_reply(reply, time.time(), __version__)

    async def manifest_from_dht(self, run_id: str, connected: list[str]) -> RunConfig | None:
        """The manifest of `run_id` from the run's signed "manifest" records in the DHT, when
        the nodes we reached are still syncing (a restarted bootstrap node). The record
        must hash to `run_id` (a manifest's run id is its hash) and come from our version.
        No clock check here (a record carries no "now"): the clock is checked the next
        time a node answers `seedflood.manifest` (a restart). None: no such record."""
        if self.discovery is None:
            return None
        try:
            await self.discovery.add_peers(connected)
            records = await self.discovery.lookup(run_id, "manifest")
        except Exception as exc:  # a DHT failure: go on dialling as without discovery
            log.warning("reading the manifest from the DHT failed: %r", exc)
            return None
        other_versions = []
        for record in records.values():
            try:
                config = RunConfig.from_json(record.body["manifest"])
            except UserError:
                continue
            if config.run_id != run_id:
                continue
            try:  # one writer's odd version must not stop us if another's matches
                check_version(record.body["version"], __version__)
            except UserError as exc:
                other_versions.append(exc)
                continue
            log.info(
                "manifest of run %s from the DHT (%d signed record(s)): the node(s) reached "
                "are still syncing",
                run_id[:12],
                len(records),
                extra={"fields": {"event": "manifest_from_dht", "records": len(records)}},
            )
            return config
        if other_versions:
            raise other_versions[0]
        return None

    def stored_manifest(self) -> RunConfig | None:
        """The run this data dir already belongs to (its ledger's manifest), if any."""
        path = self.s.data_dir / "ledger.sqlite"
        if not path.exists():
            return None
        with Ledger.open_existing(path) as stored:
            text = stored.get_meta("manifest")
        return None if text is None else RunConfig.from_json(text)

    async def first_contact(self) -> RunConfig | None:
        """Dial the bootstrap list and every peer in the peer book (with backoff) until one
        serves the run manifest. A new peer gives up after `connect_retries` rounds with one
        line naming what it tried; a peer whose data dir already holds the run keeps trying
        for as long as it runs (it knows the run has others), unless --allow-alone. None
        if stopped while waiting."""
        s = self.s
        stored = self.stored_manifest()
        attempt = 0
        while not self.stopping:
            dial_errors = await self.reconnector.dial_due(force=attempt == 0)
            attempt += 1
            connected = self.reconnector.connected
            order = [p for p in self.reconnector.bootstrap if p in connected]
            order += sorted(p for p in connected if p not in order)
            errors = {p: f"dial failed: {e}" for p, e in dial_errors.items()}
            syncing_runs = set()
            for peer in order:
                try:
                    return await self.ask_manifest(peer)
                except NotReady as exc:
                    errors[peer] = str(exc)
                    syncing_runs.add(exc.run_id)
                except RemoteCallError as exc:
                    errors[peer] = str(exc)
            for run_id in sorted(syncing_runs - {None}):
                if (config := await self.manifest_from_dht(run_id, order)) is not None:
                    return config
            tried = (
                "; ".join(
                    f"{p}{' at ' + ', '.join(a) if a else ''}: {errors.get(p, 'not connected')}"
                    for p, a in self.reconnector.candidates().items()
                )
                or "no address: pass --bootstrap"
            )
            if stored is not None and s.node.allow_alone:
                log.warning("no peer reachable (%s): starting alone (--allow-alone)", tried)
                return stored
            if stored is None and attempt > s.connect_retries:
                check = host_port(next(iter(self.reconnector.candidates().values()), [""])[0])
                raise UserError(
                    f"could not reach any bootstrap peer or known peer after {attempt} "
                    f"attempt(s) (tried: {tried}); at least one must be running and "
                    f"reachable from this machine (check with `nc -vz {check}`, and open or "
                    "forward its port if it is behind a firewall or NAT)"
                )
            delay = min(s.node.redial_max, s.node.redial_min * 2 ** (attempt - 1))
            if stored is not None:
                self.state = (
                    "waiting: this peer's data dir holds run "
                    f"{stored.run_id[:12]}, so the run has others, and none is reachable"
                )
                log.warning(
                    "%s (tried: %s); retrying in %.0f s, not training alone (pass "
                    "--allow-alone to start anyway)",
                    self.state,
                    tried,
                    delay,
                    extra={"fields": {"event": "waiting", "attempt": attempt}},
                )
            else:
                log.warning(
                    "attempt %d of %d to reach the run failed (tried: %s); retrying in %.0f s",
                    attempt,
                    s.connect_retries + 1,
                    tried,
                    delay,
                    extra={"fields": {"event": "connect_failed", "attempt": attempt}},
                )
            until = time.monotonic() + delay
            while not self.stopping and time.monotonic() < until:
                await asyncio.sleep(0.2)
        return None

    def check_ledger(self):
        """`Ledger.verify` of every row, but the signatures of rows our checkpoint covers
        that are byte for byte unchanged since it was written (`unchanged_rows`)."""
        return self.ledger.verify(
            verify_pubsub_signature,
            f"move {self.ledger.path} aside and restart: the peer re-syncs from the network",
            self.config.directions,
            self.peer_id,
            unchanged_rows(self.ledger, self.s.data_dir),
        )

    def load_model(self, config: RunConfig):
        from seedflood_p2p.workload.data import examples_sha256
        from seedflood_p2p.workload.models import load_model, weights_sha256
        from seedflood_p2p.workload.tasks import load_run_task, run_sources

        if self.s.threads > 0:
            torch.set_num_threads(self.s.threads)
        own = self.asset_paths
        model_name, dataset = run_sources(
            config, own.get("model", self.s.model_dir), own.get("dataset", self.s.dataset_file)
        )
        model, tokenizer = load_model(model_name)
        digest = weights_sha256(model)
        if config.base_sha256 and digest != config.base_sha256:
            raise UserError(
                f"base weights of '{model_name}' on this machine have SHA-256 {digest[:16]}..., "
                f"the run expects {config.base_sha256[:16]}...: the model files differ (another "
                "revision or a corrupt cache); delete the cached copy and retry"
            )
        task = load_run_task(config, dataset)
        digest = examples_sha256(task)
        if config.dataset_sha256 and digest != config.dataset_sha256:
            raise UserError(
                f"dataset '{dataset}' on this machine has examples SHA-256 {digest[:16]}..., "
                f"the run expects {config.dataset_sha256[:16]}...: the data file differs from "
                "the organiser's (another version or edited rows); get the run's copy"
            )
        return model.to(self.s.device), tokenizer, task

    async def get_assets(self) -> None:
        """The run's model directory and data file, when its manifest names paths of the
        organiser's machine: this peer's own copies (--model-dir, --dataset-file), else
        fetched from peers by digest. Then served to later joiners, by digest too."""
        from seedflood_p2p.network.assets import AssetError, fetch_asset
        from seedflood_p2p.workload.tasks import check_asset, local_assets

        kinds = local_assets(self.config)
        own = {"model": self.s.model_dir, "dataset": self.s.dataset_file}
        for kind in kinds:
            if own[kind] is not None:
                self.asset_paths[kind] = own[kind]
                continue
            self._set_state(f"fetching the run's {kind} from peers")
            try:
                self.asset_paths[kind] = await fetch_asset(
                    self.p2p,
                    sorted(self.reconnector.connected),
                    self.config.run_id,
                    kind,
                    self.s.data_dir / "assets",
                    lambda path, kind=kind: check_asset(self.config, kind, path),
                )
            except AssetError as exc:
                flag = "--model-dir" if kind == "model" else "--dataset-file"
                raise UserError(f"{exc}; or pass {flag} with your copy") from None
        if kinds:
            self.assets = AssetServer(
                self.p2p,
                self.config.run_id,
                lambda peer: getattr(self, "node", None) is None or self.node.refuses(peer) is None,
            )
            await self.assets.start()
            for kind in kinds:
                try:
                    await self.assets.publish(kind, Path(self.asset_paths[kind]))
                except (AssetError, OSError) as exc:
                    log.warning("not serving the run's %s to joiners: %s", kind, exc)

    # -- per round -------------------------------------------------------------
    async def wait_ready(self, round_: int) -> None:
        """Bounded staleness with a deadline: slow or dead peers never stall us for long.

        Liveness rule: a peer still behind when the deadline passes is a laggard and is not
        waited for again until it catches up, so one identity publishing a low round now
        and then costs every honest peer one deadline in all, not one per round.

        Caught up means in step with us (it has published our previous round), not merely
        back inside the staleness bound: a peer hovering at the bound's edge (a staller a
        few rounds behind, seen one round closer whenever we are a little late) would
        otherwise cost a deadline each time it dipped below the edge again (measured: two
        deadlines for one peer in bench_hostile's stall row)."""
        deadline = time.monotonic() + self.s.round_deadline
        while not self.stopping:
            now = time.monotonic()
            live = self._live_peers(now)
            oldest = round_ - 1 - self.s.max_staleness  # a peer must have published this
            self.laggards = {p for p in self.laggards if p in live and live[p].round < round_ - 1}
            behind = [p for p, st in live.items() if st.round < oldest and p not in self.laggards]
            slowest = min((st.round for st in live.values()), default=round_)
            self.metrics.staleness.set(round_ - slowest)
            self.metrics.peers.set(len(live))
            if not behind:
                return
            if now > deadline:
                self.laggards.update(behind)
                log.warning(
                    "round %d: going on without %d slow peer(s) after %.0f s; not waiting "
                    "for them again until they catch up",
                    round_,
                    len(behind),
                    self.s.round_deadline,
                    extra={
                        "fields": {
                            "event": "deadline",
                            "round": round_,
                            "slow": [peer_name(p) for p in behind],
                        }
                    },
                )
                return
            await asyncio.sleep(0.02)

    def finish_after(self, round_: int) -> dict:
        """Graceful stop at a common round (POST /finish?after_round=N on the status port):
        train through round N, wait for live peers to get there too, then checkpoint. Unlike
        SIGTERM, peers told the same N end with the same ledger. A round already finished
        cannot be undone, so the reply says the round this peer will really stop after; the
        caller agrees on the largest reply by asking again (a peer already lingering goes
        back to training). `--until-round` stays an upper bound."""
        if self.done_training:
            return {"final_round": self.round - 1}
        started = self.round if self.in_round else self.round - 1  # will be finished anyway
        last = max(round_, started)
        if self.until_round:
            last = max(min(last, self.until_round - 1), started)
        if last != self.final_round:
            self.final_round = last
            log.info("asked to finish after round %d", last)
        return {"final_round": self.final_round}

    async def train(self) -> None:
        from seedflood_p2p.algorithm.trainer import zo_step

        while not self.stopping and (self.final_round is None or self.round <= self.final_round):
            self.in_round = True
            if self.node.fatal is not None:
                raise self.node.fatal
            self.catch_up()
            self.node.admission.own_round = self.round
            await self.wait_ready(self.round)
            t0 = time.perf_counter()
            if self.audits is None:
                incoming = self.live.take()
                apply = self.live.apply
            else:  # round t trains on the settled state: counted updates of rounds < t - lag
                incoming = self.audits.take_settled(self.round)
                apply = self.audits.apply
            with timed(self.metrics.apply_seconds):
                await self.in_model_thread(apply, incoming)
            step = (zo_step, self.live.engine, self.tokenizer, self.task, self.peer_id, self.round)
            if self.audits is None:
                message, loss = await self.in_model_thread(*step)
            else:  # its CPU time counted, against the audits' (audit CPU share)
                message, loss = await self.in_model_thread(self.audits.timed_step, *step)
            if self.s.test_cheat:  # the test hook: a cheater (peer/audits.py)
                message = cheated(self.s.test_cheat, message, self.ledger)
            # Admitted like anyone's update: logged, then pending, applied next round.
            await self.node.publish(message)
            await self.extend_chain()
            if self.audits is not None:
                await self.run_audits()
            self.metrics.loss.set(loss)
            if self.page is not None:
                self.page.record_train_loss(self.round, loss)
            self.metrics.rounds.set(self.round)
            line = {
                "event": "round",
                "round": self.round,
                "loss": round(loss, 5),
                "peers": len(self._live_peers(time.monotonic())),
                "applied": len(incoming),
                "ledger": len(self.ledger),
            }
            seconds = time.perf_counter() - t0
            if seconds < self.s.round_interval:
                await asyncio.sleep(self.s.round_interval - seconds)
            self.metrics.round_seconds.set(seconds)
            line["seconds"] = round(seconds, 3)
            log.info(
                "round %d  loss %.4f  peers %d  applied %d  ledger %d  %.2f s",
                self.round,
                loss,
                line["peers"],
                len(incoming),
                line["ledger"],
                seconds,
                extra={"fields": line},
            )
            self.round += 1
            self.in_round = False
            if self.s.eval_every and self.round % self.s.eval_every == 0:
                await self.evaluate()

    async def run_audits(self) -> None:
        """Recompute the updates due for audit (the model holds S of this round), publish
        our mismatches and re-check votes, and act on what the ledger now decides."""
        jobs = self.audits.ready(self.round)
        if not jobs:
            return
        results = await self.in_model_thread(
            self.audits.audit, jobs, self.live.engine, self.tokenizer, self.task
        )
        for record, _mismatch in results:
            self.audits.intake.own(record)
            data = encode_audit(self.config.run_id, record.accused, record.round, record.scalars)
            await self.node.publish_on(audit_topic_for(self.config.run_id), data)
            self.audits.counts["published"] += 1
        if results:
            await self.apply_judgement()
        self.audit_status()  # the /metrics gauges

    async def on_audit_records(self, fresh: list) -> None:
        """Audit records new to the ledger, from gossip or repair (the flood node admitted
        and counted them): re-checks queued, then the ledger judged."""
        self.audits.note_records(fresh)
        await self.apply_judgement()

    async def apply_judgement(self) -> None:
        """Judge the ledger (here, where the ledger is written); take back a newly banned
        peer's updates (model thread); its later ones are never applied.

        The ban store is NOT told: the admission keeps logging a convicted peer's updates
        (void in every judgement). A sender that had not learned of the verdict yet still
        counted them in its settled state, and an auditor must hold them to rebuild that
        state: when verdicts went to the ban store, auditors dropped them and convicted
        every honest peer that trained around the bans (bench/results/audit_daemon.md)."""
        after = self.audits.judge()
        before = self.audits.standing
        if (
            before is not None
            and after.banned == before.banned
            and after.established == before.established
            and after.vouched.keys() == before.vouched.keys()
        ):
            return
        await self.in_model_thread(self.audits.set_standing, after)
        self.audit_status()  # the /metrics gauges

    async def restore_settled(self, first_round: int) -> str:
        """Audited runs: weights = base + the counted updates of rounds < first_round - lag
        (the state round `first_round` trains on); the later ones stay pending. From a
        checkpoint of exactly that cut, else by replay."""
        judged = self.audits.judge()  # nothing applied yet: nothing to undo
        self.audits.standing, self.audits.banned = judged, dict(judged.banned)
        cut = self.live.cut()
        limit = first_round - self.audits.settings.lag
        earlier = [m for m in cut.messages if m.round < limit]
        settled = judged.counted(earlier)
        later = [m for m in cut.messages if m.round >= limit]
        how = await self.in_model_thread(
            self.live.restore, LedgerCut(settled, digest_of(settled), []), self.s.data_dir
        )
        self.audits.applied = list(settled)
        self.audits.waiting = [m for m in earlier if not judged.counts(m.peer, m.round)]
        self.live.receive(later)
        return how + f" (settled state of round {first_round})"

    async def apply_pending(self) -> None:
        """Apply every update received and not applied yet (a banned peer's: not)."""
        incoming = self.live.take()
        await self.in_model_thread(self.audits.apply if self.audits else self.live.apply, incoming)

    def catch_up(self) -> None:
        """A peer far behind the run (slow, or paused) jumps to the round a quorum of
        distinct peers reached: its updates would otherwise fall below every peer's window.
        One identity cannot pull it forward (see Admission.reference_round)."""
        quorum = quorum_round(self.node.admission.claims.values())
        if quorum - self.round > self.s.node.max_behind // 2:
            log.warning(
                "round %d is far behind the run's round %d (a quorum of peers): jumping ahead",
                self.round,
                quorum,
                extra={"fields": {"event": "catch_up", "from": self.round, "to": quorum}},
            )
            self.round = quorum if self.final_round is None else min(quorum, self.final_round)

    async def evaluate(self) -> None:
        """Held-out figures of the live model after `self.round` rounds, logged: loss, and
        accuracy and macro-F1 (classification) or perplexity (lm, completion)."""
        from seedflood_p2p.algorithm.trainer import evaluate_metrics, format_metrics

        metrics = await self.in_model_thread(
            evaluate_metrics,
            self.model,
            self.tokenizer,
            self.task,
            self.config,
            self.s.eval_examples,
        )
        await self.in_model_thread(self.set_model_hash)
        loss, accuracy = metrics["loss"], metrics.get("accuracy")
        self.last_eval = (loss, accuracy)
        self.last_eval_round = self.round
        if self.page is not None:
            self.page.record_eval(self.round, loss, accuracy)
        examples = min(self.s.eval_examples, len(self.task.test))
        fields = {
            "event": "eval",
            "rounds_done": self.round,
            "eval_examples": examples,
            "eval_loss": round(loss, 5),
        }
        if accuracy is not None:
            fields["eval_accuracy"] = round(accuracy, 4)
            self.metrics.eval_accuracy.set(accuracy)
        for name in ("macro_f1", "perplexity"):
            if name in metrics:
                fields[f"eval_{name}"] = round(metrics[name], 4)
        log.info(
            "eval after %d rounds on %d held-out examples: %s",
            self.round,
            examples,
            format_metrics(metrics),
            extra={"fields": fields},
        )

    async def linger(self, final_round: int) -> None:
        """Keep flooding and repairing until live peers reached `final_round` and no new
        message arrived for `linger` seconds (at most `linger_max` seconds): a peer that
        leaves early would miss the stragglers' last updates."""
        started = quiet_since = time.monotonic()
        while time.monotonic() - started < self.s.linger_max and not self.stopping:
            if await self.node.sync_round():
                quiet_since = time.monotonic()
            await asyncio.sleep(0.5)
            now = time.monotonic()
            if now - self.node.last_accept < 0.5:
                quiet_since = now
            if self.final_round is not None and self.final_round > final_round:
                return  # asked to train further (see finish_after)
            waiting = [p for p, st in self._live_peers(now).items() if st.round < final_round]
            if not waiting and now - quiet_since >= self.s.linger:
                return
        if not self.stopping:
            log.warning("stopped waiting for slow peers after %.0f s", self.s.linger_max)

    async def report_sources(self, check) -> None:
        """Log how the ledger fetched at start compares with each source's (flood.SourceCheck)."""
        names = {
            kind: ", ".join(f"{_b58(p)[-8:]} ({n} rows)" for p, n in found.items())
            for kind, found in (("lacking", check.lacking), ("ahead", check.ahead))
        }
        fields = {
            "event": "sources_checked",
            "compared": check.compared,
            "agree": len(check.agree),
            "lacking": {_b58(p): n for p, n in check.lacking.items()},
            "ahead": {_b58(p): n for p, n in check.ahead.items()},
            "differ": {_b58(p): n for p, n in check.differ.items()},
            "unanswered": len(check.unanswered),
        }
        if check.lacking or check.ahead or check.differ:
            log.warning(
                "ledger checked against %d source(s): %d agree; lacking rows we hold (behind, "
                "or withholding what others served): %s; still ahead of us: %s",
                check.compared,
                len(check.agree),
                names["lacking"] or "none",
                names["ahead"] or "none",
                extra={"fields": fields},
            )
        else:
            log.info(
                "ledger checked against %d source(s): all agree",
                check.compared,
                extra={"fields": fields},
            )

    def set_model_hash(self, sha256: str | None = None) -> None:
        self.model_hash = sha256 or self.live.sha256()
        self.metrics.model.info({"sha256": self.model_hash, "round": str(self.round)})

    async def checkpoint(self) -> dict:
        """Weights and the ledger cut they equal. The cut is taken here, on the event loop
        where every accept runs (see algorithm/live.py): an update arriving while the
        weights are written stays pending, in neither."""
        cut = self.live.cut()
        meta = {
            # lets the next start skip re-checking these rows' signatures (unchanged_rows)
            "ledger_rows_sha256": self.ledger.rows_sha256(
                {(m.peer, m.round) for m in cut.messages}
            ),
            "round": self.round,
            "run_id": self.config.run_id,
            "peer_id": self.p2p.peer_id.to_base58(),
        }
        return await self.in_model_thread(self._write_checkpoint, cut, meta)

    def _write_checkpoint(self, cut: LedgerCut, meta: dict) -> dict:
        meta = self.live.checkpoint(self.s.data_dir, cut, meta)
        self.set_model_hash(meta["model_sha256"])
        return meta

    # -- main ------------------------------------------------------------------
    async def run(self) -> dict:
        s = self.s
        s.data_dir.mkdir(parents=True, exist_ok=True)
        stale = remove_stale_sockets()
        if stale:
            log.info("removed %d stale p2pd control socket(s) of killed daemons", len(stale))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGUSR1, log_tasks)  # where is it waiting?
        # No initial peers for the daemon: it would give up at once when they are down. The
        # reconnector dials the bootstrap list and the peer book itself, with backoff.
        self.p2p = await create_p2p(
            identity_path=s.data_dir / "identity.key",
            host_maddrs=s.listen,
            announce_maddrs=s.announce or None,
            use_auto_relay=s.node.auto_relay,
            reachability=s.node.reachability,
            relays=s.node.relays,
            relay_service=s.node.relay_limits(default_on=False),
            nat_port_map=s.node.nat_port_map,
            startup_timeout=s.node.daemon_start_timeout,
            bootstrap_addrs=s.bootstrap,
        )
        self.peer_id = self.p2p.peer_id.to_bytes()
        self.reconnector = Reconnector(self.p2p, s.data_dir, s.bootstrap, s.node, self.metrics)
        discovering: asyncio.Task | None = None
        sampling: asyncio.Task | None = None
        http = None
        try:
            if s.node.discovery:
                self.discovery = Discovery(self.p2p, s.data_dir / "identity.key", self.metrics)
                await self.discovery.start()
            if s.metrics_port is not None:  # early, so /status says why the peer waits
                http = await serve_http(
                    s.metrics_host,
                    s.metrics_port,
                    self.metrics,
                    self.status,
                    self.finish_after,
                    routes=(lambda app: add_routes(app, lambda: self.page)) if s.run_page else None,
                )
                port = http.port
                log.info(
                    "metrics and status on http://%s:%d/status",
                    s.metrics_host,
                    port,
                    extra={"fields": {"event": "http", "port": port}},
                )
                (s.data_dir / "status_port").write_text(str(port))
            self.state = "connecting"
            config = await self.first_contact()
            if config is None:  # stopped while waiting
                return {}
            self.config = config
            log.info(
                "peer %s joining run %s (model %s, dataset %s)",
                self.p2p.peer_id.to_base58(),
                self.config.run_id[:12],
                self.config.model,
                self.config.dataset,
                extra={
                    "fields": {
                        "event": "join",
                        "peer_id": self.p2p.peer_id.to_base58(),
                        "run_id": self.config.run_id,
                    }
                },
            )
            self.state = "loading"
            self.ledger = Ledger(s.data_dir / "ledger.sqlite", self.config.run_id)
            self.ledger.claim(self.config.to_json(), "use a new --data-dir per run")
            check = await asyncio.to_thread(self.check_ledger)  # O(rows): ~120 us a signature
            log.info(
                "ledger checked: %d signed rows in %.1f s%s",
                check.signed,
                check.seconds,
                f" ({check.trusted} of them unchanged since the checkpoint: not re-checked)"
                if check.trusted
                else "",
            )
            await self.get_assets()
            self.model, self.tokenizer, self.task = await self.in_model_thread(
                self.load_model, self.config
            )
            from seedflood_p2p.algorithm.subcge import make_estimator

            self.live = LiveModel(make_estimator(self.model, self.config), self.ledger)
            self.node = FloodNode(
                self.p2p,
                self.ledger,
                self.config.to_json(),
                self.metrics,
                s.node,
                on_accept=self.live.receive,
            )
            audit_settings = AuditSettings.of(self.config.extra)
            if ticket_creator(self.config) is not None:
                # The admission rule and the tickets are built (network/tickets.py); handing
                # each peer's ticket to the others is not, so a ticketed run would drop every
                # honest update: refused, in one line, rather than started half-closed.
                raise UserError(
                    "this run is ticketed (extra.join.mode): the peer daemon cannot join "
                    "ticketed runs yet (tickets are not passed between peers); use "
                    "allow_peers for a closed run"
                )
            if audit_settings.enabled:
                self.audits = PeerAudits(
                    audit_settings,
                    (s.data_dir / "identity.key").read_bytes(),  # our secret audit draws
                    self.peer_id,
                    self.ledger,
                    self.live,
                    self.node.audits,
                    ProbationSettings.of(self.config),
                )
                self.node.on_accept = self._accept_audited
                self.node.on_audit_records = self.on_audit_records
            if chain_period(self.config) and self.audits is None:  # not in audited runs
                self.chain = await self.in_model_thread(self._make_chain)
            elif chain_period(self.config):
                log.warning(
                    "extra.checkpoint_every is ignored: the run has audits (on unless its "
                    "manifest sets extra.audit = false), and audited runs build no chain"
                )
            self.node.not_ready = "starting: syncing with the run first"
            self.page = RunPage(
                self.ledger,
                json.loads(self.config.to_json()),
                self.p2p.peer_id.to_base58(),
                "peer",
                self.observe,
                "this peer's own evaluations of its live model"
                + (
                    f" every {s.eval_every} rounds on the first {s.eval_examples} held-out "
                    "examples (peers do not publish their evaluations)"
                    if s.eval_every
                    else ": none (start it with --eval-every N); peers do not publish theirs"
                ),
            )
            sampling = asyncio.create_task(run_sampler(self.page), name="run-page")
            base_scored = False
            if s.eval_every and len(self.ledger) == 0:
                # A fresh peer scores the base model before it joins the topic: the run's
                # zero-shot point. Peers waiting for --min-peers wait for this too.
                await self.evaluate()
                base_scored = True
            await self.node.start()  # with the audit topic and audit repair, if the run has them
            if self.chain is not None:
                hook = "corrupt" if s.test_checkpoint == "corrupt" else ""
                self.checkpoint_server = CheckpointServer(self.node, hook)
                await self.checkpoint_server.start()
            await self.reconnector.attach(self.node)
            if self.discovery is not None:  # finds the run's other peers while we sync
                discovering = asyncio.create_task(
                    run_discovery(
                        self.discovery,
                        self.reconnector,
                        self.node,
                        lambda: self.round,
                        s.node.discovery_interval,
                    ),
                    name="discovery",
                )
            # No lonely start: a peer that knows others exist (its ledger's rows, its peer
            # book, its bootstrap list) trains only after one of them answered a repair pass.
            self.state = "syncing"
            if not s.node.allow_alone:
                others = {_b58(p) for p in self.ledger.peers() if p != self.peer_id}
                others |= set(self.reconnector.others_known())
                await catch_up(
                    self.reconnector,
                    self.node,
                    sorted(others),
                    lambda: self.stopping,
                    self._set_state,
                )
            await self.wait_for_peers()
            # The topic's peer list can still be empty right after subscribing (seen on
            # loopback: "ready at round 0 ... (0 fetched from peers)" against a full ledger).
            # Every connected node of the run is a source too, whatever the topic list says.
            from hivemind.p2p import PeerID

            peers = await self.node.connected_peers()
            for peer in sorted(self.reconnector.connected):
                if PeerID.from_base58(peer) not in peers:
                    peers.append(PeerID.from_base58(peer))
            # Sync first, then replay: overlapping the two was measured to gain nothing on
            # 2 cores (bench/results/latejoin_overlap.md).
            synced = await self.node.sync_until_complete(peers)
            if len(peers) > 1:  # what one source served, checked against the others
                await self.report_sources(await self.node.cross_check(peers))
            # The cut is taken here, on the event loop (see algorithm/live.py); updates
            # accepted while the model thread restores it stay pending for round one.
            if self.audits is None:
                how = await self.restore_model(peers)
            else:  # the model of our first round is its settled state, not the whole ledger
                how = await self.restore_settled(start_round(self.ledger, self.peer_id))
            if republished := await self.node.republish_unsigned():
                log.info(
                    "published again %d own update(s) or audit record(s) never sent signed",
                    republished,
                )
            await self.in_model_thread(self.set_model_hash)
            self.node.not_ready = None
            self.state = "training"
            self.round = start_round(self.ledger, self.peer_id)
            log.info(
                "ready at round %d: model from %s (%d fetched from peers)",
                self.round,
                how,
                synced,
                extra={
                    "fields": {
                        "event": "ready",
                        "round": self.round,
                        "source": how,
                        "fetched": synced,
                    }
                },
            )
            await self.extend_chain()
            if s.eval_every and not (base_scored and self.round == 0):
                await self.evaluate()
            self.until_round = s.until_round or self.config.total_rounds
            if self.until_round and self.final_round is None:
                self.final_round = self.until_round - 1
            await self.train()
            while not self.stopping and self.final_round is not None:
                self.state = "finishing: waiting for the others' last rounds"
                await self.linger(self.final_round)
                if self.round <= self.final_round:  # raised by /finish while lingering
                    self.state = "training"
                    await self.train()
                    continue
                if s.eval_every and self.last_eval_round != self.round:
                    await self.apply_pending()  # score the final model
                    await self.evaluate()
                break
            self.done_training = True
            self.state = "stopping"
            # No accepts after this: the checkpoint then covers the whole ledger on disk, so
            # a restart loads it instead of replaying everything.
            await self.node.stop()
            await self.apply_pending()  # without a banned peer's updates (audits)
            meta = await self.checkpoint()
            status = {**self.status(), "ledger_digest": meta["ledger_digest"]}
            (s.data_dir / "final_status.json").write_text(json.dumps(status, indent=1))
            log.info(
                "checkpoint written: round %d, %d ledger messages, model sha256 %s",
                meta["round"],
                meta["ledger_messages"],
                meta["model_sha256"][:16],
                extra={"fields": {"event": "checkpoint", **meta}},
            )
            return meta
        finally:
            if sampling is not None:
                sampling.cancel()
            if http is not None:
                await http.close()
            if self.discovery is not None:
                await self.discovery.stop(discovering)
            await self.reconnector.stop()
            if hasattr(self, "node"):
                await self.node.stop()
            if self.checkpoint_server is not None:
                self.checkpoint_server.close()
            await self.p2p.shutdown()
            self._model_thread.shutdown(wait=False)

    # -- checkpoint chain and download --------------------------------------
    def _make_chain(self) -> CheckpointChain:
        """The chain builder, on a second copy of the base model (model thread)."""
        from seedflood_p2p.workload.models import load_model
        from seedflood_p2p.workload.tasks import run_sources

        scratch, _ = load_model(
            run_sources(self.config, self.asset_paths.get("model", self.s.model_dir))[0]
        )
        return CheckpointChain(scratch.to(self.s.device), self.config, self.s.data_dir / CHAIN_DIR)

    async def extend_chain(self) -> None:
        """Build and serve the newest settled link of the run's checkpoint chain, if due."""
        if self.chain is None:
            return
        target = link_round(self.round, self.chain.period, self.s.checkpoint_settle)
        if target <= self.chain_round:
            return
        rows = list(self.ledger.messages(0, target - 1))
        await self.in_model_thread(self.chain.build, rows, target)
        self.chain_round = target
        directory = self.chain.directory
        if self.s.test_checkpoint == "forge":  # the test hook: offer forged weights
            directory = await self.in_model_thread(self._forge_link)
        offer = await self.checkpoint_server.publish(directory)
        log.info(
            "checkpoint chain: link of round %d (%d rows, %.1f MiB) served to joiners",
            target,
            len(rows),
            offer.size / 2**20,
            extra={
                "fields": {
                    "event": "chain_link",
                    "round": target,
                    "rows": len(rows),
                    "file_sha256": offer.file_sha256.hex(),
                }
            },
        )

    def _forge_link(self) -> Path:
        """TEST HOOK: the chain's link with one tensor shifted, its hashes made consistent."""
        from seedflood_p2p.storage.checkpoint import (
            read_checkpoint_meta,
            read_checkpoint_weights,
            tensors_sha256,
            write_checkpoint,
        )

        weights = read_checkpoint_weights(self.chain.directory, "cpu")
        first = sorted(weights)[0]
        weights[first] = weights[first] + 0.01
        meta = read_checkpoint_meta(self.chain.directory)
        meta["weights_sha256"] = tensors_sha256(weights)
        forged = self.chain.directory / "forged"
        forged.mkdir(exist_ok=True)
        write_checkpoint(forged, weights, meta)
        return forged

    def choose_checkpoint(self, offer) -> str | None:
        """The joiner's rule: take the checkpoint if downloading it (its size at
        checkpoint_bandwidth) is estimated faster than replaying the rows it covers
        (replay.estimate_replay_seconds); None to take it, else why not."""
        from seedflood_p2p.algorithm.replay import estimate_replay_seconds

        if self.s.checkpoint_fetch == "always":
            return None
        meta = offer.meta
        download = offer.size * 8 / (self.s.checkpoint_bandwidth * 1e6)
        params = self.live.engine.num_parameters
        replay_s = estimate_replay_seconds(
            meta["ledger_messages"], meta["round"], self.config, params
        )
        if download < replay_s:
            return None
        return (
            f"replaying its {meta['ledger_messages']} rows (~{replay_s:.1f} s) is estimated "
            f"faster than downloading {offer.size / 2**20:.1f} MiB (~{download:.1f} s at "
            f"{self.s.checkpoint_bandwidth:g} Mbit/s)"
        )

    def _count_refused(self, refused: dict[str, int]) -> None:
        for why, n in refused.items():
            self.metrics.checkpoint_refused.labels(why).inc(n)
            self.checkpoint_info["refused"][why] = self.checkpoint_info["refused"].get(why, 0) + n

    async def restore_model(self, peers: list) -> str:
        """Weights = base + the ledger cut: from our own checkpoint plus the rows after it;
        a peer without one, in a run with a checkpoint chain, first tries to fetch a link
        that a quorum of peers offers (network/checkpoints.py) and restores from it plus the
        rows after it. Whatever is refused on the way is counted and logged; the fallback is
        always the replay of the ledger."""
        s = self.s
        own = (s.data_dir / "checkpoint.json").exists()
        if self.chain is None or own or s.checkpoint_fetch == "never" or not peers:
            return await self.in_model_thread(self.live.restore, self.live.cut(), s.data_dir)
        chain_dir = s.data_dir / CHAIN_DIR
        try:
            result = await fetch_checkpoint(
                self.node, peers, chain_dir, s.node.call_timeout, self.choose_checkpoint
            )
        except FetchFailed as exc:
            self._count_refused(exc.refused)
            log.warning(
                "no checkpoint fetched (%s): replaying the ledger instead",
                exc,
                extra={"fields": {"event": "checkpoint_fetch", "ok": False, "why": str(exc)}},
            )
            return await self.in_model_thread(self.live.restore, self.live.cut(), s.data_dir)
        self._count_refused(result.refused)
        meta = result.offer.meta
        self.checkpoint_info["fetched"] = {
            "round": meta["round"],
            "rows": meta["ledger_messages"],
            "bytes": result.offer.size,
            "peers": result.peers,
            "chunks_resumed": result.chunks_resumed,
            "seconds": round(result.seconds, 2),
        }
        log.info(
            "fetched the checkpoint of round %d (%.1f MiB) from %d peers in %.1f s",
            meta["round"],
            result.offer.size / 2**20,
            len(result.peers),
            result.seconds,
            extra={
                "fields": {
                    "event": "checkpoint_fetch",
                    "ok": True,
                    **self.checkpoint_info["fetched"],
                }
            },
        )
        how = await self.in_model_thread(self.live.restore, self.live.cut(), chain_dir)
        if how.startswith("replay"):  # its cut or its tensors did not check out: replayed
            self._count_refused({"ledger": 1})
            log.warning(
                "the fetched checkpoint of round %d does not match this ledger: refused, "
                "the ledger was replayed instead",
                meta["round"],
                extra={"fields": {"event": "checkpoint_refused", "why": "ledger"}},
            )
            return how
        return f"fetched {how} from {len(result.peers)} peers"

    def _accept_audited(self, messages: list) -> None:
        self.live.receive(messages)
        self.audits.on_accept(messages, len(self._live_peers(time.monotonic())) + 1)

    def _set_state(self, state: str) -> None:
        self.state = state

    async def wait_for_peers(self) -> None:
        if self.s.min_peers <= 0:
            return
        deadline = time.monotonic() + self.s.startup_wait
        while time.monotonic() < deadline:
            if len(await self.node.connected_peers()) >= self.s.min_peers:
                return
            await asyncio.sleep(0.2)
        log.warning(
            "only %d of %d peers after %.0f s: starting anyway",
            len(await self.node.connected_peers()),
            self.s.min_peers,
            self.s.startup_wait,
        )


def _b58(peer: bytes) -> str:
    import base58

    return base58.b58encode(peer).decode()


def log_tasks() -> None:
    """Log where every asyncio task of the daemon is waiting (`kill -USR1 PID`): a daemon
    that seems stuck says what it awaits, without stopping it. The await chain is walked
    from the task's coroutine down (`Task.get_stack` gives only the outermost frame)."""
    for task in asyncio.all_tasks():
        chain, coro = [], task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                break
            chain.append(
                f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"
            )
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        where = " -> ".join(chain) or "(not started)"
        log.warning(
            "task %s waits in %s",
            task.get_name(),
            where,
            extra={"fields": {"event": "task", "task": task.get_name(), "where": where}},
        )


def run_peer(settings: PeerSettings) -> dict:
    try:
        import uvloop

        return uvloop.run(PeerDaemon(settings).run())
    except ImportError:  # uvloop is Linux/macOS only
        return asyncio.run(PeerDaemon(settings).run())
