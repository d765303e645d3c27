"""Late join and restore: sync the ledger from the run, then the model = base + ledger,
from our own checkpoint, a checkpoint of the run's chain fetched from peers, or replay;
and the chain itself, built and served to later joiners.

    sync       every connected node of the run is a source; sync until complete, then
               what one source served is checked against the others (cross_check)
    restore    own checkpoint + later rows | fetched chain link + later rows | replay
               (audited runs: the settled state of the first round, `restore_settled`)
    chain      link R built once the own round is R + checkpoint_settle, then served
               (audited runs: the rows that count in a settled prefix, chain.py; built
               SETTLED_MARGIN rounds later)

With `--history-sync background` (a run with a chain, no audits) a joiner without its
own checkpoint fetches the quorum's link first, syncs only the rows after it, and is
ready: it trusts the link's rows, as a restart trusts its own checkpoint's. Repair then
brings the history while it trains, and `check_history` compares it with the link's
digest: a match ends the trust; a difference rebuilds the model by replay of the ledger.
Until then it builds no link of its own and writes no checkpoint at stop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path

from peer.applied_rows import AppliedRows
from peer.audit_duty import PeerAudits
from peer.behaviour import Behaviour
from peer.settings import PeerSettings
from seedflood_p2p.algorithm.chain import (
    CHAIN_DIR,
    SETTLED_MARGIN,
    STANDING,
    STEP_ROWS,
    CheckpointChain,
    SettledCount,
    link_round,
    settled_alike,
)
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.probation import NEVER, effective_round
from seedflood_p2p.algorithm.standing_summary import StandingSummary
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.transfer.checkpoints import (
    OFFER_RETRY_SECONDS,
    CheckpointServer,
    FetchFailed,
    fetch_checkpoint,
)
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.protocol.update import quorum_round
from seedflood_p2p.storage.checkpoint import (
    META_FILE,
    WEIGHTS_FILE,
    read_checkpoint_meta,
    read_checkpoint_tensor,
    read_checkpoint_weights,
    tensors_sha256,
    write_checkpoint,
)
from seedflood_p2p.storage.cut import cut_contains
from seedflood_p2p.storage.digests import digest_within
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.peer")
NO_HISTORY = 1 << 62  # a repair floor above every round: no bucket is fetched
PAUSE_LIMIT = 300.0  # seconds an audited joiner stops for its trusted link's history, at most


def start_round(ledger: Ledger, peer_id: bytes) -> int:
    """The round to train first after a (re)start or late join: after our own last update,
    and not behind the round a quorum of distinct other peers reached in the ledger. A pure
    function of the ledger; not the highest round in it, which one identity could set."""
    rounds = ledger.peer_rounds()
    own = rounds.pop(peer_id, -1)
    return max(own + 1, quorum_round(rounds.values()), 0)


class LateJoin:
    """Sync, restore, and the run's checkpoint chain (if it has one) for one peer.

    `run`: runs a function on the model thread; `audits`: the run's audits (None: none);
    `asset_paths`: this machine's copy of the run's model dir, when the manifest names one;
    `behaviour`: what the chain's server offers and sends (honest, but for a test's peer)."""

    def __init__(
        self,
        settings: PeerSettings,
        config: RunConfig,
        node: FloodNode,
        live: LiveModel,
        metrics: NodeMetrics,
        run: Callable[..., Awaitable],
        audits: PeerAudits | None,
        asset_paths: dict[str, Path],
        behaviour: Behaviour,
    ) -> None:
        self.s = settings
        self.config = config
        self.node = node
        self.ledger = node.ledger
        self.live = live
        self.metrics = metrics
        self.run = run
        self.audits = audits
        self.asset_paths = asset_paths
        self.behaviour = behaviour
        self.chain: CheckpointChain | None = None  # the run's checkpoint chain (if it has one)
        self.server: CheckpointServer | None = None
        self.chain_round = 0  # the newest link built and served
        self.info: dict = {
            "fetched": None,
            "refused": {},
            "history": None,
            "link_check": None,
            "self_check": None,  # audited runs: a fetched link's state, checked before ready
        }
        self.trusting = False  # will this join trust a link (`hold_history`)?
        self.fetch_failed = False  # a trusting join found no link to trust
        # the link the model was restored from, until `check_link` has rebuilt it
        self.fetched_meta: dict | None = None
        self.trusted_round: int | None = None  # the link trusted at join, until checked
        self._trusted_fetch = None  # its FetchResult (an audited join's self-check reads it)
        # audited runs: set while the weights may stand on a trusted link (the daemon's
        # DaemonAudits.settled: the rounds wait while it is clear)
        self.settled: asyncio.Event | None = None
        # audited runs: (matched, recomputed) of others' recent updates on the restored
        # model (`PeerAudits.self_check` on the model thread; set by the daemon)
        self.verify_settled: (
            Callable[[int, frozenset[bytes]], Awaitable[tuple[int, int]]] | None
        ) = None
        # starts a background task that the daemon cancels at shutdown (NetworkHost.spawn;
        # None: a link is built in the caller's await)
        self.spawn: Callable[[Coroutine, str], asyncio.Task] | None = None
        self._building: asyncio.Task | None = None  # the link being built, if any
        self._failed_round = 0  # a link whose build failed (logged): not tried again

    # -- the chain ---------------------------------------------------------------------
    async def make_chain(self) -> list[CheckpointServer]:
        """The chain builder and its server, if the run has a chain (in an audited run its
        links are settled states: algorithm/chain.py); the services to start on the flood
        node's daemon."""
        if not self.config.checkpoint_every:
            return []
        if self.config.momentum:  # (refused in unaudited runs: RunConfig.daemon_problem)
            log.warning(
                "extra.checkpoint_every is ignored: the chain's links do not carry the "
                "velocity, and this audited run trains with momentum"
            )
            return []
        self.chain = await self.run(self._make_chain)
        self.server = CheckpointServer(self.node, self.behaviour.served_chunk)
        return [self.server]

    def _make_chain(self) -> CheckpointChain:
        """The chain builder, on a second copy of the base model (model thread)."""
        from seedflood_p2p.workload.models import load_model
        from seedflood_p2p.workload.tasks import run_sources

        scratch, _ = load_model(
            run_sources(self.config, self.asset_paths.get("model", self.s.model_dir))[0]
        )
        return CheckpointChain(
            scratch.to(self.s.device),
            self.config,
            self.s.data_dir / CHAIN_DIR,
            self.live.schedule,
        )

    async def extend_chain(self, round_: int) -> None:
        """Build and serve the newest settled link of the run's checkpoint chain, if due
        (`round_`: the peer's round): in the background, one build at a time, when the
        daemon gave a way to start tasks (`spawn`), so rounds go on while a link is built
        from all rows; else here."""
        if self.chain is None or self.fetched_meta is not None or self._building is not None:
            return  # (no link built on a fetched link not yet checked: `check_link`)
        settle = self.s.checkpoint_settle + (SETTLED_MARGIN if self.audits is not None else 0)
        target = link_round(round_, self.chain.period, settle)
        if target <= max(self.chain_round, self._failed_round):
            return
        if self.spawn is None:
            await self._extend(target)
        else:
            self._building = self.spawn(self._extend(target), "chain-link")

    async def _extend(self, target: int) -> None:
        """Build link `target` (from the newest link built here if it can, else from all
        rows, a model-thread step at a time) and serve it."""
        try:
            meta = await self._link(target)
            await self._serve(target, meta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (the chain is a service: the rounds go on without it)
            self._failed_round = target  # not tried again until the next link is due
            log.error(
                "checkpoint chain: building link of round %d failed: %r",
                target,
                exc,
                exc_info=exc,
                extra={"fields": {"event": "chain_link_failed", "round": target}},
            )
        finally:
            self._building = None

    async def _link(self, target: int) -> dict:
        """Link `target`'s JSON, once built: its period's rows onto the newest link built
        here, or from all rows below it. Those are read from a snapshot and replayed on the
        model thread a step at a time (`CheckpointChain.build_steps`): at ten million rows
        the read alone takes ~36 s and the replay minutes, which in one call stalled the
        rounds."""
        ledger, tail, meta = self.ledger, self.chain.tail, None
        count = self._settled_count(target)
        if tail is not None and tail.round < target:  # its period's rows onto the last link
            rows = list(ledger.messages(tail.round, target - 1))
            below = ledger.count_below(tail.round)
            meta = await self.run(
                self.chain.extend, rows, target, below, ledger.replacements, count
            )
        if meta is not None:
            return meta
        # the first link of this process, or rows below the last one changed
        replaced, snapshot = ledger.replacements, ledger.snapshot()
        try:
            rows = await self._rows_below(snapshot, target)
        finally:  # on the model thread, after any read of it still running there
            await asyncio.shield(self.run(_close, snapshot))
        steps = self.chain.build_steps(rows, target, replaced, count)
        built: dict = {}

        def step() -> bool:
            try:
                next(steps)
            except StopIteration as done:
                built["meta"] = done.value
                return False
            return True

        while await self.run(step):
            pass
        return built["meta"]

    async def _rows_below(self, snapshot, target: int) -> list[UpdateMessage]:
        """The snapshot's rows of rounds < target (canonical order), read on the model
        thread STEP_ROWS a call."""
        rows: list[UpdateMessage] = []
        it = iter(snapshot)

        def pull() -> bool:
            taken = 0
            for m in itertools.islice(it, STEP_ROWS):
                if m.round >= target:
                    return False
                rows.append(m)
                taken += 1
            return taken == STEP_ROWS

        while await self.run(pull):
            pass
        return rows

    async def _serve(self, target: int, meta: dict) -> None:
        """Offer the link just built to joiners (and log it)."""
        self.chain_round = target
        try:
            offer = await self.server.publish(
                await self.behaviour.served_link(self.chain.directory)
            )
        except ValueError as exc:  # no honest joiner could take it: not offered
            log.warning(
                "checkpoint chain: link of round %d built but not served: %s",
                target,
                exc,
                extra={"fields": {"event": "chain_link_unserved", "round": target}},
            )
            return
        log.info(
            "checkpoint chain: link of round %d (%d rows, %.1f MiB) served to joiners",
            target,
            meta["ledger_messages"],
            offer.size / 2**20,
            extra={
                "fields": {
                    "event": "chain_link",
                    "round": target,
                    "rows": meta["ledger_messages"],
                    "file_sha256": offer.file_sha256.hex(),
                }
            },
        )

    def _settled_count(self, target: int) -> SettledCount | None:
        """In an audited run, the rows link `target` holds: those counted in the settled
        prefix `target` + SETTLED_MARGIN by the ledger's standing as last judged (records
        that took effect before it have arrived by now, `checkpoint_settle` rounds later;
        one that comes later still is a late row's case). None without audits: every row."""
        if self.audits is None:
            return None
        standing = self.audits.standing
        # what the link's standing summary is made of (a trusting joiner's standing, below
        # the link): the ledger's records and the claims they audit, as a judgement reads
        # them (claims read once each); the summary reads only those that took effect in
        # the link's prefix, which all have by now
        claims, records, _, _ = self.audits.read_inputs()
        return SettledCount(
            standing or self.audits.judge(),
            target + SETTLED_MARGIN,
            tuple(records),
            claims,
            self.audits.settings,
        )

    def status(self) -> dict:
        """The checkpoint fetched at start (if any), what was refused, the newest link."""
        return {**self.info, "chain_round": self.chain_round}

    # -- sync --------------------------------------------------------------------------
    async def sync(self, connected: set[str]) -> tuple[list, int]:
        """Sync the ledger from every node of the run we are connected to (`connected`:
        the reconnector's, base58), then check what one source served against the others.
        The sources (PeerIDs) and the rows fetched."""
        from hivemind.p2p import PeerID

        # The topic's peer list can still be empty right after subscribing (seen on
        # loopback: "ready at round 0 ... (0 fetched from peers)" against a full ledger).
        # Every connected node of the run is a source too, whatever the topic list says.
        peers = await self.node.connected_peers()
        for peer in sorted(connected):
            if PeerID.from_base58(peer) not in peers:
                peers.append(PeerID.from_base58(peer))
        # Sync first, then replay: overlapping the two was measured to gain nothing on
        # 2 cores (bench/results/latejoin_overlap.md). Each pass asks only the peers that
        # neither we nor the ledger synced so far ban (the audit records fetched are judged
        # as they come, DaemonAudits.on_records; repair.Repair.sources).
        if self.trusting and peers:
            # only the rows after a trusted link, until ready (`restore` lifts the floor)
            self.node.repair.floor_round = await self._fetch_link(peers) or 0
        else:
            self.node.repair.floor_round = 0
        synced = await self.node.sync_until_complete(peers)
        peers = [p for p in peers if self.node.is_source(p.to_bytes())]
        if len(peers) > 1 and self.trusted_round is None:  # checked against the others
            report_sources(await self.node.cross_check(peers))
        return peers, synced

    def hold_history(self) -> None:
        """Before the node goes online: a joiner that will trust a link fetches no history
        (repair's floor above every round) until it knows the link's round (`sync`)."""
        self.trusting = self.trusts_history()
        if self.trusting:
            self.node.repair.floor_round = NO_HISTORY

    def trusts_history(self) -> bool:
        """Does this join trust a fetched link's rows (`--history-sync background`)? Only
        with a chain, no own checkpoint and a step rule the trust holds for."""
        s = self.s
        if s.history_sync != "background" or self.chain is None:
            return False
        if (s.data_dir / "checkpoint.json").exists() or s.checkpoint_fetch == "never":
            return False
        if self.config.round_sized or self.config.momentum:
            log.warning(
                "--history-sync background is ignored: under this run's %s a late row "
                "changes rows a trusted link holds; the whole history is synced first",
                "momentum" if self.config.momentum else f"step_rule {self.config.step_rule}",
            )
            return False
        return True

    async def _fetch_link(self, peers: list) -> int | None:
        """Fetch the link a quorum offers, to trust (`trusts_history`); its round, or None
        (nothing fetched: the whole history is synced first, as without the setting)."""
        result = await self._fetch(peers, lambda offer: None)
        if result is None:
            self.fetch_failed = True  # not asked again after the sync (`restore_model`)
            return None
        self.trusted_round = result.offer.meta["round"]
        self._trusted_fetch = result
        return self.trusted_round

    # -- restore -----------------------------------------------------------------------
    async def restore(self, peers: list, first_round: int) -> str:
        """The model of our first round: base + the whole ledger, or in an audited run its
        settled state (`restore_settled`). How it was built, for the log."""
        # The cut is taken here, on the event loop (see algorithm/live.py); updates
        # accepted while the model thread restores it stay pending for round one.
        if self.audits is None:
            try:
                return await self.restore_model(peers)
            finally:
                self.node.repair.floor_round = 0  # the history now comes by repair
        try:
            return await self.restore_settled(first_round, peers)
        finally:
            self.node.repair.floor_round = 0

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
            self.info["refused"][why] = self.info["refused"].get(why, 0) + n

    async def restore_model(self, peers: list) -> str:
        """Weights = base + the ledger cut: from our own checkpoint plus the rows after it;
        a peer without one, in a run with a checkpoint chain, first tries to fetch a link
        that a quorum of peers offers (network/transfer/checkpoints.py) and restores from it
        plus the
        rows after it. Whatever is refused on the way is counted and logged; the fallback is
        always the replay of the ledger."""
        s = self.s
        chain_dir = s.data_dir / CHAIN_DIR
        if self.trusted_round is not None:
            how = await self._restore_trusting(chain_dir)
            if how is not None:
                return how
        own = (s.data_dir / "checkpoint.json").exists()
        # (fetch_failed: a trusting join found no quorum's link a moment ago, before the sync)
        if self.chain is None or own or s.checkpoint_fetch == "never" or not peers:
            return await self._restore_from(s.data_dir)
        result = None if self.fetch_failed else await self._fetch(peers, self.choose_checkpoint)
        if result is None:
            return await self._restore_from(s.data_dir)
        return self._took(await self._restore_from(chain_dir), result)

    def _took(self, how: str, fetched) -> str:
        """After a restore from the fetched link (`fetched`, a FetchResult): refused and
        counted if it did not check out (its cut or tensors: `how` is a replay), else kept
        to be rebuilt after ready (`check_link`). How, for the log."""
        if how.startswith("replay"):
            self._count_refused({"ledger": 1})
            log.warning(
                "the fetched checkpoint of round %d does not match this ledger: refused, "
                "the ledger was replayed instead",
                fetched.offer.meta["round"],
                extra={"fields": {"event": "checkpoint_refused", "why": "ledger"}},
            )
            return how
        self.fetched_meta = read_checkpoint_meta(self.s.data_dir / CHAIN_DIR)
        return f"fetched {how} from {len(fetched.peers)} peers"

    async def _fetch(self, peers: list, choose: Callable):
        """`fetch_checkpoint` of the quorum's link into the chain dir, logged and counted;
        its FetchResult, or None when nothing was fetched."""
        s = self.s
        try:
            result = await fetch_checkpoint(
                self.node,
                peers,
                s.data_dir / CHAIN_DIR,
                s.node.call_timeout,
                choose,
                retry_wait=OFFER_RETRY_SECONDS,
            )
        except FetchFailed as exc:
            self._count_refused(exc.refused)
            log.warning(
                "no checkpoint fetched (%s): replaying the ledger instead",
                exc,
                extra={"fields": {"event": "checkpoint_fetch", "ok": False, "why": str(exc)}},
            )
            return None
        self._count_refused(result.refused)
        meta = result.offer.meta
        self.info["fetched"] = {
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
            extra={"fields": {"event": "checkpoint_fetch", "ok": True, **self.info["fetched"]}},
        )
        return result

    async def _restore_trusting(self, chain_dir: Path) -> str | None:
        """The fetched link, trusted, + the rows after it; None when its weights are
        refused: then the whole history is synced and the ledger replayed."""
        try:
            self.fetched_meta = read_checkpoint_meta(chain_dir)  # the file the quorum offered
            self.live.trust(self.fetched_meta)
        except (OSError, TypeError, ValueError, KeyError) as exc:
            log.warning("the fetched link cannot be trusted (%s): syncing its history", exc)
            how = None
        else:
            cut = self.live.streamed_cut()  # right after `trust`, on the event loop
            try:
                how = await self.run(self.live.restore_trusting, cut, chain_dir)
            finally:
                cut.close()
        if how is None:
            self.trusted_round = self.fetched_meta = None
            self._count_refused({"weights": 1})
            self.node.repair.floor_round = 0
            await self.node.sync_until_complete(await self.node.connected_peers())
            return None
        self.info["history"] = {
            "trusted_round": self.trusted_round,
            "rows": self.live.trusted_meta["ledger_messages"],
            "held_at_ready": self.live.trusted_held,  # of the link's rows, in the ledger
            "held": self.live.trusted_held,  # (rows below its round: `check_history`)
            "checked": False,
        }
        return f"fetched {how} from {len(self.info['fetched']['peers'])} peers"

    async def check_link(self, interval: float) -> None:
        """After ready from a fetched link: if it was trusted, its rows as repair brings
        them (`check_history`); then its weights, rebuilt from those rows on the chain's
        scratch model (`check_weights`). Until then this peer builds no link of its own."""
        try:
            if self.live.trusted is not None and not await self.check_history(interval):
                self.fetched_meta = None  # the model was rebuilt; the chain rebuilds itself
                return
            if self.fetched_meta is not None:
                await self.check_weights()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the link stays unchecked: no link of ours is built on it
            log.error("checking the fetched link failed: %r", exc, exc_info=exc)
            if self.settled is not None and not self.settled.is_set():
                log.error(
                    "training stays stopped: the model cannot stand on the trusted link and "
                    "was not rebuilt; restart the peer (it syncs and restores again)"
                )
            return
        self.fetched_meta = None

    async def check_weights(self) -> bool:
        """Rebuild the fetched link from the ledger's rows it covers, one period a model
        thread call (rounds go on between), as `CheckpointChain.build` makes every link: an
        honest link's tensors come out bit for bit. A difference means the peers that
        offered it served weights its rows do not make: logged as an error, the rebuilt link
        replaces it in the chain dir (this peer then serves the right one), and the live
        model is rebuilt by replay (in an audited run, moved by what the link was off by:
        its settled state is not base + ledger). True if they matched."""
        meta, chain = self.fetched_meta, self.chain
        covered = cut_contains(meta["ledger_cut"])
        started = time.monotonic()
        # The rows are read on the model thread from a snapshot (10M rows are not read on
        # the event loop), one period per call; periods without rows replay nothing.
        rows = self.ledger.snapshot()
        periods = itertools.groupby(rows, key=lambda m: m.round // chain.period)

        def step() -> bool:
            for period, group in periods:
                if period * chain.period >= meta["round"]:
                    return False
                chain.add([m for m in group if (m.peer, m.round) in covered])
                return True
            return False

        try:
            await self.run(chain.reset)
            while await self.run(step):
                pass
            weights = await self.run(chain.weights)
        finally:
            _close(rows)
        # an audited link's file also holds its standing summary, which no replay makes:
        # the rebuilt file holds the fetched one's (algorithm/standing_summary.py)
        summary = await self.run(read_checkpoint_tensor, chain.directory, STANDING)
        extra = {} if summary is None else {STANDING: summary}
        rebuilt = await asyncio.to_thread(tensors_sha256, {**weights, **extra})
        match = rebuilt == meta["weights_sha256"]
        offerers = (self.info["fetched"] or {}).get("peers", [])
        fields = {
            "event": "link_checked",
            "round": meta["round"],
            "match": match,
            "seconds": round(time.monotonic() - started, 1),
            "offered_by": offerers,
        }
        self.info["link_check"] = {k: v for k, v in fields.items() if k != "event"}
        if match:
            log.info(
                "fetched link of round %d checked: rebuilt from its %d rows, the same "
                "tensors (%.0f s)",
                meta["round"],
                meta["ledger_messages"],
                fields["seconds"],
                extra={"fields": fields},
            )
            return True
        self._count_refused({"forged_weights": 1})
        log.error(
            "the fetched link of round %d is not base + its rows: %s offered weights its "
            "rows do not make (forged, or another float arithmetic); the link is rebuilt "
            "and the model %s",
            meta["round"],
            ", ".join(offerers) or "its offerers",
            "moved by what the link was off by"
            if self.audits is not None
            else "rebuilt by replay of the ledger",
            extra={"fields": fields},
        )
        link = {**meta, "weights_sha256": rebuilt}  # the JSON `write_link` makes for them
        if self.audits is not None:
            # a settled state is not base + ledger: the model moves by what the link was
            # off by (it was restored from the link, the same difference on every weight)
            fetched = await self.run(read_checkpoint_weights, chain.directory, "cpu")
            await self.run(write_checkpoint, chain.directory, {**weights, **extra}, link)
            delta = {k: weights[k].float() - fetched[k].float() for k in weights}
            await self.run(self.live.shift, delta)
            return False
        await self.run(write_checkpoint, chain.directory, {**weights, **extra}, link)
        await self._rebuild()
        return False

    async def _digest_history(self) -> tuple[int, str]:
        """(count, digest) of the ledger's rows inside the trusted cut, in a child process
        (`storage.ledger.digest_within_main`): a pass over ten million rows takes about a
        minute, and in a thread it held this process's GIL, slowing its rounds. In a thread
        only if the child fails."""
        try:
            return await _digest_in_child(self.ledger.path, self.live.trusted_meta["ledger_cut"])
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("history check in a child process failed (%s): checking it here", exc)
        rows = self.ledger.snapshot()
        try:
            return await asyncio.to_thread(digest_within, rows, self.live.trusted)
        finally:
            _close(rows)

    async def check_history(self, interval: float) -> bool:
        """While a fetched link is trusted: every `interval` seconds, once the ledger may
        hold all of its rows, check them against its digest (a pass over the ledger in a
        child process: `_digest_history`). A match ends the trust; a difference rebuilds
        the model by replay of the ledger. Logged either way; True on a match."""
        live, meta = self.live, self.live.trusted_meta
        started, seen, stopped = time.monotonic(), -1, None
        while live.trusted is not None:
            await asyncio.sleep(interval)
            if self.settled is not None and not self.settled.is_set():
                stopped = stopped or time.monotonic()
                if time.monotonic() - stopped > max(PAUSE_LIMIT, 20 * interval):
                    # the history the link names never came in full (rows no source holds,
                    # or a cut naming rows nobody signed): the rounds do not wait for ever,
                    # the settled state is rebuilt from the history the sources have
                    log.warning(
                        "the history behind the trusted link of round %d is still not in "
                        "after %.0f s stopped: rebuilding from the history the run holds",
                        self.trusted_round,
                        time.monotonic() - stopped,
                        extra={"fields": {"event": "trust_given_up"}},
                    )
                    await self.node.sync_until_complete(await self.node.connected_peers())
                    await self._settle_history(False)
                    live.end_trust()
                    self.trusted_round = None
                    return False
            # rows in the buckets that start below the link's round (repair's cached
            # counts): at least the link's rows before a pass over the ledger can find them
            held = sum(
                count
                for bucket, (count, _) in self.ledger.bucket_digests(BUCKET_ROUNDS).items()
                if bucket * BUCKET_ROUNDS < self.trusted_round
            )
            self.info["history"]["held"] = min(held, meta["ledger_messages"])
            if held < meta["ledger_messages"] or held == seen:
                continue  # cannot hold them all yet, or nothing new there since the last pass
            seen = held
            verdict = live.history_verdict(*await self._digest_history())
            if verdict is None:
                continue
            if verdict and self.audits is not None:
                verdict = await self._summary_holds()
            fields = {
                "event": "history_checked",
                "trusted_round": self.trusted_round,
                "rows": meta["ledger_messages"],
                "seconds": round(time.monotonic() - started, 1),
                "match": verdict,
            }
            if verdict:
                log.info(
                    "history checked: the %d rows of the trusted link of round %d are in "
                    "the ledger and digest as it recorded (%.0f s after ready)",
                    meta["ledger_messages"],
                    self.trusted_round,
                    fields["seconds"],
                    extra={"fields": fields},
                )
            else:
                log.error(
                    "the history differs from the trusted link of round %d (the peers that "
                    "offered it served other rows than they hold, or lost some%s): "
                    "rebuilding the model by replay of the ledger",
                    self.trusted_round,
                    ", or its standing summary other records" if self.audits else "",
                    extra={"fields": fields},
                )
            rebuilt = False
            if self.audits is not None:
                rebuilt = await self._settle_history(verdict)
            elif not verdict:
                await self._rebuild()
            live.end_trust()
            self.info["history"] = {
                **self.info["history"],
                "checked": True,
                "match": verdict,
                "seconds": fields["seconds"],
            }
            self.trusted_round = None
            return verdict and not rebuilt
        return True  # (the trust ended elsewhere: nothing left to check)

    async def _summary_holds(self) -> bool:
        """Audited runs, the trusted link's rows in the ledger: does its standing summary
        say what this peer's own records say, once repair has brought every record its
        sources hold (`sync_until_complete`)? The summary of the ledger's records about
        the rows below the link, made as builders make it, must be the same bytes."""
        from seedflood_p2p.algorithm.standing_summary import summarize

        await self.node.sync_until_complete(await self.node.connected_peers())
        trusted, ledger = self.audits.summary, self.ledger
        if trusted is None:
            return True
        records = ledger.audits(0, trusted.below - 1)
        claims = ledger.claims((r.round, r.accused) for r in records)
        own = summarize(
            claims,
            records,
            self.audits.settings,
            trusted.below,
            trusted.held,
            frozenset(ledger.peers(below=trusted.below)),
        )
        return own.encode() == trusted.encode()

    async def _settle_history(self, verdict: bool) -> bool:
        """Audited runs, the trusted link's history checked: the standing from the ledger
        alone from now on. Held (`verdict`, and no judgement stopped the rounds meanwhile):
        the account of what the weights hold names the link's rows (a later ban takes them
        back as anyone's), a step at a time on the model thread, the trust's checks still
        on. Else the settled state of the round we train is rebuilt by replay, with the
        rounds stopped, and the link is removed (nothing is built on it). True if rebuilt."""
        audits, meta = self.audits, self.live.trusted_meta
        if verdict and self.settled is not None and self.settled.is_set():
            covered, below = self.live.trusted, meta["round"]
            snapshot = self.ledger.snapshot()
            rows = iter(snapshot)

            def step() -> bool:
                chunk = list(itertools.islice(rows, STEP_ROWS))
                audits.applied.hold_seen(
                    m for m in chunk if m.round < below and (m.peer, m.round) in covered
                )
                return len(chunk) == STEP_ROWS and chunk[-1].round < below

            try:
                while await self.run(step):
                    pass
            finally:
                await asyncio.shield(self.run(_close, snapshot))
        paused = self.settled is not None and not self.settled.is_set()
        audits.summary, audits.below_link, audits.records_below = None, None, []
        audits.generation += 1  # a judgement read with the summary is not applied
        if verdict and not paused:
            return False
        if self.settled is not None:
            self.settled.clear()  # no round starts on a half-rebuilt model
        _discard_link(self.s.data_dir / CHAIN_DIR)
        base = await self.run(self._base_weights)
        self.live.end_trust()  # every row the ledger takes is applied again
        judged = await asyncio.to_thread(audits.judge_of, audits.read_inputs())
        audits.standing, audits.banned = judged, dict(judged.banned)
        first = audits.round
        state = SettledState(
            first - audits.settings.lag,
            lambda m: judged.counts_in(m.peer, m.round, first),
            audits.restoring(),
        )
        cut = self.live.streamed_cut()

        def rebuild() -> str:  # one model-thread call: base, then the replay
            self.live.load_weights(base)
            return self.live.restore(cut, None, state.observe, state.holds)

        try:
            how = await self.run(rebuild)
        finally:
            cut.close()
        audits.applied, audits.waiting = state.account, state.waiting
        audits.generation += 1
        await self.run(audits.set_standing, judged)  # (after any queued before the rebuild)
        self.live.receive(state.later)
        how += f" (settled state of round {first})"
        log.info("model rebuilt: %s", how, extra={"fields": {"event": "rebuilt", "how": how}})
        if self.settled is not None:
            self.settled.set()
        return True

    async def _rebuild(self) -> None:
        """The model = base + the ledger, by replay: the trusted link was not what its rows
        make. The base weights come from the run's model source again."""
        base = await self.run(self._base_weights)
        live = self.live
        live.end_trust()  # from here, every row the ledger takes is applied
        cut = live.streamed_cut()
        try:

            def replay_from_base() -> str:
                live.load_weights(base)
                return live.restore(cut)

            how = await self.run(replay_from_base)
        finally:
            cut.close()
        log.info("model rebuilt: %s", how, extra={"fields": {"event": "rebuilt", "how": how}})

    def _base_weights(self) -> dict:
        """The base model's trainable tensors (model thread)."""
        from seedflood_p2p.algorithm.subcge import trainable_tensors
        from seedflood_p2p.workload.models import load_model
        from seedflood_p2p.workload.tasks import run_sources

        base, _ = load_model(
            run_sources(self.config, self.asset_paths.get("model", self.s.model_dir))[0]
        )
        return {m.name: m.weight.detach() for m in trainable_tensors(base, self.config)}

    async def _restore_from(self, directory: Path) -> str:
        """`LiveModel.restore` of a start cut (a ledger snapshot, streamed) and the
        checkpoint in `directory`, if it holds."""
        cut = self.live.streamed_cut()
        try:
            return await self.run(self.live.restore, cut, directory)
        finally:
            cut.close()

    async def restore_settled(self, first_round: int, peers: list = ()) -> str:
        """Audited runs: weights = base + the counted updates of rounds < first_round - lag
        (the state round `first_round` trains on); the later ones stay pending. From our
        checkpoint (written at stop, of every row then: the rows it holds that this state
        does not are taken back), else from a link of the run's chain a quorum of `peers`
        offers (a settled state of an older round: the rows counted since are added, those
        no longer counted taken back; kept only if the model then recomputes others' recent
        updates, `verify_settled`), else by replay. The ledger is streamed from a snapshot
        in one pass, which also fills the audits' account of what the weights hold
        (`SettledState`): memory does not grow with the ledger's rows."""
        if self.trusted_round is not None:
            how = await self._restore_settled_trusting(first_round)
            if how is not None:
                return how
        audits = self.audits
        judged = audits.judge()  # nothing applied yet: nothing to undo
        audits.standing, audits.banned = judged, dict(judged.banned)
        audits.round = first_round
        directory, fetched = await self._settled_source(peers)
        refused = None
        cut = self.live.streamed_cut()
        try:
            how, state = await self._settle(cut, directory, first_round, judged)
            if fetched is not None and not how.startswith("replay"):
                refused = await self._refuse_settled(first_round, fetched)
                if refused is not None:  # base + the ledger's counted rows, by replay
                    _discard_link(directory)  # never built on, nor served, by this peer
                    await self.run(self.live.load_weights, await self.run(self._base_weights))
                    how, state = await self._settle(cut, None, first_round, judged)
        finally:
            cut.close()
        self.live.receive(state.later)
        how += f" (settled state of round {first_round})"
        if fetched is None or refused is not None:
            return how if refused is None else f"{how}: {refused}"
        return self._took(how, fetched)

    async def _restore_settled_trusting(self, first_round: int) -> str | None:
        """Audited runs, `--history-sync background`: the settled state of `first_round`
        from the fetched link, trusted, and the rows after it, before the history. The
        standing below the link comes from the link's standing summary
        (algorithm/standing_summary.py); the link is stood on only if what counts below
        its round is the same in the state of `first_round` as in its prefix
        (`settled_alike`) and the model then recomputes others' recent updates
        (`verify_settled`). None when it is not: the history is synced (and the link
        restored from the usual way, or the ledger replayed)."""
        audits, lag = self.audits, self.audits.settings.lag
        chain_dir, round_ = self.s.data_dir / CHAIN_DIR, self.trusted_round
        try:
            meta = read_checkpoint_meta(chain_dir)
            summary = _summary_of(chain_dir, meta)
            held_digest = int(meta["held_digest"], 16)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return await self._no_trust(f"its standing summary cannot be used ({exc})")
        audits.summary = summary
        judged = audits.judge()  # nothing applied yet: nothing to undo
        in_link = cut_contains(meta["ledger_cut"]).peers  # the peers with rows in the link
        why = self._below_link(judged, summary, in_link)
        if why is not None:
            audits.summary = None
            return await self._no_trust(why)
        audits.standing, audits.banned = judged, dict(judged.banned)
        audits.round = first_round
        self.live.trust(meta)
        state = SettledState(
            first_round - lag,
            lambda m: judged.counts_in(m.peer, m.round, first_round),
            audits.restoring(),
        )
        cut = self.live.streamed_cut()  # right after `trust`, on the event loop
        try:
            how = await self.run(
                self.live.restore_trusting, cut, chain_dir, state.observe, state.holds
            )
        finally:
            cut.close()
        if how is None:  # its tensors refused (logged): the history first
            audits.summary = None
            self._count_refused({"weights": 1})
            return await self._no_trust("its weights were refused", keep_link=False)
        state.account.hold_unseen(held_digest)  # the link's rows, in the held-state digest
        audits.applied, audits.waiting = state.account, state.waiting
        self.live.receive(state.later)
        refused = await self._refuse_settled(first_round, self._trusted_fetch)
        if refused is not None:
            _discard_link(chain_dir)  # never built on, nor served, by this peer
            self.live.end_trust()
            audits.summary = None
            await self.run(self.live.load_weights, await self.run(self._base_weights))
            return await self._no_trust(refused, keep_link=False)
        self.fetched_meta = meta
        audits.below_link = lambda st: self._below_link(st, summary, in_link)
        self.info["history"] = {
            "trusted_round": round_,
            "rows": meta["ledger_messages"],
            "held_at_ready": self.live.trusted_held,
            "held": self.live.trusted_held,
            "checked": False,
            "standing_summary": meta.get("standing_summary"),
        }
        offered = len(self._trusted_fetch.peers)
        return f"fetched {how} (settled state of round {first_round}) from {offered} peers"

    def _below_link(self, standing, summary, peers: frozenset[bytes]) -> str | None:
        """Why the weights cannot stand on the trusted link under `standing` (None: they
        can): what counts below its round in some settled state to come differs from its
        prefix (a ban of one of the `peers` with rows in it, a vouch or an establishment
        after it: the rows to take back or add are not here; the future states, since a
        verdict is known rounds before the state it is in trains), or the ledger holds a
        record about a row below it that took effect after its prefix, which the summary
        cannot hold (a late vouch or accusation: only the history can judge it)."""
        if not settled_alike(standing, summary.below, summary.held, NEVER, peers):
            return (
                f"what counts below round {summary.below} changed since its settled prefix "
                f"{summary.held} (a ban, a vouch or an establishment since)"
            )
        settings = self.audits.settings
        for r in self.audits.records_below:  # (the history's own: the summary's prefix)
            if effective_round(r, settings) >= summary.held:
                return (
                    f"an audit record about a row below round {summary.below} that takes "
                    f"effect after its settled prefix {summary.held} arrived (a late record "
                    "the summary cannot hold)"
                )
        return None

    async def _no_trust(self, why: str, keep_link: bool = True) -> None:
        """The fetched link is not trusted (`why`, logged): the whole history is synced, and
        the settled restore goes on as without `--history-sync background` (from this link
        if `keep_link`, checked as any fetched link is; else by replay)."""
        log.warning(
            "the fetched link of round %s is not trusted before its history: %s; syncing "
            "the whole history first",
            self.trusted_round,
            why,
            extra={"fields": {"event": "trust_refused", "why": why}},
        )
        self.trusted_round = None
        if not keep_link:
            self._trusted_fetch, self.fetch_failed = None, True
        self.node.repair.floor_round = 0
        await self.node.sync_until_complete(await self.node.connected_peers())
        return None

    async def _settle(
        self, cut, directory: Path | None, first_round: int, judged
    ) -> tuple[str, SettledState]:
        """`LiveModel.restore` of the settled state of `first_round` by the standing
        `judged`, from the checkpoint in `directory` if it holds (None: replay); the audits'
        account and waiting rows put in place. How, and the state (its `later` rows still
        to be received)."""
        audits = self.audits
        state = SettledState(
            first_round - audits.settings.lag,
            # counted in S_first_round: vouches and establishments that took effect by then
            lambda m: judged.counts_in(m.peer, m.round, first_round),
            audits.restoring(),
        )
        how = await self.run(self.live.restore, cut, directory, state.observe, state.holds)
        await self.run(self.live.advance, state.limit)  # momentum: the state of `limit`
        audits.applied = state.account
        audits.waiting = state.waiting
        return how, state

    async def _refuse_settled(self, first_round: int, fetched) -> str | None:
        """Why the model restored from the fetched link is refused, or None: it must make
        what the run makes (`verify_settled`: others' recent updates, recomputed). A link
        a quorum of colluders forged would otherwise have this peer's own updates
        convicted by every honest auditor."""
        if self.verify_settled is None:
            return None
        import base58

        offerers = frozenset(base58.b58decode(p) for p in fetched.peers)
        try:
            matched, checked = await self.verify_settled(first_round, offerers)
        except Exception as exc:  # unchecked is not good: refused, the ledger replayed
            log.error("checking the fetched link's state failed: %r", exc, exc_info=exc)
            self._count_refused({"unchecked": 1})
            return f"the fetched link of round {fetched.offer.meta['round']} could not be checked"
        fields = {
            "event": "link_self_check",
            "round": fetched.offer.meta["round"],
            "matched": matched,
            "checked": checked,
            "offered_by": fetched.peers,
        }
        self.info["self_check"] = {k: v for k, v in fields.items() if k != "event"}
        if matched * 2 > checked > 0:
            log.info(
                "the model restored from the fetched link of round %d recomputes %d of %d "
                "recent updates of other peers as they published them: kept",
                fields["round"],
                matched,
                checked,
                extra={"fields": fields},
            )
            return None
        if checked == 0:  # nothing to check it against: the safe way is the replay
            self._count_refused({"unchecked": 1})
            log.warning(
                "the fetched link of round %d is not used: no recent update of another "
                "peer to check its state against; replaying the ledger",
                fields["round"],
                extra={"fields": fields},
            )
            return f"the fetched link of round {fields['round']} was not checked"
        self._count_refused({"forged_weights": 1})
        log.error(
            "the model restored from the fetched link of round %d recomputes only %d of %d "
            "recent updates of other peers as they published them: %s offered weights the "
            "run does not have (forged, or another float arithmetic); replaying the ledger",
            fields["round"],
            matched,
            checked,
            ", ".join(fetched.peers) or "its offerers",
            extra={"fields": fields},
        )
        return (
            f"the fetched link of round {fields['round']} was refused, {matched} of {checked} "
            "recent updates recomputed"
        )

    async def _settled_source(self, peers: list) -> tuple[Path, object]:
        """Where an audited restore starts from: our own checkpoint if we have one (the data
        dir), else a link of the run's chain that a quorum offers (the chain dir, and the
        FetchResult), else nothing to start from (the data dir: a replay)."""
        s = self.s
        if not peers or self.chain is None or s.checkpoint_fetch == "never" or self.fetch_failed:
            return s.data_dir, None
        if (s.data_dir / "checkpoint.json").exists():
            return s.data_dir, None
        if self._trusted_fetch is not None:  # fetched to trust, not trusted: restored from
            result, self._trusted_fetch = self._trusted_fetch, None
            return s.data_dir / CHAIN_DIR, result
        result = await self._fetch(peers, self.choose_checkpoint)
        if result is None:
            return s.data_dir, None
        return s.data_dir / CHAIN_DIR, result


class SettledState:
    """What the settled state of a round holds, sorted out of a start cut's rows as a
    restore's pass shows them (`observe`, each row once): the rows of rounds < `limit`
    that `counts` (`holds`; into `account`, the audits' `AppliedRows`), `waiting` (those
    rounds, not counted there: a probationer's unvouched rows, a banned peer's) and
    `later` (rounds >= `limit`: pending)."""

    def __init__(
        self, limit: int, counts: Callable[[UpdateMessage], bool], account: AppliedRows
    ) -> None:
        self.limit, self.counts, self.account = limit, counts, account
        self.waiting: list[UpdateMessage] = []
        self.later: list[UpdateMessage] = []

    def holds(self, m: UpdateMessage) -> bool:
        return m.round < self.limit and self.counts(m)

    def observe(self, m: UpdateMessage) -> None:
        if m.round >= self.limit:
            self.later.append(m)
        elif self.counts(m):
            self.account.restored(m)
        else:
            self.waiting.append(m)


def report_sources(check) -> None:
    """Log how the ledger fetched at start compares with each source's (repair.SourceCheck)."""
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


async def _digest_in_child(path: Path, cut: dict) -> tuple[int, str]:
    """`digest_within_file(path, cut)` in a bare `python -c` child (the ledger module and
    the cut only: no torch), killed if this task is cancelled. RuntimeError if it fails."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from seedflood_p2p.storage.ledger import digest_within_main; digest_within_main()",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await proc.communicate(json.dumps({"path": str(path), "cut": cut}).encode())
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"exit {proc.returncode}: {last[0]}")
    count, digest = json.loads(out)
    return int(count), str(digest)


def _summary_of(directory: Path, meta: dict) -> StandingSummary:
    """The standing summary in the link file of `directory` (`meta`: its JSON), checked
    to be the one of its round and settled prefix; ValueError naming what is wrong."""
    tensor = read_checkpoint_tensor(directory, STANDING)
    if tensor is None:
        raise ValueError("the link has none (built by an older version?)")
    summary = StandingSummary.decode(tensor.numpy().tobytes())
    if summary.below != meta["round"] or summary.held != meta.get("settled_prefix"):
        raise ValueError(
            f"it is of rows below {summary.below} in prefix {summary.held}, the link of "
            f"round {meta['round']} in prefix {meta.get('settled_prefix')}"
        )
    return summary


def _discard_link(directory: Path) -> None:
    """Remove the link in `directory` (a fetched one refused): the chain's builder would
    otherwise find its rows right, its hashes consistent, and build on it."""
    for name in (META_FILE, WEIGHTS_FILE):
        (directory / name).unlink(missing_ok=True)


def _close(rows) -> None:
    """End a ledger snapshot (`Ledger.snapshot`; an in-memory ledger's is a list)."""
    close = getattr(rows, "close", None)
    if close is not None:
        close()


def _b58(peer: bytes) -> str:
    import base58

    return base58.b58encode(peer).decode()
