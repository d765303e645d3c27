"""Summaries: peer exchange and island detection, and their rules.

Summaries (`seedflood.summary`, request/response, network/peers/reconnect.py) tell a node
who else exists and whether its ledger agrees with theirs, and carry the addresses
peers are dialled at:

    request  [run_id: str, addrs: [str]]             the caller's dialable addresses
    reply    [round: int, rows: int, live: int, digests: [[bucket, count, sha256]],
              addrs: [str], peers: [[peer_id: bin, [str]]]]

At most MAX_SUMMARY_DIGESTS digests (the newest buckets, of BUCKET_ROUNDS rounds as in
repair, `protocol/repair.py`), MAX_ADDRS addresses per peer and MAX_SUMMARY_PEERS peers;
an address is ASCII, starts with "/" and is at most MAX_ADDR_CHARS long. A reply that
breaks any of these is dropped whole as `bad_reply`; a request that does is answered
empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from seedflood_p2p.core.checks import is_int
from seedflood_p2p.core.config import MAX_ROUND
from seedflood_p2p.protocol.framing import MAX_PEER_ID_BYTES, Rejected, is_round
from seedflood_p2p.protocol.repair import BUCKET_HASH_BYTES, BUCKET_ROUNDS

MAX_ADDRS = 16  # multiaddrs per peer in a summary
MAX_ADDR_CHARS = 256
MAX_SUMMARY_PEERS = 32  # peers (with addresses) a summary names
MAX_SUMMARY_DIGESTS = 8  # newest ledger buckets a summary lists


@dataclass(frozen=True)
class Summary:
    """What a peer says about itself: progress, its newest buckets, where it and others are."""

    round: int  # the newest round its ledger holds (-1: none)
    rows: int  # rows in its ledger
    live: int  # training peers it hears
    digests: dict[int, tuple[int, bytes]]  # its newest buckets: {bucket: (count, SHA-256)}
    addrs: list[str]  # its own dialable multiaddrs
    peers: dict[bytes, list[str]]  # peers it is connected to, with their addresses


def _is_addr(x: object) -> bool:
    return (
        isinstance(x, str)
        and 1 < len(x) <= MAX_ADDR_CHARS
        and x.isascii()
        and x.startswith("/")
        and x.isprintable()
    )


def _is_addr_list(x: object) -> bool:
    return isinstance(x, list) and len(x) <= MAX_ADDRS and all(_is_addr(a) for a in x)


def encode_summary_request(run_id: str, addrs: Sequence[str]) -> bytes:
    return msgpack.packb([run_id, list(addrs)[:MAX_ADDRS]], use_bin_type=True)


def decode_summary_request(data: bytes) -> tuple[str, list[str]] | None:
    """(run id, the caller's addresses) of a well-formed summary request, else None."""
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=MAX_ADDR_CHARS,
            max_bin_len=0,
            max_array_len=MAX_ADDRS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception:
        return None
    if not (
        isinstance(body, list)
        and len(body) == 2
        and isinstance(body[0], str)
        and _is_addr_list(body[1])
    ):
        return None
    return body[0], body[1]


def encode_summary(summary: Summary) -> bytes:
    newest = sorted(summary.digests)[-MAX_SUMMARY_DIGESTS:]
    peers = list(summary.peers.items())[:MAX_SUMMARY_PEERS]
    return msgpack.packb(
        [
            summary.round,
            summary.rows,
            summary.live,
            [[b, *summary.digests[b]] for b in newest],
            list(summary.addrs)[:MAX_ADDRS],
            [[p, list(a)[:MAX_ADDRS]] for p, a in peers],
        ],
        use_bin_type=True,
    )


def decode_summary(data: bytes) -> Summary:
    """A summary reply, or Rejected("bad_reply")."""
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=MAX_ADDR_CHARS,
            max_bin_len=MAX_PEER_ID_BYTES,
            max_array_len=max(MAX_SUMMARY_PEERS, MAX_ADDRS, MAX_SUMMARY_DIGESTS, 6),
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:
        raise Rejected("bad_reply", f"summary not msgpack ({type(exc).__name__})") from None
    if not (isinstance(body, list) and len(body) == 6):
        raise Rejected("bad_reply", "summary is not an array of 6 fields")
    round_, rows, live, digests, addrs, peers = body
    if not (
        is_int(round_)
        and -1 <= round_ <= MAX_ROUND
        and is_round(rows)
        and is_round(live)
        and isinstance(digests, list)
        and len(digests) <= MAX_SUMMARY_DIGESTS
        and _is_addr_list(addrs)
        and isinstance(peers, list)
        and len(peers) <= MAX_SUMMARY_PEERS
    ):
        raise Rejected("bad_reply", "bad summary fields")
    buckets: dict[int, tuple[int, bytes]] = {}
    for item in digests:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and is_round(item[0])
            and item[0] <= MAX_ROUND // BUCKET_ROUNDS
            and item[0] not in buckets
            and is_round(item[1])
            and isinstance(item[2], bytes)
            and len(item[2]) == BUCKET_HASH_BYTES
        ):
            raise Rejected("bad_reply", "bad summary digest")
        buckets[item[0]] = (item[1], item[2])
    named: dict[bytes, list[str]] = {}
    for item in peers:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], bytes)
            and 0 < len(item[0]) <= MAX_PEER_ID_BYTES
            and _is_addr_list(item[1])
        ):
            raise Rejected("bad_reply", "bad summary peer")
        named[item[0]] = item[1]
    return Summary(round_, rows, live, buckets, addrs, named)
