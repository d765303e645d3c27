"""Rounds: when to start one, training and publishing it, and how a peer stops.

    wait_ready (bounded staleness, deadline, laggards) -> apply this round's updates
        -> zo_step on the round's batch -> publish (admitted like anyone's update, applied
        next round) -> extend the checkpoint chain -> audits -> log -> next round
    the last round (--until-round, the run's total, or POST /finish) -> linger for the
        stragglers -> final evaluation -> stop the flood node -> apply -> checkpoint

Model work runs on one dedicated thread (`ModelThread`), so the event loop keeps
receiving, validating and repairing while a forward pass runs, and the model is only
ever touched from that thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from peer.audit_duty import DaemonAudits
from peer.behaviour import Behaviour
from peer.settings import PeerSettings
from seedflood_p2p.algorithm.live import LedgerCut, LiveModel
from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.network.gossip.flood import FloodNode
from seedflood_p2p.network.gossip.peer_table import PeerTable
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, timed
from seedflood_p2p.network.monitoring.runpage import RunPage
from seedflood_p2p.protocol.update import quorum_round
from seedflood_p2p.storage.ledger import LedgerRows, peer_name

log = logging.getLogger("seedflood.peer")


class ModelThread:
    """The one thread that touches the model."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="model")

    async def run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


@dataclass
class Schedule:
    """Which round the peer is at, and the last one it will train."""

    round: int = 0
    final_round: int | None = None  # last round to train (None: open-ended)
    until_round: int | None = None  # --until-round or the run's total: a hard cap
    done_training: bool = False  # past linger: the final round can no longer move
    in_round: bool = False  # between the start of round `round` and its end

    def set_until(self, until_round: int) -> None:
        """The hard cap (0: none); the final round is the one before it unless /finish
        already set one."""
        self.until_round = until_round
        if self.until_round and self.final_round is None:
            self.final_round = self.until_round - 1

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


HOLE_WINDOW = 8  # rounds of the settled state checked for holes before a round trains
HOLE_CHECK_SECONDS = 0.2  # how often a waiting round looks for holes again
WAIT_TICK = 0.02  # how often a waiting round looks at its peers again, at least ...
WAIT_TICK_MAX = 0.5  # ... and at most (a tick lengthens with the time a look takes)
WAIT_SCAN_SHARE = 0.03  # the share of the event loop a waiting round's looks may take
PEER_GAUGE_SECONDS = 1.0  # the live-peer gauge (a pass over every live peer) this often


def holes(rows: list[tuple[bytes, int]], low: int, high: int) -> dict[bytes, list[int]]:
    """Per peer, the rounds in [low, high] it has no row for in `rows` (peer, round) although
    it has rows of an earlier and of a later round. A peer publishes every round once it
    has started, so such a hole is most likely a row dropped on the way that repair will
    bring (or one the peer skipped, e.g. a restart: then it never comes)."""
    seen: dict[bytes, set[int]] = {}
    for peer, round_ in rows:
        seen.setdefault(peer, set()).add(round_)
    out = {}
    for peer, rounds in seen.items():
        first, last = min(rounds), max(rounds)
        missing = [
            r for r in range(max(low, first + 1), min(high, last - 1) + 1) if r not in rounds
        ]
        if missing:
            out[peer] = missing
    return out


def audited_staleness(max_staleness: int, audit: AuditSettings) -> int:
    """The --max-staleness a peer may use in a run with these audits: at most lag - 1 (0 in
    lockstep runs, lag 0). Round t trains on the counted updates of rounds < t - lag; a
    peer holds them all only if nobody it waits for is more than lag - 1 rounds behind."""
    if not audit.enabled:
        return max_staleness
    return min(max_staleness, max(audit.lag - 1, 0))


class Pacing:
    """Bounded staleness with a deadline: which live peers a round waits for.

    `peers`: the flood node's peer table (`PeerTable`), read at each check.
    `holes(round_)`: in an audited run, the rows the state of `round_` lacks (`holes` on
    the ledger's settled rounds); a round waits for them too, at most `hole_wait` seconds
    (a few repair intervals: a row repair has not brought by then is most likely one its
    peer skipped, e.g. across a restart) and never past the round's deadline.
    `banned(peer)`: is the peer banned here (the ledger's audit verdicts or this peer's
    own reputation)? A banned peer is never live, so never waited for: a ban acts at the
    next check (20 ms), not at the liveness timeout or the round's deadline.
    `probationer(peer)`: is the peer on probation (a run with founders, the peer not
    established)? Live, but not waited for: its updates count only once vouched, and a
    fresh key must not buy time (issue 45: 20 slow keys held 4 founders to their pace,
    0.15x, until banned)."""

    def __init__(
        self,
        settings: PeerSettings,
        metrics: NodeMetrics,
        peers: Callable[[], PeerTable],
        stopping: Callable[[], bool],
        holes: Callable[[int], dict[bytes, list[int]]] | None = None,
        hole_wait: float = float("inf"),
        banned: Callable[[bytes], bool] = lambda peer: False,
        probationer: Callable[[bytes], bool] = lambda peer: False,
    ) -> None:
        self.s = settings
        self.metrics = metrics
        self.peers = peers
        self.stopping = stopping
        self.holes = holes
        self.hole_wait = hole_wait
        self.banned = banned
        self.probationer = probationer
        self.laggards: set[bytes] = set()  # live peers not waited for (see wait_ready)
        self.gapped: set[bytes] = set()  # peers whose holes are not waited for (wait_ready)

    def live(self, now: float) -> dict:
        """Peers heard within the liveness timeout, but for banned ones (O(live peers):
        the wait itself reads the table's index, `behind`)."""
        live = self.peers().live(now, self.s.liveness_timeout)
        return {p: st for p, st in live.items() if not self.banned(p)}

    def waited(self, now: float) -> dict:
        """The live peers a round waits for: all but probationers."""
        return {p: st for p, st in self.live(now).items() if not self.probationer(p)}

    async def wait_ready(self, round_: int) -> None:
        """Bounded staleness with a deadline: slow or dead peers never stall us for long.

        Liveness rule: a peer still behind when the deadline passes is a laggard and is not
        waited for again until it catches up, so one identity publishing a low round now
        and then costs every honest peer one deadline in all, not one per round.

        Caught up means in step with us (it has published our previous round), not merely
        back inside the staleness bound: a peer hovering at the bound's edge (a staller a
        few rounds behind, seen one round closer whenever we are a little late) would
        otherwise cost a deadline each time it dipped below the edge again (measured: two
        deadlines for one peer in bench_hostile's stall row).

        Holes (audited runs): an update is audited on the settled state its round trains on,
        so a row of that state dropped on the way here (and not yet repaired) would make
        our honest update look like a cheat. The round waits for such rows too, at most
        `hole_wait`; a peer whose holes outlast that (it skipped rounds) is never waited for
        again on holes, so one identity costs every honest peer at most one such wait.

        Bans: a peer banned meanwhile (`banned`) leaves `live` at the next check, so the
        round goes on at once instead of at the deadline (issue 45: every identity an
        attacker minted cost every honest peer a 30 s deadline after its ban)."""
        started = time.monotonic()
        deadline = started + self.s.round_deadline
        hole_deadline = started + min(self.hole_wait, self.s.round_deadline)
        found: dict[bytes, list[int]] = {}
        next_hole_check = started
        checked_in_step = False  # holes queried since the last peer we wait for caught up
        next_gauge = started
        while not self.stopping():
            now = time.monotonic()
            if now >= next_gauge:  # the gauge counts probationers too
                self.metrics.peers.set(len(self.live(now)))
                next_gauge = now + PEER_GAUGE_SECONDS
            oldest = round_ - 1 - self.s.max_staleness  # a peer must have published this
            behind, slowest = self.behind(now, oldest, round_ - 1)
            self.metrics.staleness.set(round_ - slowest if slowest is not None else 0)
            scan = time.monotonic() - now
            missing = {}
            if self.holes is not None:
                # A ledger query: not at every 20 ms tick, but always before the wait ends.
                # The row that ends it (a peer's later round: it is no longer behind) can
                # show a hole behind it that the last query, made while it was behind,
                # could not see. Returning on that stale answer is the likely cause of an
                # honest lossy peer's ban in CI (tests/test_round_mean_daemon.py: it trained
                # a round holding 2 of the 4 rows of the last, with no wait logged).
                due = now >= next_hole_check or (not behind and not checked_in_step)
                if due:
                    found = self.holes(round_)  # its cost grows with the peers: paced too
                    took = time.monotonic() - now - scan
                    next_hole_check = now + max(HOLE_CHECK_SECONDS, took / WAIT_SCAN_SHARE)
                checked_in_step = not behind and (due or checked_in_step)
                missing = {p: r for p, r in found.items() if p not in self.gapped}
            if not behind and not missing:
                return
            if missing and now > hole_deadline:
                self.gapped.update(missing)
                log.warning(
                    "round %d: going on without %d row(s) of the settled state after "
                    "%.1f s (%s); not waiting for these peers' missing rows again",
                    round_,
                    sum(len(r) for r in missing.values()),
                    now - started,
                    ", ".join(f"{peer_name(p)} rounds {r}" for p, r in missing.items()),
                    extra={
                        "fields": {
                            "event": "deadline_rows",
                            "round": round_,
                            "missing": {peer_name(p): r for p, r in missing.items()},
                        }
                    },
                )
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
            # A look reads the table's index of live rounds, so it costs the peers behind,
            # not all; should it still grow (thousands behind), the tick grows to keep it
            # under WAIT_SCAN_SHARE of the loop (a round then starts up to a tick late).
            tick = min(WAIT_TICK_MAX, max(WAIT_TICK, scan / WAIT_SCAN_SHARE))
            await asyncio.sleep(tick)

    def behind(self, now: float, oldest: int, in_step: int) -> tuple[list[bytes], int | None]:
        """The peers a round waits for (live, not banned, not on probation) that have not
        published round `oldest`, but for laggards; and the lowest round of any of them,
        laggards too (None: none). A laggard that published `in_step` (our previous round)
        is waited for again. Reads the table's live rounds lowest first: the peers behind,
        then one peer in step, not every live peer."""
        table = self.peers()
        timeout = self.s.liveness_timeout

        def waited(peers: set[bytes]) -> Iterator[bytes]:
            return (p for p in peers if not self.banned(p) and not self.probationer(p))

        self.laggards = {
            p
            for p in self.laggards
            if table.is_live(p, now, timeout)
            and table[p].round < in_step
            and not self.banned(p)
            and not self.probationer(p)
        }
        behind: list[bytes] = []
        slowest = None
        for round_, peers in table.live_rounds(now, timeout):
            if round_ >= oldest:
                if slowest is None and any(True for _ in waited(peers)):
                    slowest = round_
                if slowest is not None:
                    break
                continue
            here = list(waited(peers))
            behind += [p for p in here if p not in self.laggards]
            if here and slowest is None:
                slowest = round_
        return behind, slowest


class Rounds:
    """Trains and publishes the peer's rounds, evaluates, lingers, checkpoints."""

    def __init__(
        self,
        settings: PeerSettings,
        config: RunConfig,
        schedule: Schedule,
        pacing: Pacing,
        node: FloodNode,
        live: LiveModel,
        model: Any,
        tokenizer: Any,
        task: Any,
        model_thread: ModelThread,
        metrics: NodeMetrics,
        audits: DaemonAudits | None,
        extend_chain: Callable[[int], Awaitable[None]],
        page: RunPage | None,
        stopping: Callable[[], bool],
        set_state: Callable[[str], None],
        prefix_cache: ExamplePrefixCache | None = None,
        eval_cache: ExamplePrefixCache | None = None,
        behaviour: Behaviour | None = None,
    ) -> None:
        self.s = settings
        # Frozen-prefix caches (a run training upper blocks only): training examples (ours
        # and those we audit, least recently used first out) and the held-out ones apart,
        # so training examples never push out the sentences scored at every evaluation.
        self.prefix_cache = prefix_cache
        self.eval_cache = eval_cache
        self.config = config
        self.schedule = schedule
        self.pacing = pacing
        self.node = node
        self.ledger = node.ledger
        self.peer_id = node.peer_id
        self.live = live
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.model_thread = model_thread
        self.metrics = metrics
        self.audits = audits
        self.extend_chain = extend_chain  # the checkpoint chain's link, when due
        self.page = page
        self.stopping = stopping
        self.set_state = set_state
        self.behaviour = behaviour or Behaviour()  # honest, but for a test's peer
        self.model_hash = ""
        self.last_eval: tuple[float, float | None] | None = None
        self.last_eval_round = -1

    async def run(self, base_scored: bool) -> None:
        """From the ready round to the final one (open-ended: until stopped), lingering
        for the others' last rounds; a final evaluation of the last model."""
        s, schedule = self.s, self.schedule
        if s.eval_every and not (base_scored and schedule.round == 0):
            await self.evaluate()
        schedule.set_until(s.until_round or self.config.total_rounds)
        await self.train()
        while not self.stopping() and schedule.final_round is not None:
            self.set_state("finishing: waiting for the others' last rounds")
            await self.linger(schedule.final_round)
            if schedule.round <= schedule.final_round:  # raised by /finish while lingering
                self.set_state("training")
                await self.train()
                continue
            if s.eval_every and self.last_eval_round != schedule.round:
                await self.apply_pending()  # score the final model
                await self.evaluate()
            break

    async def finish(self) -> dict:
        """Stop taking updates, apply what is pending, write the checkpoint; its meta."""
        self.schedule.done_training = True
        self.set_state("stopping")
        # No accepts after this: the checkpoint then covers the whole ledger on disk, so
        # a restart loads it instead of replaying everything.
        await self.node.stop()
        await self.apply_pending()  # without a banned peer's updates (audits)
        return await self.checkpoint()

    async def train(self) -> None:
        from seedflood_p2p.algorithm.trainer import zo_step

        schedule, audits = self.schedule, self.audits
        while not self.stopping() and (
            schedule.final_round is None or schedule.round <= schedule.final_round
        ):
            schedule.in_round = True
            if self.node.fatal is not None:
                raise self.node.fatal
            if audits is not None and not audits.settled.is_set():
                self.set_state("waiting for the history behind the trusted link")
                await audits.settled.wait()
                self.set_state("training")
            self.catch_up()
            self.node.admission.own_round = schedule.round
            await self.pacing.wait_ready(schedule.round)
            t0 = time.perf_counter()
            if audits is None:
                incoming = self.live.take()
                apply = self.live.apply
            else:  # round t trains on the settled state: counted updates of rounds < t - lag
                incoming = audits.audits.take_settled(schedule.round)
                apply = audits.audits.apply
            with timed(self.metrics.apply_seconds):
                await self.model_thread.run(apply, incoming)
                if self.live.config.momentum:  # the state of round t - lag, rows or not
                    lag = 0 if audits is None else audits.audits.settings.lag
                    await self.model_thread.run(self.live.advance, schedule.round - lag)
            step = (
                zo_step,
                self.live.engine,
                self.tokenizer,
                self.task,
                self.peer_id,
                schedule.round,
                self.prefix_cache,
            )
            held = None  # with audits: the digest of the rows the step's weights held
            if audits is None:
                message, loss = await self.model_thread.run(*step)
            else:  # its CPU time counted, against the audits' (audit CPU share)
                (message, loss), held = await self.model_thread.run(audits.audits.timed_step, *step)
            message = self.behaviour.update(message, self.ledger)
            # Admitted like anyone's update: logged, then pending, applied next round.
            await self.node.publish(message, held)
            await self.extend_chain(schedule.round)
            if audits is not None:
                await audits.run_round(
                    schedule.round, self.node, self.live.engine, self.tokenizer, self.task
                )
            self.metrics.loss.set(loss)
            if self.page is not None:
                self.page.record_train_loss(schedule.round, loss)
            self.metrics.rounds.set(schedule.round)
            line = {
                "event": "round",
                "round": schedule.round,
                "loss": round(loss, 5),
                "peers": len(self.pacing.live(time.monotonic())),
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
                schedule.round,
                loss,
                line["peers"],
                len(incoming),
                line["ledger"],
                seconds,
                extra={"fields": line},
            )
            schedule.round += 1
            schedule.in_round = False
            if self.s.eval_every and schedule.round % self.s.eval_every == 0:
                await self.evaluate()

    async def apply_pending(self) -> None:
        """Apply every update received and not applied yet (a banned peer's: not), and with
        audits every one that counts by the ledger's judgement, also those whose vouch takes
        effect after our last round: the model is then base + the counted ledger."""
        incoming = self.live.take()
        apply = self.audits.audits.apply_final if self.audits else self.live.apply
        await self.model_thread.run(apply, incoming)

    def catch_up(self) -> None:
        """A peer far behind the run (slow, or paused) jumps to the round a quorum of
        distinct peers reached: its updates would otherwise fall below every peer's window.
        One identity cannot pull it forward (see Admission.reference_round)."""
        schedule = self.schedule
        quorum = quorum_round(self.node.admission.claims.values())
        if quorum - schedule.round > self.s.node.max_behind // 2:
            log.warning(
                "round %d is far behind the run's round %d (a quorum of peers): jumping ahead",
                schedule.round,
                quorum,
                extra={"fields": {"event": "catch_up", "from": schedule.round, "to": quorum}},
            )
            final = schedule.final_round
            schedule.round = quorum if final is None else min(quorum, final)

    def cache_status(self) -> dict | None:
        """The frozen-prefix caches' counts (None: this peer keeps none)."""
        if self.prefix_cache is None or self.eval_cache is None:
            return None
        return {
            "frozen_blocks": self.prefix_cache.first,
            "train": self.prefix_cache.status(),
            "held_out": self.eval_cache.status(),
        }

    async def evaluate(self) -> None:
        """Held-out figures of the live model after the rounds done, logged: loss, and
        accuracy and macro-F1 (classification) or perplexity (lm, completion)."""
        from seedflood_p2p.algorithm.trainer import evaluate_metrics, format_metrics

        metrics = await self.model_thread.run(
            evaluate_metrics,
            self.model,
            self.tokenizer,
            self.task,
            self.config,
            self.s.eval_examples,
            self.eval_cache,
        )
        await self.model_thread.run(self.set_model_hash)
        done = self.schedule.round
        loss, accuracy = metrics["loss"], metrics.get("accuracy")
        self.last_eval = (loss, accuracy)
        self.last_eval_round = done
        if self.page is not None:
            self.page.record_eval(done, loss, accuracy)
        examples = min(self.s.eval_examples, len(self.task.test))
        fields = {
            "event": "eval",
            "rounds_done": done,
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
            done,
            examples,
            format_metrics(metrics),
            extra={"fields": fields},
        )

    async def linger(self, final_round: int) -> None:
        """Keep flooding and repairing until live peers reached `final_round` and no new
        message arrived for `linger` seconds (at most `linger_max` seconds): a peer that
        leaves early would miss the stragglers' last updates."""
        started = quiet_since = time.monotonic()
        while time.monotonic() - started < self.s.linger_max and not self.stopping():
            if await self.node.sync_round():
                quiet_since = time.monotonic()
            await asyncio.sleep(0.5)
            now = time.monotonic()
            if now - self.node.last_accept < 0.5:
                quiet_since = now
            final = self.schedule.final_round
            if final is not None and final > final_round:
                return  # asked to train further (see Schedule.finish_after)
            waiting = [p for p, st in self.pacing.waited(now).items() if st.round < final_round]
            if not waiting and now - quiet_since >= self.s.linger:
                return
        if not self.stopping():
            log.warning("stopped waiting for slow peers after %.0f s", self.s.linger_max)

    async def wait_for_peers(self) -> None:
        """Up to `startup_wait` seconds for `min_peers` topic peers before the first round."""
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

    def set_model_hash(self, sha256: str | None = None) -> None:
        """The live model's SHA-256 (computed unless given), for /status and /metrics."""
        self.model_hash = sha256 or self.live.sha256()
        self.metrics.model.info({"sha256": self.model_hash, "round": str(self.schedule.round)})

    async def checkpoint(self) -> dict:
        """Weights and the ledger cut they equal. The cut is taken here, on the event loop
        where every accept runs (see algorithm/live.py): an update arriving while the
        weights are written stays pending, in neither. Its rows are a snapshot of the
        ledger, streamed on the model thread (`LiveModel.streamed_cut`)."""
        meta = {
            "round": self.schedule.round,
            "run_id": self.config.run_id,
            "peer_id": self.node.p2p.peer_id.to_base58(),
        }
        if self.live.trusted is not None:  # a joiner's link, its history not yet checked
            return await self.model_thread.run(self._no_checkpoint, meta)
        cut = self.live.streamed_cut()
        try:
            return await self.model_thread.run(self._write_checkpoint, cut, meta)
        finally:
            cut.close()

    def _no_checkpoint(self, meta: dict) -> dict:
        """What a checkpoint's meta would say, without one: the weights hold a trusted
        link's rows the ledger does not all hold yet, so no cut of the ledger describes
        them. A restart fetches a link again (peer/latejoin.py)."""
        log.warning(
            "no checkpoint written: the history behind the trusted link of round %s is not "
            "yet fetched and checked; a restart fetches a link again",
            self.live.trusted_meta["round"],
            extra={"fields": {"event": "checkpoint_skipped", "why": "history_unchecked"}},
        )
        self.ledger.flush()
        model_sha256 = self.live.sha256()
        self.set_model_hash(model_sha256)
        return {
            **meta,
            "ledger_messages": len(self.ledger),
            "ledger_digest": self.ledger.digest(),
            "model_sha256": model_sha256,
            "history": "unchecked",
        }

    def _write_checkpoint(self, cut: LedgerCut, meta: dict) -> dict:
        # every commit durable first: no checkpoint counts a row a power loss could take
        self.ledger.flush()
        rows = cut.messages
        # lets the next start skip re-checking these rows' signatures (unchanged_rows)
        meta["ledger_rows_sha256"] = (
            rows.rows_sha256()
            if isinstance(rows, LedgerRows)
            else self.ledger.rows_sha256({(m.peer, m.round) for m in rows})
        )
        meta = self.live.checkpoint(self.s.data_dir, cut, meta)
        self.set_model_hash(meta["model_sha256"])
        return meta
