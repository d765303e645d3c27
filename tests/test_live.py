"""The live model's consensus invariants, without processes: whatever order updates arrive
and are applied in, with restores, checkpoints and equivocations in between, a peer's
weights stay base + its ledger (the canonical replay) to float32 rounding."""

import json
import random

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip.admission import Admission, Outcome
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.protocol.message import Envelope, UpdateMessage, quantize_scalars
from seedflood_p2p.protocol.update import encode_update
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model

# The same tolerance as the multi-process test (tests/test_p2p.py): live peers merge per
# round in arrival order, replay per epoch in canonical order, the same sums in another
# order.
LIVE_VS_REPLAY_ATOL = 1e-5
CONFIG = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=3, directions=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


ED25519_ID = bytes.fromhex("002408011220")  # peer ids of this form only (framing.check_sender_key)


def _messages(rounds: int, peers: int, seed: int = 0) -> list[UpdateMessage]:
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, ED25519_ID + bytes([p + 1]) * 32, quantize_scalars(rng.normal(size=2)))
        for t in range(rounds)
        for p in range(peers)
    ]


def _live(ledger: Ledger | None = None) -> LiveModel:
    model, _ = load_model(CONFIG.model)
    return LiveModel(make_estimator(model, CONFIG), ledger)


def _ledger(messages=()) -> Ledger:
    ledger = Ledger(":memory:", CONFIG.run_id)
    ledger.add(messages)
    return ledger


def _replayed(ledger: Ledger) -> dict[str, torch.Tensor]:
    model, _ = load_model(CONFIG.model)
    replay(model, CONFIG, ledger.messages())
    return LiveModel(make_estimator(model, CONFIG)).weights()


def _assert_matches_replay(live: LiveModel, ledger: Ledger) -> None:
    for name, tensor in _replayed(ledger).items():
        torch.testing.assert_close(
            live.weights()[name], tensor, atol=LIVE_VS_REPLAY_ATOL, rtol=0, msg=name
        )


def test_any_arrival_order_agrees_with_the_canonical_replay():
    messages = _messages(12, 3)  # three epochs
    ledger = _ledger(messages)
    for seed in (1, 2):
        shuffled = list(messages)
        random.Random(seed).shuffle(shuffled)
        live = _live()
        for start in range(0, len(shuffled), 5):  # arrive in batches, applied per "round"
            live.receive(shuffled[start : start + 5])
            if start % 10 == 0:
                live.apply(live.take())
        live.apply(live.take())
        assert live.pending == []
        _assert_matches_replay(live, ledger)


def test_checkpoint_and_restore_round_trip(tmp_path):
    ledger = _ledger(_messages(8, 3))
    live = _live(ledger)
    live.restore(live.cut())  # replay of the ledger so far
    more = _messages(10, 3, seed=1)[24:]  # rounds 8 and 9, arriving live
    ledger.add(more)
    live.receive(more)
    meta = live.checkpoint(tmp_path, live.cut(), {"round": 10})  # applies them first
    assert meta["ledger_messages"] == 30 and meta["ledger_digest"] == ledger.digest()
    assert json.loads((tmp_path / "checkpoint.json").read_text()) == meta
    assert meta["model_sha256"] == live.sha256()

    again = _live(ledger)
    assert again.restore(again.cut(), tmp_path) == "checkpoint of round 10"
    assert all(torch.equal(again.weights()[k], v) for k, v in live.weights().items())
    _assert_matches_replay(again, ledger)

    ledger.add([UpdateMessage(10, b"peer-0", (0.5, -0.5))])  # the ledger moved on: the
    third = _live(ledger)  # checkpoint plus the one row it does not cover
    assert third.restore(third.cut(), tmp_path) == (
        "checkpoint of round 10 + 1 ledger messages after it"
    )
    _assert_matches_replay(third, ledger)


def test_restart_from_checkpoint_plus_tail_equals_a_full_replay(tmp_path):
    """Rows outside the checkpoint's cut, also rows of rounds inside its span (a late
    repair), are applied on top of it: same ledger digest, same weights as a replay."""
    from seedflood_p2p.storage.cut import cut_contains

    messages = _messages(12, 3)
    third_peer = messages[2].peer
    late = [m for m in messages if m.peer == third_peer and 3 <= m.round <= 5]
    ledger = _ledger([m for m in messages[:24] if m not in late])  # rounds 0..7, a gap
    live = _live(ledger)
    live.restore(live.cut())
    meta = live.checkpoint(tmp_path, live.cut(), {"round": 8})
    assert len(meta["ledger_cut"][third_peer.hex()]) == 2  # two ranges around the gap
    assert len(cut_contains(meta["ledger_cut"])) == meta["ledger_messages"] == 21
    ledger.add(late + messages[24:])  # the gap repaired, and rounds 8..11
    restarted = _live(ledger)
    how = restarted.restore(restarted.cut(), tmp_path)
    assert how == "checkpoint of round 8 + 15 ledger messages after it"
    full = _live(ledger)
    assert full.restore(full.cut()) == "replay of 36 ledger messages"
    assert restarted.cut().digest == full.cut().digest == ledger.digest()
    for name, tensor in full.weights().items():
        torch.testing.assert_close(
            restarted.weights()[name], tensor, atol=LIVE_VS_REPLAY_ATOL, rtol=0, msg=name
        )


def test_edited_checkpoint_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    ledger = _ledger(_messages(6, 2))
    live = _live(ledger)
    live.restore(live.cut())
    live.checkpoint(tmp_path, live.cut(), {"round": 6})
    weights = load_file(tmp_path / "checkpoint.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] += 1.0  # a valid file, one weight changed
    save_file(weights, tmp_path / "checkpoint.safetensors")
    again = _live(ledger)
    assert again.restore(again.cut(), tmp_path) == "replay of 12 ledger messages"
    _assert_matches_replay(again, ledger)


def test_checkpoint_whose_rows_differ_from_the_ledger_is_refused(tmp_path):
    messages = _messages(6, 2)
    first_peer = messages[0].peer
    ledger = _ledger(messages)
    live = _live(ledger)
    live.restore(live.cut())
    live.checkpoint(tmp_path, live.cut(), {"round": 6})
    meta = json.loads((tmp_path / "checkpoint.json").read_text())
    # Forged: it claims a row the ledger does not hold (its digest cannot match).
    meta["ledger_cut"][first_peer.hex()].append([40, 40])
    (tmp_path / "checkpoint.json").write_text(json.dumps(meta))
    ledger.add([UpdateMessage(6, first_peer, (0.5, -0.5))])
    again = _live(ledger)
    assert again.restore(again.cut(), tmp_path) == "replay of 13 ledger messages"
    _assert_matches_replay(again, ledger)


def test_unreadable_checkpoint_falls_back_to_replay(tmp_path):
    ledger = _ledger(_messages(4, 2))
    live = _live(ledger)
    live.checkpoint(tmp_path, live.cut(), {"round": 4})  # the base weights: nothing applied
    (tmp_path / "checkpoint.safetensors").write_bytes(b"not safetensors")
    again = _live(ledger)
    assert again.restore(again.cut(), tmp_path) == "replay of 8 ledger messages"
    _assert_matches_replay(again, ledger)


def test_update_accepted_during_a_restore_is_applied_exactly_once(tmp_path):
    messages = _messages(6, 3)
    ledger = _ledger(messages)
    live = _live(ledger)
    live.receive(messages[-3:])  # accepted (logged) before the cut, not applied yet ...
    cut = live.cut()
    assert cut.unapplied == messages[-3:] and live.pending == []  # ... so in the cut only
    late = UpdateMessage(6, b"peer-1", (0.5, -1.0))
    ledger.add([late])  # accepted on the event loop while the model thread restores
    live.receive([late])
    assert live.restore(cut) == "replay of 18 ledger messages"
    assert live.take() == [late]
    live.apply([late])
    _assert_matches_replay(live, ledger)

    # The same across a checkpoint: an update accepted after the cut is in neither the
    # checkpoint nor the weights written, and stays pending.
    cut = live.cut()
    later = UpdateMessage(7, b"peer-2", (-0.5, 1.0))
    ledger.add([later])
    live.receive([later])
    meta = live.checkpoint(tmp_path, cut, {"round": 7})
    assert meta["ledger_messages"] == len(ledger) - 1 and live.pending == [later]
    live.apply(live.take())
    _assert_matches_replay(live, ledger)


def test_equivocation_is_taken_back_by_the_negated_update():
    """Two peers see a sender's two updates for one round in opposite orders, through
    admission: both keep the smaller, and both live models equal their ledger's replay."""
    sender = ED25519_ID + bytes(32)
    others = _messages(5, 2)
    peers = []
    for order in ((0.5, 0.25), (0.25, 0.5)):
        ledger = _ledger()
        live = _live(ledger)
        admission = Admission(ledger, 2, b"me", NodeMetrics(), 50, deliver=live.receive)
        admission.gossip([(m.peer, _envelope(m)) for m in others[:5]])
        for scalar in order:
            admission.gossip([(sender, _envelope(UpdateMessage(1, sender, (scalar, scalar))))])
            live.apply(live.take())  # the first one is applied before the second arrives
        admission.gossip([(m.peer, _envelope(m)) for m in others[5:]])
        live.apply(live.take())
        assert ledger.scalars_of(sender, 1) == (0.25, 0.25)
        _assert_matches_replay(live, ledger)
        peers.append((ledger.digest(), admission.metrics.admission_counts()["gossip"]))
    assert peers[0][0] == peers[1][0]
    assert peers[0][1][Outcome.REPLACED] == 1 and peers[1][1][Outcome.DROPPED] == 1


def _envelope(message: UpdateMessage) -> Envelope:
    return Envelope(encode_update(CONFIG.run_id, message.round, message.scalars), b"", b"")


# -- round-sized step rules: a late row re-scales its round --------------------------------
# round_mean with n_ref 2 (rounds of 3-5 rows move at lr / n); round_sqrt with n_ref 4
# (rounds of 1-3 rows at lr / sqrt(4 n), of 4-5 at lr / n: sizes cross n_ref).
ROUND_SIZED = [CONFIG.replace(step_rule="round_mean", n_ref=2)]
ROUND_SIZED.append(CONFIG.replace(step_rule="round_sqrt", n_ref=4))
round_sized = pytest.mark.parametrize("config", ROUND_SIZED, ids=lambda c: c.step_rule)


def _round_mean_live(config: RunConfig, ledger: Ledger | None = None) -> LiveModel:
    model, _ = load_model(config.model)
    return LiveModel(make_estimator(model, config), ledger)


def _assert_round_mean_replay(
    config: RunConfig, live: LiveModel, rows: list[UpdateMessage]
) -> None:
    model, _ = load_model(config.model)
    replay(model, config, sorted(rows, key=lambda m: (m.round, m.peer)))
    for name, tensor in LiveModel(make_estimator(model, config)).weights().items():
        torch.testing.assert_close(
            live.weights()[name], tensor, atol=LIVE_VS_REPLAY_ATOL, rtol=0, msg=name
        )


@round_sized
def test_round_mean_late_rows_and_take_backs_end_where_the_replay_is(config):
    """Rows of 5 peers arrive shuffled in batches, some taken back (negated) and put back
    again; the live model re-scales each round as its size changes and ends where a
    replay of the rows it holds is, whose steps use each round's final size."""
    messages = _messages(12, 5)
    for seed in (1, 2):
        rng = random.Random(seed)
        events = list(messages)
        rng.shuffle(events)
        taken = rng.sample(messages, 8)
        events[20:20] = [m.negated() for m in taken[:4]]  # taken back, some for good
        events += [m.negated() for m in taken[4:]] + taken[4:6]  # ... and two put back
        live = _round_mean_live(config)
        for start in range(0, len(events), 7):
            live.apply(events[start : start + 7])
        gone = {(m.peer, m.round) for m in taken[:4] + taken[6:]}
        kept = [m for m in messages if (m.peer, m.round) not in gone]
        assert sum(len(rows) for rows in live.held.values()) == len(kept)
        _assert_round_mean_replay(config, live, kept)
        # the step rule matters: a per-update replay of the same rows is elsewhere
        model, _ = load_model(CONFIG.model)
        per_update = config.replace(step_rule="per_update")
        replay(model, per_update, sorted(kept, key=lambda m: (m.round, m.peer)))
        other = LiveModel(make_estimator(model, CONFIG)).weights()
        assert any(
            (other[n] - w).abs().max() > 10 * LIVE_VS_REPLAY_ATOL for n, w in live.weights().items()
        )


@round_sized
def test_round_mean_restart_from_a_checkpoint_re_scales_the_rounds_a_tail_joins(config, tmp_path):
    messages = _messages(10, 4)
    late = [m for m in messages if m.peer == messages[3].peer and 2 <= m.round <= 4]
    ledger = Ledger(":memory:", config.run_id)
    ledger.add([m for m in messages[:28] if m not in late])
    live = _round_mean_live(config, ledger)
    live.restore(live.cut())
    live.checkpoint(tmp_path, live.cut(), {"round": 7})
    ledger.add(late + messages[28:])  # rows of rounds the checkpoint covers, and new rounds
    restarted = _round_mean_live(config, ledger)
    how = restarted.restore(restarted.cut(), tmp_path)
    assert how == f"checkpoint of round 7 + {len(late) + 12} ledger messages after it"
    _assert_round_mean_replay(config, restarted, messages)


@round_sized
def test_round_mean_trial_states_put_back_the_weights_and_what_they_hold(config):
    messages = _messages(6, 4)
    live = _round_mean_live(config)
    live.apply(messages)
    saved = live.save_state()  # copies the rounds' table, not each round (never changed)
    held = {t: dict(rows) for t, rows in live.held.items()}
    before = {n: w.clone() for n, w in live.weights().items()}
    live.apply([m.negated() for m in messages if m.round >= 3])  # an audit's S_3
    live.apply([messages[5].negated()])  # and one row of round 1: a round that stays
    assert sorted(live.held) == [0, 1, 2] and len(live.held[1]) == 3
    live.load_state(saved)
    assert live.held == held
    assert all(torch.equal(before[n], w) for n, w in live.weights().items())
    live.apply([messages[0].negated()])  # round 0 shrinks 4 -> 3: the rest re-scaled
    _assert_round_mean_replay(config, live, messages[1:])


# -- restarts that stream the ledger (`streamed_cut`) and restore part of it (`keep`) -------


def test_a_streamed_cut_is_a_snapshot_read_again_on_each_pass(tmp_path):
    """Rows committed after the cut are in neither pass (the daemon hands them on as
    pending); the snapshot restores what a list cut restores."""
    messages = _messages(6, 3)
    ledger = Ledger(tmp_path / "ledger.sqlite", CONFIG.run_id)
    ledger.add(messages[:12])
    live = _live(ledger)
    cut = live.streamed_cut()
    ledger.add(messages[12:])  # accepted on the event loop while the model thread restores
    assert len(cut.messages) == 12
    assert list(cut.messages) == list(cut.messages) == messages[:12]  # canonical order
    assert live.restore(cut) == "replay of 12 ledger messages"
    cut.close()
    with pytest.raises(ValueError, match="closed"):
        list(cut.messages)
    live.apply(messages[12:])
    _assert_matches_replay(live, ledger)


@pytest.mark.parametrize("late_rows", [False, True], ids=["no tail", "with a tail"])
def test_a_restart_keeps_part_of_the_ledger_taking_back_what_its_checkpoint_holds_beyond_it(
    tmp_path, late_rows
):
    """An audited restart keeps the settled state, lag rounds short of the checkpoint it
    wrote at stop: the checkpoint is used, the rows it holds that the state does not are
    taken back, the kept rows it lacks are added; every row is shown to `observe` once, in
    one pass; the weights are a replay of the kept rows."""
    messages = _messages(8, 3)
    gap = [m for m in messages if m.peer == messages[1].peer and m.round == 2]
    ledger = Ledger(tmp_path / "ledger.sqlite", CONFIG.run_id)
    ledger.add([m for m in messages if m not in gap] if late_rows else messages)
    live = _live(ledger)
    live.restore(live.cut())
    live.checkpoint(tmp_path, live.cut(), {"round": 8})
    if late_rows:
        ledger.add(gap)  # repaired after the checkpoint: kept, not covered
    keep = lambda m: m.round < 6  # noqa: E731
    seen: list[UpdateMessage] = []
    restarted = _live(ledger)
    cut = restarted.streamed_cut()
    how = restarted.restore(cut, tmp_path, seen.append, keep)
    cut.close()
    tail = " + 1 ledger messages after it" if late_rows else ""
    assert how == f"checkpoint of round 8{tail} - 6 it holds that this state does not"
    assert seen == list(ledger.messages())
    kept = Ledger(":memory:", CONFIG.run_id)
    kept.add([m for m in ledger.messages() if keep(m)])
    _assert_matches_replay(restarted, kept)
    # no checkpoint: a replay of the kept rows, observed the same
    seen.clear()
    fresh = _live(ledger)
    assert fresh.restore(fresh.cut(), None, seen.append, keep) == "replay of 18 ledger messages"
    assert seen == list(ledger.messages())
    _assert_matches_replay(fresh, kept)


@round_sized
def test_round_mean_restart_that_keeps_part_of_the_ledger_re_scales_its_rounds(config, tmp_path):
    messages = _messages(6, 4)
    ledger = Ledger(":memory:", config.run_id)
    ledger.add(messages)
    live = _round_mean_live(config, ledger)
    live.restore(live.cut())
    live.checkpoint(tmp_path, live.cut(), {"round": 6})
    dropped = {messages[0], messages[5]}  # rows of rounds 0 and 1 that no longer count
    keep = lambda m: m.round < 4 and m not in dropped  # noqa: E731
    restarted = _round_mean_live(config, ledger)
    how = restarted.restore(restarted.cut(), tmp_path, keep=keep)
    assert how == "checkpoint of round 6 - 10 it holds that this state does not"
    kept = [m for m in messages if keep(m)]
    assert sum(len(rows) for rows in restarted.held.values()) == len(kept)
    _assert_round_mean_replay(config, restarted, kept)


def test_a_checkpoint_cut_is_asked_by_its_ranges_not_a_set_of_its_rows():
    from seedflood_p2p.storage.cut import cut_contains, encode_cut

    a, b = b"\x01" * 38, b"\x02" * 38
    rows = {(a, r) for r in [*range(0, 5000), *range(5003, 10_000)]} | {(b, 7), (b, 9)}
    covered = cut_contains(json.loads(json.dumps(encode_cut(rows))))
    assert len(covered) == len(rows)
    probes = [(p, r) for p in (a, b, b"\x03" * 38) for r in range(-1, 10_002)]
    assert [p in covered for p in probes] == [p in rows for p in probes]
    with pytest.raises(ValueError, match="overlap or are unsorted"):
        cut_contains({a.hex(): [[0, 5], [5, 9]]})
    with pytest.raises(ValueError, match="bad round range"):
        cut_contains({a.hex(): [[4, 2]]})


def test_a_checkpoint_of_a_streamed_cut_is_the_checkpoint_of_the_list(tmp_path):
    """What the daemon writes at stop from a snapshot (one pass, the cut kept as ranges)
    equals what the whole ledger as a list gives: count, digest, cut, the rows' hash."""
    messages = _messages(6, 3)
    gap = messages[7]  # a peer's round 2 missing: two ranges for it
    ledger = Ledger(tmp_path / "ledger.sqlite", CONFIG.run_id)
    ledger.add([m for m in messages if m is not gap])
    live = _live(ledger)
    live.restore(live.cut())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    listed = live.checkpoint(tmp_path / "a", live.cut(), {"round": 6})
    cut = live.streamed_cut()
    assert cut.messages.rows_sha256() == ledger.rows_sha256(
        {(m.peer, m.round) for m in ledger.messages()}
    )
    streamed = live.checkpoint(tmp_path / "b", cut, {"round": 6})
    cut.close()
    assert streamed == listed
    assert len(streamed["ledger_cut"][gap.peer.hex()]) == 2


@pytest.mark.parametrize(
    "edit",
    [
        lambda meta: [meta],  # not a table
        lambda meta: {k: v for k, v in meta.items() if k != "ledger_digest"},
        lambda meta: {**meta, "ledger_cut": {"zz": [[0, 1]]}},  # not hex
        lambda meta: {k: v for k, v in meta.items() if k != "round"},
    ],
    ids=["list", "no digest", "bad cut", "no round"],
)
def test_a_malformed_checkpoint_meta_is_refused_or_used_never_a_crash(tmp_path, edit):
    """A fetched chain link's meta comes from peers: whatever it holds, the restore replays
    (or, where the rows and tensors check out, uses it), and ends at base + ledger."""
    ledger = _ledger(_messages(4, 2))
    live = _live(ledger)
    live.restore(live.cut())
    meta = live.checkpoint(tmp_path, live.cut(), {"round": 4})
    (tmp_path / "checkpoint.json").write_text(json.dumps(edit(meta)))
    ledger.add([UpdateMessage(4, b"peer-0", (0.5, -0.5))])
    again = _live(ledger)
    how = again.restore(again.cut(), tmp_path)
    assert how in (
        "replay of 9 ledger messages",
        "checkpoint of round None + 1 ledger messages after it",
    )
    _assert_matches_replay(again, ledger)
