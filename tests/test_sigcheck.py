"""Signatures checked in bulk (network/transport/sigcheck.py, issue 46): the same answers
as `verify_pubsub_signature`, in worker processes, for repair pages (`Prechecked`) and a
restart's ledger check (`Ledger.verify(check_many=...)`)."""

import pytest
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.proto import p2pd_pb2 as pb

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.gossip.admission import Admission, Outcome
from seedflood_p2p.network.gossip.repair import Prechecked, UpdateTable
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.network.transport.sigcheck import SignaturePool, check_many, signed_bytes
from seedflood_p2p.protocol.framing import topic_for
from seedflood_p2p.protocol.message import Envelope, UpdateMessage
from seedflood_p2p.protocol.update import encode_update
from seedflood_p2p.storage import ledger as ledger_module
from seedflood_p2p.storage.ledger import Ledger

RUN = "cd" * 32
TOPIC = topic_for(RUN)


class Signer:
    def __init__(self, run: str = RUN) -> None:
        self.run, self.topic = run, topic_for(run)
        self.key = Ed25519PrivateKey.generate()
        public = self.key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        self.id = bytes.fromhex("002408011220") + public

    def row(self, round_: int, scalar: float) -> tuple[UpdateMessage, Envelope]:
        """As go-libp2p-pubsub signs (the protobuf library's encoding, not ours)."""
        data, seqno = encode_update(self.run, round_, (scalar,)), round_.to_bytes(8, "big")
        body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[self.topic])
        setattr(body, "from", self.id)
        signature = self.key.sign(b"libp2p-pubsub:" + body.SerializeToString())
        return UpdateMessage(round_, self.id, (scalar,)), Envelope(data, seqno, signature)


def _item(message: UpdateMessage, envelope: Envelope) -> tuple:
    return (message.peer, envelope.data, envelope.seqno, TOPIC, envelope.signature)


def _cases() -> list[tuple]:
    """Valid rows of 3 signers, and every way one can be wrong."""
    signers = [Signer() for _ in range(3)]
    items = [_item(*s.row(t, 0.5)) for t in range(4) for s in signers]
    sender, data, seqno, topic, sig = items[0]
    items += [
        (sender, data + b"x", seqno, topic, sig),  # payload changed
        (sender, data, b"\1" * 8, topic, sig),  # seqno changed
        (sender, data, seqno, topic + "x", sig),  # another topic
        (items[1][0], data, seqno, topic, sig),  # another signer
        (sender, data, seqno, topic, sig[:-1]),  # short signature
        (sender, data, seqno, topic, b""),  # no signature
        (b"\x00\x25" + sender[2:] + b"!", data, seqno, topic, sig),  # not an Ed25519 id
        (sender[:6] + b"\xff" * 32, data, seqno, topic, sig),  # not a curve point
    ]
    return items


def test_signed_bytes_are_the_protobuf_encoding():
    for sender, data, seqno, topic in [
        (b"\x00" * 38, b"d" * 200, b"12345678", "t" * 19),
        (b"", b"", b"", ""),  # proto2: empty fields are written too
        (b"p" * 130, b"x" * 300, b"s", "topic"),  # lengths over one varint byte
    ]:
        body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[topic])
        setattr(body, "from", sender)
        assert signed_bytes(sender, data, seqno, topic) == (
            b"libp2p-pubsub:" + body.SerializeToString()
        )


def test_check_many_and_the_pool_answer_as_verify_pubsub_signature():
    items = _cases()
    expected = [verify_pubsub_signature(*item) for item in items]
    assert expected.count(True) == 12 and expected.count(False) == 8
    assert check_many(items) == expected
    with SignaturePool(workers=2, min_batch=1) as pool:
        assert pool.check(items) == expected
        assert pool.pooled == len(items) and pool.workers == 2
        # a worker that died: its share is checked here, and it is replaced next time
        pool._workers[0].proc.kill()
        pool._workers[0].proc.wait()
        assert pool.check(items) == expected
        assert pool.workers == 1
        assert pool.check(items) == expected
        assert pool.workers == 2
    assert pool.workers == 0


def test_a_pool_ends_idle_workers():
    import time

    pool = SignaturePool(workers=1, min_batch=1, idle=0.2)
    items = _cases()
    assert pool.check(items) == check_many(items)
    procs = [w.proc for w in pool._workers]
    deadline = time.monotonic() + 30
    while pool.workers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.workers == 0 and all(p.poll() is not None for p in procs)
    assert pool.check(items) == check_many(items)  # started again when needed
    pool.close()


def _ledger(path, rounds: int = 40) -> tuple[Ledger, list[Signer]]:
    from seedflood_p2p.core.config import RunConfig

    config = RunConfig(salt="sigcheck", directions=1)
    signers = [Signer(config.run_id) for _ in range(4)]
    ledger = Ledger(path, config.run_id)
    ledger.claim(config, "")
    for t in range(rounds):
        rows = [s.row(t, 0.25 * (t % 7) - 0.5) for s in signers]
        ledger.add([m for m, _ in rows], [e for _, e in rows])
    return ledger, signers


def test_ledger_verify_in_batches_matches_one_by_one(tmp_path, monkeypatch):
    """Same counts; with a tampered row, the same first row named, batch or not (chunks
    smaller than the ledger, so a failure in a later chunk is found too)."""
    monkeypatch.setattr(ledger_module, "VERIFY_CHUNK", 16)
    ledger, signers = _ledger(tmp_path / "l.sqlite")
    with SignaturePool(workers=2, min_batch=1) as pool:
        one = ledger.verify(verify_pubsub_signature, "fix it", 1)
        many = ledger.verify(verify_pubsub_signature, "fix it", 1, check_many=pool.check)
        assert (one.signed, one.unsigned) == (many.signed, many.unsigned) == (160, 0)
        assert pool.pooled == 160
        # Two bad rows: a signature swapped in round 30, a malformed row in round 33.
        for sql in (
            "UPDATE messages SET signature = (SELECT signature FROM messages WHERE round = 1 "
            "LIMIT 1) WHERE round = 30 AND peer = (SELECT MIN(peer) FROM messages)",
            "UPDATE messages SET scalars = X'00' WHERE round = 33",
        ):
            ledger._db.execute(sql)
            errors = []
            for kwargs in ({}, {"check_many": pool.check}):
                with pytest.raises(UserError) as info:
                    ledger.verify(verify_pubsub_signature, "fix it", 1, **kwargs)
                errors.append(str(info.value))
            assert errors[0] == errors[1] and "round 30" in errors[0]
    ledger.close()


async def test_a_repair_page_is_checked_ahead_in_workers(tmp_path):
    """UpdateTable.insert checks a page's new rows in the pool; the admission's checks are
    then answered from memory, with the same verdicts (a forged row still refused)."""
    ledger = Ledger(":memory:", RUN)
    me = Signer()
    prechecked = Prechecked(SignaturePool(workers=1, min_batch=1))
    admission = Admission(
        ledger, 1, me.id, NodeMetrics(), max_ahead=10_000, verify=prechecked.verify
    )
    table = UpdateTable(ledger, admission, NodeMetrics(), lambda v: None, prechecked)
    signers = [Signer() for _ in range(4)]
    page = [s.row(t, 0.5) for t in range(20) for s in signers]
    held = page[:8]
    await table.insert(held, b"server", True)  # 8 rows held before: skipped, not checked
    prechecked.hits = 0
    before = prechecked.pool.pooled
    intake = await table.insert(page, b"server", True)
    assert intake.new == 72 and not intake.bad
    assert prechecked.pool.pooled - before == 72 and prechecked.hits == 72
    assert prechecked._known == {}  # nothing kept after the page
    m, e = signers[0].row(25, 0.5)
    forged = (m, Envelope(e.data, e.seqno, bytes(64)))
    verdicts = await admission.repair([forged], b"server")  # not prechecked: checked here
    assert verdicts[0].outcome is Outcome.DROPPED and verdicts[0].reason == "bad_signature"
    intake = await table.insert([forged], b"server", True)
    assert intake.bad and len(ledger) == 80
    prechecked.close()
