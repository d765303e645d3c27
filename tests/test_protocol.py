"""The update's wire format and every validation rule (protocol/update.py), and the repair
requests and replies (protocol/repair.py), one by one."""

import math

import msgpack
import pytest
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.proto import p2pd_pb2 as pb

from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.network.transport.identity import verify_pubsub_signature
from seedflood_p2p.protocol.framing import PROTOCOL_VERSION, Rejected, run_tag, topic_for
from seedflood_p2p.protocol.message import Envelope, UpdateMessage, pack_scalars
from seedflood_p2p.protocol.repair import (
    BUCKET_ROUNDS,
    FETCH_LIMIT,
    UPDATE_ROWS,
    decode_digest_request,
    decode_digests,
)
from seedflood_p2p.protocol.update import (
    MAX_UPDATE_BYTES,
    WindowRule,
    check_against_ledger,
    check_envelope,
    decode_update,
    encode_update,
    keeps_new,
)

RUN = "ab" * 32
PACK = msgpack.Packer(use_bin_type=True).pack
HALF = pack_scalars((0.5,))  # one float16 scalar as it travels


def test_update_round_trip_is_small_and_float16():
    data = encode_update(RUN, 123_456, (0.1,))
    assert len(data) <= 20
    m = decode_update(data, RUN, b"sender", directions=1)
    assert (m.round, m.peer) == (123_456, b"sender")
    assert m.scalars[0] == pytest.approx(0.1, rel=1e-3) and m.scalars[0] != 0.1  # float16


def test_sixteen_directions_fit_in_64_bytes_at_any_round():
    scalars = tuple(float(i) - 7.5 for i in range(16))  # exact in float16
    data = encode_update(RUN, MAX_ROUND, scalars)
    assert len(data) <= MAX_UPDATE_BYTES
    assert decode_update(data, RUN, b"s", directions=16).scalars == scalars
    with pytest.raises(Rejected, match="malformed"):  # a run of k = 4 refuses 16 scalars
        decode_update(data, RUN, b"s", directions=4)


@pytest.mark.parametrize(
    "payload, reason",
    [
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, HALF]) + b"\0" * MAX_UPDATE_BYTES, "oversized"),
        (b"\xc1", "malformed"),
        (PACK({"a": 1}), "malformed"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1]), "malformed"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), "1", HALF]), "malformed"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, 0.5]), "malformed"),  # a float, not float16s
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, b"\0"]), "malformed"),  # odd length
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, b""]), "malformed"),  # no scalar
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, b"\0" * 34]), "malformed"),  # 17 scalars
        (PACK([PROTOCOL_VERSION + 1, run_tag(RUN), 1, HALF]), "bad_version"),
        (PACK([True, run_tag(RUN), 1, HALF]), "malformed"),  # bool is not version 1
        (PACK([float(PROTOCOL_VERSION), run_tag(RUN), 1, HALF]), "malformed"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), True, HALF]), "malformed"),
        (PACK([PROTOCOL_VERSION, b"\1\2\3\4", 1, HALF]), "wrong_run"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, pack_scalars((math.inf,))]), "non_finite"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 1, b"\x00\x7e"]), "non_finite"),  # NaN
        (PACK([PROTOCOL_VERSION, run_tag(RUN), -1, HALF]), "out_of_window"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), MAX_ROUND + 1, HALF]), "out_of_window"),
        (PACK([PROTOCOL_VERSION, run_tag(RUN), 2**64 - 1, HALF]), "out_of_window"),
    ],
)
def test_each_invalid_payload_is_rejected_with_its_reason(payload, reason):
    with pytest.raises(Rejected) as info:
        decode_update(payload, RUN, b"sender")
    assert info.value.reason == reason


def test_window_duplicate_and_equivocation():
    WindowRule(10).check(UpdateMessage(15, b"p", (0.5,)), reference=5)
    with pytest.raises(Rejected, match="out_of_window"):
        WindowRule(10).check(UpdateMessage(16, b"p", (0.5,)), reference=5)
    check_against_ledger(UpdateMessage(1, b"p", (0.5,)), None)
    with pytest.raises(Rejected, match="duplicate"):
        check_against_ledger(UpdateMessage(1, b"p", (0.5, 1.0)), (0.5, 1.0))
    with pytest.raises(Rejected, match="equivocation"):
        check_against_ledger(UpdateMessage(1, b"p", (0.5, 1.0)), (0.5, 0.25))
    with pytest.raises(Rejected, match="equivocation"):  # other bits, other ledger digest
        check_against_ledger(UpdateMessage(1, b"p", (-0.0,)), (0.0,))


def test_equivocation_rule_is_the_same_whatever_the_order_seen():
    pairs = [((0.5,), (0.25,)), ((-1.0,), (2.0,)), ((0.0,), (-0.0,)), ((1.0, 0.0), (1.0, -0.0))]
    pairs += [((1.0, 5.0), (2.0, -5.0))]
    for a, b in pairs:
        # a peer holding either copy ends with the same one once it has seen both
        kept_if_a_first = b if keeps_new(a, b) else a
        kept_if_b_first = a if keeps_new(b, a) else b
        assert pack_scalars(kept_if_a_first) == pack_scalars(kept_if_b_first)
        assert kept_if_a_first == min(a, b)
    assert not keeps_new((0.25,), (0.25,))


def _signed(key: Ed25519PrivateKey, round_: int, scalar: float) -> tuple[UpdateMessage, Envelope]:
    """An update signed exactly as go-libp2p-pubsub signs it."""
    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    peer = bytes.fromhex("002408011220") + public
    data, seqno = encode_update(RUN, round_, (scalar,)), round_.to_bytes(8, "big")
    body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[topic_for(RUN)])
    setattr(body, "from", peer)
    signature = key.sign(b"libp2p-pubsub:" + body.SerializeToString())
    return decode_update(data, RUN, peer), Envelope(data, seqno, signature)


def test_repair_rows_carry_verifiable_signatures():
    alice, mallory = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    message, envelope = _signed(alice, 7, 0.5)
    rows = UPDATE_ROWS.decode_rows(UPDATE_ROWS.encode_rows([(message, envelope)]), 10)
    assert rows == [(message, envelope)]
    check_envelope(message, envelope, RUN, verify_pubsub_signature)  # genuine: accepted

    forged_scalar = UpdateMessage(7, message.peer, (0.25,))  # Mallory edits Alice's scalar
    with pytest.raises(Rejected, match="mismatch"):
        check_envelope(forged_scalar, envelope, RUN, verify_pubsub_signature)
    _, mallory_env = _signed(mallory, 7, 0.25)  # ... or signs a new one under Alice's name
    with pytest.raises(Rejected, match="bad_signature"):
        check_envelope(
            UpdateMessage(7, message.peer, (0.25,)), mallory_env, RUN, verify_pubsub_signature
        )
    with pytest.raises(Rejected, match="bad_signature"):  # envelope of another run
        check_envelope(message, envelope, "cd" * 32, verify_pubsub_signature)


def test_malformed_repair_rows():
    with pytest.raises(Rejected, match="bad_reply"):
        UPDATE_ROWS.decode_rows(b"\xc1", 10)
    with pytest.raises(Rejected, match="bad_reply"):
        UPDATE_ROWS.decode_rows(PACK([[1, b"p", HALF]]), 10)  # no envelope
    with pytest.raises(Rejected, match="bad_reply"):  # a round SQLite cannot hold
        UPDATE_ROWS.decode_rows(PACK([[2**64 - 1, b"p", HALF, b"d", b"s", b"g"]]), 10)
    with pytest.raises(Rejected, match="bad_reply"):  # scalars as a float, not float16 bytes
        UPDATE_ROWS.decode_rows(PACK([[1, b"p", 0.5, b"d", b"s", b"g"]]), 10)
    with pytest.raises(Rejected, match="non_finite"):
        UPDATE_ROWS.decode_rows(PACK([[1, b"p", pack_scalars((math.nan,)), b"d", b"s", b"g"]]), 10)


def _rows(*keys):
    return [(UpdateMessage(r, p, (0.5,)), Envelope(b"d", b"s", b"g")) for r, p in keys]


def test_fetch_rows_must_advance_past_the_cursor_within_the_bucket():
    UPDATE_ROWS.check_rows_follow(_rows((5, b"a"), (5, b"b"), (6, b"a")), (4, b"\xff"), 63)
    UPDATE_ROWS.check_rows_follow([], (4, b"z"), 63)
    for rows, cursor in [
        (_rows((5, b"a")), (5, b"a")),  # not after the cursor: a server could loop us forever
        (_rows((5, b"b"), (5, b"a")), (4, b"z")),  # not ascending
        (_rows((64, b"a")), (4, b"z")),  # past the bucket asked for
    ]:
        with pytest.raises(Rejected) as info:
            UPDATE_ROWS.check_rows_follow(rows, cursor, 63)
        assert info.value.reason == "bad_reply"


@pytest.mark.parametrize(
    "reply",
    [
        PACK(None),
        b"\xc1",
        PACK([[0, 1]]),
        PACK([[0, 0, b"\0" * 9]]),  # hash of the wrong size
        PACK([[0, 0, 2**40]]),  # "hash" that would allocate 1 TB
        PACK([[2**63, 1, b"\0" * 32]]),  # bucket beyond any round
        PACK([[-1, 1, b"\0" * 32]]),
        PACK([[True, 1, b"\0" * 32]]),
        PACK([[0, True, b"\0" * 32]]),
        PACK([[0, 1.0, b"\0" * 32]]),
        PACK([[0, 1, b"\0" * 32], [0, 2, b"\1" * 32]]),  # one bucket, two answers
    ],
)
def test_bad_digest_replies_are_rejected(reply):
    with pytest.raises(Rejected) as info:
        decode_digests(reply)
    assert info.value.reason == "bad_reply"


def test_good_digest_reply_and_served_requests():
    assert decode_digests(PACK([[0, 3, b"\1" * 32], [2, 1, b"\2" * 32]])) == {
        0: (3, b"\1" * 32),
        2: (1, b"\2" * 32),
    }
    assert decode_digest_request(PACK([RUN, BUCKET_ROUNDS])) == RUN
    for bad in [
        PACK([RUN, 7]),
        PACK([RUN]),
        PACK([1, BUCKET_ROUNDS]),
        b"\xc1",
        PACK([RUN, float(BUCKET_ROUNDS)]),  # 64.0 is not the integer 64
        PACK([RUN, BUCKET_ROUNDS, 0]),
        PACK({RUN: BUCKET_ROUNDS}),
        PACK("ab"),  # two characters must not unpack into two fields
    ]:
        assert decode_digest_request(bad) is None
    good = [RUN, -1, b"\xff" * 64, 63, FETCH_LIMIT]
    assert UPDATE_ROWS.decode_fetch_request(PACK(good)) == (
        RUN,
        (-1, b"\xff" * 64),
        63,
        FETCH_LIMIT,
    )
    for i, value in [
        (4, -1),  # LIMIT -1 is "no limit" to SQLite
        (4, FETCH_LIMIT + 1),
        (2, 400_000_000),  # an int where a peer id belongs
        (2, b"\xff" * 65),
        (1, 2**63),
        (3, -5),
        (4, 64.0),  # floats and bools are not integers
        (4, True),
        (1, True),
        (1, 0.0),
        (3, 63.0),
    ]:
        assert UPDATE_ROWS.decode_fetch_request(PACK([*good[:i], value, *good[i + 1 :]])) is None


def test_scalars_pack_and_unpack_as_numpy_does():
    """pack_scalars / unpack_scalars go through `struct` (issue 46: numpy's per-call cost
    was several percent of a flooded daemon); their bytes and values must be numpy's float16
    ones: every bit pattern, random doubles, ties between float16 neighbours, overflow."""
    import random

    import numpy as np

    from seedflood_p2p.protocol.message import pack_scalars, unpack_scalars

    data = np.arange(1 << 16, dtype=np.uint16).tobytes()
    ref = np.frombuffer(data, dtype="<f2").astype(np.float64)
    got = np.array(unpack_scalars(data))
    assert np.array_equal(got, ref, equal_nan=True)
    finite = tuple(float(v) for v in ref[np.isfinite(ref)])
    assert pack_scalars(finite) == np.asarray(finite, dtype="<f2").tobytes()
    positive = ref[:0x7C00]
    ties = tuple(((positive[:-1] + positive[1:]) / 2).tolist())
    assert pack_scalars(ties) == np.asarray(ties, dtype="<f2").tobytes()
    rng = random.Random(0)
    for _ in range(500):
        x = tuple(rng.uniform(-1, 1) * 2.0 ** rng.randint(-30, 17) for _ in range(16))
        with np.errstate(over="ignore"):
            assert pack_scalars(x) == np.asarray(x, dtype="<f2").tobytes(), x
    with pytest.raises(ValueError):
        unpack_scalars(b"\x00\x01\x02")
