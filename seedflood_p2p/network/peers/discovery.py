"""Discovery records in hivemind's DHT, run on the peer's own p2pd daemon.

Every peer runs one hivemind `DHTNode` in its own event loop, on the P2P instance its
transport already made (`DHTNode.create(p2p=...)`: no second daemon, no second process;
`hivemind.DHT(start=True)` would fork a process and block its thread). The DHT's
Kademlia messages travel as hivemind protobuf handlers over the same p2pd connections
the flood uses. In it, each peer writes three expiring records about the run it trains:

    key "seedflood/<run_id>/manifest"  subkey <writer peer id>  {"manifest", "version"}
    key "seedflood/<run_id>/peer"      subkey <writer peer id>  {"addrs", "round"}
    key "seedflood/<run_id>/ledger"    subkey <writer peer id>  {"rows", "digest", "round"}

A record's value is ``msgpack([payload, signature])``; the payload is
``msgpack([RECORD_VERSION, kind, run_id, writer, expires, body])`` and the signature is
the writer's Ed25519 signature (the libp2p identity key of `network/transport/identity.py`) over
``SIGNING_CONTEXT + payload``. Since an Ed25519 peer id holds its public key, anyone can
check a record offline. `check_record` is the one rule, applied by every node to every
record it is asked to store and every record a lookup returns (`SignedRecordValidator`,
hivemind's validator hook): the signature holds, the subkey is the writer, the DHT key is
the one the payload names (no record moved to another run or kind), the DHT expiry is the
signed one (nobody extends a record), it has not expired and expires within MAX_TTL.
Anything else is dropped and counted (`seedflood_discovery_rejected{reason}`), never
stored. hivemind drops a lookup answer whole if one of its subkeys fails the check.

What a join does with them (peer/daemon.py): after its first connection to any peer of
the run, a peer pings that peer into its DHT routing table, reads the "peer" records of
the run and hands their addresses to the reconnector, which dials them: a peer started
with `--bootstrap X`, X any live peer, finds the others without the bootstrap node.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgpack

from seedflood_p2p import __version__
from seedflood_p2p.core.checks import ED25519_PEER_ID_PREFIX
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.protocol.summary import MAX_ADDRS

log = logging.getLogger("seedflood.discovery")

RECORD_VERSION = 1
SIGNING_CONTEXT = b"seedflood-discovery-v1:"
KINDS = ("manifest", "peer", "ledger")
CLOCK_SLACK = 300.0  # writers' clocks may differ this much (MAX_CLOCK_SKEW of the peer)
# Seconds a record lives. A writer refreshes its records every `interval` (NodeSettings.
# discovery_interval, default 15 s), so a live peer's records never lapse. Each life is
# CLOCK_SLACK longer than it needs to be: a writer whose clock runs behind by up to the
# skew a join allows must not see its records refused as expired. So a peer that stops
# stays in "peer" records for up to 6 minutes (readers just fail to dial it, with backoff).
RECORD_TTL = {
    "manifest": 600.0 + CLOCK_SLACK,
    "peer": 60.0 + CLOCK_SLACK,
    "ledger": 60.0 + CLOCK_SLACK,
}
MAX_TTL = 3600.0  # a record expiring later than this is refused: nobody pins stale entries
MAX_RECORD_BYTES = 64 << 10  # a manifest is ~1 KB; anything near this is hostile
REJECT_REASONS = (
    "malformed",
    "unsigned",
    "bad_signature",
    "wrong_writer",
    "wrong_key",
    "expiry_mismatch",
    "expired",
    "too_long",
    "oversized",
)


class BadRecord(Exception):
    """A discovery record failed `check_record`; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class DiscoveryRecord:
    kind: str
    run_id: str
    writer: bytes  # the writer's peer id (Ed25519, 38 bytes)
    expires: float  # unix time, as signed
    body: dict


def dht_key(run_id: str, kind: str) -> str:
    return f"seedflood/{run_id}/{kind}"


def _dht_key_id(run_id: str, kind: str) -> bytes:
    """The key as hivemind stores it (a DHTID: a hash of the serialized key)."""
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=dht_key(run_id, kind)).to_bytes()


def encode_record(
    signing_key, writer: bytes, kind: str, run_id: str, expires: float, body: dict
) -> bytes:
    """The signed value of one record (`signing_key`: the writer's Ed25519PrivateKey)."""
    payload = msgpack.packb(
        [RECORD_VERSION, kind, run_id, writer, float(expires), body], use_bin_type=True
    )
    return msgpack.packb([payload, signing_key.sign(SIGNING_CONTEXT + payload)], use_bin_type=True)


def _is_str_list(x: object, limit: int, max_len: int = 300) -> bool:
    return (
        isinstance(x, list)
        and len(x) <= limit
        and all(isinstance(a, str) and len(a) <= max_len for a in x)
    )


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _is_round(x: object) -> bool:
    """A round, or -1 for "none yet" (an empty ledger's max_round)."""
    return isinstance(x, int) and not isinstance(x, bool) and -1 <= x < 1 << 62


def _check_body(kind: str, body: object) -> None:
    ok = isinstance(body, dict)
    if ok and kind == "peer":
        ok = _is_str_list(body.get("addrs"), MAX_ADDRS) and _is_round(body.get("round"))
    elif ok and kind == "ledger":
        digest = body.get("digest")
        ok = (
            _is_count(body.get("rows"))
            and isinstance(digest, str)
            and len(digest) == 64
            and _is_round(body.get("round"))
        )
    elif ok and kind == "manifest":
        ok = isinstance(body.get("manifest"), str) and isinstance(body.get("version"), str)
    if not ok:
        raise BadRecord("malformed", f"{kind} body")


def check_record(
    value: bytes,
    *,
    subkey: bytes | None,
    dht_expiration: float | None,
    now: float,
    key_id: bytes | None = None,
) -> DiscoveryRecord:
    """The record in `value` if it holds (see the module docstring); else BadRecord.

    `subkey`, `dht_expiration` and `key_id` are what the DHT stored the value under (None:
    not checked). A pure function of its arguments."""
    if not isinstance(value, bytes | bytearray) or len(value) > MAX_RECORD_BYTES:
        raise BadRecord("oversized" if isinstance(value, bytes | bytearray) else "malformed")
    try:
        payload, signature = msgpack.unpackb(value, raw=False, strict_map_key=False)
        version, kind, run_id, writer, expires, body = msgpack.unpackb(
            payload, raw=False, strict_map_key=False
        )
    except Exception:
        raise BadRecord("malformed", "not a signed record") from None
    if not (
        version == RECORD_VERSION
        and kind in KINDS
        and isinstance(run_id, str)
        and len(run_id) == 64
        and isinstance(writer, bytes)
        and isinstance(expires, float)
        and isinstance(signature, bytes)
    ):
        raise BadRecord("malformed", "fields")
    if not signature:
        raise BadRecord("unsigned")
    if len(writer) != 38 or not writer.startswith(ED25519_PEER_ID_PREFIX):
        raise BadRecord("wrong_writer", "not an Ed25519 peer id")
    if not _verify(writer[6:], SIGNING_CONTEXT + payload, signature):
        raise BadRecord("bad_signature")
    if subkey is not None and subkey != writer:
        raise BadRecord("wrong_writer", "stored under another peer's subkey")
    if key_id is not None and key_id != _dht_key_id(run_id, kind):
        raise BadRecord("wrong_key", "stored under another run or kind")
    if dht_expiration is not None and dht_expiration != expires:
        raise BadRecord("expiry_mismatch", f"{dht_expiration} != signed {expires}")
    if not expires > now:  # NaN too
        raise BadRecord("expired", f"{now - expires:.0f} s ago")
    if expires - now > MAX_TTL + CLOCK_SLACK:
        raise BadRecord("too_long", f"expires in {expires - now:.0f} s")
    _check_body(kind, body)
    return DiscoveryRecord(kind, run_id, writer, expires, body)


# Signatures that held, by a hash of (key, signature, data): every lookup returns every
# writer's records again (and every node stores each writer's refreshes), so without it a
# run of N peers checks ~N signatures per lookup, N^2 across the run (the sybil bench's
# founders spent ~10% of their CPU here with 24 peers). Bounded; the oldest go first.
VERIFIED_CACHE = 8192
_verified: OrderedDict[bytes, None] = OrderedDict()


def _verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    framed = b"%d:%d:" % (len(public_key), len(signature)) + public_key + signature + data
    key = hashlib.sha256(framed).digest()
    if key in _verified:
        _verified.move_to_end(key)
        return True
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    _verified[key] = None
    if len(_verified) > VERIFIED_CACHE:
        _verified.popitem(last=False)
    return True


def _rejected_counter(metrics: NodeMetrics | None) -> Callable[[BadRecord], None]:
    """Count a refused record and log it, at most once per 10 s (hostile writers can be loud)."""
    last = [0.0]

    def count(exc: BadRecord) -> None:
        if metrics is not None:
            metrics.discovery_rejected.labels(exc.reason).inc()
        now = time.monotonic()
        if now - last[0] >= 10.0:
            last[0] = now
            log.warning(
                "dropped a discovery record: %s",
                exc,
                extra={"fields": {"event": "discovery_rejected", "reason": exc.reason}},
            )

    return count


def signed_record_validator(on_reject: Callable[[BadRecord], None]):
    """hivemind's validator hook running `check_record` on every record this DHT node is asked
    to store and every record a lookup returns. Built lazily: hivemind's dht package is only
    imported by nodes that run discovery."""
    from hivemind.dht.validation import RecordValidatorBase
    from hivemind.utils.serializer import MSGPackSerializer

    class SignedRecordValidator(RecordValidatorBase):
        def validate(self, record) -> bool:
            try:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
                if not isinstance(subkey, bytes):
                    raise BadRecord("wrong_writer", "subkey is not a peer id")
            except BadRecord as exc:
                on_reject(exc)
                return False
            except Exception:
                on_reject(BadRecord("malformed", "not msgpack"))
                return False
            try:
                check_record(
                    value,
                    subkey=subkey,
                    dht_expiration=record.expiration_time,
                    now=time.time(),
                    key_id=record.key,
                )
            except BadRecord as exc:
                on_reject(exc)
                return False
            return True

    return SignedRecordValidator()


class Discovery:
    """This peer's hivemind DHT node and its discovery records (see the module docstring)."""

    def __init__(
        self,
        p2p,
        identity_path: Path,
        metrics: NodeMetrics | None = None,
        *,
        wait_timeout: float = 3.0,
    ) -> None:
        from seedflood_p2p.network.transport.identity import load_signing_key

        self.p2p = p2p
        self.writer: bytes = p2p.peer_id.to_bytes()
        self._key = load_signing_key(identity_path)
        self.metrics = metrics
        self.count_rejected = _rejected_counter(metrics)
        self.wait_timeout = wait_timeout
        self.node = None
        self.found: dict[str, set[str]] = {k: set() for k in KINDS}  # writers seen, by kind
        self.stored = dict.fromkeys(KINDS, 0)  # own records stored (accepted by >= 1 node)
        self._pinged: set[str] = set()
        self.closed = False
        self._published_at: dict[str, float] = {}

    async def start(self) -> None:
        """Start the DHT node on our daemon; peers join its routing table via `add_peers`."""
        from hivemind.dht.node import DHTNode

        self.node = await DHTNode.create(
            p2p=self.p2p,
            record_validator=signed_record_validator(self.count_rejected),
            wait_timeout=self.wait_timeout,
            ensure_bootstrap_success=False,
            # A found value is not pushed to other nodes by the reader: only writers store
            cache_nearest=0,
        )

    async def stop(self, task: asyncio.Task | None = None) -> None:
        """Stop `task` (a `run_discovery` loop) and the DHT node; never blocks for more than
        a few seconds. Not `asyncio.wait_for`: on timeout it waits for the cancelled call
        to end, and a hivemind call that swallows the cancellation would hold a leaving
        peer for good (suspected, not shown, in one bench run where a peer never exited:
        its logs were lost)."""
        self.closed = True  # the loop ends at its next pass even if a cancel is swallowed
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=5.0)
        if self.node is not None:
            node, self.node = self.node, None
            # DHTNode.shutdown removes its handlers; the daemon is ours and stays up
            shutdown = asyncio.ensure_future(node.shutdown())
            await asyncio.wait({shutdown}, timeout=5.0)
            if not shutdown.done():
                shutdown.cancel()

    async def add_peers(self, peers: Iterable[str]) -> int:
        """Ping connected peers (base58 ids) into the routing table; a peer without a DHT
        node (an older version) just does not answer. Returns how many answered."""
        from hivemind.p2p import PeerID

        if self.node is None:
            return 0
        new = [p for p in peers if p not in self._pinged]
        self._pinged.update(new)
        replies = await asyncio.gather(
            *(self.node.protocol.call_ping(PeerID.from_base58(p)) for p in new),
            return_exceptions=True,
        )
        answered = sum(1 for r in replies if r is not None and not isinstance(r, BaseException))
        for peer, reply in zip(new, replies, strict=True):
            if reply is None or isinstance(reply, BaseException):
                self._pinged.discard(peer)  # try again on the next connection
        return answered

    def forget(self, peer: str) -> None:
        """`peer` disconnected: ping it again when it comes back."""
        self._pinged.discard(peer)

    async def publish(self, run_id: str, kind: str, body: dict, now: float | None = None) -> bool:
        """Store our signed `kind` record of `run_id`, living RECORD_TTL[kind] seconds. True
        if at least one node (possibly this one) took it."""
        if self.node is None:
            return False
        expires = (time.time() if now is None else now) + RECORD_TTL[kind]
        value = encode_record(self._key, self.writer, kind, run_id, expires, body)
        ok = await self.node.store(dht_key(run_id, kind), value, expires, subkey=self.writer)
        if ok:
            self.stored[kind] += 1
        return bool(ok)

    async def lookup(self, run_id: str, kind: str) -> dict[bytes, DiscoveryRecord]:
        """The run's live, valid `kind` records by writer. Records that fail `check_record`
        here (they passed hivemind's hook, but may have expired since) are counted and left
        out."""
        if self.node is None:
            return {}
        found = await self.node.get(dht_key(run_id, kind), latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        now, out = time.time(), {}
        for subkey, item in found.value.items():
            try:
                record = check_record(
                    item.value, subkey=subkey, dht_expiration=item.expiration_time, now=now
                )
                if record.run_id != run_id or record.kind != kind:
                    raise BadRecord("wrong_key")
            except BadRecord as exc:
                self.count_rejected(exc)
                continue
            out[record.writer] = record
        self.found[kind].update(_b58(w) for w in out)
        return out

    async def refresh(
        self, run_id: str, records: dict[str, dict], connected: Iterable[str]
    ) -> dict[str, list[str]]:
        """One pass of a running peer: ping new connections into the routing table, store our
        records (the manifest only when half its life has passed), and read the run's "peer"
        records. Returns {peer id (base58): addresses} of the other live peers found."""
        connected = set(connected)
        self._pinged &= connected  # a peer that left is pinged again when it returns
        await self.add_peers(sorted(connected))
        now = time.time()
        for kind, body in records.items():
            fresh = now - self._published_at.get(kind, -math.inf) < RECORD_TTL[kind] / 2
            if kind == "manifest" and fresh:
                continue  # the manifest never changes: store it again before it lapses
            if await self.publish(run_id, kind, body, now):
                self._published_at[kind] = now
        found = await self.lookup(run_id, "peer")
        return {
            _b58(writer): list(record.body["addrs"])
            for writer, record in found.items()
            if writer != self.writer and record.body["addrs"]
        }

    def status(self) -> dict:
        table = self.node.protocol.routing_table.uid_to_peer_id if self.node else {}
        return {
            "dht": self.node is not None,
            "routing_table": len(table),
            "records_stored": dict(self.stored),
            "writers_found": {k: len(v) for k, v in self.found.items()},
            "peers_found": sorted(self.found["peer"])[:64],  # writers of valid "peer" records
            "rejected": self.metrics.discovery_rejected_counts() if self.metrics else {},
        }


def node_records(flood, own_addrs: list[str], round_: int) -> dict[str, dict]:
    """The three records a node of the run writes: its run's manifest, where it listens and
    its round, and its ledger's size, set digest and newest round (`flood`: its FloodNode)."""
    ledger = flood.ledger
    return {
        "manifest": {"manifest": flood.manifest_json, "version": __version__},
        "peer": {"addrs": list(own_addrs)[:MAX_ADDRS], "round": int(round_)},
        "ledger": {
            "rows": len(ledger),
            "digest": ledger_set_digest(ledger.bucket_digests(BUCKET_ROUNDS)),
            "round": ledger.max_round(),
        },
    }


async def run_discovery(
    discovery: Discovery, reconnector, flood, round_of: Callable[[], int], interval: float
) -> None:
    """For as long as the node runs: every `interval` seconds write our records, read the
    run's live peers and hand them to `reconnector` (a Reconnector), which dials them."""
    while not discovery.closed:
        try:
            records = node_records(flood, reconnector.links.own_addrs, round_of())
            found = await discovery.refresh(flood.run_id, records, reconnector.connected)
            reconnector.add_hints(found, "dht")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a DHT hiccup must not end discovery for good
            log.warning("discovery pass failed: %r", exc)
        await asyncio.sleep(interval)


def ledger_set_digest(bucket_digests: dict[int, tuple[int, bytes]]) -> str:
    """One digest of a whole ledger from its bucket set digests (`Ledger.bucket_digests`,
    cached per bucket, so this costs little on a long ledger): equal digests, equal ledgers."""
    h = hashlib.sha256()
    for bucket in sorted(bucket_digests):
        count, digest = bucket_digests[bucket]
        h.update(bucket.to_bytes(8, "little") + count.to_bytes(8, "little") + digest)
    return h.hexdigest()


def _b58(peer: bytes) -> str:
    import base58

    return base58.b58encode(peer).decode()
