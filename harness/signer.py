"""An Ed25519 identity that signs updates exactly as go-libp2p-pubsub does, for a run id
RUN: what the tests and benchmarks that feed repair and admission without daemons sign
their rows with (tests/test_admission.py, bench/bench_repair_heal.py)."""

from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.proto import p2pd_pb2 as pb

from seedflood_p2p.protocol.framing import topic_for
from seedflood_p2p.protocol.message import Envelope, UpdateMessage
from seedflood_p2p.protocol.update import encode_update

RUN = "ab" * 32


class Peer:
    """An Ed25519 identity that signs updates exactly as go-libp2p-pubsub does."""

    def __init__(self) -> None:
        self.key = Ed25519PrivateKey.generate()
        public = self.key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        self.id = bytes.fromhex("002408011220") + public

    def envelope(self, round_: int, scalars: tuple, data: bytes | None = None) -> Envelope:
        data = encode_update(RUN, round_, scalars) if data is None else data
        seqno = round_.to_bytes(8, "big")
        body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[topic_for(RUN)])
        setattr(body, "from", self.id)
        return Envelope(data, seqno, self.key.sign(b"libp2p-pubsub:" + body.SerializeToString()))

    def gossip(self, round_: int, scalars: tuple) -> tuple[bytes, Envelope]:
        return self.id, self.envelope(round_, scalars)

    def row(self, round_: int, scalars: tuple) -> tuple[UpdateMessage, Envelope]:
        return UpdateMessage(round_, self.id, scalars), self.envelope(round_, scalars)
