"""The Ed25519 check (`sigcheck.verify_ed25519`): libsodium first, OpenSSL for its no.

The rule the project applies is OpenSSL's (pyca/cryptography). libsodium is twice as fast
here; its yes is taken as final, which is right only if everything libsodium accepts
OpenSSL accepts too. These vectors are the known places where Ed25519 libraries disagree
(small-order and non-canonical points, non-canonical S: "Taming the many EdDSAs", 2020),
each built to satisfy the cofactorless equation where that is possible, plus random
mutations of honest signatures. For every one: the answer equals OpenSSL's, and where
libsodium says yes, OpenSSL says yes.
"""

import hashlib
import random

import pytest
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nacl.bindings import (
    crypto_core_ed25519_add,
    crypto_core_ed25519_sub,
    crypto_scalarmult_ed25519_base_noclamp,
    crypto_scalarmult_ed25519_noclamp,
    crypto_sign_open,
)

from seedflood_p2p.network.transport import sigcheck
from seedflood_p2p.network.transport.sigcheck import _openssl_verify, verify_ed25519

L = 2**252 + 27742317777372353535851937790883648493  # the group order
P = 2**255 - 19
IDENTITY = (1).to_bytes(32, "little")
ORDER_2 = (P - 1).to_bytes(32, "little")  # y = -1
ORDER_8 = bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a")
IDENTITY_NONCANONICAL = (P + 1).to_bytes(32, "little")  # y = p + 1 = 1 mod p


def _sodium(public: bytes, signature: bytes, message: bytes) -> bool:
    if len(signature) != 64:
        return False
    try:
        crypto_sign_open(signature + message, public)
        return True
    except Exception:
        return False


def _scalar(b: bytes) -> int:
    return int.from_bytes(b, "little")


def _le(n: int) -> bytes:
    return n.to_bytes(32, "little")


def _k(r: bytes, public: bytes, message: bytes) -> int:
    return _scalar(hashlib.sha512(r + public + message).digest()) % L


def _base(s: int) -> bytes:
    return crypto_scalarmult_ed25519_base_noclamp((s % L).to_bytes(32, "little"))


def _times(point: bytes, k: int) -> bytes:
    """[k]point for any point (small-order ones too: libsodium refuses those, so by hand)."""
    out, add = None, point
    while k:
        if k & 1:
            out = add if out is None else crypto_core_ed25519_add(out, add)
        add = crypto_core_ed25519_add(add, add)
        k >>= 1
    return IDENTITY if out is None else out


def _honest(message: bytes) -> tuple[bytes, bytes]:
    key = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    return public, key.sign(message)


def _vectors() -> list[tuple[str, bytes, bytes, bytes]]:
    """(name, public key, signature, message)."""
    msg = b"libp2p-pubsub:an update"
    public, sig = _honest(msg)
    out = [
        ("honest", public, sig, msg),
        ("wrong message", public, sig, msg + b"!"),
        ("S + L (non-canonical S)", public, sig[:32] + _le(_scalar(sig[32:]) + L), msg),
        ("S = L", public, sig[:32] + L.to_bytes(32, "little"), msg),
        ("all zero", bytes(32), bytes(64), msg),
    ]  # fmt: skip
    # A small-order key: [k]A is the identity (order 1) or a torsion point; pick R so the
    # cofactorless equation [S]B = R + [k]A holds.
    s = 123456789
    out.append(("identity A, R = [s]B", IDENTITY, _base(s) + s.to_bytes(32, "little"), msg))
    out.append(("identity A and R, S = 0", IDENTITY, IDENTITY + bytes(32), msg))
    for name, a in (("order-2 A", ORDER_2), ("order-8 A", ORDER_8)):
        found = [
            (name, a, r + _le(s2), msg)
            for s2 in range(s, s + 64)
            for t in range(8)  # guess k mod 8; keep an R whose k agrees
            for r in [crypto_core_ed25519_sub(_base(s2), _times(a, t)) if t else _base(s2)]
            if _k(r, a, msg) % 8 == t
        ]
        out.append(found[0])
    # A mixed-order key: an honest key plus a torsion point, the signature made for it.
    x = 987654321
    a = crypto_core_ed25519_add(_base(x), ORDER_8)
    for nonce in range(64):
        r = _base(1000 + nonce)
        k = _k(r, a, msg)
        if k % 8 == 0:  # then [k]A = [k x]B, and S = nonce + k x satisfies the equation
            out.append(("mixed-order A", a, r + _le((1000 + nonce + k * x) % L), msg))
            break
    # Small-order R with an honest-looking key: [S]B = R + [k]A has no solution, so this
    # is false everywhere; it must stay false.
    out.append(("order-8 R", public, ORDER_8 + sig[32:], msg))
    out.append(("non-canonical identity A", IDENTITY_NONCANONICAL, _base(s) + _le(s), msg))
    return out


VECTORS = _vectors()


@pytest.mark.parametrize("name,public,signature,message", VECTORS, ids=[v[0] for v in VECTORS])
def test_the_answer_is_openssl_s_and_libsodium_s_yes_implies_openssl_s(
    name, public, signature, message
):
    openssl = _openssl_verify(public, signature, message)
    assert verify_ed25519(public, signature, message) == openssl
    if _sodium(public, signature, message):
        assert openssl, f"{name}: libsodium accepts what OpenSSL refuses"


def test_the_vectors_reach_the_cases_where_the_libraries_differ():
    """The table above is not vacuous: OpenSSL accepts signatures of small-order keys that
    libsodium refuses (there the fallback decides), and honest ones both accept."""
    differ = [v[0] for v in VECTORS if _openssl_verify(*v[1:]) and not _sodium(*v[1:])]
    assert "identity A, R = [s]B" in differ and "identity A and R, S = 0" in differ
    assert _sodium(*VECTORS[0][1:]) and _openssl_verify(*VECTORS[0][1:])
    assert {v[0] for v in VECTORS} >= {"order-2 A", "order-8 A", "mixed-order A"}


def test_an_honest_signature_never_reaches_openssl(monkeypatch):
    def refuse(*_):
        raise AssertionError("OpenSSL asked about a signature libsodium accepts")

    monkeypatch.setattr(sigcheck, "_openssl_verify", refuse)
    for i in range(20):
        msg = b"row %d" % i
        assert verify_ed25519(*_honest(msg), msg)


def test_random_mutations_agree_with_openssl():
    rng = random.Random(5)
    for i in range(300):
        msg = b"libp2p-pubsub:" + rng.randbytes(rng.randrange(1, 120))
        public, sig = _honest(msg)
        parts = [bytearray(public), bytearray(sig), bytearray(msg)]
        which = parts[i % 3]
        which[rng.randrange(len(which))] ^= 1 << rng.randrange(8)
        public, sig, msg = map(bytes, parts)
        openssl = _openssl_verify(public, sig, msg)
        assert verify_ed25519(public, sig, msg) == openssl
        assert not _sodium(public, sig, msg) or openssl
    for bad in (b"", b"x" * 31, b"x" * 33):  # lengths either library refuses
        assert verify_ed25519(bad, sig, msg) is False
        assert verify_ed25519(public, bad, msg) is False


def test_small_order_multiplication_helper():
    """`_times` is right where libsodium can check it: on the base point."""
    assert (
        _times(_base(1), 5)
        == _base(5)
        == crypto_scalarmult_ed25519_noclamp((5).to_bytes(32, "little"), _base(1))
    )
    assert _times(ORDER_8, 8) == IDENTITY and _times(ORDER_8, 4) != IDENTITY
