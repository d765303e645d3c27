"""A joiner that trusts a checkpoint link before it holds the link's rows
(`--history-sync background`, algorithm/live.py `trust` / `restore_trusting` /
`check_history`), without processes: the link + only the rows after it make base + the
whole ledger; the link's rows arriving later are not applied twice; the history is
checked against the link's digest (incomplete, matching, differing); repair asks only for
buckets after the floor; step rules the trust cannot hold are refused."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.chain import CheckpointChain
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip.repair import _Exchange, plan
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.storage.checkpoint import read_checkpoint_meta
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model

CONFIG = RunConfig(
    model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=3, extra={"checkpoint_every": 4}
)
ED25519_ID = bytes.fromhex("002408011220")
LINK = 8

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _messages(rounds: int, peers: int, seed: int = 0) -> list[UpdateMessage]:
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, ED25519_ID + bytes([p + 1]) * 32, quantize_scalars(rng.normal(size=1)))
        for t in range(rounds)
        for p in range(peers)
    ]


def _replayed(rows) -> dict[str, torch.Tensor]:
    reference, _ = load_model(CONFIG.model)
    replay(reference, CONFIG, rows)
    return {m.name: m.weight for m in make_estimator(reference, CONFIG).matrices}


def _joiner(tmp_path, held):
    """A link of round LINK built by a peer with every row, and a joiner whose ledger
    holds only `held`, restored trusting it."""
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    ledger = Ledger(":memory:", CONFIG.run_id)
    ledger.add(held(rows))
    live = LiveModel(make_estimator(load_model(CONFIG.model)[0], CONFIG), ledger)
    live.trust(read_checkpoint_meta(tmp_path))
    how = live.restore_trusting(live.cut(), tmp_path)
    return rows, ledger, live, how


def _close(live: LiveModel, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in live.weights().items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0)


def test_the_link_and_only_its_tail_make_base_plus_the_whole_ledger(tmp_path):
    rows, _, live, how = _joiner(tmp_path, lambda rows: [m for m in rows if m.round >= LINK])
    assert how == "trusted checkpoint of round 8 + 12 ledger messages after it"
    _close(live, _replayed(rows))


def test_history_arriving_later_is_logged_not_applied_and_then_checked(tmp_path):
    rows, ledger, live, _ = _joiner(tmp_path, lambda rows: [m for m in rows if m.round >= LINK])
    history = [m for m in rows if m.round < LINK]
    assert live.check_history(ledger.messages()) is None  # none of the link's rows yet
    ledger.add(history[:5])
    live.receive(history[:5])
    assert live.take() == [] and live.check_history(ledger.messages()) is None  # 5 of 24
    late = UpdateMessage(3, ED25519_ID + b"\x09" * 32, (0.5,))  # a row the link lacks
    ledger.add([*history[5:], late])
    live.receive([*history[5:], late])
    assert live.take() == [late]  # only the late row is new to the weights
    live.apply([late])
    assert live.check_history(ledger.messages()) is True
    live.end_trust()
    assert live.trusted is None
    _close(live, _replayed(ledger.messages()))  # base + the whole ledger again
    live.receive([late])
    assert live.take() == [late]  # no filter any more


def test_a_history_other_than_the_links_is_found(tmp_path):
    rows, ledger, live, _ = _joiner(tmp_path, lambda rows: [m for m in rows if m.round >= LINK])
    history = [m for m in rows if m.round < LINK]
    forged = dataclasses.replace(history[7], scalars=quantize_scalars(np.array([9.0])))
    ledger.add([*history[:7], forged, *history[8:]])
    assert live.check_history(ledger.messages()) is False


def test_a_link_with_tampered_weights_is_refused_and_the_trust_lifted(tmp_path):
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    meta = read_checkpoint_meta(tmp_path)
    meta["weights_sha256"] = "00" * 32
    (tmp_path / "checkpoint.json").write_text(json.dumps(meta))
    ledger = Ledger(":memory:", CONFIG.run_id)
    live = LiveModel(make_estimator(load_model(CONFIG.model)[0], CONFIG), ledger)
    base = {k: v.clone() for k, v in live.weights().items()}
    live.trust(meta)
    assert live.restore_trusting(live.cut(), tmp_path) is None
    assert live.trusted is None
    for name, tensor in live.weights().items():
        assert torch.equal(tensor, base[name])  # the base weights, for the replay after


@pytest.mark.parametrize("rule", ["round_mean", "round_sqrt"])
def test_round_sized_step_rules_are_refused(tmp_path, rule):
    # (momentum is refused too, and a chain run cannot have it: core/config.py)
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    config = dataclasses.replace(CONFIG, step_rule=rule)
    live = LiveModel(make_estimator(load_model(config.model)[0], config))
    with pytest.raises(ValueError, match="round-sized"):
        live.trust(read_checkpoint_meta(tmp_path))


def test_a_cut_that_does_not_hold_its_stated_rows_is_refused(tmp_path):
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    meta = {**read_checkpoint_meta(tmp_path), "ledger_messages": 5}
    live = LiveModel(make_estimator(load_model(CONFIG.model)[0], CONFIG))
    with pytest.raises(ValueError, match="as many rows"):
        live.trust(meta)


def test_repair_plans_no_bucket_wholly_below_the_floor():
    theirs = {b: (10, bytes([b]) * 32) for b in range(5)}
    floor = 2 * BUCKET_ROUNDS + 5  # inside bucket 2: it is asked for, 0 and 1 are not

    def wanted(floor_round: int) -> list[int]:
        runs = plan(theirs, {}, 10**6, _Exchange(deadline=0.0), {}, b"s", True, 4096, floor_round)
        return [bucket for run in runs for bucket, _ in run]

    assert wanted(0) == [0, 1, 2, 3, 4]
    assert wanted(floor) == [2, 3, 4]
