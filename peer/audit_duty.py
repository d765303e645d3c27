"""The peer daemon's audits: on unless the manifest sets `extra.audit = false`.

What the daemon does with `algorithm/audit_rules.py` and `network/gossip/audit_intake.py`:

    train round t on the settled state S_t = base + counted updates of rounds < t - lag
    an accepted update (p, t) of another peer -> audited if our secret draw selects it
    an audit record from the audit topic -> ledger (AuditIntake, counted); a mismatch
        record on (p, t) makes us re-check (p, t) ourselves and publish our vote
    after new records: judge the ledger -> a peer banned in the settled state we hold:
        its applied updates taken back (negated), its pending ones kept waiting (still
        logged: a ban takes effect in S_t from the round its records fix, so an audit of
        an earlier round recomputes on a state that still counts them)

An audit of (p, t) recomputes on S_t, rebuilt on our model by peer/state_rewind.py
(`StateRewind`: the held-state digest's state first, then S_t and the states the sender
may honestly have trained on instead, among them S_t with an equivocated row swapped back
to the copy that lost, from the ledger's `replaced` table; any match is a match). A
replaced row is drawn for audit again like a new update (`on_accept`). Bans are timed like vouches
(`probation.Standing.bans`): S_t's banned set is the judgement of the ledger prefix a
sender training t held, so the sender and its auditors agree on it and no auditor guesses
which bans a sender knew.

Audit records arrive by gossip and by repair (the flood node's `AuditIntake`, then
`note_records` here), so a late joiner ends with the others' audit table and verdicts.
With founders in the manifest (`algorithm/probation.py`), what counts is the ledger's
standing, not only its bans: a settled update that does not count (a probationer's
unvouched one, a banned peer's) waits in `waiting`. A vouch or an establishment takes
effect from the round its record fixes (`probation.Standing.count_from`: the auditor's
publication round `at`, as a row of that round), so the update is applied at that round
(`take_settled`) on every peer alike, and an audit recomputes on the same S_t the sender
trained on; a record that reaches us after that round makes it a late row. A ban, too,
takes effect at the round its records fix (`Standing.counts_at`). Probation
audits take at most `share` audits a round, probationers served least-served first
(peer/probation_queue.py, docs/SYBIL.md).

`PeerAudits` coordinates: what to audit (draws, re-checks, the probation queue), what the
weights hold (`applied`, `waiting`), and the judgement. `done` forgets audits older than
the MAX_REWIND horizon (none is ever run again), so it stays bounded over a long run.

Limits (docs/ROADMAP.md): an update older than MAX_REWIND rounds is not
audited.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from peer.applied_rows import AppliedRows
from peer.held_digests import HeldDigests
from peer.probation_queue import ProbationQueue
from peer.state_rewind import (
    ARRIVAL_ROUNDS,
    ARRIVALS_KEPT,
    FROZEN_AFTER,
    HELD_WINDOW,
    MAX_LATE_STATES,
    MAX_REWIND,
    PROBATION_LATE_STATES,
    StateRewind,
    late_states,
)
from seedflood_p2p.algorithm.audit_rules import audit_rate, recompute, selects
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
from seedflood_p2p.algorithm.probation import NEVER, Standing, revoked_rounds
from seedflood_p2p.algorithm.probation import standing as standing_of
from seedflood_p2p.algorithm.standing_summary import StandingSummary
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.network.gossip.audit_intake import AuditIntake
from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.protocol.update import decode_held
from seedflood_p2p.storage.ledger import Ledger, peer_name

log = logging.getLogger("seedflood.audit")

# Named here too: tests and callers read them from this module.
__all__ = [
    "ARRIVAL_ROUNDS",
    "ARRIVALS_KEPT",
    "HELD_WINDOW",
    "LIVE_COUNT_SECONDS",
    "MAX_LATE_STATES",
    "MAX_REWIND",
    "PROBATION_LATE_STATES",
    "DaemonAudits",
    "HeldDigests",
    "PeerAudits",
    "late_states",
]
# Seconds a count of live peers serves `DaemonAudits.accept` (the audit sampling rate):
# counting is O(peers), 0.7 ms at 10,000, once per admitted batch before; liveness itself
# moves on the scale of the liveness timeout (60 s), and draws are our own choice.
LIVE_COUNT_SECONDS = 1.0
# Updates a joiner restored from a fetched link recomputes before it trains (`self_check`):
# each is a few forward passes; a majority must match.
SELF_CHECKS = 5


class PeerAudits:
    """One peer's audit state: what to audit, what it applied, whom the ledger bans."""

    def __init__(
        self,
        settings: AuditSettings,
        secret: bytes,
        peer_id: bytes,
        ledger: Ledger,
        live: LiveModel,
        intake: AuditIntake | None,
        probation: ProbationSettings | None = None,
        prefix_cache: ExamplePrefixCache | None = None,
    ) -> None:
        self.settings = settings
        self.prefix_cache = prefix_cache  # our frozen-prefix cache (recomputations use it)
        self.probation = probation or ProbationSettings()
        self.standing: Standing | None = None  # what counts (`probation.standing`)
        # Settled updates taken that do not count (yet): a probationer's unvouched ones (or
        # vouched from a later settled state), a banned peer's. Kept: they are applied at
        # the round their vouch or establishment takes effect (`take_settled`), or at once
        # if its record reached us after that round (then like any late row).
        self.waiting: list[UpdateMessage] = []
        # the verification budget and the fair queue of probationers' updates
        self.queue = ProbationQueue(self.probation)
        self.secret = secret  # our private draw: a sender cannot predict its auditors
        self.peer_id = peer_id
        self.ledger = ledger
        # the claims judgements read (`read_inputs`): a row's scalars change only when an
        # equivocation replaces it (the ledger's `replacements`), so they are read once
        self._claims: dict[tuple[int, bytes], tuple[float, ...]] = {}
        self._claims_replaced = 0
        # A joiner trusting an audited link before its history (peer/latejoin.py): the
        # link's standing summary stands for the records about the rows below it, and
        # `below_link(standing)` says why a judgement no longer lets the weights stand on
        # it (None: they may). Both None once the history is in.
        self.summary: StandingSummary | None = None
        self.below_link: Callable[[Standing], str | None] | None = None
        self.records_below: list[AuditRecord] = []  # the ledger's, about rows below the link
        # Moved on whenever what a judgement's inputs stand for changes (the summary taken
        # or dropped, the account rebuilt): a judgement read before is dropped, not applied.
        self.generation = 0
        self.live = live
        self.intake = intake  # the flood node's (None in the daemon: DaemonAudits uses it)
        # The bans of the state the weights were last checked against (`_bans_moved`).
        self._span: object | None = None
        self.banned: dict[bytes, str] = {}  # the ledger's judgement: peer -> why
        self.due: dict[tuple[bytes, int], str] = {}  # (peer, round) -> "draw" | "recheck"
        self.done: set[tuple[bytes, int]] = set()  # audited (or handed out), within MAX_REWIND
        self._done_floor = 0  # `done` holds no key of a round below this (`_forget_done`)
        self.round = 0  # the round we are training (take_settled)
        # rebuilds the settled state an update was trained on; keeps the arrival order
        # (the equivocations' losing copies, `Ledger.losing_copies`: a mismatch's retries)
        self.rewind = StateRewind(live, settings.lag, self._counts_in, ledger.losing_copies)
        # what the weights hold, in order applied (older rows packed: `AppliedRows`)
        self._applied = AppliedRows(self.rewind.held.row_hash, FROZEN_AFTER + settings.lag)
        self.late_matches: Counter[str] = Counter()  # kind of late state that matched
        self.counts: Counter[str] = Counter()  # audits, mismatches, published, ...
        # CPU seconds of the model thread (time.thread_time: with --threads 1 that is all the
        # work) spent training ("train": our own zo_step) and auditing ("audit"): the cost
        # the audit rate is set to keep at `cpu_share` of training.
        self.cpu_seconds: Counter[str] = Counter()
        self.verdicts = 0  # cases decided (confirmed or refuted)
        # An update of a peer the standing does not know arrived: judge again at the next
        # round (`DaemonAudits.run_round`), so a newcomer becomes a probationer (and is
        # audited) even if no audit record ever arrives to prompt a judgement.
        self.unknown_peers = False
        self.rate = 0.0
        self.delay = settings.delay  # rounds an audit waits (see `ready`)

    # -- the pieces' state, under the names it always had ------------------------------
    @property
    def tokens(self) -> float:
        """Probation audits we may still do (the verification budget, `ProbationQueue`)."""
        return self.queue.tokens

    @tokens.setter
    def tokens(self, value: float) -> None:
        self.queue.tokens = value

    @property
    def served(self) -> Counter[bytes]:
        """Probation audits spent on each probationer (`ProbationQueue`)."""
        return self.queue.served

    @property
    def arrival(self) -> dict[tuple[bytes, int], tuple[int, int]]:
        """When each update reached us: (our round, order) (`StateRewind.arrival`)."""
        return self.rewind.arrival

    # -- where updates are accepted (event loop) -----------------------------------
    def on_accept(self, messages: list[UpdateMessage], peers: int) -> None:
        """Draw audits among just-accepted updates of others (`peers`: the run's size
        as we see it, for the sampling rate).

        A replaced row (an equivocation: the admission hands on the held copy negated and
        the kept one, in one batch, so its key comes twice) is drawn again like a new
        update, though an audit of the copy it replaced was done: the kept copy is what
        counts now, and an equivocator is then convicted by audits too."""
        self.rate = audit_rate(peers, self.settings.cpu_share)
        st = self.standing
        seen: set[tuple[bytes, int]] = set()
        for m in messages:
            key = (m.peer, m.round)
            if key in seen:  # its key's second row in the batch: a replacement
                self.counts["replaced_rows"] += 1
                self.done.discard(key)  # audited as the old copy: due again
                self.rewind.replaced(key, self.round)  # its winner reached us now
                if m.peer != self.peer_id and m.peer not in self.banned:
                    # Witnessed: audited for certain, so the equivocator is convicted by
                    # audits (a ledger fact every peer judges alike), not only banned here.
                    self.due[key] = "recheck"
            seen.add(key)
            self.rewind.arrived(key, self.round)
            if (
                st is not None
                and st.enabled
                and m.peer not in st.established
                and m.peer not in st.probationers
                and m.peer not in self.banned
            ):
                self.unknown_peers = True
            if m.peer == self.peer_id or m.peer in self.banned or key in self.done:
                continue
            if selects(self.secret, self.live.config.run_key, m.peer, m.round, self.rate):
                self.due.setdefault(key, "draw")
        self.rewind.trim_arrivals(self.round)  # only recent arrivals are asked for

    def take_settled(self, round_: int) -> list[UpdateMessage]:
        """The pending updates that belong to S_round, and the waiting ones whose vouch or
        establishment takes effect in S_round (`apply` keeps back those that do not
        count)."""
        self.round = round_
        settled = self.live.take_settled(round_, self.settings.lag)
        due = [m for m in self.waiting if self.is_counted(m)]
        if due:
            self.waiting = [m for m in self.waiting if not self.is_counted(m)]
            self.counts["counted_on_time"] += len(due)
        return settled + due

    def apply_final(self, messages: list[UpdateMessage]) -> None:
        """At the end of training: the weights become base + every update that counts by the
        ledger's judgement (what a replay applies, what a checkpoint is labelled with), the
        waiting ones whose vouch takes effect after our last round included. (Training on
        after this, e.g. /finish raised while lingering, would start from that state.)"""
        # a settled prefix past every effective round (`at` <= config.MAX_ROUND < NEVER), so
        # every vouch and ban counts as in the whole ledger's standing, a replay's
        self.round = NEVER + self.settings.lag
        due = [m for m in self.waiting if self.is_counted(m)]
        self.waiting = [m for m in self.waiting if not self.is_counted(m)]
        self.apply(messages + due)

    def is_counted(self, message: UpdateMessage) -> bool:
        """Does `message` count in the settled state of the round we train (`self.round`), by
        the ledger's judgement as we last read it? Its vouch or establishment must have taken
        effect by then, and its peer not be banned there (`Standing.counts_at`); its own
        round is the caller's to check."""
        return self._counts_now(message.peer, message.round)

    def _counts_now(self, peer: bytes, round_: int) -> bool:
        """`is_counted` of the update (peer, round_)."""
        if self.standing is None:
            return peer not in self.banned
        return self.standing.counts_at(peer, round_, self.round - self.settings.lag)

    def _revoked(self, message: UpdateMessage) -> bool:
        """Is `message` of a round its author's ticket was revoked from? It never counts, so
        it is not kept waiting (a revoked holder may go on sending)."""
        st = self.standing
        return st is not None and message.round >= st.revoked.get(message.peer, NEVER)

    def _bans_moved(self) -> bool:
        """Has the banned set changed between the state last checked and the one of the
        round we train (a ban that takes effect now, or a case turned back)?"""
        if self.standing is None:
            return False
        span = self.standing.span(self.round - self.settings.lag)
        moved, self._span = span is not self._span, span
        return moved

    def note_records(self, fresh: list[AuditRecord]) -> None:
        """Records new to the ledger (gossip or repair, admitted by the flood node's
        intake): a mismatch we did not vote on yet makes us re-check the update."""
        rule = self.settings.rule
        for record in fresh:
            key = (record.accused, record.round)
            if record.auditor == self.peer_id or record.accused == self.peer_id:
                continue
            if key in self.done or record.accused in self.banned:
                continue
            st = self.standing
            if st is not None and st.enabled and record.auditor not in st.established:
                continue  # its vote does not count: re-checking it would let fresh keys
                # make every peer work for nothing
            claimed = self.ledger.scalars_of(record.accused, record.round)
            if claimed is None or rule.mismatches(claimed, record.scalars):
                self.due[key] = "recheck"

    def judge(self) -> Standing:
        """What counts: who the ledger bans, who is established, which updates are vouched (a
        pure function of its updates and audit records, `probation.standing`)."""
        return self.judge_of(self.read_inputs())

    def read_inputs(self) -> tuple:
        """`probation.ledger_inputs`, the claims read only for records new since the last
        call (at a hundred thousand records the claims were half of the read)."""
        ledger = self.ledger
        records = ledger.audits()
        if ledger.replacements != self._claims_replaced:
            self._claims, self._claims_replaced = {}, ledger.replacements
        claims = self._claims
        claims.update(ledger.claims({(r.round, r.accused) for r in records} - claims.keys()))
        revoked = revoked_rounds(ledger.revocations())
        if self.summary is not None:  # (new dicts: judged in a thread)
            self.records_below = [r for r in records if r.round < self.summary.below]
            claims, records, seen = self.summary.inputs(claims, records, ledger.peers())
            return claims, records, revoked, seen
        return dict(claims), records, revoked, ledger.peers()

    def judge_of(self, inputs: tuple) -> Standing:
        """`judge` of what `read_inputs` read (any thread: a pure function)."""
        claims, records, revoked, seen = inputs
        after = standing_of(claims, records, self.settings, self.probation, revoked, seen)
        self.verdicts = sum(1 for c in after.judgement.cases if c.outcome != "open")
        return after

    def probation_status(self) -> dict | None:
        """Probation as this peer sees it (None: the run has no founders, probation off)."""
        waiting = sum(1 for m in self.waiting if m.peer not in self.banned)
        return self.queue.status(self.standing, self.peer_id, waiting, self.counts)

    def probation_jobs(self, trained_round: int) -> list[tuple]:
        """Probation audits for this round, within the verification budget, each (peer,
        round, "probation", claimed scalars): the probationers' unvouched updates that are
        due (old enough, see `ready`; young enough to rewind to), least-served probationer
        first (`ProbationQueue.jobs`); the rest wait (kept, counted in `backlog`). Only an
        established peer does probation audits."""
        st, queue = self.standing, self.queue
        low, high = max(0, trained_round - MAX_REWIND), trained_round - self.delay
        if not queue.auditing(st, self.peer_id) or high < low or not st.probationers:
            return queue.idle()
        rows = self.ledger.messages(low, high)
        run_key = self.live.config.run_key
        picked = queue.jobs(st, rows, self.done, self.secret, run_key, trained_round)
        self.counts["probation_audits"] += len(picked)
        return [(m.peer, m.round, "probation", m.scalars) for m in picked]

    def ready(self, trained_round: int) -> list[tuple]:
        """Audits to do now: updates of rounds <= trained_round - `delay` (the model holds S
        of trained_round), each (peer, round, why, claimed scalars).

        Why wait: the sender's settled state counts the updates and the records (vouches,
        bans) of its settled prefix. After `delay` rounds we hold what it held."""
        out = []
        st = self.standing
        probationers = st.probationers if st is not None and st.enabled else frozenset()
        self.queue.earn(st, self.peer_id)
        self._forget_done(trained_round - MAX_REWIND)
        for (peer, round_), why in sorted(self.due.items(), key=lambda kv: kv[0][1]):
            if round_ > trained_round - self.delay:
                continue
            if why == "recheck" and peer in probationers and trained_round - round_ <= MAX_REWIND:
                # a re-check of a probationer's update is probation work: within the budget
                # (its unvouched updates do not count meanwhile; it waits, as they do)
                if not self.queue.pay_recheck(peer):
                    continue
                self.counts["probation_audits"] += 1
            del self.due[(peer, round_)]
            if trained_round - round_ > MAX_REWIND or peer in self.banned:
                self.counts["skipped"] += 1
                continue
            claimed = self.ledger.scalars_of(peer, round_)
            if claimed is None:
                continue
            out.append((peer, round_, why, claimed))
        return out + self.probation_jobs(trained_round)

    def _forget_done(self, floor: int) -> None:
        """Forget the audits of rounds below `floor` (trained round - MAX_REWIND): `ready`
        never runs one that old, so `done` keeps only the keys a draw, a re-check or the
        probation queue could still ask about."""
        if floor <= self._done_floor:
            return
        self._done_floor = floor
        self.done = {key for key in self.done if key[1] >= floor}

    # -- where the model lives (model thread) ---------------------------------------
    def timed_step(self, step, *args) -> tuple[object, int]:
        """`step(*args)` (our own training step), its CPU time counted as "train"; returns
        (its result, the held-state digest of the weights it trained on: sent with the
        update, so auditors recompute on exactly this state)."""
        started = time.thread_time()
        try:
            held = self.held_digest()
            return step(*args), held
        finally:
            self.cpu_seconds["train"] += time.thread_time() - started

    @property
    def applied(self) -> AppliedRows:
        """The rows the weights hold, in order applied (peer/applied_rows.py)."""
        return self._applied

    @applied.setter
    def applied(self, rows: Iterable[UpdateMessage] | AppliedRows) -> None:
        """Hold exactly `rows` (a restore, a late join: the weights were set to them), or
        the account a restore filled (`restoring`)."""
        if isinstance(rows, AppliedRows):
            self._applied = rows
        else:
            self._applied.reset(rows, self.round)

    def restoring(self) -> AppliedRows:
        """An empty account of what the weights hold, for a restore to fill row by row in
        the pass it makes anyway (`LiveModel.restore(observe=account.restored)`, on the
        model thread); `applied = account` then puts it in place."""
        account = AppliedRows(self.rewind.held.row_hash, FROZEN_AFTER + self.settings.lag)
        account.reset((), self.round)
        return account

    def held_digest(self) -> int:
        """The digest of the rows the weights hold (`applied`)."""
        a = self._applied
        return self.rewind.held.of(a.recent, a.frozen_total, a.is_frozen)

    def _may_stop_counting(self) -> set[bytes]:
        """The peers whose frozen rows may have stopped counting: without probation a
        counted row stops counting only by its peer's ban or its ticket's revocation; on
        probation also by a vouch lost (its voucher banned, its record replaced), so every
        peer but the founders."""
        st = self.standing
        if st is None:
            return set(self.banned)
        peers = set(st.banned) | set(st.revoked) | {p for span in st.bans for p in span.banned}
        if st.enabled:
            peers |= self._applied.frozen_peers() - st.founders
        return peers

    def _recompute(self, message: UpdateMessage, engine, tokenizer, task) -> tuple[float, ...]:
        """One recomputation, its CPU time counted as "audit"."""
        started = time.thread_time()
        try:
            return recompute(engine, tokenizer, task, message, self.prefix_cache)
        finally:
            self.cpu_seconds["audit"] += time.thread_time() - started

    def apply(self, messages: list[UpdateMessage]) -> None:
        """Apply the updates that count; keep the others (`waiting`) for a later judgement.
        A ban that takes effect in the state of the round we train takes its peer's applied
        updates back (they wait: a case turned back would count them again)."""
        drop = []
        if self._bans_moved():
            drop = self._applied.take_back(self._counts_now, self._may_stop_counting())
            self.waiting.extend(drop)
            banned = self.standing.banned_at(self.round) if self.standing else frozenset()
            for peer in sorted({m.peer for m in drop} & banned):  # (others lost a vouch)
                log.warning(
                    "audit verdict in effect from round %d: peer %s banned; %d applied "
                    "update(s) taken back",
                    self.round,
                    peer_name(peer),
                    sum(1 for m in drop if m.peer == peer),
                    extra={"fields": {"event": "audit_ban", "peer": peer_name(peer)}},
                )
        keep = [m for m in messages if self.is_counted(m)]
        self.waiting.extend(m for m in messages if not self.is_counted(m) and not self._revoked(m))
        self.live.apply([m.negated() for m in drop] + keep)
        self._applied.extend(keep, self.round)
        self._applied.freeze(self.round)

    def set_standing(self, after: Standing) -> list[bytes]:
        """Move to the judgement `after`: applied updates that no longer count (a newly banned
        peer's) are taken back (negated) and kept waiting; waiting updates that count in the
        settled state we hold (a vouch or establishment whose record reached us after the
        round it takes effect in, an unbanned peer's) are applied, as late rows: their
        arrival is now (audits then know a sender may have lacked them). Those that count
        from a later round wait for it (`take_settled`). Returns the newly banned peers."""
        if self.standing is not None and after.enabled:
            for peer in sorted(after.established - self.standing.established):
                log.info(
                    "probation: peer %s established (%d vouched updates)",
                    peer_name(peer),
                    sum(1 for (p, _) in after.vouched if p == peer),
                    extra={"fields": {"event": "established", "peer": peer_name(peer)}},
                )
        revoked_before = self.standing.revoked if self.standing is not None else {}
        self.standing = after
        self._span = after.span(self.round - self.settings.lag)
        drop = self._applied.take_back(self._counts_now, self._may_stop_counting())
        for peer, round_ in sorted(after.revoked.items()):
            if revoked_before.get(peer) != round_:
                log.warning(
                    "ticket revocation: peer %s's updates of rounds >= %d do not count; %d "
                    "applied update(s) taken back",
                    peer_name(peer),
                    round_,
                    sum(1 for m in drop if m.peer == peer and m.round >= round_),
                    extra={"fields": {"event": "ticket_revoked", "peer": peer_name(peer),
                                      "round": round_}},
                )  # fmt: skip
        add = [m for m in self.waiting if self.is_counted(m)]
        newly = sorted(p for p in after.banned if p not in self.banned)
        for peer in newly:
            log.warning(
                "audit verdict: peer %s banned (%s); %d applied update(s) taken back",
                peer_name(peer),
                after.banned[peer],
                sum(1 for m in drop if m.peer == peer),
                extra={"fields": {"event": "audit_ban", "peer": peer_name(peer)}},
            )
        self.banned = dict(after.banned)
        if drop:
            self.waiting.extend(m for m in drop if not self._revoked(m))  # those never count
        self.waiting = [m for m in self.waiting if not self._revoked(m)]
        if add:
            self.waiting = [m for m in self.waiting if not self.is_counted(m)]
            self._applied.extend(add, self.round)
            for m in add:
                self.rewind.arrived_late((m.peer, m.round), self.round)
            self.counts["counted_late"] += len(add)
        self.live.apply([m.negated() for m in drop] + add)
        return newly

    def set_banned(self, after: dict[bytes, str]) -> list[bytes]:
        """`set_standing` without probation: only bans change what counts."""
        from seedflood_p2p.algorithm.audit_rules import Judgement

        return self.set_standing(
            Standing(
                False,
                frozenset(),
                frozenset(),
                {},
                {},
                Judgement(dict(after), []),
                lag=self.settings.lag,
            )
        )

    def audit(self, jobs: list[tuple[bytes, int, str, tuple]], engine, tokenizer, task) -> list:
        """Recompute each job (peer, round, why, claimed scalars) on its settled state;
        returns the records to publish, (record, mismatch), for a mismatch or a re-check
        (a vote either way)."""
        out = []
        rule = self.settings.rule
        for peer, round_, why, claimed in jobs:
            if peer in self.banned:  # banned since `ready` handed it out: dropped, not run
                self.counts["skipped"] += 1
                continue
            message = UpdateMessage(round_, peer, claimed)

            def compute(m=message):
                return self._recompute(m, engine, tokenizer, task)

            # The sender's held-state digest, S_t, then the states it may have lacked rows
            # of (`StateRewind.recompute`). Probation work pays for its retries.
            held = decode_held(self.ledger.payload_of(peer, round_))
            paid = self._is_probation_work(peer, why)
            # A peer that signed two updates for one round (we hold a losing copy, with
            # its signature's weight behind it: no one else can make one) is not honest:
            # its mismatches get no retries (issue 45: 20 equivocators' twins cost the
            # founders 92-112 retries and a third of their rounds).
            retries = 0 if self.ledger.has_losing_copies(peer) else None
            rebuilt = self.rewind.recompute(
                peer,
                round_,
                claimed,
                held,
                self.applied,
                self.waiting,
                compute,
                rule.mismatches,
                retries if retries is not None else PROBATION_LATE_STATES if paid else None,
            )
            self.counts["equivocator_audits"] += retries is not None
            recomputed = rebuilt.recomputed
            if rebuilt.held is not None:
                self.counts[f"held_{rebuilt.held}"] += 1
            if rebuilt.retries:
                self.counts["late_state_retries"] += rebuilt.retries
                self.counts["swap_retries"] += rebuilt.swaps  # (of them: `swap_states`)
                if paid:  # repaid from later rounds' budget (`ProbationQueue.earn`)
                    self.queue.pay_retries(rebuilt.retries)
                    self.counts["probation_retries"] += rebuilt.retries
            if rebuilt.matched is not None:
                self.counts["late_state_matches"] += 1
                self.late_matches[rebuilt.matched] += 1
            self.done.add((peer, round_))
            mismatch = rule.mismatches(claimed, recomputed)
            self.counts["audits"] += 1
            self.counts["mismatches"] += mismatch
            st = self.standing
            vouch = st is not None and st.enabled and peer in st.probationers  # a match vouches
            if mismatch or why in ("recheck", "probation") or vouch:
                record = AuditRecord(peer, round_, self.peer_id, recomputed, self.round)
                out.append((record, mismatch))
        return out

    def self_check(
        self,
        trained_round: int,
        engine,
        tokenizer,
        task,
        exclude: frozenset[bytes] = frozenset(),
        most: int = SELF_CHECKS,
    ) -> tuple[int, int]:
        """Does our model make what the run makes? Recompute up to `most` recent updates of
        distinct other peers that count, each on the states its sender may have trained on,
        as an audit does but with no record, no vote and no count; (matched, recomputed).
        A joiner restored from a link peers offered runs it before it trains: weights its
        rows do not make would have its own updates convicted.

        Whose updates: not those of `exclude` (the link's offerers: colluders could
        publish updates made on their own forged weights) unless nobody else's can be
        checked, nor of a peer any record accuses; under probation only established
        peers', founders first; the rest drawn at random with this process's own
        randomness, not by recency, so a few fresh keys cannot choose to be the ones
        checked."""
        st, rule = self.standing, self.settings.rule
        accused = {
            r.accused
            for r in self.ledger.audits()
            if (claimed := self.ledger.scalars_of(r.accused, r.round)) is not None
            and rule.mismatches(claimed, r.scalars)
        }
        low = max(0, trained_round - MAX_REWIND)
        recent = (
            m
            for round_ in range(trained_round - self.delay, low - 1, -1)
            for m in self.ledger.messages(round_, round_)
        )
        skip = accused | set(self.banned) | {self.peer_id}
        jobs = choose_self_checks(recent, st, skip, exclude, most, random.SystemRandom())
        matched = 0
        for m in jobs:
            rebuilt = self.rewind.recompute(
                m.peer,
                m.round,
                m.scalars,
                decode_held(self.ledger.payload_of(m.peer, m.round)),
                self.applied,
                self.waiting,
                lambda m=m: self._recompute(m, engine, tokenizer, task),
                rule.mismatches,
            )
            matched += not rule.mismatches(m.scalars, rebuilt.recomputed)
        return matched, len(jobs)

    def _is_probation_work(self, peer: bytes, why: str) -> bool:
        """Is an audit of `peer`'s update paid from the verification budget: a probation
        audit, or a re-check of a probationer's update (`ready`)?"""
        st = self.standing
        probationer = st is not None and st.enabled and peer in st.probationers
        return why == "probation" or (why == "recheck" and probationer)

    # -- the settled state of a round (`StateRewind`) --------------------------------
    def _counts_in(self, peer: bytes, round_: int, limit: int) -> bool:
        """Does (peer, round_) count in the settled state of rows of rounds < `limit`, by
        the ledger's judgement as we last read it (`Standing.counts_at`)?"""
        st = self.standing
        if st is None:
            return peer not in self.banned
        return st.counts_at(peer, round_, limit)

    def _late_states(self, peer: bytes, round_: int) -> list[tuple[str, list[UpdateMessage]]]:
        """Sets of updates of S_round the sender of (peer, round_) may not have held when it
        trained, most likely first (`late_states`)."""
        return self.rewind.late_states(peer, round_, self.applied, self.waiting)

    def _on_settled(self, round_: int, counted_too: list[UpdateMessage], compute):
        """`compute()` on S_round plus `counted_too` (`StateRewind.on_settled`)."""
        return self.rewind.on_settled(round_, self.applied, self.waiting, counted_too, compute)


def choose_self_checks(
    recent: Iterable[UpdateMessage],
    standing: Standing | None,
    skip: set[bytes],
    exclude: frozenset[bytes],
    most: int,
    draw: random.Random,
) -> list[UpdateMessage]:
    """The updates `PeerAudits.self_check` recomputes: of `recent` (newest rounds first),
    each peer's newest that counts, none of `skip`; under probation only established
    peers', founders first; the rest in `draw`'s random order; none of `exclude` (a link's
    offerers) unless nobody else has one. At most `most`."""
    probation = standing is not None and standing.enabled
    chosen: dict[bytes, UpdateMessage] = {}
    for m in recent:
        if m.peer in skip or m.peer in chosen:
            continue
        if standing is not None and not standing.counts(m.peer, m.round):
            continue
        if probation and m.peer not in standing.established:
            continue
        chosen[m.peer] = m
    founders = standing.founders if probation else frozenset()
    order = sorted(chosen.values(), key=lambda m: (m.peer not in founders, draw.random()))
    others = [m for m in order if m.peer not in exclude]
    return (others or order)[:most]


class DaemonAudits:
    """The peer daemon's audit work on its event loop, around `PeerAudits` (model thread):
    draws on accepted updates, the round's recomputations published, the ledger judged
    after new audit records, the audit gauges and status.

    `run`: runs a function on the model thread; `peers_alive`: live peers besides us;
    `on_ban(peer)`: a peer the ledger's judgement newly bans (the daemon disconnects it)."""

    def __init__(
        self,
        audits: PeerAudits,
        metrics,
        run: Callable[..., Awaitable],
        peers_alive: Callable[[], int],
        on_ban: Callable[[bytes], None] = lambda peer: None,
    ) -> None:
        self.audits = audits
        self.metrics = metrics  # network/monitoring/metrics.py:NodeMetrics
        self.run = run
        self.peers_alive = peers_alive
        self.on_ban = on_ban
        self._alive = (-float("inf"), 0)  # (monotonic time, peers_alive()) last counted
        # One judgement at a time: records that arrive during one are judged together in
        # the next pass (`request_judgement`), so a burst of records, or a key that floods
        # them, costs one pass over the ledger, not one each.
        self._judging: asyncio.Future | None = None
        self._stale = False
        # Cleared while the weights stand on a trusted link that a judgement no longer
        # lets them stand on (`PeerAudits.below_link`): the rounds wait (peer/rounds.py)
        # until the history is in and the model rebuilt (peer/latejoin.py), since what
        # this peer trained meanwhile would be convicted by every auditor.
        self.settled = asyncio.Event()
        self.settled.set()

    @property
    def standing(self) -> Standing | None:
        """What counts, as this peer last judged the ledger (`PeerAudits.standing`): the
        daemon reads bans and revocations from it."""
        return self.audits.standing

    def live_count(self) -> int:
        """`peers_alive()`, counted at most once per LIVE_COUNT_SECONDS."""
        now = time.monotonic()
        at, alive = self._alive
        if now - at >= LIVE_COUNT_SECONDS:
            alive = self.peers_alive()
            self._alive = (now, alive)
        return alive

    def accept(self, messages: list[UpdateMessage]) -> None:
        """The flood node's `on_accept`: pending in the live model, then drawn for audit."""
        self.audits.live.receive(messages)
        self.audits.on_accept(messages, self.live_count() + 1)

    async def on_records(self, fresh: list[AuditRecord]) -> None:
        """The flood node's `on_audit_records`: audit records new to the ledger, from gossip
        or repair (the node admitted and counted them): re-checks queued, the ledger judged."""
        self.audits.note_records(fresh)
        self.request_judgement()  # not awaited: the next records join a pass still to come

    async def run_round(self, round_: int, node, engine, tokenizer, task) -> None:
        """Recompute the updates due for audit (the model holds S of `round_`), publish
        our mismatches and re-check votes through `node` (the flood node), and act on what
        the ledger now decides."""
        audits = self.audits
        if audits.unknown_peers:  # newcomers: on probation once the standing knows them
            audits.unknown_peers = False
            await self.judge()
        jobs = audits.ready(round_)
        if not jobs:
            return
        results = await self.run(audits.audit, jobs, engine, tokenizer, task)
        run_id = node.run_id
        for record, _mismatch in results:
            node.audits.own(record)
            data = encode_audit(run_id, record.accused, record.round, record.scalars, record.at)
            await node.publish_on(audit_topic_for(run_id), data)
            audits.counts["published"] += 1
        if results:
            await self.judge()
        self.status(dict(node.audits.counts))  # the /metrics gauges

    def request_judgement(self) -> asyncio.Future:
        """Judge the ledger as it is now, soon: one pass if none is running, else one more
        pass after the running one (however many ask meanwhile). Returns the passes' task,
        done once a pass that began after this call has ended."""
        self._stale = True
        if self._judging is None:
            self._judging = asyncio.ensure_future(self._judge_while_stale())
            self._judging.add_done_callback(_log_judgement_failure)
        return self._judging

    async def _judge_while_stale(self) -> None:
        try:
            while self._stale:
                self._stale = False
                await self._judge_once()
        finally:
            self._judging = None

    async def judge(self) -> None:
        """`request_judgement`, waited for: the standing holds every record the ledger held
        when called."""
        await asyncio.shield(self.request_judgement())

    async def _judge_once(self) -> None:
        """Judge the ledger (here, where the ledger is written); take back a newly banned
        peer's updates (model thread); its later ones are never applied.

        The ban store is NOT told: the admission keeps logging a convicted peer's updates
        (void in every judgement). A sender that had not learned of the verdict yet still
        counted them in its settled state, and an auditor must hold them to rebuild that
        state: when verdicts went to the ban store, auditors dropped them and convicted
        every honest peer that trained around the bans (bench/results/audit_daemon.md).
        The daemon only disconnects it (`on_ban`) and stops waiting for it, asking it for
        repair and auditing it: its rows still reach us, relayed by others or repaired."""
        audits = self.audits
        # Read here, where the ledger is written; judged in a thread: at a hundred thousand
        # records a judgement is seconds of CPU (bench/results/judge-scale.md), which on the
        # event loop stalled gossip, repair and the rounds for as long.
        generation = audits.generation
        inputs = audits.read_inputs()
        after = await asyncio.to_thread(audits.judge_of, inputs)
        if audits.generation != generation:  # read before a summary or account changed
            self._stale = True  # judged again, from what stands now
            return
        if audits.below_link is not None and self.settled.is_set():
            why = audits.below_link(after)
            if why is not None:
                self.settled.clear()
                log.warning(
                    "the trusted link no longer holds what counts below its round (%s): "
                    "not training until its history is in",
                    why,
                    extra={"fields": {"event": "trust_paused", "why": why}},
                )
        before = audits.standing
        if (
            before is not None
            and after.banned == before.banned
            and after.established == before.established
            and after.probationers == before.probationers
            and after.vouched.keys() == before.vouched.keys()
            and after.vouched_at == before.vouched_at
            and after.steps == before.steps
            and after.bans == before.bans
            and after.revoked == before.revoked
        ):
            return
        newly = await self.run(audits.set_standing, after)
        # A ban acts at once: its queued audits are dropped here (`audit` skips any that
        # `ready` handed out meanwhile), and the daemon disconnects it; Pacing and repair
        # read `banned` at each use.
        dropped = [key for key in audits.due if key[0] in audits.banned]
        for key in dropped:
            del audits.due[key]
        audits.counts["skipped"] += len(dropped)
        for peer in newly:
            self.on_ban(peer)
        self.status()  # the /metrics gauges

    def status(self, records: dict | None = None) -> dict:
        """Audits done, mismatches found, verdicts in the ledger, peers it bans; sets the
        audit gauges. `records`: the flood node's audit record counts by outcome."""
        audits, m = self.audits, self.metrics
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
                **{
                    k: audits.counts[k]
                    for k in ("late_state_retries", "late_state_matches", "swap_retries")
                },
                "matched_by_kind": dict(sorted(audits.late_matches.items())),
            },
            # audits by the sender's held-state digest: its state was the settled one
            # ("exact"), rebuilt without the rows it lacked ("found"), or not explained
            "held_state": {k: audits.counts[f"held_{k}"] for k in ("exact", "found", "unknown")},
            "records": dict(records or {}),
            "verdicts": audits.verdicts,
            "banned": sorted(peer_name(p) for p in audits.banned),
            "rate": audits.rate,
            "cpu_seconds": {k: round(v, 3) for k, v in sorted(audits.cpu_seconds.items())},
        }


def _log_judgement_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("judging the ledger failed: %r", task.exception(), exc_info=task.exception())
