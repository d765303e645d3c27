"""The audit paths' caches stay bounded over a long run, and bounding them changes no result
(issue 45: a run of hours with churn keeps flat memory): the held-state row hashes
(peer/held_digests.py) and the audits done (peer/audit_duty.py `done`)."""

import random
import types

from peer.audit_duty import MAX_REWIND, PeerAudits
from peer.held_digests import HeldDigests
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.network.gossip.audit_intake import AuditIntake
from seedflood_p2p.protocol.held_state import state_digest
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger

PEERS = [bytes([i]) * 4 for i in range(1, 6)]
ROUNDS = 400


def _rows(round_: int) -> list[UpdateMessage]:
    return [UpdateMessage(round_, p, (0.25,)) for p in PEERS]


def test_row_hashes_stay_bounded_and_digests_and_searches_are_unchanged():
    bounded, whole = HeldDigests(kept=64), HeldDigests(kept=10**9)
    applied: list[UpdateMessage] = []
    rng = random.Random(3)
    for round_ in range(ROUNDS):
        applied.extend(_rows(round_))
        digest = bounded.of(applied)
        assert digest == whole.of(applied) == state_digest((m.peer, m.round) for m in applied)
        assert bounded.cached() <= 64
        if round_ % 25 == 24:  # a sender that lacked one peer's newest rows, or a lost row
            lacked = [m for m in applied if m.peer == PEERS[1] and m.round >= round_ - 1]
            if rng.random() < 0.5:
                lacked = [rng.choice([m for m in applied[-40:] if m.peer != PEERS[0]])]
            held = state_digest((m.peer, m.round) for m in applied if m not in lacked)
            since = round_ - 60
            found = bounded.missing(applied, held, PEERS[0], since)
            assert found == whole.missing(applied, held, PEERS[0], since)
            assert {(m.peer, m.round) for m in found} == {(m.peer, m.round) for m in lacked}
            assert bounded.cached() <= 64
    # a list rebuilt (a ban took one peer's rows back) is summed again, old rows included
    rebuilt = [m for m in applied if m.peer != PEERS[2]]
    assert bounded.of(rebuilt) == state_digest((m.peer, m.round) for m in rebuilt)
    assert bounded.cached() <= 64 < whole.cached()


def test_row_hashes_are_cached_for_the_newest_rounds_only_however_few_the_peers():
    """A small swarm never reaches the count bound, so the cache also keeps only the newest
    `rounds` rounds (a soak of 6 peers had cached 131,072 rows, ~16 MiB, and a restarted
    peer hashed every frozen row of its history into it); digests and searches unchanged."""
    window = 16
    recent, whole = HeldDigests(rounds=window), HeldDigests(kept=10**9, rounds=10**9)
    applied: list[UpdateMessage] = []
    for round_ in range(ROUNDS):
        applied.extend(_rows(round_))
        assert recent.of(applied) == whole.of(applied)
        assert recent.rounds_cached() <= window + window // 4
        if round_ % 50 == 49:  # a sender that lacked one peer's newest two rows
            lacked = [m for m in applied if m.peer == PEERS[3] and m.round >= round_ - 1]
            held = state_digest((m.peer, m.round) for m in applied if m not in lacked)
            found = recent.missing(applied, held, PEERS[0], round_ - 8)
            assert found == lacked == whole.missing(applied, held, PEERS[0], round_ - 8)
    assert recent.cached() <= len(PEERS) * (window + window // 4)
    assert whole.cached() == len(PEERS) * ROUNDS
    # a restart hashes the whole history once, oldest first (rows frozen as they are packed,
    # peer/applied_rows.py): what stays cached is the newest rounds', and old rows still hash
    restarted = HeldDigests(rounds=window)
    for m in applied:
        assert restarted.row_hash((m.peer, m.round)) == whole.row_hash((m.peer, m.round))
    assert restarted.rounds_cached() <= window + window // 4
    assert restarted.row_hash((PEERS[0], 0)) == whole.row_hash((PEERS[0], 0))
    assert restarted.rounds_cached() <= window + window // 4


def test_the_digest_keeps_the_keys_of_its_newest_rounds_only_and_counts_each_key_once():
    """A run of hours appends rows without end: the digest's keys are of the newest
    KEYS_WINDOW rounds, and a row of an older round (a late row; an equivocation's swap,
    three rows for one key) is still counted once, as `state_digest` of the keys says."""
    from peer.held_digests import KEYS_WINDOW, MAX_OLD_APPENDED

    held = HeldDigests()
    applied: list[UpdateMessage] = []
    late = UpdateMessage(3, bytes([9]) * 4, (0.5,))  # a peer's row that reaches us late
    for round_ in range(3 * KEYS_WINDOW):
        applied.extend(_rows(round_))
        if round_ == 2 * KEYS_WINDOW:
            old = applied[7]  # an old row, swapped: taken back and replaced, as admission does
            applied += [old.negated(), UpdateMessage(old.round, old.peer, (-0.25,)), late]
        assert held.of(applied) == state_digest((m.peer, m.round) for m in applied)
        assert held.keys_held() <= 2 * max(1024, len(PEERS) * (KEYS_WINDOW + 1))
    assert held.keys_held() < len(PEERS) * 3 * KEYS_WINDOW  # the oldest keys were dropped
    # many old rows at once (an unbanned peer's whole history): summed again, the same digest
    history = [UpdateMessage(r, bytes([8]) * 4, (0.125,)) for r in range(2 * MAX_OLD_APPENDED)]
    applied.extend(history)
    assert held.of(applied) == state_digest((m.peer, m.round) for m in applied)
    applied.extend(history[:5])  # the same rows again count once
    assert held.of(applied) == state_digest((m.peer, m.round) for m in applied)


class _Unbounded(PeerAudits):
    """The audit state as before: `done` never forgets."""

    def _forget_done(self, floor: int) -> None:
        pass


def _audits(cls, tmp_path, name):
    config = RunConfig()
    ledger = Ledger(tmp_path / f"{name}.sqlite", config.run_id)
    live = types.SimpleNamespace(apply=lambda messages: None, config=config)  # no model
    settings = AuditSettings(enabled=True, cpu_share=2.0, lag=0)
    probation = ProbationSettings(founders=frozenset(PEERS[:4]), share=1.0)
    audits = cls(settings, b"secret", PEERS[0], ledger, live, AuditIntake(ledger, 1), probation)
    return ledger, audits


def test_audits_done_stay_bounded_and_the_audits_chosen_are_unchanged(tmp_path):
    """Over many rounds of draws and probation audits (PEERS[4] on probation, never vouched:
    its updates stay due), `done` keeps the keys within the audit horizon only, and every
    round hands out the same audits as an audit state that never forgets."""
    runs = [_audits(PeerAudits, tmp_path, "bounded"), _audits(_Unbounded, tmp_path, "whole")]
    for ledger, audits in runs:
        ledger.add([m for r in range(ROUNDS) for m in _rows(r)])
        audits.set_standing(audits.judge())
        assert audits.standing.probationers == {PEERS[4]}
    sizes = []
    for round_ in range(ROUNDS):
        jobs = []
        for _, audits in runs:
            audits.round = round_
            audits.on_accept(_rows(round_), len(PEERS))
            handed = audits.ready(round_)
            audits.done.update((peer, r) for peer, r, *_ in handed)  # as `audit` marks them
            jobs.append(handed)
        assert jobs[0] == jobs[1], round_
        sizes.append(len(runs[0][1].done))
    bounded, whole = runs[0][1], runs[1][1]
    assert bounded.counts["probation_audits"] > 0  # the probation queue added to `done` too
    assert max(sizes) <= (MAX_REWIND + 1) * len(PEERS) < len(whole.done)
    assert bounded.counts == whole.counts and bounded.tokens == whole.tokens
    for ledger, _ in runs:
        ledger.close()
