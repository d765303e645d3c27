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

An audit of (p, t) recomputes on S_t. The model holds S_r for the round r we trained
last (r >= t), so the updates it applied of rounds t - lag .. r - lag - 1 are taken
back for the recomputation (and the updates of peers banned since put in), and the exact
weights put back afterwards (a copy, not a re-addition: the live model must not drift by
rounding). Bans are timed like vouches (`probation.Standing.bans`): S_t's banned set is
the judgement of the ledger prefix a sender training t held, so the sender and its
auditors agree on it and no auditor guesses which bans a sender knew. A mismatch is
retried on the states the sender may honestly have trained on instead: before the
settled updates that reached us last had reached it (`_late_states`); any match is a
match. Each retry is one more recomputation, at most MAX_LATE_STATES per audit. Since
protocol version 3 an update carries the digest of the rows its sender held
(`protocol/held_state.py`): the auditor rebuilds that state and tries it first, so an
honest sender that lacked rows is matched by the first recomputation; a mismatch there
still tries S_t and the guessed states.

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
audits take at most `share` audits a round (`probation_jobs`, docs/SYBIL.md).

Limits (docs/ROADMAP.md): an update older than MAX_REWIND rounds is not
audited.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from itertools import count

from seedflood_p2p.algorithm.audit_rules import audit_draw, audit_rate, recompute, selects
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.prefix_cache import ExamplePrefixCache
from seedflood_p2p.algorithm.probation import NEVER, Standing, revoked_rounds, standing
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.core.rng import derive_key
from seedflood_p2p.network.gossip.audit_intake import AuditIntake
from seedflood_p2p.protocol.audit_record import audit_topic_for, encode_audit
from seedflood_p2p.protocol.held_state import MASK, find_missing, row_hash
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.protocol.update import decode_held
from seedflood_p2p.storage.ledger import Ledger, peer_name

log = logging.getLogger("seedflood.audit")

MAX_REWIND = 30  # rounds: an update older than this (behind our model) is not audited
MAX_LATE_STATES = 8  # states without the latest-arrived settled rows a mismatch retries
# ... of a probationer's update: each retry is paid from the verification budget like an
# audit (so `share` bounds the compute), and fresh keys are free, so fewer: 20 keys that
# negate cost a founder 3 budget units each, not 9 (bench/results/sybil_daemon_n20*.md).
PROBATION_LATE_STATES = 2
HELD_WINDOW = 2 * MAX_REWIND  # rounds of a state searched for the rows a sender lacked
ARRIVALS_KEPT = 4096  # arrival order of this many latest updates (others count as old)
# Seconds a count of live peers serves `DaemonAudits.accept` (the audit sampling rate):
# counting is O(peers), 0.7 ms at 10,000, once per admitted batch before; liveness itself
# moves on the scale of the liveness timeout (60 s), and draws are our own choice.
LIVE_COUNT_SECONDS = 1.0


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
        self.tokens = 0.0  # probation audits we may still do (the verification budget)
        self.backlog = 0  # probationers' updates due for a probation audit we had no budget for
        self.waiting_peers = 0  # probationers with such updates
        # Probation audits we spent on each probationer (`probation_jobs` serves the least
        # served first); a key leaves when it stops being a probationer.
        self.served: Counter[bytes] = Counter()
        self.secret = secret  # our private draw: a sender cannot predict its auditors
        self.peer_id = peer_id
        self.ledger = ledger
        self.live = live
        self.intake = intake  # the flood node's (None in the daemon: DaemonAudits uses it)
        self.applied: list[UpdateMessage] = []  # what the weights hold, in order applied
        # The bans of the state the weights were last checked against (`_bans_moved`).
        self._span: object | None = None
        self.banned: dict[bytes, str] = {}  # the ledger's judgement: peer -> why
        self.due: dict[tuple[bytes, int], str] = {}  # (peer, round) -> "draw" | "recheck"
        self.done: set[tuple[bytes, int]] = set()
        # When each update reached us (our training round then, and a counter in
        # acceptance order; ours when we published it): the rows of a settled state that
        # came later here than a sender's update are the ones it most likely did not have
        # yet when it trained (`_late_states`).
        self.arrival: dict[tuple[bytes, int], tuple[int, int]] = {}  # (our round, order)
        self.round = 0  # the round we are training (take_settled)
        self._clock = count()
        self.held = HeldDigests()  # the held-state digests of our weights and senders' states
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

    # -- where updates are accepted (event loop) -----------------------------------
    def on_accept(self, messages: list[UpdateMessage], peers: int) -> None:
        """Draw audits among just-accepted updates of others (`peers`: the run's size
        as we see it, for the sampling rate)."""
        self.rate = audit_rate(peers, self.settings.cpu_share)
        st = self.standing
        for m in messages:
            key = (m.peer, m.round)
            self.arrival.setdefault(key, (self.round, next(self._clock)))
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
        if len(self.arrival) > 2 * ARRIVALS_KEPT:  # only the latest arrivals are ever asked for
            newest = sorted(self.arrival.items(), key=lambda kv: kv[1])[-ARRIVALS_KEPT:]
            self.arrival = dict(newest)

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
        if self.standing is None:
            return message.peer not in self.banned
        return self.standing.counts_at(message.peer, message.round, self.round - self.settings.lag)

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
        claims = {(m.round, m.peer): m.scalars for m in self.ledger.messages()}
        revoked = revoked_rounds(self.ledger.revocations())  # ticket revocations
        after = standing(claims, self.ledger.audits(), self.settings, self.probation, revoked)
        self.verdicts = sum(1 for c in after.judgement.cases if c.outcome != "open")
        return after

    def _earn_tokens(self, st: Standing | None) -> None:
        """One round's verification budget: `share` audits (an audit, or a retry of one on a
        late state, costs one training step), for an established peer only; at most two
        rounds' worth saved up. Retries may leave it below 0: later rounds repay that."""
        if st is None or not st.enabled or self.peer_id not in st.established:
            return
        share = self.probation.share
        self.tokens = min(self.tokens + share, max(1.0, 2 * share))

    def probation_status(self) -> dict | None:
        """Probation as this peer sees it (None: the run has no founders, probation off)."""
        st = self.standing
        if st is None or not st.enabled:
            return None
        return {
            "established": len(st.established),
            "founders": len(st.founders),
            "earned": len(st.since),
            "on_probation": len(st.probationers),
            "vouched_updates": len(st.vouched),
            "waiting_updates": sum(1 for m in self.waiting if m.peer not in self.banned),
            "counted_late": self.counts["counted_late"],  # records that reached us late
            "counted_on_time": self.counts["counted_on_time"],  # at their effective round
            "probation_audits": self.counts["probation_audits"],
            "probation_retries": self.counts["probation_retries"],  # paid like audits
            "backlog": self.backlog,
            "backlog_peers": self.waiting_peers,
            "share": self.probation.share,
            "vouches": self.probation.vouches,
            "we_are": "established" if self.peer_id in st.established else "on probation",
        }

    def probation_jobs(self, trained_round: int) -> list[tuple]:
        """Probation audits for this round, within the verification budget: `share` audits
        a round (an audit costs one training step), only by an established peer. The
        probationers' unvouched updates that are due (old enough, see `ready`; young
        enough to rewind to) are served fairly: one at a time to the probationer we spent
        the fewest probation audits on so far (`served`: round-robin across rounds, so a
        newcomer never queues behind keys that came earlier), ties broken by a draw with
        our secret (auditors spread differently), each one's updates in an order drawn with
        our secret (so auditors spread over different updates); the rest wait (kept,
        counted in `backlog`). Local scheduling only: which audits we do, not what counts."""
        st = self.standing
        if st is None or not st.enabled or self.peer_id not in st.established:
            self.backlog = self.waiting_peers = 0
            return []
        low, high = max(0, trained_round - MAX_REWIND), trained_round - self.delay
        if high < low or not st.probationers:
            self.backlog = self.waiting_peers = 0
            return []
        for peer in set(self.served) - st.probationers:  # established or banned since
            del self.served[peer]
        due: dict[bytes, list[UpdateMessage]] = {}
        for m in self.ledger.messages(low, high):
            key = (m.peer, m.round)
            if m.peer in st.probationers and key not in st.vouched and key not in self.done:
                due.setdefault(m.peer, []).append(m)
        run_key = self.live.config.run_key
        for updates in due.values():  # popped from the end: lowest draw first
            updates.sort(key=lambda m: audit_draw(self.secret, run_key, m.peer, m.round))
            updates.reverse()
        # the tie draw: ours, and fresh each round (a tie is not always won by one key)
        queue = [
            (
                self.served[p],
                derive_key("seedflood/probation-tie", self.secret, run_key, p, trained_round),
                p,
            )
            for p in due
        ]
        heapq.heapify(queue)
        jobs, budget = [], max(0, int(self.tokens))  # below 0: retries still being repaid
        while queue and len(jobs) < budget:
            served, tie, peer = heapq.heappop(queue)
            m = due[peer].pop()
            self.done.add((m.peer, m.round))
            self.served[peer] += 1
            jobs.append((m.peer, m.round, "probation", m.scalars))
            if due[peer]:
                heapq.heappush(queue, (served + 1, tie, peer))
        self.tokens -= len(jobs)
        self.counts["probation_audits"] += len(jobs)
        self.backlog = sum(len(updates) for updates in due.values())
        self.waiting_peers = sum(1 for updates in due.values() if updates)
        return jobs

    def ready(self, trained_round: int) -> list[tuple]:
        """Audits to do now: updates of rounds <= trained_round - `delay` (the model holds S
        of trained_round), each (peer, round, why, claimed scalars).

        Why wait: the sender's settled state counts the updates and the records (vouches,
        bans) of its settled prefix. After `delay` rounds we hold what it held."""
        out = []
        st = self.standing
        probationers = st.probationers if st is not None and st.enabled else frozenset()
        self._earn_tokens(st)
        for (peer, round_), why in sorted(self.due.items(), key=lambda kv: kv[0][1]):
            if round_ > trained_round - self.delay:
                continue
            if why == "recheck" and peer in probationers and trained_round - round_ <= MAX_REWIND:
                # a re-check of a probationer's update is probation work: within the budget
                # (its unvouched updates do not count meanwhile; it waits, as they do)
                if self.tokens < 1:
                    continue
                self.tokens -= 1
                self.counts["probation_audits"] += 1
                self.served[peer] += 1
            del self.due[(peer, round_)]
            if trained_round - round_ > MAX_REWIND or peer in self.banned:
                self.counts["skipped"] += 1
                continue
            claimed = self.ledger.scalars_of(peer, round_)
            if claimed is None:
                continue
            out.append((peer, round_, why, claimed))
        return out + self.probation_jobs(trained_round)

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

    def held_digest(self) -> int:
        """The digest of the rows the weights hold (`applied`)."""
        return self.held.of(self.applied)

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
            drop = [m for m in self.applied if not self.is_counted(m)]
            if drop:
                self.applied = [m for m in self.applied if self.is_counted(m)]
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
        self.applied.extend(keep)

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
        drop = [m for m in self.applied if not self.is_counted(m)]
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
            self.applied = [m for m in self.applied if self.is_counted(m)]
            self.waiting.extend(m for m in drop if not self._revoked(m))  # those never count
        self.waiting = [m for m in self.waiting if not self._revoked(m)]
        if add:
            self.waiting = [m for m in self.waiting if not self.is_counted(m)]
            self.applied.extend(add)
            for m in add:
                self.arrival[(m.peer, m.round)] = (self.round, next(self._clock))
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

            # The sender may have trained before a settled update reached it (a peer that
            # fell behind, e.g. a laptop that slept, publishes its rounds late; nobody waits
            # for it past --round-deadline). Its update says which rows it held (a digest,
            # protocol/held_state.py): that state, rebuilt, is tried first. A mismatch there
            # still tries S_t and the states without the updates it most likely lacked
            # (`_late_states`): the digest adds a state, never removes one, so a sender that
            # sends two copies with different digests to different peers cannot make an
            # auditor accuse where others match. Probation work pays for its retries.
            held = decode_held(self.ledger.payload_of(peer, round_))
            missing = None if held is None else self._held_missing(peer, round_, held)
            if held is not None:
                self.counts[
                    "held_unknown" if missing is None else "held_found" if missing else "held_exact"
                ] += 1
            # reversed: an equivocation's rows (original, its negation, the replacement)
            # come out in the order applied, so a round-sized rule's sizes unwind cleanly
            first = [m.negated() for m in reversed(missing or [])]
            recomputed = self._on_settled(round_, first, compute)
            states = ([("settled", [])] if first else []) + self._late_states(peer, round_)
            paid = self._is_probation_work(peer, why)
            for kind, late in states[:PROBATION_LATE_STATES] if paid else states:
                if not rule.mismatches(claimed, recomputed):
                    break
                self.counts["late_state_retries"] += 1
                if paid:
                    self.tokens -= 1  # repaid from later rounds' budget (`_earn_tokens`)
                    self.counts["probation_retries"] += 1
                without = self._on_settled(round_, [m.negated() for m in late], compute)
                if not rule.mismatches(claimed, without):
                    recomputed = without
                    self.counts["late_state_matches"] += 1
                    self.late_matches[kind] += 1
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

    def _held_missing(self, peer: bytes, round_: int, held: int) -> list[UpdateMessage] | None:
        """The updates of S_round the sender of (peer, round_) lacked by its held-state
        digest `held` ([]: none), or None if no honest pattern explains it."""
        since = round_ - self.settings.lag - HELD_WINDOW
        return self.held.missing(self._state(round_), held, peer, since)

    def _is_probation_work(self, peer: bytes, why: str) -> bool:
        """Is an audit of `peer`'s update paid from the verification budget: a probation
        audit, or a re-check of a probationer's update (`ready`)?"""
        st = self.standing
        probationer = st is not None and st.enabled and peer in st.probationers
        return why == "probation" or (why == "recheck" and probationer)

    def _late_states(self, peer: bytes, round_: int) -> list[tuple[str, list[UpdateMessage]]]:
        """Sets of updates of S_round the sender of (peer, round_) may not have held when it
        trained, most likely first (`late_states`)."""
        return late_states(self._state(round_), self.arrival, peer, round_)

    def _in_state(self, message: UpdateMessage, round_: int) -> bool:
        """Is update `message` in S_round: of a round < round_ - lag, and counted there (not
        banned there; a vouch or an establishment that took effect by then, `counts_at`)?"""
        limit = round_ - self.settings.lag
        if message.round >= limit:
            return False
        st = self.standing
        if st is None:
            return message.peer not in self.banned
        return st.counts_at(message.peer, message.round, limit)

    def _state(self, round_: int) -> list[UpdateMessage]:
        """The updates of S_round: applied ones, and waiting ones that counted then and not
        now (a peer banned since, or a vouch it lost with its voucher's ban)."""
        return [m for m in self.applied + self.waiting if self._in_state(m, round_)]

    def _on_settled(self, round_: int, counted_too: list[UpdateMessage], compute):
        """`compute()` on S_round (plus `counted_too`): take back the applied updates that
        are not in S_round (of rounds >= round_ - lag, or counted from a later round), put
        in the waiting ones that are (a peer banned since), compute, put the exact weights
        back."""
        newer = [m for m in self.applied if not self._in_state(m, round_)]
        older = [m for m in self.waiting if self._in_state(m, round_)]
        if not newer and not older and not counted_too:
            return compute()
        saved = self.live.save_state()
        try:
            self.live.apply([m.negated() for m in newer] + older + counted_too)
            return compute()
        finally:
            self.live.load_state(saved)


class HeldDigests:
    """Held-state digests (`protocol/held_state.py`): of the rows our weights hold, kept up
    to date as rows are applied, and the search for the rows a sender's digest says it
    lacked. Each row's hash is computed once."""

    def __init__(self) -> None:
        self._hashes: dict[tuple[bytes, int], int] = {}  # row_hash of each row met
        self._memo: tuple | None = None  # (applied list, rows summed, keys, digest)

    def of(self, applied: list[UpdateMessage]) -> int:
        """The digest of the rows `applied` (one hash per (peer, round), so an
        equivocation's swap, three rows applied for one key, counts once). Kept up to date
        from the rows appended since the last call; a list rebuilt (a ban took rows back, a
        restore) is summed again."""
        memo = self._memo
        if memo is not None and memo[0] is applied and memo[1] <= len(applied):
            _, start, keys, total = memo
        else:
            start, keys, total = 0, set(), 0
        for m in applied[start:]:
            key = (m.peer, m.round)
            if key not in keys:
                keys.add(key)
                total = (total + self._row_hash(key)) & MASK
        self._memo = (applied, len(applied), keys, total)
        return total

    def missing(
        self, state: list[UpdateMessage], held: int, peer: bytes, since: int
    ) -> list[UpdateMessage] | None:
        """The updates of `state` that the sender of `peer`'s update lacked by its digest
        `held` ([]: none), or None if no honest pattern explains it
        (`held_state.find_missing`; rows of rounds before `since` are not searched)."""
        hashes = {(m.peer, m.round): self._row_hash((m.peer, m.round)) for m in state}
        keys = find_missing(hashes, held, peer, since)
        if keys is None:
            return None
        lacked = set(keys)
        return [m for m in state if (m.peer, m.round) in lacked]

    def _row_hash(self, key: tuple[bytes, int]) -> int:
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = row_hash(*key)
        return h


def late_states(
    state: list[UpdateMessage],
    arrival: Mapping[tuple[bytes, int], tuple[int, int]],
    peer: bytes,
    round_: int,
) -> list[tuple[str, list[UpdateMessage]]]:
    """Sets of updates of S_round the sender of (peer, round_) may not have held when it
    trained, most likely first, at most MAX_LATE_STATES.

    Updates spread to everyone in about the same order, and each peer's in round
    order. So the sender most likely lacked the updates of S_round that reached us in
    a later round of ours than its update did (`after`); of those that reached us in
    the same round (`tied`: a burst, e.g. after we slept), it may have lacked the
    latest rounds of one other peer: all of them, or its newest 1, 2, ... (peers with
    updates in `after` first: a straggler); and it may have got the first one or two
    of `after` just before it trained. Last, the newest-arrived 1, 2, ... updates. Its
    own updates it held; one without an arrival stamp (restored at start) counts as old;
    a peer banned in S_round has none there (bans are timed, `probation.Standing.counts_at`).

    Rows that count by a vouch or an establishment (on probation) need no retry of
    their own: they are in S_round only from the round their record takes effect in
    (`probation.Standing.count_from`), which the sender held as it held the rows; one
    whose record reached us late was applied as a late row (its arrival is then).

    Each state comes with its kind ("after", "straggler", "first-of-after",
    "straggler-newest", "newest"): `late_matches` counts which kinds matched, the data
    to cut retries on (every mismatch, a cheater's too, tries up to MAX_LATE_STATES)."""
    settled = {(m.peer, m.round): m for m in state if m.peer != peer}
    stamped = sorted(((arrival[key], key) for key in settled if key in arrival), reverse=True)
    heard = arrival.get((peer, round_))
    after = [settled[key] for stamp, key in stamped if stamp[0] > heard[0]] if heard else []
    candidates: list[tuple[str, list[UpdateMessage]]] = []
    if heard is not None:
        tied: dict[bytes, list[UpdateMessage]] = {}
        for _, key in sorted((k[1], k) for stamp, k in stamped if stamp[0] == heard[0]):
            tied.setdefault(key[0], []).insert(0, settled[key])  # newest round first
        stragglers = sorted(tied, key=lambda q: -sum(m.peer == q for m in after))
        candidates.append(("after", after))
        candidates += [("straggler", after + tied[q]) for q in stragglers]
        # ... or it got the first of `after` just before it trained (newest first)
        candidates += [("first-of-after", after[:-j]) for j in (1, 2) if len(after) > j]
        most = min(MAX_LATE_STATES, max((len(rows) for rows in tied.values()), default=0))
        candidates += [
            ("straggler-newest", after + tied[q][:j]) for q in stragglers for j in range(1, most)
        ]
    # Last, the newest-arrived 1, 2, ... (a sender whose wait for holes ran out, or one
    # that lost gossip). While these were cut to 2 for a known arrival (1dcc5ba), an
    # honest peer dropping 30% of gossip was banned in 1 of 3 CI runs of
    # tests/test_round_mean_daemon.py: a false conviction costs the run an honest peer,
    # a cheater's retries only CPU (a probationer's are few and paid, above).
    newest = [settled[key] for _, key in stamped[:MAX_LATE_STATES]]
    candidates += [("newest", newest[:j]) for j in range(1, len(newest) + 1)]
    states, seen = [], set()
    for kind, rows in candidates:
        key = frozenset((m.peer, m.round) for m in rows)
        if rows and key not in seen:
            seen.add(key)
            states.append((kind, rows))
        if len(states) == MAX_LATE_STATES:
            break
    return states


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
        await self.judge()

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

    async def judge(self) -> None:
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
        after = audits.judge()
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
                **{k: audits.counts[k] for k in ("late_state_retries", "late_state_matches")},
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
