"""Probation: a new identity's updates count only once established peers have matched them.

Identities are free (an Ed25519 key), so a rule per identity (window, rate, score, the
audit draw) bounds one key, not one attacker. Probation makes an identity's influence
cost verified work instead: an update of an identity that is not established counts for
the model only when an established peer has recomputed it and published a match (a
*vouch*: an audit record whose scalars match the claim, `AuditRule`). An identity
becomes established after `vouches` of its updates were vouched, each by an already
established auditor; from then on its updates of later rounds count without a vouch
(audits sample them as anyone's). The seed set is the run creator's: the manifest's
`extra.probation.founders` and its `allow_peers`.

Everything is a pure function of the ledger's updates and audit records (`standing`),
like `audit.judge`, so every peer and every replay agree on which updates count,
whatever order updates and records arrived in:

    1. E = least fixpoint from the founders: p joins E when >= `vouches` of its updates
       carry a match record of an auditor in E. Monotone, so the result does not depend on
       the order records are looked at. A cartel of probationers cannot vouch for itself:
       a match counts only if its auditor is already in E, and nobody outside E can enter
       E without `vouches` matches from inside it.
    2. The audit verdicts (`judge`) with only the auditors in E voting: a thousand fresh
       keys outvote nobody. The founders are the court: a case any founder voted on is
       decided by the founders' votes alone, and a confirmed case also bans the earned
       identities that matched the cheat (a false vouch costs its author). So identities
       that earned their standing and then turn (or vouch for a fellow's cheat) cannot
       outvote the founders once those re-check, and lose their vouches when caught.
    3. E again without the banned peers (neither as members nor as vouchers): a peer
       convicted later takes its vouches with it.

Update (p, t) counts iff p is not banned and p is a founder, or (p, t) is vouched, or
p is established and t > since[p], the round of p's `vouches`-th vouched update. So an
established identity's unverified updates from its probation never count (only those
matched), and what it sends afterwards counts as any established peer's (audited by
sampling). A run whose manifest names no founders and no allow-list has probation off:
nobody could vouch for anyone (`ProbationSettings.enabled`).

From which settled state (`Standing.counts_in`). The above says what counts in the end.
Round t trains (and is audited) on the settled state S_t = base + the counted updates of
rounds < t - lag, and a sender training t surely holds the updates of those rounds (the
`lag` rule), but not the records that arrived since. So a record takes effect from a round
fixed by the record itself, its *effective round* e = max(at, round + delay): `at` is the
auditor's round when it published (`AuditRecord.at`; delay = lag + 3, before which no
honest auditor audits round `round`, bounds a backdated or missing `at`), and a record
of effective round e is in S_t iff e < t - lag, exactly like an update of round e. The
counted set of S_t is then the one the rules above give on the ledger prefix "updates of
rounds < t - lag, records of effective rounds < t - lag", which
`standing` computes from the whole ledger as times: (p, t') vouched from
v = min over its matching auditors q of max(e, est[q]); p established from est[p], the
`vouches`-th smallest v of its updates; (p, t') counts by establishment from the
`vouches`-th smallest v of p's updates of rounds < t' (then t' > since in that prefix);
a founder always. So whatever order updates and records reach a peer, its S_t, a
replay's and an auditor's recomputation of S_t count the same rows; a record that
reaches a peer after S_e+lag+1 is a late row there, as an update that arrives late is.
Bans are timed the same way (`Standing.bans`): the banned set of S_t is the judgement
(`judge`, step 2) of that same prefix, so a verdict takes effect in S_t once the records
that decide it have effective rounds < t - lag (and their voters are established there),
and a record that turns a case back (a late match vote) lifts it from its own effective
round. The steps 3 and the times above are then those of that banned set. A sender and
its auditors compute S_t from the same prefix, so no auditor has to guess which bans a
sender knew; `standing` gives the banned set of every prefix as change points.

Ticket revocations (the ledger's `revocations`, network/peers/tickets.py) void a holder's
updates of rounds >= R in the end and in every S_t alike (`Standing.revoked`): the creator
names R ahead of the run, so no sender trained on them; a revocation that reaches a
sender after round R + lag is a late row there.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from seedflood_p2p.algorithm.audit_rules import Judgement, choose_records, judge
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage

if TYPE_CHECKING:
    from seedflood_p2p.storage.ledger import Ledger

NEVER = 1 << 62  # an effective round that never comes
ALWAYS = -(1 << 62)  # ... that every settled state is past (the founders')


@dataclass(frozen=True)
class BanSpan:
    """From the settled prefix `start` on (a state S_t with t - lag >= start) until the next
    span, these peers are banned, and the times below are those the rules give without
    them: (peer, round) -> vouch effective round, earned peer -> `Standing.steps`."""

    start: int
    banned: frozenset[bytes]
    vouched_at: Mapping[tuple[bytes, int], int] = field(default_factory=dict)
    steps: Mapping[bytes, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    def count_from(self, standing: Standing, peer: bytes, round_: int) -> int:
        """`Standing.count_from` under this span's bans."""
        if peer in self.banned or round_ >= standing.revoked.get(peer, NEVER):
            return NEVER
        if not standing.enabled or peer in standing.founders:
            return ALWAYS
        when = self.vouched_at.get((peer, round_), NEVER)
        steps = self.steps.get(peer)
        if steps is not None:
            rounds, times = steps
            i = bisect_left(rounds, round_) - 1  # the last r_k < round_
            if i >= 0:
                when = min(when, times[i])
        return when


@dataclass(frozen=True)
class Standing:
    """Who is established, which updates are vouched, who is banned: what counts."""

    enabled: bool
    founders: frozenset[bytes]
    established: frozenset[bytes]  # founders included
    vouched: Mapping[tuple[bytes, int], frozenset[bytes]]  # (peer, round) -> established auditors
    since: Mapping[bytes, int]  # earned peer -> round of its `vouches`-th vouched update
    judgement: Judgement
    probationers: frozenset[bytes] = frozenset()  # seen, not established
    lag: int = 0  # AuditSettings.lag: S_t holds rows (and records) of effect < t - lag
    # (peer, round) -> the effective round its vouch takes effect from (module docstring)
    vouched_at: Mapping[tuple[bytes, int], int] = field(default_factory=dict)
    # earned peer -> (rounds r_k, times w_k): its updates of rounds > r_k count by
    # establishment from effective round w_k (k >= vouches; w_k non-increasing)
    steps: Mapping[bytes, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    established_at: Mapping[bytes, int] = field(default_factory=dict)  # peer -> its est
    # The banned set of each settled prefix, as spans sorted by start (the first from
    # ALWAYS, the last the whole ledger's: `judgement.banned`); empty: untimed, the final
    # bans in every state (a standing made by hand).
    bans: tuple[BanSpan, ...] = ()
    # Ticket revocations: holder -> R, its updates of rounds >= R never count, in any state
    # (network/peers/tickets.py: the creator names R ahead of the run, so no sender trained
    # on them; one that did, before the revocation reached it, is a late row's case)
    revoked: Mapping[bytes, int] = field(default_factory=dict)

    @property
    def banned(self) -> dict[bytes, str]:
        """The whole ledger's bans (what counts in the end; `banned_at` for a state)."""
        return self.judgement.banned

    def span(self, held: int) -> BanSpan:
        """The bans (and the times without them) of the settled prefix `held` = t - lag."""
        if not self.bans:
            return BanSpan(ALWAYS, frozenset(self.banned), self.vouched_at, self.steps)
        i = bisect_left(self._starts, held + 1) - 1  # the last start <= held
        return self.bans[max(i, 0)]

    @cached_property
    def _starts(self) -> list[int]:
        return [s.start for s in self.bans]

    def banned_at(self, t: int) -> frozenset[bytes]:
        """The peers banned in S_t, the state round t trains on: a function of the ledger
        prefix a sender training t surely held (module docstring)."""
        return self.span(t - self.lag).banned

    def count_from(self, peer: bytes, round_: int) -> int:
        """The effective round from which update (peer, round_) counts under the whole
        ledger's bans (`counts_at` for a state's own): ALWAYS for a founder (or probation
        off), NEVER if it never counts (banned, or a probationer's unvouched update)."""
        return self.span(NEVER).count_from(self, peer, round_)

    def counts_at(self, peer: bytes, round_: int, held: int) -> bool:
        """Does update (peer, round_) count in the settled prefix `held` = t - lag, by the
        bans of that prefix and a vouch or establishment that took effect by then? Its own
        round (< held) is the caller's to check."""
        return self.span(held).count_from(self, peer, round_) < held

    def counts_in(self, peer: bytes, round_: int, t: int) -> bool:
        """Does update (peer, round_) count in the settled state S_t, the state round t
        trains on (base + counted updates of rounds < t - lag)? A pure function of the
        ledger prefix a sender training t surely held (module docstring)."""
        held = t - self.lag
        return round_ < held and self.counts_at(peer, round_, held)

    def counts(self, peer: bytes, round_: int) -> bool:
        """Does update (peer, round_) count for the model?"""
        if peer in self.judgement.banned or round_ >= self.revoked.get(peer, NEVER):
            return False
        if not self.enabled or peer in self.founders:
            return True
        if (peer, round_) in self.vouched:
            return True
        since = self.since.get(peer)
        return since is not None and round_ > since

    def counted(self, messages: Iterable[UpdateMessage]) -> list[UpdateMessage]:
        return [m for m in messages if self.counts(m.peer, m.round)]


def effective_round(record: AuditRecord, settings: AuditSettings) -> int:
    """The round a record takes effect from, as an update of that round would: the
    auditor's round when it published, at least round + delay (an honest auditor audits
    no earlier; a record without `at`, or one backdated, is read as that early)."""
    return max(record.at, record.round + settings.delay)


def _matches(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    chosen: Mapping[tuple[bytes, int, bytes], AuditRecord],
    settings: AuditSettings,
) -> dict[tuple[bytes, int], dict[bytes, int]]:
    """(peer, round) -> {auditor: effective round} of the records that match the claim."""
    rule = settings.rule
    out: dict[tuple[bytes, int], dict[bytes, int]] = defaultdict(dict)
    for (accused, round_, auditor), record in chosen.items():
        claimed = claims.get((round_, accused))
        if claimed is not None and not rule.mismatches(claimed, record.scalars):
            out[(accused, round_)][auditor] = effective_round(record, settings)
    return out


def _kth_smallest_prefix(times: list[int], k: int) -> list[int]:
    """[the k-th smallest of times[:i + 1] for i in range(len(times))] (NEVER before k)."""
    heap: list[int] = []  # the k smallest so far, negated (a max-heap)
    out = []
    for x in times:
        if len(heap) < k:
            heapq.heappush(heap, -x)
        elif x < -heap[0]:
            heapq.heapreplace(heap, -x)
        out.append(-heap[0] if len(heap) == k else NEVER)
    return out


def _timed(
    founders: frozenset[bytes],
    matches: Mapping[tuple[bytes, int], Mapping[bytes, int]],
    vouches: int,
    banned: Iterable[bytes],
    index: Mapping[bytes, list[tuple[tuple[bytes, int], int]]] | None = None,
) -> tuple[dict[tuple[bytes, int], int], dict[bytes, int]]:
    """When each update is vouched and each member established, as effective rounds: the
    earliest solution of v[(p, r)] = min over matching auditors q of max(e, est[q]),
    est[p] = the `vouches`-th smallest v of p's updates (founders ALWAYS), on the times the
    prefix rule gives (module docstring). The `banned` neither vouch nor are vouched for.

    Members are settled in the order of their times, as Dijkstra settles nodes: a time
    an auditor settled at T gives is max(e, T) >= T, so once every member settled before T
    has given its times, no later one can move a peer's `vouches`-th smallest below T
    (nor change it, if it is T). One pass over each member's matches, not one pass over
    all matches per step of the chain of establishments (at a hundred thousand records,
    seconds each). `index`: `_by_auditor(founders, matches)`, made once for many calls."""
    banned = frozenset(banned)
    by_auditor = _by_auditor(founders, matches) if index is None else index
    vouched: dict[tuple[bytes, int], int] = {}
    times_of: dict[bytes, dict[tuple[bytes, int], int]] = defaultdict(dict)  # p -> its v
    est: dict[bytes, int] = {}
    tentative = {p: ALWAYS for p in founders - banned}
    heap = [(ALWAYS, p) for p in sorted(tentative)]
    while heap:
        t, q = heapq.heappop(heap)
        if q in est or tentative[q] != t:
            continue  # settled already, or a time since improved on
        est[q] = t
        for key, e in by_auditor.get(q, ()):
            if key[0] in banned:
                continue
            time = max(e, t)
            if vouched.get(key, NEVER) <= time:
                continue
            vouched[key] = time
            peer = key[0]
            times = times_of[peer]
            times[key] = time
            if peer in est or len(times) < vouches or time >= tentative.get(peer, NEVER):
                continue  # settled, too few vouched updates, or its k-th smallest stays
            kth = heapq.nsmallest(vouches, times.values())[-1]
            if kth < tentative.get(peer, NEVER):
                tentative[peer] = kth
                heapq.heappush(heap, (kth, peer))
    return vouched, est


def _by_auditor(
    founders: frozenset[bytes], matches: Mapping[tuple[bytes, int], Mapping[bytes, int]]
) -> dict[bytes, list[tuple[tuple[bytes, int], int]]]:
    """auditor -> [((peer, round), effective round)] of its matches of non-founders'
    updates (a founder's count without a vouch)."""
    out: dict[bytes, list[tuple[tuple[bytes, int], int]]] = defaultdict(list)
    for key, auditors in matches.items():
        if key[0] not in founders:
            for q, e in auditors.items():
                out[q].append((key, e))
    return out


def _established(
    founders: frozenset[bytes],
    matches: Mapping[tuple[bytes, int], Mapping[bytes, int]],
    vouches: int,
    excluded: Iterable[bytes] = (),
) -> frozenset[bytes]:
    """Least fixpoint: founders, then anyone with >= `vouches` updates matched by a member."""
    excluded = frozenset(excluded)
    members = set(founders - excluded)
    by_peer: dict[bytes, list[tuple[int, set[bytes]]]] = defaultdict(list)
    for (peer, round_), auditors in matches.items():
        if peer not in excluded:
            by_peer[peer].append((round_, set(auditors) - excluded))
    grew = True
    while grew:
        grew = False
        for peer in sorted(by_peer):
            if peer in members:
                continue
            if sum(1 for _, auditors in by_peer[peer] if auditors & members) >= vouches:
                members.add(peer)
                grew = True
    return frozenset(members)


def ban_spans(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    records: Iterable[AuditRecord],
    settings: AuditSettings,
    voting_from: Mapping[bytes, int] | None = None,
    court: frozenset[bytes] = frozenset(),
) -> list[tuple[int, frozenset[bytes]]]:
    """The banned set of every settled prefix "records of effective rounds < h, voters
    established by h" (`judge` of it), as change points [(h, banned from h on)], the first
    (ALWAYS, no one). `voting_from`: auditor -> the effective round it votes from (its
    establishment; None: everyone votes from the start, probation off).

    Only a case with a mismatch bans anyone, and a prefix holds a subset of the ledger's
    records: so only the records on updates some record mismatches matter, and the verdict
    can change only where one of them, or one of their voters, enters the prefix."""
    rule = settings.rule
    records = [r for r in records if r.auditor != r.accused]
    if voting_from is not None:
        records = [r for r in records if r.auditor in voting_from]
    suspect = set()
    for r in records:
        claimed = claims.get((r.round, r.accused))
        if claimed is not None and rule.mismatches(claimed, r.scalars):
            suspect.add((r.accused, r.round))
    timed = [(effective_round(r, settings), r) for r in records if (r.accused, r.round) in suspect]
    points = {e + 1 for e, _ in timed}
    if voting_from is not None:
        points |= {voting_from[r.auditor] + 1 for _, r in timed}
    spans: list[tuple[int, frozenset[bytes]]] = [(ALWAYS, frozenset())]
    for h in sorted(p for p in points if p > ALWAYS + 1):
        held = [r for e, r in timed if e < h]
        voters = None
        if voting_from is not None:
            voters = frozenset(r.auditor for r in held if voting_from[r.auditor] < h)
        banned = frozenset(judge(claims, held, settings, voters=voters, court=court).banned)
        if banned != spans[-1][1]:
            spans.append((h, banned))
    return spans


def standing(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    records: Iterable[AuditRecord],
    settings: AuditSettings,
    probation: ProbationSettings,
    revoked: Mapping[bytes, int] | None = None,
    seen: Iterable[bytes] | None = None,
) -> Standing:
    """What counts, given the claimed scalars of each (round, peer), the audit records and
    the ticket revocations (holder -> R, `revoked_rounds`): a pure function of its
    arguments (see the module docstring for the three steps), and from which settled state
    (the times, the bans of each prefix).

    `seen`: every peer with an update (None: the peers of `claims`, which then holds every
    update). Given it, `claims` need hold only the updates the records audit: nothing else
    is read, so a peer judging its ledger reads those rows, not the whole history."""
    judged = _standing(claims, records, settings, probation, seen)
    return dataclasses.replace(judged, revoked=dict(revoked)) if revoked else judged


def revoked_rounds(revocations: Iterable[tuple[bytes, int, bytes]]) -> dict[bytes, int]:
    """{holder: its earliest revoked round} of a ledger's (holder, round, bytes) ticket
    revocations (`Ledger.revocations`): the holder's updates of rounds >= it never count."""
    out: dict[bytes, int] = {}
    for holder, round_, _ in revocations:
        out[holder] = min(round_, out.get(holder, round_))
    return out


def _standing(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    records: Iterable[AuditRecord],
    settings: AuditSettings,
    probation: ProbationSettings,
    seen: Iterable[bytes] | None = None,
) -> Standing:
    records = list(records)
    # Only a case with a mismatch can ban anyone (`judge`): the verdicts are those of its
    # records alone, and a pass over every case is seconds at a hundred thousand records.
    accused = _accusations(claims, records, settings)
    if not probation.enabled:
        judgement = judge(claims, accused, settings)
        spans = ban_spans(claims, accused, settings)
        bans = tuple(BanSpan(start, banned) for start, banned in spans)
        return Standing(
            False, frozenset(), frozenset(), {}, {}, judgement, lag=settings.lag, bans=bans
        )
    chosen = choose_records(records)
    matches = _matches(claims, chosen, settings)
    first = _established(probation.founders, matches, probation.vouches)
    judgement = judge(claims, accused, settings, voters=first, court=probation.founders)
    # who votes from when: the times of establishment without bans (step 2's `first`)
    _, voting_from = _timed(probation.founders, matches, probation.vouches, ())
    spans = ban_spans(claims, accused, settings, voting_from, probation.founders)
    seen = frozenset(peer for _, peer in claims) if seen is None else frozenset(seen)
    return _settle(probation, settings.lag, matches, judgement, seen, spans)


def _accusations(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    records: list[AuditRecord],
    settings: AuditSettings,
) -> list[AuditRecord]:
    """The records about updates that some record (not the accused's own) mismatches: all
    that `judge` and `ban_spans` decide anything from."""
    rule = settings.rule
    cases = set()
    for r in records:
        claimed = claims.get((r.round, r.accused))
        if (
            claimed is not None
            and r.auditor != r.accused
            and (r.accused, r.round) not in cases
            and rule.mismatches(claimed, r.scalars)
        ):
            cases.add((r.accused, r.round))
    return [r for r in records if (r.accused, r.round) in cases]


def _timing(
    probation: ProbationSettings,
    matches: Mapping[tuple[bytes, int], Mapping[bytes, int]],
    banned: Iterable[bytes],
    index: Mapping[bytes, list[tuple[tuple[bytes, int], int]]] | None = None,
) -> tuple[dict[tuple[bytes, int], int], dict[bytes, tuple], dict[bytes, int]]:
    """The times without the `banned` (module docstring): vouch effective rounds, each
    earned peer's steps (its updates of rounds > r_k count from w_k), establishments.
    `index`: as for `_timed`."""
    vouched_at, est = _timed(probation.founders, matches, probation.vouches, banned, index)
    per_peer: dict[bytes, list[int]] = defaultdict(list)
    for peer, round_ in vouched_at:
        per_peer[peer].append(round_)
    steps = {}
    k = probation.vouches - 1
    for peer, rounds in per_peer.items():
        if len(rounds) < probation.vouches:
            continue  # not established: a fixpoint member has `vouches` vouched updates
        rounds.sort()
        times = _kth_smallest_prefix([vouched_at[(peer, r)] for r in rounds], probation.vouches)
        steps[peer] = (tuple(rounds[k:]), tuple(times[k:]))
    return vouched_at, steps, est


def _timing_after(timings: Mapping[frozenset[bytes], tuple], banned: frozenset[bytes]):
    """`_timing` without `banned`, from one made without fewer peers (`timings`, newest
    first) when none of those it adds was established there (then they vouched for nobody,
    and leaving their own updates out is all that changes); None if no such one. So the
    bans of many fresh keys (each a new settled prefix's ban set) cost a filter each, not
    a `_timed` over every match."""
    for before in reversed(list(timings)):
        added = banned - before
        vouched_at, steps, est = timings[before]
        if before <= banned and not added & est.keys():
            return (
                {key: at for key, at in vouched_at.items() if key[0] not in added},
                {peer: s for peer, s in steps.items() if peer not in added},
                est,
            )
    return None


def _settle(
    probation: ProbationSettings,
    lag: int,
    matches: Mapping[tuple[bytes, int], Mapping[bytes, int]],
    judgement: Judgement,
    seen: frozenset[bytes],
    spans: list[tuple[int, frozenset[bytes]]],
) -> Standing:
    """Steps 3 and the times (module docstring), given the judgement's bans, and the times
    under the bans of each prefix (`spans`)."""
    banned = set(judgement.banned)
    members = _established(probation.founders, matches, probation.vouches, excluded=banned)
    vouched = {}
    for key, auditors in matches.items():
        if key[0] in banned:
            continue
        # (not `auditors.keys() & members`: that walks all the members for every update)
        matched = frozenset(q for q in auditors if q in members)
        if matched:
            vouched[key] = matched
    rounds_of: dict[bytes, list[int]] = defaultdict(list)
    for peer, round_ in sorted(vouched):
        if peer in members and peer not in probation.founders:
            rounds_of[peer].append(round_)
    since = {peer: rounds[probation.vouches - 1] for peer, rounds in rounds_of.items()}
    timings: dict[frozenset[bytes], tuple] = {}
    index = _by_auditor(probation.founders, matches)  # one for every span's times

    def timing(banned_then: frozenset[bytes]) -> tuple:
        if banned_then not in timings:
            timings[banned_then] = _timing_after(timings, banned_then) or _timing(
                probation, matches, banned_then, index
            )
        return timings[banned_then]

    bans = []
    for start, banned_then in spans:
        vouched_at, steps, _ = timing(banned_then)
        bans.append(BanSpan(start, banned_then, vouched_at, steps))
    # the last span's bans are the whole ledger's (the same judge)
    vouched_at, steps, est = timing(frozenset(banned))
    return Standing(
        True,
        probation.founders,
        members,
        vouched,
        since,
        judgement,
        frozenset(seen - members - banned),
        lag=lag,
        vouched_at=vouched_at,
        steps=steps,
        established_at={p: t for p, t in est.items() if p not in probation.founders},
        bans=tuple(bans),
    )


def standing_of_ledger(
    ledger: Ledger, settings: AuditSettings, probation: ProbationSettings
) -> Standing:
    """`standing` over a ledger's updates, audit records and ticket revocations: the rows
    the records audit, and who has rows (`seen`), are all it reads of the updates."""
    claims, records, revoked, seen = ledger_inputs(ledger)
    return standing(claims, records, settings, probation, revoked, seen)


def ledger_inputs(
    ledger: Ledger,
) -> tuple[dict, list[AuditRecord], dict[bytes, int], set[bytes]]:
    """What `standing_of_ledger` reads of a ledger: the claims of the rows the records
    audit, the records, the revocations (`revoked_rounds`) and who has rows. A daemon reads
    them where it writes the ledger and judges them in a thread."""
    records = ledger.audits()
    claims = ledger.claims((r.round, r.accused) for r in records)
    return claims, records, revoked_rounds(ledger.revocations()), ledger.peers()


def rounds_to_count(
    auditors: int, share: float, vouches: int, lag: int, ahead: int = 0
) -> tuple[int, int]:
    """Rounds after an honest newcomer's first update until (one of its updates counts in
    the state peers train on, it is established there), with `auditors` established peers
    each spending `share` audits a round on probation and `ahead` probationers' audits
    (each `vouches` audits) queued before it.

    An audit of round t waits lag + 3 rounds (peer/audit_duty.py: the sender's settled state
    and the bans it could know); the probation budget is auditors * share audits a round;
    a vouch published at round a takes effect in the settled state of round a + lag + 1
    (`Standing.count_from`; the ledger's final standing counts it at once). An estimate
    for an unloaded run (auditors may pick the same update, rounds may be late), not a
    bound."""
    per_round = max(auditors * share, 1e-9)
    wait = math.ceil(ahead * vouches / per_round)
    effect = lag + 1  # from the vouch's publication to the settled state it counts in
    first = lag + 3 + wait + effect
    return first, lag + 3 + wait + math.ceil(vouches / per_round) + effect
