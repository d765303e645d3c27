"""A peer's identity: its Ed25519 key file, and the check of a GossipSub signature.

The key file is the libp2p format `p2pd -id` reads. An Ed25519 peer id contains its public
key, so a signed message (an update, or a row a repair reply carries) can be checked
offline against its sender's id: no peer can hand us another's update.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.proto import p2pd_pb2 as pb

from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import IdentityWork

logger = logging.getLogger(__name__)


def _ed25519_peer_id(public_key: bytes) -> PeerID:
    """Peer id of an Ed25519 key: the identity multihash of its protobuf public key."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=public_key)
    encoded = encoded.SerializeToString()
    return PeerID(bytes([0x00, len(encoded)]) + encoded)


def load_or_create_identity(path: Path) -> PeerID:
    """Return the peer id stored in the libp2p key file `path`, creating an Ed25519 key if missing.

    The file holds a libp2p ``crypto.pb.PrivateKey`` (for Ed25519: 32-byte seed followed by
    the 32-byte public key), the format ``p2pd -id`` reads. New files get mode 0600.
    Refused with one line each: a file other users can access (chmod 600), a key of another
    type (RSA, Secp256k1, ECDSA), a public half that does not match the private key.
    """
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    if not path.exists():
        if not path.parent.is_dir():
            raise UserError(
                f"directory {path.parent} for the identity key does not exist; create it"
            )
        key = Ed25519PrivateKey.generate()
        seed = key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
        public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + public)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob.SerializeToString())
        logger.info("created a new Ed25519 identity in %s", path)
        return _ed25519_peer_id(public)

    bad = f"identity file {path} is not a libp2p private key; fix the path or delete the file"
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(
            f"cannot read identity file {path}: {e.strerror}; check its permissions"
        ) from None
    if mode & 0o077:  # anyone who reads the key can sign updates as this peer
        raise UserError(
            f"identity file {path} is open to other users (mode {mode:04o}): run "
            f"`chmod 600 {path}`, or delete it to create a new identity (new peer id)"
        )
    try:
        blob = crypto_pb2.PrivateKey.FromString(raw)
    except Exception:
        raise UserError(f"{bad} to create a new identity") from None
    if blob.key_type != crypto_pb2.Ed25519:
        try:
            kind = crypto_pb2.KeyType.Name(blob.key_type)
        except ValueError:
            kind = f"type {blob.key_type}"
        raise UserError(
            f"identity file {path} holds a key of type {kind}; seedflood uses Ed25519 "
            "identities only "
            "(repair verifies Ed25519 signatures only): move the file aside to create an "
            "Ed25519 identity (new peer id)"
        )
    if len(blob.data) not in (64, 96):
        raise UserError(f"{bad} to create a new Ed25519 identity")
    key = Ed25519PrivateKey.from_private_bytes(blob.data[:32])
    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    if any(blob.data[at : at + 32] != public for at in range(32, len(blob.data), 32)):
        raise UserError(
            f"identity file {path} is damaged: its public key does not match its private key; "
            "restore it from a backup, or delete it to create a new identity (new peer id)"
        )
    return _ed25519_peer_id(public)


def grind_identity(
    work: IdentityWork, progress: Callable[[int], None] | None = None, every: int = 1 << 16
) -> tuple[bytes, bytes, int]:
    """An Ed25519 key whose peer id carries `work` (`IdentityWork.qualifies`): new keys are
    drawn until one does (2^difficulty tries expected; ~35 us a try). Returns (the libp2p
    private key file's bytes, the raw peer id, the tries); `progress(tries)` every `every`
    tries."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    tries = 0
    while True:
        seed = os.urandom(32)
        public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
        peer = ED25519_PEER_ID_PREFIX + public
        tries += 1
        if work.qualifies(peer):
            blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + public)
            return blob.SerializeToString(), peer, tries
        if progress is not None and tries % every == 0:
            progress(tries)


def write_identity(path: Path, blob: bytes) -> None:
    """Write a libp2p private key file (`grind_identity`'s) as `load_or_create_identity`
    does: a new file of mode 0600; an existing file is one UserError line, never replaced."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"directory {path.parent} for the identity key does not exist; create it")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UserError(
            f"{path} exists: move it aside first (it is another identity), or pick another --out"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(blob)


def load_signing_key(path: Path):
    """The Ed25519 private key in the libp2p key file `path` (checked and created by
    `load_or_create_identity`): it signs this peer's discovery records."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    load_or_create_identity(Path(path))
    blob = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    return Ed25519PrivateKey.from_private_bytes(blob.data[:32])


def verify_pubsub_signature(
    sender: bytes, data: bytes, seqno: bytes, topic: str, signature: bytes
) -> bool:
    """Check a GossipSub message's signature as go-libp2p-pubsub makes it.

    Signed bytes: "libp2p-pubsub:" + protobuf Message{from, data, seqno, topic}. Only
    Ed25519 senders can be checked offline (their public key is inside the peer id).
    """
    from seedflood_p2p.network.transport.sigcheck import verify_ed25519

    if len(sender) != 38 or not sender.startswith(ED25519_PEER_ID_PREFIX):
        return False
    body = pb.PSMessage(data=data, seqno=seqno, topicIDs=[topic])
    setattr(body, "from", sender)
    return verify_ed25519(sender[6:], signature, b"libp2p-pubsub:" + body.SerializeToString())
