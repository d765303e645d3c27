"""An audited peer's restart (peer/latejoin.py `LateJoin.restore_settled`), without
processes: the ledger streamed from a snapshot in one pass, the peer's own checkpoint
used though it holds rows the settled state does not (it was written at stop, of every
row then), and the audits' account of what the weights hold (`applied`, `waiting`,
pending) the same as the account the whole ledger as a list gave before."""

import asyncio
import types

import numpy as np
import pytest
import torch

from peer.audit_duty import PeerAudits
from peer.latejoin import LateJoin
from peer.state_rewind import FROZEN_AFTER
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings, ProbationSettings
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONFIG = RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=3, directions=2)
PEERS = [bytes.fromhex("002408011220") + bytes([i]) * 32 for i in range(1, 6)]
NEWCOMER = PEERS[4]  # on probation, never vouched: its rows wait, they never count
LAG = 2
ROUNDS = 300  # past the audits' frozen horizon: most restored rows are packed at once


def _messages() -> list[UpdateMessage]:
    rng = np.random.default_rng(0)
    return [
        UpdateMessage(t, p, quantize_scalars(rng.normal(size=2)))
        for t in range(ROUNDS)
        for p in PEERS
    ]


def _peer(ledger: Ledger, data_dir) -> tuple[LiveModel, PeerAudits, LateJoin]:
    model, _ = load_model(CONFIG.model)
    live = LiveModel(make_estimator(model, CONFIG), ledger)
    settings = AuditSettings(enabled=True, lag=LAG)
    probation = ProbationSettings(founders=frozenset(PEERS[:4]), share=1.0)
    audits = PeerAudits(settings, b"secret", PEERS[0], ledger, live, None, probation)

    async def on_model_thread(function, *args):
        return function(*args)

    join = LateJoin.__new__(LateJoin)  # what restore_settled reads, and nothing else
    join.s = types.SimpleNamespace(data_dir=data_dir)
    join.live, join.audits, join.run = live, audits, on_model_thread
    join.trusted_round = None  # (no link trusted: a restart)
    return live, audits, join


def test_an_audited_restart_uses_its_checkpoint_and_accounts_as_the_whole_list_did(tmp_path):
    messages = _messages()
    ledger = Ledger(tmp_path / "ledger.sqlite", CONFIG.run_id)
    ledger.claim(CONFIG, "")
    ledger.add(messages)
    # The peer stopped after round ROUNDS - 1: its checkpoint holds every row then.
    before, _, _ = _peer(ledger, tmp_path)
    before.restore(before.cut())
    before.checkpoint(tmp_path, before.cut(), {"round": ROUNDS})

    first = ROUNDS  # the round it trains next
    live, audits, join = _peer(ledger, tmp_path)
    how = asyncio.run(join.restore_settled(first))

    limit = first - LAG
    settled = [m for m in messages if m.round < limit and m.peer != NEWCOMER]
    waiting = [m for m in messages if m.round < limit and m.peer == NEWCOMER]
    later = [m for m in messages if m.round >= limit]
    taken_back = len(messages) - len(settled)
    assert how == (
        f"checkpoint of round {ROUNDS} - {taken_back} it holds that this state does not "
        f"(settled state of round {first})"
    )
    # the audits' account: what a restore from the whole ledger as a list gave
    _, reference, _ = _peer(ledger, tmp_path)
    reference.round = first
    reference.applied = list(settled)
    assert sorted(audits.applied, key=lambda m: (m.round, m.peer)) == settled
    assert audits.held_digest() == reference.held_digest()
    # rows older than any audit searches were packed as they passed
    floor = first - FROZEN_AFTER - LAG
    assert min(m.round for m in audits.applied.recent) == floor
    assert audits.applied.frozen_peers() == set(PEERS[:4])
    assert audits.waiting == waiting and live.pending == later
    # the weights: base + the settled rows, to float32 rounding
    model, _ = load_model(CONFIG.model)
    replay(model, CONFIG, settled)
    for name, tensor in LiveModel(make_estimator(model, CONFIG)).weights().items():
        torch.testing.assert_close(live.weights()[name], tensor, atol=1e-5, rtol=0, msg=name)

    # Without the checkpoint: a replay of the same rows, the same account.
    (tmp_path / "checkpoint.json").unlink()
    live, audits, join = _peer(ledger, tmp_path)
    how = asyncio.run(join.restore_settled(first))
    assert how == f"replay of {len(settled)} ledger messages (settled state of round {first})"
    assert audits.held_digest() == reference.held_digest()
    assert audits.waiting == waiting and live.pending == later
