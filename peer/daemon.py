"""The peer daemon: the one place where network, ledger and model are wired together.

    network host (network/host.py):   p2pd, flood node, reconnection, discovery, /status
    join         (peer/join.py):       manifest and its checks, ledger signatures, model, data
    late join    (peer/latejoin.py):   sync, restore (own checkpoint, fetched link, replay), chain
    rounds       (peer/rounds.py):     pacing, train, publish, evaluate, linger, checkpoint
    audits       (peer/audit_duty.py): draws, recomputations, judgement (runs with audits)

The message path, wired once in `_wire_message_path`:

    gossip, repair, own update -> FloodNode admission (network/gossip/admission.py: decode,
        validate, policy, ledger) -> on_accept = LiveModel.receive (pending), or in a run
        with audits DaemonAudits.accept (pending, then drawn for audit)
        -> (once per round) LiveModel.apply / PeerAudits.apply (settled, counted only)
    audit records (gossip, repair) -> AuditIntake -> ledger -> DaemonAudits.on_records
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import base58

from peer.audit_duty import DaemonAudits, PeerAudits
from peer.behaviour import Behaviour
from peer.join import (
    MAX_CLOCK_SKEW,
    Joiner,
    NotReady,
    check_ledger,
    check_manifest_reply,
    check_own_work,
)
from peer.latejoin import LateJoin, start_round
from peer.rounds import (
    HOLE_WINDOW,
    ModelThread,
    Pacing,
    Rounds,
    Schedule,
    audited_staleness,
    holes,
)
from peer.settings import PeerSettings
from seedflood_p2p import __version__
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
from seedflood_p2p.core.config import MAX_ROUND, RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.core.heap import freeze_startup_heap
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.gossip.peer_table import PeerTable
from seedflood_p2p.network.host import HostSettings, NetworkHost
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, value
from seedflood_p2p.network.monitoring.runpage import Observed, RunPage, add_routes, run_sampler
from seedflood_p2p.network.peers.tickets import Ticket
from seedflood_p2p.network.transfer.checkpoints import CheckpointServer
from seedflood_p2p.storage.ledger import Ledger

__all__ = [
    "MAX_CLOCK_SKEW",
    "NotReady",
    "PeerDaemon",
    "PeerSettings",
    "check_manifest_reply",
    "log_tasks",
    "run_peer",
    "start_round",
]

log = logging.getLogger("seedflood.peer")

# the frozen blocks' output per training example and per held-out one (make_prefix_caches)
PrefixCaches = tuple[ExamplePrefixCache | None, ExamplePrefixCache | None]


def check_own_ticket(text: str, config: RunConfig, peer_id: bytes) -> Ticket | None:
    """This peer's join ticket for a ticketed run (None for another run); a missing, bad or
    foreign ticket stops the peer at start with one line that says what to do."""
    from seedflood_p2p.network.peers.tickets import check, decode

    creator = config.join.creator
    if creator is None:
        return None
    me = base58.b58encode(peer_id).decode()
    if not text:
        raise UserError(
            f"run {config.run_id[:12]} is ticketed: ask its creator for a join ticket for "
            f"this peer ({me}: `seedflood ticket --peer {me} ...`) and pass --ticket"
        )
    ticket = decode(text)
    if ticket.peer != peer_id:
        raise UserError(
            f"--ticket is for peer {base58.b58encode(ticket.peer).decode()}, not this one "
            f"({me}): a ticket cannot be passed on; use this peer's own, or its --data-dir"
        )
    if (problem := check(ticket, config, creator)) is not None:
        raise UserError(f"--ticket is not valid for run {config.run_id[:12]}: {problem}")
    return ticket


class PeerDaemon:
    """Wires one peer: the network host, then the run's collaborators, in order.
    `behaviour`: honest unless a test's peer passes its own (peer/behaviour.py)."""

    def __init__(self, settings: PeerSettings, behaviour: Behaviour | None = None) -> None:
        self.s = settings
        self.behaviour = behaviour or Behaviour()
        self.metrics = NodeMetrics()
        self.stopping = False
        self.started = time.time()
        self.state = "starting"  # what the peer is doing, or why it waits (/status, logs)
        self.schedule = Schedule()  # /finish may set the final round from the start
        self.model_thread = ModelThread()
        # set once each, as `run` gets to them (status() shows what exists)
        self.host: NetworkHost | None = None
        self.config: RunConfig | None = None
        self.pacing: Pacing | None = None
        self.audits: DaemonAudits | None = None  # the run's audits (manifest extra.audit)
        self.late_join: LateJoin | None = None
        self.rounds: Rounds | None = None
        self.page: RunPage | None = None  # the run as this peer sees it (/status, /run)

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("stop requested: finishing the current round, then checkpointing")
        self.stopping = True

    def _set_state(self, state: str) -> None:
        self.state = state

    def _is_stopping(self) -> bool:
        return self.stopping

    # -- what the peer shows ---------------------------------------------------------
    def status(self) -> dict:
        """GET /status: the peer's state as it is between two awaits."""
        host = self.host
        node = host.node if host is not None else None
        reconnector = host.reconnector if host is not None else None
        alive = self.pacing.live(time.monotonic()) if self.pacing else {}
        rounds = self.rounds
        return {
            "peer_id": host.p2p.peer_id.to_base58() if host is not None else None,
            "state": self.state,
            "run_id": self.config.run_id if self.config is not None else None,
            "version": __version__,
            "round": self.schedule.round,
            "peers_alive": len(alive),
            "peer_rounds": {k.hex()[-12:]: v.round for k, v in alive.items()},
            "ledger_messages": len(node.ledger) if node else 0,
            "accepted": self.metrics.accepted_counts(),
            "dropped": self.metrics.drop_counts(),
            "admissions": self.metrics.admission_counts(),
            "banned": node.bans.status() if node else [],
            "audits": self.audit_status(),
            "checkpoint": (
                self.late_join.status()
                if self.late_join
                else {"fetched": None, "refused": {}, "chain_round": 0}
            ),
            "laggards": len(self.pacing.laggards) if self.pacing else 0,
            "bytes_out": int(value(self.metrics.bytes_out)),
            "bytes_in": int(value(self.metrics.bytes_in)),
            "loss": value(self.metrics.loss),
            "eval": rounds.last_eval if rounds else None,
            "prefix_cache": rounds.cache_status() if rounds else None,
            "model_sha256": rounds.model_hash if rounds else "",
            "uptime_s": round(time.time() - self.started, 1),
            "network": reconnector.islands.view.as_status() if reconnector else None,
            "nat": reconnector.links.nat_status() if reconnector else None,
            "discovery": host.discovery.status() if host and host.discovery else None,
            "run": self.page.summary() if self.page is not None else None,
        }

    def audit_status(self) -> dict | None:
        """Audits done, mismatches found, verdicts, bans (None: the run has no audits)."""
        if self.audits is None:
            return None
        node = self.host.node
        return self.audits.status(node.audits.counts if node and node.audits else None)

    def observe(self) -> Observed:
        """What the run page samples (network/monitoring/runpage.py)."""
        alive = self.pacing.live(time.monotonic())
        return Observed(
            round=self.schedule.round,
            state=self.state,
            peers_alive={p: st.round for p, st in alive.items()},
            bytes_in=int(value(self.metrics.bytes_in)),
            bytes_out=int(value(self.metrics.bytes_out)),
            banned=self.host.node.bans.status(),
            network=self.host.reconnector.islands.view.as_status(),
            audits=self.audit_status(),
        )

    # -- main --------------------------------------------------------------------------
    async def run(self) -> dict:
        s = self.s
        s.data_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGUSR1, log_tasks)  # where is it waiting?
        host_settings = HostSettings(
            node=s.node,
            listen=s.listen,
            announce=s.announce,
            bootstrap=s.bootstrap,
            data_dir=s.data_dir,
            remove_stale_sockets=True,
        )
        try:
            async with NetworkHost(host_settings, self.metrics) as host:
                self.host = host
                return await self._run(host)
        finally:
            self.model_thread.shutdown()

    async def _run(self, host: NetworkHost) -> dict:
        """The peer's life on its host, phase by phase: its checkpoint meta ({} when it
        stopped before it joined)."""
        await self._serve_status(host)  # early, so /status says why the peer waits
        joined = await self._join(host)
        if joined is None:  # stopped while waiting
            return {}
        node, live, prefix_caches = self._wire_message_path(host, joined)
        rounds, services = await self._wire_rounds(host, joined, node, live, prefix_caches)
        base_scored = await self._score_base_model(rounds, joined.ledger)
        freeze_startup_heap()  # everything loaded: the collector need not walk it again
        await self._go_online(host, joined.ledger, rounds, services)
        await self._sync_then_start(host, joined, node, rounds)
        return await self._train_then_leave(rounds, base_scored)

    async def _serve_status(self, host: NetworkHost) -> None:
        """/metrics, /status (and the run page) on --metrics-port, if set."""
        s = self.s
        if s.metrics_port is None:
            return
        port = await host.serve_status(
            s.metrics_host,
            s.metrics_port,
            self.status,
            self.schedule.finish_after,
            routes=(lambda app: add_routes(app, lambda: self.page)) if s.run_page else None,
        )
        log.info(
            "metrics and status on http://%s:%d/status",
            s.metrics_host,
            port,
            extra={"fields": {"event": "http", "port": port}},
        )

    # -- 1. join: the manifest, the ledger's signatures, the model and data ---------------
    async def _join(self, host: NetworkHost) -> Joined | None:
        """The run's manifest from a peer, then its ledger, ticket, assets and model (None:
        stopped while waiting for the manifest)."""
        self.state = "connecting"
        joiner = Joiner(self.s, host, self._is_stopping, self._set_state)
        config = await joiner.first_contact()
        if config is None:
            return None
        self.config = config
        name = host.p2p.peer_id.to_base58()
        log.info(
            "peer %s joining run %s (model %s, dataset %s)",
            name,
            config.run_id[:12],
            config.model,
            config.dataset,
            extra={"fields": {"event": "join", "peer_id": name, "run_id": config.run_id}},
        )
        check_own_work(config, host.peer_id, self.s.data_dir / "identity.key")
        self.state = "loading"
        ledger = await self._open_ledger(config, host.peer_id)
        own_ticket = self._use_own_ticket(config, host.peer_id)
        await joiner.get_assets(config)
        model, tokenizer, task = await self.model_thread.run(joiner.load_model, config)
        return Joined(config, ledger, own_ticket, joiner, model, tokenizer, task)

    async def _open_ledger(self, config: RunConfig, peer_id: bytes) -> Ledger:
        """This run's ledger in --data-dir, its signatures checked."""
        ledger = Ledger(self.s.data_dir / "ledger.sqlite", config.run_id)
        ledger.claim(config, "use a new --data-dir per run")
        # O(rows): ~45 us a signature, in worker processes (the rows a checkpoint vouches for: none)
        check = await asyncio.to_thread(check_ledger, ledger, config, peer_id, self.s.data_dir)
        log.info(
            "ledger checked: %d signed rows in %.1f s%s",
            check.signed,
            check.seconds,
            f" ({check.trusted} of them unchanged since the checkpoint: not re-checked)"
            if check.trusted
            else "",
        )
        return ledger

    def _use_own_ticket(self, config: RunConfig, peer_id: bytes) -> Ticket | None:
        """This peer's ticket in a ticketed run; the peer stops where its ticket expires."""
        s = self.s
        own_ticket = check_own_ticket(s.ticket, config, peer_id)
        if own_ticket is not None and own_ticket.expires <= (
            s.until_round or config.total_rounds or MAX_ROUND
        ):
            log.info(
                "this peer's join ticket counts its updates of rounds < %d: it stops there",
                own_ticket.expires,
            )
            self.s = dataclasses.replace(s, until_round=own_ticket.expires)
        return own_ticket

    # -- 2. the message path: network -> admission (validate, ledger) -> apply -----------
    def _wire_message_path(
        self, host: NetworkHost, joined: Joined
    ) -> tuple[FloodNode, LiveModel, PrefixCaches]:
        """The live model, pacing, the run's audits and the flood node that feeds them."""
        from seedflood_p2p.algorithm.subcge import make_estimator

        config, ledger, peer_id = joined.config, joined.ledger, host.peer_id
        engine = make_estimator(joined.model, config)
        if config.basis_sha256:
            engine.add_basis(0, joined.joiner.basis_artifact(config, ledger))
        live = LiveModel(engine, ledger)
        prefix_caches = make_prefix_caches(joined.model, engine, self.s.prefix_cache_mb)
        audit_settings = config.audit
        self._bound_staleness(audit_settings)
        self.pacing = self._make_pacing(host, ledger, audit_settings)
        probation = config.probation
        log_probation(probation, peer_id)
        if audit_settings.enabled:
            peer_audits = PeerAudits(
                audit_settings,
                (self.s.data_dir / "identity.key").read_bytes(),  # our secret audit draws
                peer_id,
                ledger,
                live,
                None,  # the flood node's intake: DaemonAudits reaches it through the node
                probation,
                prefix_caches[0],
            )
            self.audits = DaemonAudits(
                peer_audits,
                self.metrics,
                self.model_thread.run,
                lambda: len(self.pacing.live(time.monotonic())),
                on_ban=lambda peer: host.node.disconnect(peer),
            )
        node = host.flood_node(
            ledger,
            config,
            on_accept=live.receive if self.audits is None else self.audits.accept,
            on_audit_records=None if self.audits is None else self.audits.on_records,
            hears=self.behaviour.hears,
            avoids=self._ledger_bans,
        )
        if joined.own_ticket is not None and node.tickets is not None:
            node.tickets.add(joined.own_ticket)  # served to the peers that look for it
        if self.audits is not None:  # a ticket revoked: judge again (its rows taken back)
            node.on_revocations = self.audits.judge
        return node, live, prefix_caches

    def _bound_staleness(self, audit_settings: AuditSettings) -> None:
        """Lower --max-staleness to what the run's audits allow."""
        s = self.s
        staleness = audited_staleness(s.max_staleness, audit_settings)
        if staleness != s.max_staleness:
            log.warning(
                "--max-staleness lowered from %d to %d: this run audits updates on the "
                "state of %d round(s) back (extra.audit.lag), so a peer must not train "
                "further ahead of its slowest peer than that, or honest updates look like "
                "cheats to their auditors",
                s.max_staleness,
                staleness,
                audit_settings.lag,
            )
            self.s = dataclasses.replace(s, max_staleness=staleness)

    def _make_pacing(
        self, host: NetworkHost, ledger: Ledger, audit_settings: AuditSettings
    ) -> Pacing:
        """When the next round may start; in audited runs, not before the settled state
        has its rows."""

        def settled_holes(round_: int) -> dict[bytes, list[int]]:
            """Rows the settled state of `round_` lacks (audited runs: see Pacing)."""
            high = round_ - audit_settings.lag - 1
            low = high - HOLE_WINDOW + 1
            gapped = ledger.rounds_by_peer(max(0, low - 1), low, high, holes_only=True)
            found = holes([(p, r) for p, rounds in gapped.items() for r in rounds], low, high)
            # a peer banned in that state has no row there: nothing of it to wait for; nor
            # a probationer's missing row: unvouched (we lack it), it does not count there
            standing = self.audits.audits.standing if self.audits else None
            out = standing.banned_at(round_) if standing is not None else ()
            return {p: r for p, r in found.items() if p not in out and not self._probationer(p)}

        return Pacing(
            self.s,
            self.metrics,
            lambda: host.node.peers if host.node else PeerTable(),
            self._is_stopping,
            settled_holes if audit_settings.enabled else None,
            hole_wait=3 * self.s.node.repair_interval,  # a dropped row comes by repair by then
            banned=self._banned,
            probationer=self._probationer,
        )

    def _ledger_bans(self, peer: bytes) -> bool:
        """Is `peer` banned by the ledger's audit verdicts (the whole ledger's judgement as
        this peer last read it)?"""
        return self.audits is not None and peer in self.audits.audits.banned

    def _probationer(self, peer: bytes) -> bool:
        """Is `peer` on probation here (a run with founders; not established by the ledger as
        this peer last judged it)? Not waited for (Pacing): scheduling, not what counts."""
        standing = self.audits.standing if self.audits is not None else None
        return standing is not None and standing.enabled and peer not in standing.established

    def _revoked(self, peer: bytes) -> bool:
        """Has the run's creator revoked `peer`'s ticket (in the ledger, as this peer last
        judged it)? Its rows before the revocation's round still count when they come, but
        no round waits for them: waiting is liveness, not what counts."""
        standing = self.audits.standing if self.audits is not None else None
        return standing is not None and peer in standing.revoked

    def _banned(self, peer: bytes) -> bool:
        """Is `peer` banned here: by the ledger's verdicts or by this peer's reputation
        (network/peers/reputation.py)? Such a peer is not waited for (Pacing), asked for
        repair, or audited, from the moment of its ban (issue 45)."""
        node = self.host.node if self.host is not None else None
        return (
            self._ledger_bans(peer)
            or self._revoked(peer)
            or (node is not None and node.reputation.is_banned(peer))
        )

    # -- 3. late join and the checkpoint chain; rounds; the run page -----------------------
    async def _wire_rounds(
        self,
        host: NetworkHost,
        joined: Joined,
        node: FloodNode,
        live: LiveModel,
        prefix_caches: PrefixCaches,
    ) -> tuple[Rounds, list[CheckpointServer]]:
        """Late join with its checkpoint chain, the run page, and the rounds; the chain's
        servers, to start with the node."""
        s, config = self.s, joined.config
        self.late_join = late_join = LateJoin(
            s,
            config,
            node,
            live,
            self.metrics,
            self.model_thread.run,
            self.audits.audits if self.audits else None,
            joined.joiner.asset_paths,
            self.behaviour,
        )
        if self.audits is not None:  # a link's settled state is checked before it trains
            audits, engine = self.audits.audits, live.engine

            def verify_settled(first_round: int, offerers: frozenset[bytes]):
                return self.model_thread.run(
                    audits.self_check,
                    first_round,
                    engine,
                    joined.tokenizer,
                    joined.task,
                    offerers,
                )

            late_join.verify_settled = verify_settled
            late_join.settled = self.audits.settled  # cleared while a trust cannot stand
        late_join.spawn = host.spawn  # links are built in the background
        services = await late_join.make_chain()
        late_join.hold_history()
        node.not_ready = "starting: syncing with the run first"
        self.page = RunPage(
            joined.ledger,
            json.loads(config.to_json()),
            host.p2p.peer_id.to_base58(),
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
        host.spawn(run_sampler(self.page), name="run-page")
        self.rounds = Rounds(
            s,
            config,
            self.schedule,
            self.pacing,
            node,
            live,
            joined.model,
            joined.tokenizer,
            joined.task,
            self.model_thread,
            self.metrics,
            self.audits,
            late_join.extend_chain,
            self.page,
            self._is_stopping,
            self._set_state,
            *prefix_caches,
            behaviour=self.behaviour,
        )
        return self.rounds, services

    async def _score_base_model(self, rounds: Rounds, ledger: Ledger) -> bool:
        """A fresh peer scores the base model before it joins the topic: the run's
        zero-shot point. Peers waiting for --min-peers wait for this too. True if it did."""
        if self.s.eval_every and len(ledger) == 0:
            await rounds.evaluate()
            return True
        return False

    # -- 4. on the network: flood (with the audit topic and audit repair, if the run has
    # them), the chain's server, reconnection, discovery; then catch up and sync ----------
    async def _go_online(
        self,
        host: NetworkHost,
        ledger: Ledger,
        rounds: Rounds,
        services: list[CheckpointServer],
    ) -> None:
        """Start the node and its services, then wait for the run's other peers."""
        await host.start_node(round_of=lambda: self.schedule.round, services=services)
        # No lonely start: a peer that knows others exist (its ledger's rows, its peer
        # book, its bootstrap list) trains only after one of them answered a repair pass.
        self.state = "syncing"
        if self.audits is not None and ledger.audits():  # (a restart's ledger)
            # its bans are not asked for repair; records fetched from here on are judged
            # as they come (DaemonAudits.on_records), so each sync pass skips new bans
            await self.audits.judge()
        if not self.s.node.allow_alone:
            await host.catch_up(host.known_others(ledger), self._is_stopping, self._set_state)
        await rounds.wait_for_peers()

    async def _sync_then_start(
        self, host: NetworkHost, joined: Joined, node: FloodNode, rounds: Rounds
    ) -> None:
        """Fetch what the ledger lacks, restore the model, and take up training at this
        peer's start round."""
        ledger, peer_id, late_join = joined.ledger, host.peer_id, self.late_join
        peers, synced = await late_join.sync(host.reconnector.connected)
        how = await late_join.restore(peers, start_round(ledger, peer_id))
        if republished := await node.republish_unsigned():
            log.info(
                "published again %d own update(s) or audit record(s) never sent signed",
                republished,
            )
        await self.model_thread.run(rounds.set_model_hash)
        node.not_ready = None
        self.state = "training"
        self.schedule.round = start_round(ledger, peer_id)
        device = str(next(joined.model.parameters()).device)  # where this peer computes
        log.info(
            "ready at round %d on %s: model from %s (%d fetched from peers)",
            self.schedule.round,
            device,
            how,
            synced,
            extra={
                "fields": {
                    "event": "ready",
                    "round": self.schedule.round,
                    "device": device,
                    "source": how,
                    "fetched": synced,
                    "ledger_rows": len(ledger),
                }
            },
        )
        if late_join.fetched_meta is not None:  # its history (if trusted), then its weights
            host.spawn(late_join.check_link(self.s.node.repair_interval), "link-check")
        await late_join.extend_chain(self.schedule.round)

    # -- 5. rounds, then leave with a checkpoint --------------------------------------------
    async def _train_then_leave(self, rounds: Rounds, base_scored: bool) -> dict:
        """Train to the end, write the final checkpoint and status; the checkpoint meta."""
        await rounds.run(base_scored)
        meta = await rounds.finish()
        status = {**self.status(), "ledger_digest": meta["ledger_digest"]}
        (self.s.data_dir / "final_status.json").write_text(json.dumps(status, indent=1))
        log.info(
            "checkpoint written: round %d, %d ledger messages, model sha256 %s",
            meta["round"],
            meta["ledger_messages"],
            meta["model_sha256"][:16],
            extra={"fields": {"event": "checkpoint", **meta}},
        )
        return meta


@dataclass(frozen=True)
class Joined:
    """What joining gives the later phases: the run, its ledger and ticket, the model."""

    config: RunConfig
    ledger: Ledger
    own_ticket: Ticket | None
    joiner: Joiner
    model: Any
    tokenizer: Any
    task: Any


def log_probation(probation: ProbationSettings, peer_id: bytes) -> None:
    """Say, in a run with probation, whether this peer's updates count at once."""
    if not probation.enabled:
        return
    log.info(
        "probation: this run names %d founder(s); %s",
        len(probation.founders),
        "this peer is one: its updates count at once"
        if peer_id in probation.founders
        else "this peer is new: an update counts once an established peer has "
        f"recomputed and matched it, and every later one once {probation.vouches} "
        "have been (`seedflood status` shows where it stands)",
        extra={"fields": {"event": "probation", "founder": peer_id in probation.founders}},
    )


def make_prefix_caches(model: Any, engine: Any, megabytes: int) -> PrefixCaches:
    """The frozen blocks' output per example (training examples, held-out examples) for a
    run that trains upper blocks only; (None, None) when every block trains. Every peer of
    such a run computes it per example, as its auditors do (prefix_cache.py); `megabytes`
    of training examples are kept (0: none), and every held-out one."""
    train = ExamplePrefixCache(model, engine.matrices, max_bytes=megabytes << 20)
    if not train.active:
        return None, None
    log.info(
        "frozen prefix: blocks 0-%d do not train; their output is computed per example and "
        "kept (up to %d MB of training examples, and the held-out ones), so an example "
        "seen before skips them",
        train.first - 1,
        megabytes,
        extra={"fields": {"event": "prefix_cache", "frozen_blocks": train.first, "mb": megabytes}},
    )
    return train, ExamplePrefixCache(model, engine.matrices)


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


def run_peer(settings: PeerSettings, behaviour: Behaviour | None = None) -> dict:
    """Run one peer daemon to its end (uvloop where there is one); its checkpoint meta.
    `behaviour`: honest unless a test's peer passes its own (peer/behaviour.py)."""
    try:
        import uvloop

        return uvloop.run(PeerDaemon(settings, behaviour).run())
    except ImportError:  # uvloop is Linux/macOS only
        return asyncio.run(PeerDaemon(settings, behaviour).run())
