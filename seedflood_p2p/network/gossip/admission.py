"""Admission: the one path by which an update enters the ledger and reaches the model.

Every update, whatever brought it (gossip, a repair reply, or this peer's own publish),
passes the same stages and ends with exactly one `Verdict`, counted:

    decode    gossip: the payload (`update.decode_update`). Repair rows arrive decoded with
              their reply (`protocol.repair.UPDATE_ROWS.decode_rows`; the caller drops a bad
              reply whole, see `drop_reply`). Our own update is built by the trainer.
    validate  repair: the envelope's signature and payload (`update.check_envelope`), so no
              peer can hand us another's update. A row we already hold with the same
              scalars skips it: a duplicate changes nothing, and a late join fetches tens
              of thousands of them at ~150 us per check.
    sender    the author's key is Ed25519 (`framing.check_sender_key`), it is in a closed
              run's allow-list, it carries the run's identity work if the run asks for
              some (`framing.check_sender_work`, `no_work`), and, for gossip, it is not
              banned here and keeps to its rate (`update.SENDER_RATE`, a token bucket per
              author).
    policy    the run's k scalars; the round window around the reference round
              (`reference_round`: own round, or a quorum of distinct peers' rounds):
              gossip both bounds, repair the upper bound and, below the lower one, only
              rows relayed by a peer other than their author (`update.WindowRule`); one
              update per (peer, round): a repeat is a duplicate, a different one an
              equivocation that every peer resolves the same way (`update.keeps_new`) and
              that bans its author.
    ledger    new rows inserted in one transaction (one fsync per batch); an equivocation
              resolved for the newcomer replaces the row held; our own update echoed back
              by the daemon attaches its signed envelope to our row (then others can
              fetch it from us).
    apply     what changed the ledger is handed to `deliver` (the peer's
              LiveModel.receive): a new update as is, a replacement as the held update
              negated followed by the new one (updates are linear in the scalars), both
              in one batch. An equivocation's losing copy (the row replaced, or a copy
              that lost to the row held) is kept in the ledger's `replaced` table, the
              auditor's evidence for a retry (peer/state_rewind.py), never replayed.

Rules and reasons are the protocol's (`update` and `framing`: protocol/update.py and
protocol/framing.py); this module only orders them, counts them, and reports the senders
to the reputation (network/peers/reputation.py), which may ban them.
No network I/O here: the flood node feeds it, so it is tested on a bare ledger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum

from seedflood_p2p.core.extra_settings import IdentityWork
from seedflood_p2p.network.monitoring.metrics import NodeMetrics, timed
from seedflood_p2p.network.peers.reputation import LogLimiter, PeerBuckets, Reputation, short_id
from seedflood_p2p.network.peers.tickets import TicketBook
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.protocol.framing import (
    Rejected,
    check_sender_key,
    check_sender_work,
    same_scalars,
)
from seedflood_p2p.protocol.message import Envelope, UpdateMessage, pack_scalars
from seedflood_p2p.protocol.update import (
    SENDER_BURST,
    SENDER_RATE,
    RoundClaims,
    WindowRule,
    check_against_ledger,
    check_envelope,
    decode_update,
    keeps_new,
    quorum_round,
)
from seedflood_p2p.storage.bans import BanStore
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.node")


class Source(StrEnum):
    GOSSIP = "gossip"
    REPAIR = "repair"
    OWN = "own"


class Outcome(StrEnum):
    ACCEPTED = "accepted"  # a new (peer, round): logged, handed on
    REPLACED = "replaced"  # equivocation resolved for this one: logged over the held
    # update, handed on with that one's take-back
    DUPLICATE = "duplicate"  # exactly this update is in the ledger already
    ECHO = "echo"  # our own update back from the daemon, signed: envelope attached
    DROPPED = "dropped"  # broke a rule: `Verdict.reason` (a protocol.framing.DROP_REASONS entry)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    sender: bytes
    message: UpdateMessage | None = None  # None: the payload did not decode
    reason: str = ""  # every outcome but ACCEPTED: the DROP_REASONS entry it counts under
    detail: str = ""

    @property
    def changed_ledger(self) -> bool:
        return self.outcome in (Outcome.ACCEPTED, Outcome.REPLACED)


def _rejected(exc: Rejected, sender: bytes, message: UpdateMessage | None) -> Verdict:
    outcome = Outcome.DUPLICATE if exc.reason == "duplicate" else Outcome.DROPPED
    return Verdict(outcome, sender, message, exc.reason, exc.detail)


def _row_key(message: UpdateMessage, envelope: Envelope) -> tuple:
    """A repair row, exactly: what its signature check is a function of (scalars as their
    float16 bytes: 0.0 and -0.0 are equal as floats, not as rows)."""
    scalars = pack_scalars(message.scalars)
    return (message.round, message.peer, scalars, envelope.data, envelope.seqno, envelope.signature)


def _quorum_of(claims: dict[bytes, int]) -> int:
    """`quorum_round` of the claims' rounds (kept up to date by a RoundClaims)."""
    if isinstance(claims, RoundClaims):
        return claims.quorum_round()
    return quorum_round(claims.values())


class Admission:
    """The pipeline of one node: its ledger, the run's k, the round window, its counters."""

    def __init__(
        self,
        ledger: Ledger,
        directions: int,
        peer_id: bytes,
        metrics: NodeMetrics,
        max_ahead: int,
        deliver: Callable[[list[UpdateMessage]], None] = lambda messages: None,
        verify: Callable[[bytes, bytes, bytes, str, bytes], bool] = verify_pubsub_signature,
        max_behind: int = 30,
        reputation: Reputation | None = None,
        allowed: Collection[bytes] | None = None,
        tickets: TicketBook | None = None,
        work: IdentityWork | None = None,
    ) -> None:
        self.ledger = ledger
        self.run_id = ledger.run_id
        self.directions = directions
        self.peer_id = peer_id
        self.metrics = metrics
        self.window = WindowRule(max_ahead, max_behind)
        self.deliver = deliver
        self.verify = verify
        self.reputation = reputation or Reputation(BanStore(None), metrics.count_ban)
        self.allowed = None if allowed is None else frozenset(allowed)  # None: an open run
        # The run's identity work (`RunConfig.identity_work`; None or difficulty 0: none)
        self.work = work if work is not None and work.enabled else None
        # A ticketed run: only holders of a valid ticket signed by the run creator
        self.tickets = tickets if tickets is not None and tickets.required else None
        self.sender_rate = PeerBuckets(SENDER_RATE, SENDER_BURST)
        # rows a repair exchange is checking now (`_verify_once`): key -> (the checking
        # call's future, the row's place in its results)
        self._verifying: dict[tuple, tuple[asyncio.Future, int]] = {}
        self.log_limit = LogLimiter()
        self.newest_round = ledger.max_round()  # the highest round held: shown, not trusted
        # Set by the owner while it syncs before training (FloodNode.not_ready): gossip
        # ahead of the window is then our lag, not the sender's doing (a joiner syncing a
        # long history for minutes would otherwise ban honest peers that publish faster
        # than their score recovers)
        self.catching_up = False
        self.own_round = -1  # the round this peer trains (set by the peer daemon)
        # Each other peer's newest round in our ledger: one vote per identity (see
        # `reference_round`). Only admitted rows count: a round refused as out of window
        # is no vote, so even a few identities can move the reference only by steps that
        # every peer's window admits (and each refused step is held against them).
        # (A RoundClaims: its quorum round is kept up to date, not sorted per batch.)
        self.claims: dict[bytes, int] = RoundClaims(
            {p: r for p, r in ledger.peer_rounds().items() if p != peer_id}
        )
        # Each peer's highest digest bucket, by its last round: only ever an upper bound
        # for repair (a late joiner that heard no gossip yet must not refuse the run's
        # newest rows), never the window's centre (it over-claims by up to 63 rounds).
        self.bucket_claims: dict[bytes, int] = RoundClaims()

    def behind(self) -> bool:
        """Is this node behind the run through no fault of its senders: it knew no round
        yet, or it is still syncing (`catching_up`)? Gossip out of its window is then
        expected: not penalized, logged at debug."""
        return self.newest_round < 0 or self.catching_up

    def reference_round(self) -> int:
        """The round the window is centred on: our own training round, or the round a
        quorum of distinct other peers reached if that is higher (a restarted, slow or
        non-training node). Never the highest round seen: one identity claiming round
        5,063 is one vote, and the quorum round stays with the honest peers."""
        return max(self.own_round, _quorum_of(self.claims))

    def note_claim(self, peer: bytes, round_: int) -> None:
        """`peer` reached `round_`: an update of it was admitted."""
        if peer != self.peer_id and round_ > self.claims.get(peer, -1):
            self.claims[peer] = round_

    def note_bucket_claim(self, peer: bytes, last_round: int) -> None:
        """`peer`'s digest reply lists rows up to the bucket ending at `last_round`."""
        if peer != self.peer_id:
            self.bucket_claims[peer] = last_round

    def sender_problem(self, peer: bytes, round_: int | None = None) -> Rejected | None:
        """Why updates authored by `peer` (of `round_`, when given) are not admitted, or
        None."""
        try:
            check_sender_key(peer)
        except Rejected as exc:
            return exc
        if self.allowed is not None and peer not in self.allowed:
            return Rejected("not_allowed", "not in the run's allow_peers")
        if self.work is not None:
            try:
                check_sender_work(peer, self.work)
            except Rejected as exc:
                return exc
        return self.ticket_problem(peer, round_)

    def ticket_problem(self, peer: bytes, round_: int | None) -> Rejected | None:
        """A ticketed run: a row whose author holds no ticket here for its round (None: for
        any round) is dropped and the ticket looked for (`TicketBook.want`); repair brings
        the row back once it is known."""
        if self.tickets is None or peer == self.peer_id or self.tickets.admits(peer, round_):
            return None
        self.tickets.want(peer)
        return Rejected("no_ticket", "no join ticket of the run creator for this round")

    # -- the three sources ------------------------------------------------------------
    def gossip(self, arrivals: list[tuple[bytes, Envelope]]) -> list[Verdict]:
        """Admit a batch of gossip payloads, each (sender, signed envelope), in one ledger
        transaction (per-message commits kept the event loop in fsync: arrival p50 86 ms
        at 16 peers, 35 ms grouped). Verdicts in arrival order."""
        knew_no_round = self.behind()
        verdicts: list[Verdict | None] = [None] * len(arrivals)
        rows, where, echoes = [], [], []
        for i, (sender, envelope) in enumerate(arrivals):
            problem = self.sender_problem(sender)
            if problem is None and sender != self.peer_id:
                if self.reputation.is_banned(sender):
                    problem = Rejected("banned")
                elif not self.sender_rate.allow(sender):
                    problem = Rejected("rate_limited", f"over {self.sender_rate.rate:g}/s")
            if problem is not None:
                verdicts[i] = _rejected(problem, sender, None)
                continue
            try:
                with timed(self.metrics.decode_seconds):
                    message = decode_update(envelope.data, self.run_id, sender, self.directions)
            except Rejected as exc:
                verdicts[i] = _rejected(exc, sender, None)
                continue
            except Exception as exc:  # never let a hostile payload out of the pipeline
                verdicts[i] = Verdict(Outcome.DROPPED, sender, None, "malformed", repr(exc))
                continue
            if (problem := self.ticket_problem(sender, message.round)) is not None:
                verdicts[i] = _rejected(problem, sender, message)  # its ticket's end is past
                continue
            if message.peer == self.peer_id and same_scalars(
                self.ledger.scalars_of(message.peer, message.round), message.scalars
            ):
                echoes.append((message, envelope))
                verdicts[i] = Verdict(Outcome.ECHO, sender, message, "own")
                continue
            rows.append((message, envelope))
            where.append(i)
        if echoes:
            self.ledger.set_envelopes(echoes)
        for i, verdict in zip(where, self._admit(rows, Source.GOSSIP), strict=True):
            verdicts[i] = verdict
        self._count(Source.GOSSIP, verdicts, knew_no_round)
        for verdict in verdicts:  # the author signed each (strict signing): its doing
            if verdict.outcome is not Outcome.ECHO and verdict.sender != self.peer_id:
                if not (knew_no_round and verdict.reason == "out_of_window"):
                    self.reputation.penalize(verdict.sender, verdict.reason)
        return verdicts

    async def repair(
        self,
        rows: list[tuple[UpdateMessage, Envelope]],
        server: bytes = b"",
        sole_server: bool = True,
    ) -> list[Verdict]:
        """Admit rows of a repair reply from `server` (already checked whole by the caller).
        `sole_server`: it is the only peer we could ask (see
        `protocol.update.WindowRule.check_repair`).
        Penalties for bad rows are the caller's to give, per page, to the server; only an
        equivocation is held against the rows' author, who signed both."""
        verdicts: list[Verdict | None] = [None] * len(rows)
        unseen, where = [], []
        logged = self.ledger.scalars_of_many((m.peer, m.round) for m, _ in rows)
        for i, (message, envelope) in enumerate(rows):
            if (problem := self.sender_problem(message.peer, message.round)) is not None:
                verdicts[i] = _rejected(problem, message.peer, message)
                continue
            held = logged.get((message.peer, message.round))
            if same_scalars(held, message.scalars):
                verdicts[i] = Verdict(Outcome.DUPLICATE, message.peer, message, "duplicate")
            else:  # our own rows too, when missing (a lost ledger): their signature is ours
                unseen.append((message, envelope))
                where.append(i)
        checked = await self._verify_once(unseen)
        valid, valid_where = [], []
        for i, row, rejected in zip(where, unseen, checked, strict=True):
            if rejected is None:
                valid.append(row)
                valid_where.append(i)
            else:
                verdicts[i] = _rejected(rejected, row[0].peer, row[0])
        admitted = self._admit(valid, Source.REPAIR, server, sole_server)
        for i, verdict in zip(valid_where, admitted, strict=True):
            verdicts[i] = verdict
        self._count(Source.REPAIR, verdicts)
        for verdict in verdicts:
            if verdict.reason == "equivocation" and verdict.sender != self.peer_id:
                self.reputation.penalize(verdict.sender, "equivocation")
        return verdicts

    def own(self, message: UpdateMessage) -> Verdict:
        """Our own update, before it is published: logged unsigned (its echo signs it) and
        handed on like any other, so the sender applies exactly what it sends."""
        verdicts = self._admit([(message, None)], Source.OWN)
        self._count(Source.OWN, verdicts)
        return verdicts[0]

    def drop_reply(self, exc: Rejected, sender: bytes) -> None:
        """A repair reply that failed its checks is dropped whole, before any row, and
        held against the peer that sent it."""
        self.metrics.dropped.labels(exc.reason).inc()
        self._log_drop(exc.reason, str(exc), sender, self.behind())
        self.reputation.penalize(sender, exc.reason)

    # -- policy, ledger, apply -----------------------------------------------------------
    async def _verify_once(
        self, rows: list[tuple[UpdateMessage, Envelope]]
    ) -> list[Rejected | None]:
        """`_verify_rows` of `rows`, each exact row (update and envelope, byte for byte)
        checked once however many repair exchanges bring it at the same time: an exchange
        whose row another is checking waits for that check's result, a pure function of
        the same bytes. After a partition heals, a node repairs from every newly connected
        peer at once, and each brought the same rows: every signature was checked 2-3
        times (the check is the largest cost of repair, ~45-90 us a row, holding the GIL).
        Ed25519 checks run in a thread: it keeps the event loop (gossip) running during a
        long late-join sync (80,000 rows: 13 s of checks)."""
        keys = [_row_key(message, envelope) for message, envelope in rows]
        verifying = self._verifying
        mine = [i for i, key in enumerate(keys) if key not in verifying]
        waits = {i: verifying[key] for i, key in enumerate(keys) if key in verifying}
        # One future for this call's rows, each key naming its place in the results: a
        # future per row cost a sixth of a joiner's repair intake (4,096 a page).
        batch = asyncio.get_running_loop().create_future()
        for place, i in enumerate(mine):
            verifying[keys[i]] = (batch, place)
        try:
            results = await asyncio.to_thread(self._verify_rows, [rows[i] for i in mine])
        except BaseException:  # cancelled (the node stops) or failed: waiters check alone
            batch.cancel()
            raise
        finally:
            for i in mine:
                if verifying.get(keys[i], (None,))[0] is batch:
                    del verifying[keys[i]]
        batch.set_result(results)
        checked: list[Rejected | None] = [None] * len(rows)
        for i, result in zip(mine, results, strict=True):
            checked[i] = result
        alone = []
        for i, (future, place) in waits.items():
            try:
                checked[i] = (await asyncio.shield(future))[place]
            except asyncio.CancelledError:
                if not future.cancelled():
                    raise  # this exchange is cancelled, not the check it waited for
                alone.append(i)
        if alone:
            results = await asyncio.to_thread(self._verify_rows, [rows[i] for i in alone])
            for i, result in zip(alone, results, strict=True):
                checked[i] = result
        return checked

    def _verify_rows(self, rows: list[tuple[UpdateMessage, Envelope]]) -> list[Rejected | None]:
        """Each row's signature and payload check: None if it holds. Touches no state, so
        it may run off the event loop."""
        out: list[Rejected | None] = []
        # Timed by hand: `timed`'s context manager cost a third of this loop.
        clock, observe = time.perf_counter, self.metrics.verify_seconds.observe
        for message, envelope in rows:
            start = clock()
            try:
                check_envelope(message, envelope, self.run_id, self.verify)
                out.append(None)
            except Rejected as exc:
                out.append(exc)
            observe(clock() - start)
        return out

    def _admit(
        self,
        items: list[tuple[UpdateMessage, Envelope | None]],
        source: Source,
        server: bytes = b"",
        sole_server: bool = True,
    ) -> list[Verdict]:
        """Policy, then one ledger transaction, then hand on. Verdicts in input order."""
        with timed(self.metrics.admit_seconds.labels(source)):
            return self._admit_batch(items, source, server, sole_server)

    def _admit_batch(
        self,
        items: list[tuple[UpdateMessage, Envelope | None]],
        source: Source,
        server: bytes,
        sole_server: bool,
    ) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(items)
        reference = self.reference_round()
        upper = _quorum_of(self.bucket_claims)
        new: dict[tuple[int, bytes], int] = {}  # (round, peer) -> index: not in the ledger
        winners: dict[tuple[int, bytes], int] = {}  # ... in the ledger, to be replaced
        losing: list[UpdateMessage] = []  # equivocations' copies that lost (never logged)
        logged = self.ledger.scalars_of_many((m.peer, m.round) for m, _ in items)
        for i, (message, _) in enumerate(items):
            key = (message.round, message.peer)
            j = new.get(key, winners.get(key))  # an earlier row of this batch, same key
            held = (
                items[j][0].scalars if j is not None else logged.get((message.peer, message.round))
            )
            try:
                if len(message.scalars) != self.directions:
                    raise Rejected("malformed", f"{len(message.scalars)} scalars")
                if source is Source.GOSSIP:
                    self.window.check(message, reference)
                elif source is Source.REPAIR:
                    self.window.check_repair(message, reference, server, sole_server, upper)
                check_against_ledger(message, held)
            except Rejected as exc:
                if exc.reason == "equivocation" and keeps_new(held, message.scalars):
                    if j is not None:  # the earlier row of this batch loses
                        verdicts[j] = Verdict(
                            Outcome.DROPPED, key[1], items[j][0], "equivocation", exc.detail
                        )
                        losing.append(items[j][0])
                    (new if key in new else winners)[key] = i
                else:
                    if exc.reason == "equivocation" and source is not Source.OWN:
                        losing.append(message)  # it loses to the copy held
                    verdicts[i] = _rejected(exc, message.peer, message)
                continue
            new[key] = i
        fresh = []
        if new:
            rows = [items[i] for i in new.values()]
            fresh = self.ledger.add([m for m, _ in rows], [e for _, e in rows])
        added = {(m.round, m.peer) for m in fresh}
        for key, i in new.items():
            message = items[i][0]
            if key in added:
                verdicts[i] = Verdict(Outcome.ACCEPTED, message.peer, message)
            else:  # logged by someone else since we looked: nothing changed
                verdicts[i] = Verdict(Outcome.DUPLICATE, message.peer, message, "duplicate")
        handed = list(fresh)
        for i in winners.values():
            message, envelope = items[i]
            old = self.ledger.replace(message, envelope)
            log.warning(
                "peer %s signed two updates for round %d: keeping %r over %r (every peer "
                "applies this rule), taking the other back",
                short_id(message.peer),
                message.round,
                message.scalars,
                old,
                extra={"fields": {"event": "equivocation", "round": message.round}},
            )
            handed += [UpdateMessage(message.round, message.peer, old).negated(), message]
            verdicts[i] = Verdict(
                Outcome.REPLACED, message.peer, message, "equivocation", f"kept over {old}"
            )
        # The losing copies, kept for audits (`Ledger.keep_losing`; `replace` kept the rows
        # it replaced): a peer may have trained on a state holding one before it lost.
        for message in losing:
            self.ledger.keep_losing(message)
        for verdict in verdicts:
            if verdict.changed_ledger:
                self.newest_round = max(self.newest_round, verdict.message.round)
                self.note_claim(verdict.message.peer, verdict.message.round)
        if handed:
            self.metrics.ledger_size.set(len(self.ledger))
            self.deliver(handed)
        return verdicts

    # -- counting and logging --------------------------------------------------------------
    def _count(self, source: Source, verdicts: list[Verdict], knew_no_round: bool = False) -> None:
        """Every verdict in `admissions{source, outcome}`. The `accepted{source}` and
        `dropped{reason}` counters, which the status page and the demo read, keep their
        meaning: `accepted` is ACCEPTED; `dropped` is DROPPED by reason, a REPLACED update
        as an equivocation seen (like the one it beat), and duplicates. Not repair's
        duplicates: a repair pass refetches whole buckets, mostly rows we hold, and they
        would bury the drops that mean something. Not our own echoes: nothing is dropped."""
        # Counted once per outcome a batch (a `labels` call costs a lock and a lookup:
        # per update it was a few percent of a flooded daemon's event loop).
        for outcome, n in Counter(v.outcome for v in verdicts).items():
            self.metrics.admissions.labels(source, outcome).inc(n)
            if outcome is Outcome.ACCEPTED:
                self.metrics.accepted.labels(source).inc(n)
            elif outcome is Outcome.REPLACED:  # logged as an equivocation where resolved
                self.metrics.dropped.labels("equivocation").inc(n)
        for verdict in verdicts:
            outcome = verdict.outcome
            if outcome is Outcome.DROPPED or (
                outcome is Outcome.DUPLICATE and source is not Source.REPAIR
            ):
                self.metrics.dropped.labels(verdict.reason).inc()
                text = f"{verdict.reason}: {verdict.detail}" if verdict.detail else verdict.reason
                self._log_drop(verdict.reason, text, verdict.sender, knew_no_round)

    def _log_drop(self, reason: str, text: str, sender: bytes, knew_no_round: bool) -> None:
        # Expected, not suspicious: overlaps, and a fresh peer that knew no round yet
        # seeing the run's current rounds before its first sync (repair fetches them).
        expected = reason in ("duplicate", "own", "own_backfill") or (
            reason == "out_of_window" and knew_no_round
        )
        level = logging.DEBUG if expected else logging.WARNING
        if not log.isEnabledFor(level):
            return
        allowed, held = self.log_limit.allow(reason)  # the counters stay exact
        if not allowed:
            return
        log.log(
            level,
            "dropped update from %s: %s%s",
            short_id(sender),
            text,
            f" ({held} more '{reason}' drops not logged)" if held else "",
            extra={"fields": {"event": "drop", "reason": reason}},
        )
