"""Joining a run: the manifest from a node of the run (or the DHT), its checks (clock,
version, what the daemon supports), the stored ledger's signatures, the run's model and
data (own copies or fetched from peers) checked against the manifest's digests.

    first_contact  dial bootstrap list + peer book -> `seedflood.manifest` -> RunConfig
    check_ledger   every stored row's signature (not those the checkpoint vouches for)
    get_assets     the run's model dir / data file when the manifest names local paths
    load_model     the base weights and the task, checked against the manifest
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch

from peer.settings import PeerSettings
from seedflood_p2p import __version__
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.host import NetworkHost
from seedflood_p2p.network.transfer.assets import AssetServer
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.network.transport.p2pd import host_port
from seedflood_p2p.network.transport.rpc import RemoteCallError, call_bytes
from seedflood_p2p.network.transport.sigcheck import SignaturePool
from seedflood_p2p.storage.checkpoint import unchanged_rows
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.peer")

MAX_CLOCK_SKEW = 300.0  # seconds; beyond this the peer refuses to join


def check_manifest_reply(reply: dict, now: float, version: str) -> RunConfig:
    """The run's settings from a `seedflood.manifest` reply, if this peer can join it."""
    skew = reply["time"] - now
    if not abs(skew) <= MAX_CLOCK_SKEW:  # NaN too
        raise UserError(
            f"this machine's clock differs from the bootstrap node's by {skew:+.0f} s: "
            "enable time sync (e.g. `timedatectl set-ntp true`) and restart"
        )
    check_version(reply["version"], version)
    config = RunConfig.from_network(reply["manifest"])
    if problem := config.daemon_problem():
        raise UserError(f"cannot join run {config.run_id[:12]}: {problem}")
    if config.data_basis and not config.basis_sha256:
        raise UserError(
            f"cannot join run {config.run_id[:12]}: it uses an activation basis but its "
            "manifest names no basis artifact (basis_sha256); its bootstrap node must "
            "compute one (seedflood >= 0.1 does at start)"
        )
    return config


def check_own_work(config: RunConfig, peer_id: bytes, key_path: Path) -> None:
    """A run with identity work (`extra.identity_work`): this peer's key must carry it, else
    every peer would drop its updates (`no_work`); one line that says how to make one."""
    work = config.identity_work
    if work.qualifies(peer_id):
        return
    import base58

    from seedflood_p2p.core.extra_settings import work_bits

    raise UserError(
        f"run {config.run_id[:12]} admits identities with {work.difficulty} bits of identity "
        f"work (extra.identity_work) and this peer's key {key_path} "
        f"({base58.b58encode(peer_id).decode()}) has {work_bits(work.run_key, peer_id)}: move "
        f"it aside, make one with `seedflood keygen --run-id {config.run_id} --difficulty "
        f"{work.difficulty} --out {key_path}`, and restart"
    )


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


def check_ledger(ledger: Ledger, config: RunConfig, peer_id: bytes, data_dir: Path):
    """`Ledger.verify` of every row, but the signatures of rows our checkpoint covers
    that are byte for byte unchanged since it was written (`unchanged_rows`). The
    signatures are checked in bulk in worker processes (`SignaturePool`: one per core,
    ended when the check is done), not one by one under this process's GIL."""
    with SignaturePool(idle=None) as pool:
        return ledger.verify(
            verify_pubsub_signature,
            f"move {ledger.path} aside and restart: the peer re-syncs from the network",
            config.directions,
            peer_id,
            unchanged_rows(ledger, data_dir),
            check_many=pool.check,
        )


class Joiner:
    """Finds the run and what it needs to start: the manifest, the model, the data.

    `host`: the network host (its p2p daemon, reconnector and discovery); `stopping`:
    has the daemon been asked to stop; `set_state`: what the daemon shows as its state."""

    def __init__(
        self,
        settings: PeerSettings,
        host: NetworkHost,
        stopping: Callable[[], bool],
        set_state: Callable[[str], None],
    ) -> None:
        self.s = settings
        self.host = host
        self.stopping = stopping
        self.set_state = set_state
        # The run's model dir / data file on this machine, when the manifest names paths:
        # fetched from peers or the peer's own copies (get_assets); served to joiners.
        self.asset_paths: dict[str, Path] = {}
        self.assets: AssetServer | None = None

    async def ask_manifest(self, peer: str) -> RunConfig:
        """The run's settings from `peer`'s `seedflood.manifest`, if this peer can join it.
        RemoteCallError (unreachable, not ready, not a manifest) lets the caller go on."""
        from hivemind.p2p import PeerID

        reply = await call_bytes(
            self.host.p2p, PeerID.from_base58(peer), "seedflood.manifest", b"", 15.0
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
        discovery = self.host.discovery
        if discovery is None:
            return None
        try:
            await discovery.add_peers(connected)
            records = await discovery.lookup(run_id, "manifest")
        except Exception as exc:  # a DHT failure: go on dialling as without discovery
            log.warning("reading the manifest from the DHT failed: %r", exc)
            return None
        other_versions = []
        for record in records.values():
            try:
                config = RunConfig.from_network(record.body["manifest"])
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
        with Ledger.open_existing(path) as stored:  # refuses a ledger without a manifest
            return stored.config

    async def first_contact(self) -> RunConfig | None:
        """Dial the bootstrap list and every peer in the peer book (with backoff) until one
        serves the run manifest. A new peer gives up after `connect_retries` rounds with one
        line naming what it tried; a peer whose data dir already holds the run keeps trying
        for as long as it runs (it knows the run has others), unless --allow-alone. None
        if stopped while waiting."""
        s, reconnector = self.s, self.host.reconnector
        stored = self.stored_manifest()
        attempt = 0
        while not self.stopping():
            dial_errors = await reconnector.dial_due(force=attempt == 0)
            attempt += 1
            connected = reconnector.connected
            order = [p for p in reconnector.bootstrap if p in connected]
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
                    for p, a in reconnector.candidates().items()
                )
                or "no address: pass --bootstrap"
            )
            if stored is not None and s.node.allow_alone:
                log.warning("no peer reachable (%s): starting alone (--allow-alone)", tried)
                return stored
            if stored is None and attempt > s.connect_retries:
                check = host_port(next(iter(reconnector.candidates().values()), [""])[0])
                raise UserError(
                    f"could not reach any bootstrap peer or known peer after {attempt} "
                    f"attempt(s) (tried: {tried}); at least one must be running and "
                    f"reachable from this machine (check with `nc -vz {check}`, and open or "
                    "forward its port if it is behind a firewall or NAT)"
                )
            delay = min(s.node.redial_max, s.node.redial_min * 2 ** (attempt - 1))
            if stored is not None:
                state = (
                    "waiting: this peer's data dir holds run "
                    f"{stored.run_id[:12]}, so the run has others, and none is reachable"
                )
                self.set_state(state)
                log.warning(
                    "%s (tried: %s); retrying in %.0f s, not training alone (pass "
                    "--allow-alone to start anyway)",
                    state,
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
            while not self.stopping() and time.monotonic() < until:
                await asyncio.sleep(0.2)
        return None

    def load_model(self, config: RunConfig):
        """The run's base model (on the peer's device), tokenizer and task, each checked
        against the manifest's digests (model thread)."""
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

    def basis_artifact(self, config: RunConfig, ledger):
        """The run's activation basis from the file fetched by digest (`get_assets`),
        checked, and kept beside the ledger, which names it, so a replay of this ledger
        (`seedflood replay`, `export`) applies the same bytes."""
        from seedflood_p2p.algorithm.basis import decode
        from seedflood_p2p.storage.artifacts import ArtifactStore, read_schedule, write_schedule

        sha = config.basis_sha256
        artifact = decode(Path(self.asset_paths["basis"]).read_bytes(), sha)
        ArtifactStore.beside(ledger.path).put(artifact.body)
        if read_schedule(ledger) != [(0, sha)]:
            write_schedule(ledger, [(0, sha)])
        return artifact

    async def get_assets(self, config: RunConfig) -> None:
        """The run's model directory and data file, when its manifest names paths of the
        organiser's machine: this peer's own copies (--model-dir, --dataset-file), else
        fetched from peers by digest. Then served to later joiners, by digest too."""
        from seedflood_p2p.network.transfer.assets import AssetError, fetch_asset
        from seedflood_p2p.workload.tasks import check_asset, local_assets

        kinds = local_assets(config)
        own = {"model": self.s.model_dir, "dataset": self.s.dataset_file, "basis": None}
        for kind in kinds:
            if own[kind] is not None:
                self.asset_paths[kind] = own[kind]
                continue
            self.set_state(f"fetching the run's {kind} from peers")
            try:
                self.asset_paths[kind] = await fetch_asset(
                    self.host.p2p,
                    sorted(self.host.reconnector.connected),
                    config.run_id,
                    kind,
                    self.s.data_dir / "assets",
                    lambda path, kind=kind: check_asset(config, kind, path),
                )
            except AssetError as exc:
                if kind == "basis":
                    raise UserError(f"{exc}; retry when the bootstrap node is up") from None
                flag = "--model-dir" if kind == "model" else "--dataset-file"
                raise UserError(f"{exc}; or pass {flag} with your copy") from None
        if kinds:
            self.assets = AssetServer(
                self.host.p2p, config.run_id, lambda peer: self.host.refuses(peer) is None
            )
            await self.assets.start()
            for kind in kinds:
                try:
                    await self.assets.publish(kind, Path(self.asset_paths[kind]))
                except (AssetError, OSError) as exc:
                    log.warning("not serving the run's %s to joiners: %s", kind, exc)
