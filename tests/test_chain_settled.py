"""The checkpoint chain of an audited run (algorithm/chain.py `SettledCount`): link j
holds the rows of rounds < jP that count in the settled prefix jP by the ledger's records
(probation.py), so honest peers with the same ledger build the same bytes, and a ban, a
vouch or an establishment that takes effect later is taken back or added by a joiner
restoring from it, as an audited restart does from its own checkpoint. No processes:
pure functions, the tiny model, a ledger in memory."""

import json
import random

import numpy as np
import pytest
import torch
from test_checkpoint_chain import CONFIG, ED25519_ID, _chain, _files

from seedflood_p2p.algorithm.chain import SETTLED_MARGIN, STANDING, SettledCount, settled_alike
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.probation import NEVER, standing
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.standing_summary import StandingSummary, summarize
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.held_state import state_digest
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage, quantize_scalars
from seedflood_p2p.storage.checkpoint import read_checkpoint_tensor
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model

LAG = 1
AUDIT = AuditSettings(enabled=True, lag=LAG, quorum=2)
DELAY = AUDIT.delay
F = [ED25519_ID + bytes([1 + i]) * 32 for i in range(3)]  # founders
N = ED25519_ID + b"\x10" * 32  # a newcomer the founders vouch for
C = ED25519_ID + b"\x20" * 32  # a cheater the founders convict
PROBATION = ProbationSettings(founders=frozenset(F), vouches=2)
ROUNDS = 20

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _ledger(ban_at: int | None, vouch_at: tuple[int, int] = (6, 7)):
    """Founders, N and C from round 0. N's and C's updates of rounds 1 and 2 are matched by
    founders publishing at `vouch_at` (both established from the later); C's update of round 3
    is convicted by two founders' mismatches published at `ban_at` (None: never). Returns
    (rows in canonical order, records)."""
    rng = np.random.default_rng(0)
    rows = [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=1)))
        for t in range(ROUNDS)
        for p in sorted([*F, N, C])
    ]
    claims = {(m.round, m.peer): m.scalars for m in rows}
    records = [
        AuditRecord(p, t, F[i], claims[(t, p)], vouch_at[i])
        for p in (N, C)
        for i, t in enumerate((1, 2))
    ]
    if ban_at is not None:
        wrong = (claims[(3, C)][0] + 1.0,)
        records += [AuditRecord(C, 3, F[i], wrong, ban_at) for i in (0, 1)]
    return rows, records


def _standing(rows, records):
    return standing({(m.round, m.peer): m.scalars for m in rows}, records, AUDIT, PROBATION)


def _replayed(rows) -> dict:
    model, _ = load_model(CONFIG.model)
    replay(model, CONFIG, rows)
    return {m.name: m.weight.detach().clone() for m in make_estimator(model, CONFIG).matrices}


def test_a_settled_link_holds_the_rows_that_count_in_its_prefix(tmp_path):
    rows, records = _ledger(ban_at=10)
    st = _standing(rows, records)
    chain = _chain(tmp_path)
    meta = chain.build([m for m in rows if m.round < 8], 8, count=SettledCount(st, 8))
    held = [m for m in rows if m.round < 8 and st.counts_at(m.peer, m.round, 8)]
    # N's and C's updates: the vouched ones and those after their establishment (C's
    # ban takes effect after round 8); the founders' all
    assert {m.peer for m in held} == {*F, N, C}
    assert len(held) < len([m for m in rows if m.round < 8])
    assert meta["settled_prefix"] == 8 and meta["ledger_messages"] == len(held)
    rebuilt = _replayed(held)
    # link = base + its rows, replayed a period at a time: the same sums as one replay of
    # them in another grouping, to float32 rounding
    for name, tensor in chain.weights().items():
        torch.testing.assert_close(tensor, rebuilt[name], atol=1e-6, rtol=0)
    # a link of every row (an unaudited run's) is another file
    plain = _chain(tmp_path / "plain")
    plain.build([m for m in rows if m.round < 8], 8)
    assert _files(tmp_path) != _files(tmp_path / "plain")
    assert "settled_prefix" not in json.loads(_files(tmp_path / "plain")[1])


def test_a_ban_taking_effect_later_leaves_the_link_and_empties_the_next_of_the_cheater(
    tmp_path,
):
    rows, records = _ledger(ban_at=10)
    st = _standing(rows, records)
    assert st.counts_at(C, 3, 8) and not st.counts_at(C, 3, 12)
    chain = _chain(tmp_path)
    link8 = chain.build([m for m in rows if m.round < 8], 8, count=SettledCount(st, 8))
    # a peer that has not seen the convicting records builds link 8 alike: they take effect
    # after its prefix (a function of the rows below 8 and the records effective before)
    before = _standing(rows, records[:4])
    other = _chain(tmp_path / "other")
    other.build([m for m in rows if m.round < 8], 8, count=SettledCount(before, 8))
    assert _files(tmp_path) == _files(tmp_path / "other")
    # link 12: the ban took effect in between, so C's rows below 8 leave it; `extend`
    # declines (what decided the rows below 8 changed), `build` makes it
    new = [m for m in rows if 8 <= m.round < 12]
    below = len([m for m in rows if m.round < 8])
    assert chain.extend(new, 12, below, 0, SettledCount(st, 12)) is None
    link12 = chain.build([m for m in rows if m.round < 12], 12, count=SettledCount(st, 12))
    held12 = [m for m in rows if m.round < 12 and st.counts_at(m.peer, m.round, 12)]
    assert not any(m.peer == C for m in held12)
    assert link12["ledger_messages"] == len(held12) < link8["ledger_messages"] + len(new)
    direct = _chain(tmp_path / "direct")
    direct.build([m for m in rows if m.round < 12], 12, count=SettledCount(st, 12))
    assert _files(tmp_path) == _files(tmp_path / "direct")


def test_a_settled_link_is_extended_while_what_counts_below_it_holds(tmp_path):
    """No record takes effect between the links: `extend` (the period's rows only) writes
    the bytes `build` of every row writes."""
    rows, records = _ledger(ban_at=None, vouch_at=(2 + DELAY, 3 + DELAY))
    st = _standing(rows, records)
    step = _chain(tmp_path / "step")
    step.build([m for m in rows if m.round < 8], 8, count=SettledCount(st, 8))
    for target in (12, 16):
        new = [m for m in rows if step.tail.round <= m.round < target]
        below = len([m for m in rows if m.round < step.tail.round])
        assert step.extend(new, target, below, 0, SettledCount(st, target)) is not None
        direct = _chain(tmp_path / f"direct{target}")
        direct.build([m for m in rows if m.round < target], target, count=SettledCount(st, target))
        assert _files(tmp_path / "step") == _files(tmp_path / f"direct{target}")
    # an unaudited tail is not extended as a settled one, nor the other way round
    assert step.extend([], 20, len([m for m in rows if m.round < 16]), 0) is None


@pytest.mark.parametrize("seed", range(4))
def test_equal_keys_mean_equal_counts_below(seed):
    """`SettledCount(standing, held).key(below)`: whenever the keys of two prefixes are
    equal, every update below `below` counts alike in both (what lets `extend` skip the
    rows below its link); random ledgers with vouches, establishments and a ban."""
    rng = random.Random(seed)
    rows, _ = _ledger(ban_at=None)
    claims = {(m.round, m.peer): m.scalars for m in rows}
    records = []
    for (t, p), scalars in claims.items():
        if p in (N, C) and rng.random() < 0.3:
            records.append(AuditRecord(p, t, rng.choice(F), scalars, t + DELAY + rng.randrange(6)))
    wrong = (claims[(5, C)][0] + 1.0,)
    at = rng.randrange(8, 16)
    records += [AuditRecord(C, 5, F[i], wrong, at + i) for i in (0, 1)]
    st = _standing(rows, records)
    equal = differ = 0
    for below in range(2, ROUNDS, 2):
        low = [m for m in rows if m.round < below]
        for held in range(below, ROUNDS + 4):
            same = SettledCount(st, held).key(below) == SettledCount(st, below).key(below)
            counted, before = (
                {(m.peer, m.round) for m in low if st.counts_at(m.peer, m.round, h)}
                for h in (held, below)
            )
            if same:
                assert counted == before, (below, held)
            equal += same
            differ += counted != before
    assert equal and differ  # both cases were met


def test_a_joiner_restores_the_settled_state_from_an_older_link(tmp_path):
    """A joiner holding the ledger restores S_first from link 8 (`LiveModel.restore` with
    `keep`, as `LateJoin.restore_settled` does): the cheater's rows the link holds are
    taken back (its ban took effect after the link), the rows counted since added; the
    weights are those of a replay of exactly the rows S_first counts."""
    rows, records = _ledger(ban_at=10)
    st = _standing(rows, records)
    _chain(tmp_path).build([m for m in rows if m.round < 8], 8, count=SettledCount(st, 8))
    first = ROUNDS
    ledger = Ledger(":memory:", CONFIG.run_id)
    ledger.add(rows)
    model, _ = load_model(CONFIG.model)
    live = LiveModel(make_estimator(model, CONFIG), ledger)

    def keep(m):
        return st.counts_in(m.peer, m.round, first)

    cut = live.cut()
    how = live.restore(cut, tmp_path, None, keep)
    c_rows = sum(1 for m in rows if m.peer == C and m.round < 8 and st.counts_at(C, m.round, 8))
    assert c_rows == 7  # its vouched rounds 1 and 2, and those after its establishment
    assert how.startswith("checkpoint of round 8 + ") and how.endswith(
        f"- {c_rows} it holds that this state does not"
    ), how
    expected = _replayed([m for m in rows if keep(m)])
    for name, tensor in live.weights().items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0)


def test_with_the_margin_a_link_is_extended_over_vouches_that_came_after_its_round(tmp_path):
    """Rows just below a link are vouched after its round (a probationer's updates are
    audited rounds later): the links of an audited run are of the settled prefix
    SETTLED_MARGIN rounds later, so those vouches took effect already and `extend` goes
    on; with no margin the key moves and the link is built from all rows."""
    rows, records = _ledger(ban_at=None, vouch_at=(5, 6))  # rounds 1 and 2, in effect at 5, 6
    st = _standing(rows, records)
    below4 = len([m for m in rows if m.round < 4])
    new = [m for m in rows if 4 <= m.round < 8]
    bare = _chain(tmp_path / "bare")
    bare.build([m for m in rows if m.round < 4], 4, count=SettledCount(st, 4))
    assert bare.extend(new, 8, below4, 0, SettledCount(st, 8)) is None  # vouched since 4
    step = _chain(tmp_path / "step")
    step.build([m for m in rows if m.round < 4], 4, count=SettledCount(st, 4 + SETTLED_MARGIN))
    assert step.extend(new, 8, below4, 0, SettledCount(st, 8 + SETTLED_MARGIN)) is not None
    direct = _chain(tmp_path / "direct")
    direct.build([m for m in rows if m.round < 8], 8, count=SettledCount(st, 8 + SETTLED_MARGIN))
    assert _files(tmp_path / "step") == _files(tmp_path / "direct")


def _count(st, held, rows, records) -> SettledCount:
    """`SettledCount` as the daemon makes it (peer/latejoin.py `_settled_count`): with
    what the standing was judged on, so the link carries its standing summary."""
    claims = {(m.round, m.peer): m.scalars for m in rows}
    audited = {(r.round, r.accused) for r in records}
    return SettledCount(
        st, held, tuple(records), {k: c for k, c in claims.items() if k in audited}, AUDIT
    )


def test_an_audited_link_carries_its_standing_summary_and_held_digest(tmp_path):
    """What a joiner trusting the link needs of the rows below it: the standing summary
    (a tensor of the link's file, so the file's hash covers it) of the records that took
    effect in its prefix, and the held-state digest of its rows. Builders with and without
    the later records write the same bytes; extended, the same bytes as built."""
    rows, records = _ledger(ban_at=10, vouch_at=(2 + DELAY, 3 + DELAY))
    claims = {(m.round, m.peer): m.scalars for m in rows}
    late = AuditRecord(N, 4, F[2], claims[(4, N)], 30)  # a vouch taking effect after 12
    st = _standing(rows, [*records, late])
    chain = _chain(tmp_path / "a")
    meta = chain.build(
        [m for m in rows if m.round < 8], 8, count=_count(st, 12, rows, [*records, late])
    )
    held = [m for m in rows if m.round < 8 and st.counts_at(m.peer, m.round, 12)]
    assert meta["held_digest"] == f"{state_digest((m.peer, m.round) for m in held):016x}"
    tensor = read_checkpoint_tensor(tmp_path / "a", STANDING)
    summary = StandingSummary.decode(tensor.numpy().tobytes())
    assert summary == summarize(claims, records, AUDIT, 8, 12, {*F, N, C})
    # the vouches, and C's conviction (its records take effect at 10, in the prefix 12)
    assert len(summary.matches) == 4 and len(summary.cases) == 1
    assert meta["standing_summary"] == {
        "bytes": tensor.numel(),
        "matches": 4,
        "cases": 1,
        "peers": 5,
    }
    # a builder that has not seen the late vouch writes the same bytes
    other = _chain(tmp_path / "b")
    other.build(
        [m for m in rows if m.round < 8],
        8,
        count=_count(_standing(rows, records), 12, rows, records),
    )
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    # extended over a period whose records changed nothing below: the bytes of a build
    below = len([m for m in rows if m.round < 8])
    new = [m for m in rows if 8 <= m.round < 12]
    assert chain.extend(new, 12, below, 0, _count(st, 16, rows, [*records, late])) is not None
    direct = _chain(tmp_path / "c")
    direct.build([m for m in rows if m.round < 12], 12, count=_count(st, 16, rows, records))
    assert _files(tmp_path / "a") == _files(tmp_path / "c")
    # the link restores as before: the summary is no weight
    model, _ = load_model(CONFIG.model)
    ledger = Ledger(":memory:", CONFIG.run_id)
    ledger.add(rows)
    live = LiveModel(make_estimator(model, CONFIG), ledger)
    how = live.restore(
        live.cut(), tmp_path / "c", None, lambda m: st.counts_in(m.peer, m.round, 20)
    )
    assert how.startswith("checkpoint of round 12"), how


def test_a_joiner_stands_on_a_link_only_while_what_counts_below_it_is_unchanged():
    """`settled_alike`: a joiner holding only the rows from link 8 on may stand on it in a
    later state while the rows below 8 count there as in the link's prefix; a ban that
    takes effect after the prefix (C's, at 10) ends that: the link holds C's rows, which the
    joiner cannot take back without them."""
    rows, records = _ledger(ban_at=None, vouch_at=(2 + DELAY, 3 + DELAY))
    st = _standing(rows, records)
    assert all(settled_alike(st, 8, 8 + SETTLED_MARGIN, held) for held in (48, 60, 200))
    rows, records = _ledger(ban_at=10 + SETTLED_MARGIN)  # in effect after the prefix 48
    st = _standing(rows, records)
    assert settled_alike(st, 8, 8 + SETTLED_MARGIN, 8 + SETTLED_MARGIN + 1)
    assert not settled_alike(st, 8, 8 + SETTLED_MARGIN, 10 + SETTLED_MARGIN + 2)
    # the peers with rows in the link: C's ban matters to a link holding C's rows only
    assert not settled_alike(st, 8, 8 + SETTLED_MARGIN, NEVER, frozenset([*F, N, C]))
    assert settled_alike(st, 8, 8 + SETTLED_MARGIN, NEVER, frozenset([*F, N]))


def test_a_ban_of_the_links_prefix_lifted_later_ends_the_stand():
    """P is falsely accused by two fresh keys (banned in the link's prefix: its rows are not
    in the link), then three honest re-checks turn the case back: P's rows below the link
    count in the states to come, and a joiner without them must not stand on the link
    (a review's reproducer; the check compared bans of the link's own peers only)."""
    settings = AuditSettings(enabled=True, lag=1, quorum=2)
    p, h1, h2, h3, x1, x2 = (bytes([i]) * 4 for i in range(1, 7))
    claims = {(t, q): (1.0,) for t in range(60) for q in (p, h1, h2, h3)}
    records = [AuditRecord(p, 40, x, (2.0,), 45) for x in (x1, x2)]  # false, in the prefix
    records += [AuditRecord(p, 40, h, (1.0,), 50) for h in (h1, h2, h3)]  # after it
    st = standing(claims, records, settings, ProbationSettings())
    held = 8 + SETTLED_MARGIN
    assert not st.counts_at(p, 0, held) and st.counts_in(p, 0, 60)
    in_link = frozenset([h1, h2, h3])
    assert not settled_alike(st, 8, held, NEVER, in_link)
