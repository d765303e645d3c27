"""Identities that cost work (`extra.identity_work`, issue 45 item 2): the puzzle, its
setting in the manifest, admission's `no_work` drops, the join refusal, `seedflood keygen`."""

from __future__ import annotations

import asyncio
import hashlib

import base58
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_admission import RUN, Peer

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import IdentityWork, work_bits
from seedflood_p2p.network.gossip.admission import Admission, Outcome
from seedflood_p2p.network.gossip.audit_intake import AuditIntake
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.transport.identity import grind_identity, load_or_create_identity
from seedflood_p2p.protocol.audit_record import encode_audit
from seedflood_p2p.protocol.framing import DROP_REASONS, Rejected, check_sender_work
from seedflood_p2p.protocol.message import Envelope
from seedflood_p2p.storage.ledger import Ledger

RUN_KEY = bytes.fromhex(RUN)


def _worked_peer(work: IdentityWork) -> Peer:
    """A test signer whose key carries `work` (ground like `seedflood keygen`)."""
    from hivemind.proto import crypto_pb2

    blob, peer_id, _ = grind_identity(work)
    peer = Peer()
    peer.key = Ed25519PrivateKey.from_private_bytes(
        crypto_pb2.PrivateKey.FromString(blob).data[:32]
    )
    peer.id = peer_id
    return peer


def _lazy_peer(work: IdentityWork) -> Peer:
    """A fresh key without the work (most are: 1 - 2^-d)."""
    while True:
        peer = Peer()
        if not work.qualifies(peer.id):
            return peer


def test_the_puzzle_counts_leading_zero_bits_of_the_run_bound_hash():
    peer = Peer().id
    digest = hashlib.blake2b(RUN_KEY + peer, digest_size=32).digest()
    bits = 256 - int.from_bytes(digest, "big").bit_length()
    assert work_bits(RUN_KEY, peer) == bits
    assert IdentityWork(bits, RUN_KEY).qualifies(peer)
    assert not IdentityWork(bits + 1, RUN_KEY).qualifies(peer)
    assert IdentityWork(bits + 1, RUN_KEY, frozenset({peer})).qualifies(peer)  # named: exempt
    assert IdentityWork(0, RUN_KEY).qualifies(peer) and not IdentityWork().enabled
    work = IdentityWork(6, RUN_KEY)
    worked = _worked_peer(work).id
    assert work_bits(RUN_KEY, worked) >= 6
    # bound to the run: the same key for another run id is (almost surely) worth little
    other = bytes.fromhex("cd" * 32)
    assert (
        work_bits(other, worked)
        == 256
        - int.from_bytes(
            hashlib.blake2b(other + worked, digest_size=32).digest(), "big"
        ).bit_length()
    )
    check_sender_work(worked, work)
    with pytest.raises(Rejected) as exc:
        check_sender_work(_lazy_peer(work).id, work)
    assert exc.value.reason == "no_work" and "no_work" in DROP_REASONS


def test_the_setting_round_trips_and_old_manifests_keep_their_run_id():
    assert "identity_work" not in RunConfig().to_json()
    assert RunConfig().identity_work == IdentityWork()  # absent: off
    config = RunConfig(extra={"identity_work": {"difficulty": 12}})
    again = RunConfig.from_json(config.to_json())
    assert again == config and again.run_id == config.run_id != RunConfig().run_id
    assert again.identity_work.difficulty == 12 and again.identity_work.run_key == again.run_key
    for bad in ({"difficulty": 33}, {"difficulty": -1}, {"difficulty": 1.5}, {"bits": 3}, 7):
        with pytest.raises(UserError, match="extra.identity_work"):
            RunConfig(extra={"identity_work": bad})
    # the identities the manifest names cannot grind against its hash: exempt
    founder, creator = Peer().id, Peer().id
    named = RunConfig(
        extra={
            "identity_work": {"difficulty": 20},
            "probation": {"founders": [base58.b58encode(founder).decode()]},
            "join": {"mode": "ticketed", "creator": base58.b58encode(creator).decode()},
        }
    )
    assert named.identity_work.exempt == {founder, creator}
    assert named.identity_work.qualifies(founder) and named.identity_work.qualifies(creator)


def test_admission_drops_updates_repairs_and_audits_of_identities_without_work():
    work = IdentityWork(6, RUN_KEY)
    worked, lazy, me = _worked_peer(work), _lazy_peer(work), _worked_peer(work)
    ledger = Ledger(":memory:", RUN)
    admission = Admission(ledger, 1, me.id, NodeMetrics(), 50, work=work)
    verdicts = admission.gossip([worked.gossip(1, (0.5,)), lazy.gossip(1, (0.5,))])
    assert [(v.outcome, v.reason) for v in verdicts] == [
        (Outcome.ACCEPTED, ""),
        (Outcome.DROPPED, "no_work"),
    ]
    (r,) = asyncio.run(admission.repair([lazy.row(2, (0.5,))], server=worked.id))
    assert (r.outcome, r.reason) == (Outcome.DROPPED, "no_work") and len(ledger) == 1
    assert admission.metrics.drop_counts()["no_work"] == 2
    intake = AuditIntake(ledger, 1, admission)
    record = Envelope(encode_audit(RUN, worked.id, 1, (0.5,)), b"seq", b"sig")
    assert intake.admit([(lazy.id, record)]) == []
    assert intake.counts["dropped:no_work"] == 1
    assert len(intake.admit([(_worked_peer(work).id, record)])) == 1  # an auditor with work
    # a run without work: the same stranger is admitted
    open_run = Admission(Ledger(":memory:", RUN), 1, me.id, NodeMetrics(), 50)
    assert open_run.gossip([lazy.gossip(1, (0.5,))])[0].outcome is Outcome.ACCEPTED


def test_a_peer_without_work_is_refused_at_start_and_keygen_makes_one(tmp_path, capsys):
    from peer.join import check_own_work
    from seedflood.cli import main

    config = RunConfig(extra={"identity_work": {"difficulty": 8}})
    key = tmp_path / "identity.key"
    peer_id = load_or_create_identity(key).to_bytes()
    while config.identity_work.qualifies(peer_id):  # 1 in 256 fresh keys already qualifies
        key.unlink()
        peer_id = load_or_create_identity(key).to_bytes()
    with pytest.raises(UserError) as exc:
        check_own_work(config, peer_id, key)
    line = str(exc.value)
    assert "\n" not in line and "8 bits of identity work" in line
    assert f"seedflood keygen --run-id {config.run_id} --difficulty 8 --out {key}" in line
    check_own_work(RunConfig(), peer_id, key)  # a run without work: any key
    out = tmp_path / "worked.key"
    assert main(["keygen", "--run-id", config.run_id, "--difficulty", "8", "--out", str(out)]) == 0
    made = load_or_create_identity(out).to_bytes()  # a valid key file, mode 0600
    assert work_bits(config.run_key, made) >= 8
    check_own_work(config, made, out)
    printed = capsys.readouterr()
    assert base58.b58encode(made).decode() in printed.out and "CPU seconds" in printed.out
    assert "grinding" in printed.err
    assert main(["keygen", "--run-id", config.run_id, "--difficulty", "8", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err  # never replaces a key
