"""Rebuilding the state an update was trained on, for an audit (peer/audit_duty.py): split
out of the peer's audit state so the rewind reads on its own.

An audit of (p, t) recomputes on S_t, the settled state of round t: the counted updates
of rounds < t - lag. Our model holds S_r for the round r we trained last (r >= t), so
the updates it applied of rounds t - lag .. r - lag - 1 are taken back for the
recomputation (and the updates of peers banned since put in), and the exact weights put
back afterwards (a copy, not a re-addition: the live model must not drift by rounding).
Which updates count in S_t is the caller's (`counts_at`: bans and vouches are timed,
`probation.Standing.counts_at`).

A sender may honestly have trained on less than S_t. Since protocol version 3 an update
carries the digest of the rows its sender held (`protocol/held_state.py`): that state,
rebuilt, is tried first, so an honest sender that lacked rows is matched by the first
recomputation. A mismatch there still tries S_t and the states without the settled
updates that reached us last (`late_states`): the digest adds a state, never removes one,
so a sender that sends two copies with different digests to different peers cannot make
an auditor accuse where others match. Each retry is one more recomputation, at most
MAX_LATE_STATES per audit. An update older than MAX_REWIND rounds is not audited.

An equivocation replaces a row of S_t (`protocol.update.keeps_new`): a sender that trained
before the other copy reached it held the copy that lost, and the digest (one hash per
(peer, round)) cannot tell the copies apart. So a mismatch also tries the sender's state
with each replaced row of S_t swapped back to a copy that lost (`swap_states`, from the
ledger's `replaced` table: `Ledger.losing_copies`), at most MAX_SWAP_STATES per audit,
before the late states. Only after a mismatch; S_t itself is never changed by the table.
Many equivocators at once (20 keys, each with a twin flooded rounds late) leave a sender
holding several losing copies where we hold the winners, and no single swap explains it
(issue 45: all 4 founders were convicted so in one run): so the states with every such row
swapped back whose winning copy reached us after the audited update (`swap_sets`), as the
late states read arrival, come first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import count

from peer.applied_rows import AppliedRows
from peer.held_digests import HeldDigests
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.protocol.message import UpdateMessage

MAX_REWIND = 30  # rounds: an update older than this (behind our model) is not audited
MAX_LATE_STATES = 8  # states without the latest-arrived settled rows a mismatch retries
# ... of a probationer's update: each retry is paid from the verification budget like an
# audit (so `share` bounds the compute), and fresh keys are free, so fewer: 20 keys that
# negate cost a founder 3 budget units each, not 9 (bench/results/sybil_daemon_n20*.md).
PROBATION_LATE_STATES = 2
# ... with a replaced row of S_t swapped back to a copy that lost (an equivocation's):
# newest rows first. Only states that hold an equivocated row have any, so the cap only
# bites on an equivocator that signs many copies (its ban stops it at the second).
MAX_SWAP_STATES = 4
# ... and with several swapped back at once, by when the winning copies reached us
# (`swap_sets`: after the audited update, in its round or after, all of them).
MAX_SWAP_SETS = 3
HELD_WINDOW = 2 * MAX_REWIND  # rounds of a state searched for the rows a sender lacked
# Rows applied this many rounds (plus lag) before ours are older than any state an audit
# rebuilds (MAX_REWIND) or searches (HELD_WINDOW further), with a margin as large: the
# peer keeps them packed (peer/applied_rows.py), out of every state's list of rows.
FROZEN_AFTER = 2 * MAX_REWIND + HELD_WINDOW
# Arrival stamps kept: every stamp of our latest ARRIVAL_ROUNDS rounds (plus lag), which
# covers every audit ever run (MAX_REWIND back, and a sender a round or two ahead of us),
# and at least the ARRIVALS_KEPT latest; older ones count as old. A count alone was too few
# for large swarms: 4,096 stamps are under 4 rounds of 1,000 peers, so an audit at round
# t + lag + 3 found the late rows of S_t unstamped and tried no state without them.
ARRIVALS_KEPT = 4096
ARRIVAL_ROUNDS = MAX_REWIND + 3

Key = tuple[bytes, int]  # (peer, round)
# (lowest round, highest round) -> (peer, round) -> the losing copies of its equivocation
LosingCopies = Callable[[int, int], Mapping[Key, Sequence[tuple[float, ...]]]]


@dataclass(frozen=True)
class Rebuilt:
    """An audit's recomputation on the state its sender most likely trained on."""

    recomputed: tuple[float, ...]  # the scalars: of the first state that matched, else S_t's
    held: str | None  # the sender's digest: "exact" (S_t), "found", "unknown"; None: none sent
    retries: int  # recomputations on other states after the first (swaps included)
    matched: str | None  # the kind of state that matched (`late_states`, "swapped"), if any
    swaps: int = 0  # of the retries, those with an equivocated row swapped back


class StateRewind:
    """Rebuilds S_round on our live model for one computation, and guesses the states a
    sender may have held instead. Keeps when each update reached us (`arrival`), the
    data the guesses are made from, and our held-state digests (`held`).

    `counts_at(peer, round, limit)`: does that update count in the settled state whose
    rows are of rounds < limit (the caller's judgement of the ledger, read at each use).
    `losing_copies(low, high)`: the equivocations' losing copies of those rounds
    (`Ledger.losing_copies`; None: none kept), read only after a mismatch."""

    def __init__(
        self,
        live: LiveModel,
        lag: int,
        counts_at: Callable[[bytes, int, int], bool],
        losing_copies: LosingCopies | None = None,
    ) -> None:
        self.live = live
        self.lag = lag
        self.counts_at = counts_at
        self.losing_copies = losing_copies
        # When each update reached us (our training round then, and a counter in acceptance
        # order; ours when we published it): the rows of a settled state that came later
        # here than a sender's update are the ones it most likely did not have yet when it
        # trained (`late_states`).
        self.arrival: dict[Key, tuple[int, int]] = {}  # (our round, order)
        # When a row's copy was replaced by one that won an equivocation (our round, order):
        # a sender that trained before then held the copy that lost (`swap_sets`).
        self.replaced_at: dict[Key, tuple[int, int]] = {}
        # the keys stamped in each of our rounds (a re-stamped key stays in its old round's
        # list too: trimming skips it there), so a trim drops whole old rounds, no sort
        self._arrived_in: dict[int, list[Key]] = {}
        self._replaced_in: dict[int, list[Key]] = {}
        self._clock = count()
        self.held = HeldDigests()  # the held-state digests of our weights and senders' states

    # -- arrivals ----------------------------------------------------------------------
    def arrived(self, key: Key, our_round: int) -> None:
        """An update reached us (the first arrival counts)."""
        if key not in self.arrival:
            self.arrived_late(key, our_round)

    def arrived_late(self, key: Key, our_round: int) -> None:
        """An update starts to count only now (its record reached us late): its arrival is
        now, so audits know a sender may have lacked it."""
        self.arrival[key] = (our_round, next(self._clock))
        self._arrived_in.setdefault(our_round, []).append(key)

    def replaced(self, key: Key, our_round: int) -> None:
        """The row `key` was replaced now: its winning copy reached us only now."""
        self.replaced_at[key] = (our_round, next(self._clock))
        self._replaced_in.setdefault(our_round, []).append(key)

    def winner_arrival(self, key: Key) -> tuple[int, int] | None:
        """When the copy of `key` we hold reached us: at its replacement, else its arrival."""
        return self.replaced_at.get(key, self.arrival.get(key))

    def trim_arrivals(self, our_round: int) -> None:
        """Forget the stamps of our rounds before the last ARRIVAL_ROUNDS + lag, oldest
        round first, while at least ARRIVALS_KEPT stay: no audit asks for them."""
        floor = our_round - self.lag - ARRIVAL_ROUNDS
        _trim(self.arrival, self._arrived_in, floor)
        _trim(self.replaced_at, self._replaced_in, floor)

    # -- the settled state of a round --------------------------------------------------
    def holds(self, message: UpdateMessage, round_: int) -> bool:
        """Is update `message` in S_round: of a round < round_ - lag, and counted there?"""
        limit = round_ - self.lag
        if message.round >= limit:
            return False
        return self.counts_at(message.peer, message.round, limit)

    def state(
        self, round_: int, applied: AppliedRows, waiting: list[UpdateMessage]
    ) -> list[UpdateMessage]:
        """The updates of S_round: applied ones, and waiting ones that counted then and not
        now (a peer banned since, or a vouch it lost with its voucher's ban). The frozen
        applied rows (peer/applied_rows.py), all in S_round, are left out."""
        return [m for m in applied.recent + waiting if self.holds(m, round_)]

    def on_settled(
        self,
        round_: int,
        applied: AppliedRows,
        waiting: list[UpdateMessage],
        counted_too: list[UpdateMessage],
        compute: Callable[[], object],
    ) -> object:
        """`compute()` on S_round (plus `counted_too`), the exact weights put back after."""
        with self.settled(round_, applied, waiting) as on_state:
            return on_state(counted_too, compute)

    @contextlib.contextmanager
    def settled(
        self, round_: int, applied: AppliedRows, waiting: list[UpdateMessage]
    ) -> Iterator[Callable[[list[UpdateMessage], Callable[[], object]], object]]:
        """The weights as S_round while the block runs: the applied updates that are not
        in S_round (of rounds >= round_ - lag, or counted from a later round) taken back,
        the waiting ones that are (a peer banned since) put in. It yields
        `on_state(counted_too, compute)`: `compute()` on S_round plus `counted_too`, S_round
        back after. The exact weights come back when the block ends.

        The rewind is made once for all of an audit's states: it takes back about lag x M
        rows, while a retry's state differs from S_round by a few (a flood of 1,000
        identities' cheats made each retry rewind thousands of rows again, starving the
        event loop: issue 46)."""
        newer = [m for m in applied.recent if not self.holds(m, round_)]  # frozen: all hold
        older = [m for m in waiting if self.holds(m, round_)]
        limit = round_ - self.lag
        momentum = self.live.config.momentum
        rewind = bool(newer or older or (momentum and self.live.head != limit))
        saved = self.live.save_state() if rewind else None
        rewound = None  # S_round's own state, saved once a state with rows of its own needs it

        def on_state(counted_too: list[UpdateMessage], compute: Callable[[], object]) -> object:
            nonlocal rewound
            if not counted_too:
                return compute()
            if rewound is None:
                rewound = self.live.save_state()
            try:
                self.live.apply(counted_too)
                return compute()
            finally:
                self.live.load_state(rewound)

        try:
            if rewind and momentum:
                # A row's weight depends on the state's round: take back the newer rows at
                # ours, move the state to round_ - lag, then put rows in at that round.
                self.live.apply([m.negated() for m in newer])
                self.live.move_to(limit)
                self.live.apply(older)
            elif rewind:
                self.live.apply([m.negated() for m in newer] + older)
            yield on_state
        finally:
            if saved is not None:
                self.live.load_state(saved)

    # -- what a sender may have held instead -------------------------------------------
    def late_states(
        self,
        peer: bytes,
        round_: int,
        applied: AppliedRows,
        waiting: list[UpdateMessage],
    ) -> list[tuple[str, list[UpdateMessage]]]:
        """Sets of updates of S_round the sender of (peer, round_) may not have held when it
        trained, most likely first (`late_states`)."""
        return late_states(self.state(round_, applied, waiting), self.arrival, peer, round_)

    def held_missing(
        self,
        peer: bytes,
        round_: int,
        held: int,
        applied: AppliedRows,
        waiting: list[UpdateMessage],
    ) -> list[UpdateMessage] | None:
        """The updates of S_round the sender of (peer, round_) lacked by its held-state
        digest `held` ([]: none), or None if no honest pattern explains it."""
        since = round_ - self.lag - HELD_WINDOW
        state = self.state(round_, applied, waiting)
        stamped = [(self.arrival[k], k) for m in state if (k := (m.peer, m.round)) in self.arrival]
        return self.held.missing(
            state,
            held,
            peer,
            since,
            applied.frozen_total,
            applied.frozen_peers(),
            [k for _, k in sorted(stamped)],
        )

    def swap_states(
        self,
        peer: bytes,
        round_: int,
        applied: AppliedRows,
        waiting: list[UpdateMessage],
        lacked: frozenset[Key] = frozenset(),
    ) -> list[tuple[str, list[UpdateMessage]]]:
        """For the update (peer, round_): the rows that swap equivocated rows of S_round
        back to a copy that lost, several at once by when their winners reached us
        (`swap_sets`), then one at a time (`swap_states`, newest first, at most
        MAX_SWAP_STATES); none for the rows in `lacked` (the sender did not hold them at
        all). Reads the losing copies kept (one query)."""
        limit = round_ - self.lag
        if self.losing_copies is None or limit <= 0:
            return []
        losing = self.losing_copies(0, limit - 1)
        if not losing:
            return []
        old = applied.frozen_rows(k for k in losing if applied.is_frozen(k))  # applied first
        state = old + self.state(round_, applied, waiting)
        losing = {k: v for k, v in losing.items() if k not in lacked}
        heard = self.arrival.get((peer, round_))
        sets = swap_sets(state, losing, self.winner_arrival, heard)
        singles = swap_states(state, losing)[:MAX_SWAP_STATES]
        return sets + [s for s in singles if s not in sets]

    def recompute(
        self,
        peer: bytes,
        round_: int,
        claimed: tuple[float, ...],
        held: int | None,
        applied: AppliedRows,
        waiting: list[UpdateMessage],
        compute: Callable[[], tuple[float, ...]],
        mismatches: Callable[[tuple[float, ...], tuple[float, ...]], bool],
        max_retries: int | None = None,
    ) -> Rebuilt:
        """`compute()` on the state the sender of (peer, round_) says it held (`held`, its
        digest; S_round without the rows it lacked), then, while the result `mismatches`
        the `claimed` scalars, on that state with an equivocated row swapped back to a
        copy that lost (`swap_states`), then on S_round and the late states (at most
        `max_retries` of them all; None: all). The first state that matches wins."""
        # The sender may have trained before a settled update reached it (a peer that fell
        # behind, e.g. a laptop that slept, publishes its rounds late; nobody waits for it
        # past --round-deadline). Its digest's state is tried first; a mismatch there still
        # tries S_t and the states without the updates it most likely lacked.
        missing = None if held is None else self.held_missing(peer, round_, held, applied, waiting)
        found = None
        if held is not None:
            found = "unknown" if missing is None else "found" if missing else "exact"
        # reversed: an equivocation's rows (original, its negation, the replacement) come
        # out in the order applied, so a round-sized rule's sizes unwind cleanly
        first = [m.negated() for m in reversed(missing or [])]
        states = ([("settled", [])] if first else []) + self.late_states(
            peer, round_, applied, waiting
        )
        retries, matched, swapped = 0, None, 0
        with self.settled(round_, applied, waiting) as on_state:  # one rewind for all
            recomputed = on_state(first, compute)
            if mismatches(claimed, recomputed):
                # An equivocated row of S_t swapped back to a copy that lost, on the
                # sender's state (`swap_states`): first, as only a state with an
                # equivocation has any.
                lacked = frozenset((m.peer, m.round) for m in missing or [])
                states = self.swap_states(peer, round_, applied, waiting, lacked) + states
            for kind, rows in states if max_retries is None else states[:max_retries]:
                if not mismatches(claimed, recomputed):
                    break
                retries += 1
                if kind == "swapped":
                    swapped += 1
                    counted = first + rows  # the sender's state, copies swapped
                else:
                    counted = [m.negated() for m in rows]  # S_t without the late rows
                without = on_state(counted, compute)
                if not mismatches(claimed, without):
                    recomputed, matched = without, kind
        return Rebuilt(recomputed, found, retries, matched, swapped)


def _trim(stamps: dict[Key, tuple[int, int]], stamped_in: dict[int, list[Key]], floor: int) -> None:
    """`StateRewind.trim_arrivals` for one kind of stamp (`stamped_in`: keys by round)."""
    for round_ in sorted(r for r in stamped_in if r < floor):
        keys = stamped_in[round_]
        if len(stamps) - len(keys) < ARRIVALS_KEPT:
            return
        del stamped_in[round_]
        for key in keys:
            if stamps.get(key, (None,))[0] == round_:  # not stamped again since
                del stamps[key]


def late_states(
    state: list[UpdateMessage],
    arrival: Mapping[Key, tuple[int, int]],
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


def held_copy(rows: list[UpdateMessage]) -> UpdateMessage | None:
    """The copy of one (peer, round) that `rows` (its rows in the order applied) leave in
    the weights: an equivocation comes as the original, its negation, the kept copy."""
    held = None
    for m in rows:
        held = None if held is not None and m.scalars == held.negated().scalars else m
    return held


def swap_states(
    state: list[UpdateMessage], losing: Mapping[Key, Sequence[tuple[float, ...]]]
) -> list[tuple[str, list[UpdateMessage]]]:
    """For each row of `state` (S_round's rows, in the order applied) that an equivocation
    replaced, and each copy of it that lost (`losing`, in the order they lost): the rows
    that swap it back, (the copy held, negated; the losing copy), to apply on top of the
    sender's state. Kind "swapped"; newest rounds first, at most MAX_SWAP_STATES.

    A sender that trained before the winning copy reached it held the losing one (issue
    45: a twin flooded rounds late). The held-state digest names (peer, round) only, so
    it cannot say which copy; one recomputation per copy tells."""
    states: list[tuple[str, list[UpdateMessage]]] = []
    for key, held in _held_copies(state, losing):
        for copy in losing[key]:
            if copy != held.scalars and len(states) < MAX_SWAP_STATES:
                back = UpdateMessage(key[1], key[0], tuple(copy))
                states.append(("swapped", [held.negated(), back]))
    return states


def _held_copies(
    state: list[UpdateMessage], losing: Mapping[Key, Sequence[tuple[float, ...]]]
) -> list[tuple[Key, UpdateMessage]]:
    """(key, the copy `state` holds) of each equivocated row it holds, newest rounds first."""
    rows: dict[Key, list[UpdateMessage]] = {}
    for m in state:
        rows.setdefault((m.peer, m.round), []).append(m)
    keys = sorted((k for k in losing if k in rows), key=lambda k: (-k[1], k[0]))
    return [(key, held) for key in keys if (held := held_copy(rows[key])) is not None]


def swap_sets(
    state: list[UpdateMessage],
    losing: Mapping[Key, Sequence[tuple[float, ...]]],
    winner_arrival: Callable[[Key], tuple[int, int] | None],
    heard: tuple[int, int] | None,
) -> list[tuple[str, list[UpdateMessage]]]:
    """States with several equivocated rows of `state` swapped back at once to the first
    copy that lost: those whose winning copy reached us in a later round than the audited
    update did (`heard`: a sender in step with us trained before the winners reached it),
    then those from its round on, then all of them; only sets of two rows or more (one row
    is `swap_states`'s), at most MAX_SWAP_SETS. Kind "swapped", as one state's rows.

    Updates and their twins spread to everyone in about the same order, so what reached
    us after the sender's update most likely reached the sender after it trained: the
    reading `late_states` makes of late rows, made of late winners."""
    swaps: list[tuple[tuple[int, int] | None, list[UpdateMessage]]] = []
    for key, held in _held_copies(state, losing):
        copy = next((c for c in losing[key] if c != held.scalars), None)
        if copy is not None:
            back = UpdateMessage(key[1], key[0], tuple(copy))
            swaps.append((winner_arrival(key), [held.negated(), back]))
    choices = []
    if heard is not None:
        choices.append([r for stamp, r in swaps if stamp is not None and stamp[0] > heard[0]])
        choices.append([r for stamp, r in swaps if stamp is not None and stamp[0] >= heard[0]])
    choices.append([r for _, r in swaps])
    states: list[tuple[str, list[UpdateMessage]]] = []
    for chosen in choices:
        flat = [m for pair in chosen for m in pair]
        if len(chosen) >= 2 and ("swapped", flat) not in states:
            states.append(("swapped", flat))
    return states[:MAX_SWAP_SETS]
