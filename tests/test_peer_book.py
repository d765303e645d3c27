"""The pieces of reconnection that need no daemon: the peer book on disk, the summary
wire format under hostile input, and which updates show a peer alive (staleness)."""

from __future__ import annotations

import json
import math
import time

import msgpack
import pytest
from hivemind.p2p import PeerID

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.network.gossip.admission import Outcome, Verdict
from seedflood_p2p.network.gossip.flood import LIVE_ROUNDS, FloodNode
from seedflood_p2p.network.monitoring.metrics import NodeMetrics
from seedflood_p2p.network.peers.peer_book import PeerBook, dialable, split_full_addr
from seedflood_p2p.network.settings import NodeSettings
from seedflood_p2p.protocol.framing import Rejected
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.protocol.repair import BUCKET_HASH_BYTES, BUCKET_ROUNDS
from seedflood_p2p.protocol.summary import (
    MAX_ADDRS,
    MAX_SUMMARY_PEERS,
    Summary,
    decode_summary,
    decode_summary_request,
    encode_summary,
    encode_summary_request,
)
from seedflood_p2p.storage.ledger import Ledger

A = "12D3KooWRez8iPgVgUa5r7mtRc9soYeqErRv2oe8yKyiXX7jv6s6"
B = "12D3KooWLubzve29rwSb2mWMGP62ZcP3r3E9N2Yi1ALMyiEUqd4v"


def test_peer_book_persists_met_peers_atomically_and_never_lists_itself(tmp_path):
    book = PeerBook(tmp_path, own_id=A)
    book.met(B, [f"/ip4/10.0.0.2/tcp/4001/p2p/{B}", "/ip4/10.0.0.2/tcp/4001"])
    book.met(A, ["/ip4/10.0.0.1/tcp/1"])  # ourselves: never a peer to dial
    book.save()  # a newly met peer is written at once, not after the throttle
    assert not (tmp_path / "peers.tmp").exists()
    stored = json.loads((tmp_path / "peers.json").read_text())
    assert list(stored["peers"]) == [B]
    assert stored["peers"][B]["addrs"] == ["/ip4/10.0.0.2/tcp/4001"]  # /p2p stripped, once
    again = PeerBook(tmp_path, own_id=A)
    assert again.others() == [B]
    assert again.entries[B]["addrs"] == ["/ip4/10.0.0.2/tcp/4001"]


@pytest.mark.parametrize("content", ["{not json", '{"peers": 3}', '{"peers": {"x": 1}}', "[]"])
def test_a_damaged_peer_book_is_moved_aside_not_fatal(tmp_path, content):
    (tmp_path / "peers.json").write_text(content)
    book = PeerBook(tmp_path, own_id=A)
    assert book.entries == {}
    assert (tmp_path / "peers.damaged").read_text() == content


def test_split_full_addr():
    assert split_full_addr(f"/ip4/1.2.3.4/tcp/5/p2p/{B}") == (B, "/ip4/1.2.3.4/tcp/5")


def _summary(**changes) -> Summary:
    fields = dict(
        round=70,
        rows=200,
        live=3,
        digests={0: (120, b"1" * BUCKET_HASH_BYTES), 1: (80, b"a" * BUCKET_HASH_BYTES)},  # SHA-256
        addrs=["/ip4/10.0.0.2/tcp/4001"],
        peers={PeerID.from_base58(B).to_bytes(): ["/ip4/10.0.0.3/tcp/4001"]},
    )
    fields.update(changes)
    return Summary(**fields)


def test_summary_round_trip_and_bounds():
    summary = _summary()
    assert decode_summary(encode_summary(summary)) == summary
    many = {bytes([i]) * 38: ["/ip4/1.1.1.1/tcp/1"] for i in range(MAX_SUMMARY_PEERS + 5)}
    assert len(decode_summary(encode_summary(_summary(peers=many))).peers) == MAX_SUMMARY_PEERS
    assert decode_summary_request(encode_summary_request("run", ["/ip4/1.2.3.4/tcp/1"])) == (
        "run",
        ["/ip4/1.2.3.4/tcp/1"],
    )


def test_a_summary_of_a_real_ledger_decodes(tmp_path):
    """The digests a ledger hands out are the size a summary accepts (they were once
    SHA-256 on one side and 8 bytes on the other, so every live summary was dropped and
    its sender banned)."""
    ledger = Ledger(tmp_path / "ledger.sqlite", "run")
    ledger.add([UpdateMessage(r, b"o" * 38, (0.5,)) for r in range(3)])
    summary = _summary(digests=ledger.bucket_digests(BUCKET_ROUNDS))
    assert decode_summary(encode_summary(summary)) == summary


def test_relay_addresses_stay_dialable_and_name_their_relay():
    relayed = f"/ip4/10.78.0.1/tcp/31337/p2p/{B}/p2p-circuit"
    assert dialable([f"{relayed}/p2p/{A}", f"/ip4/192.168.1.2/tcp/4001/p2p/{A}"], A) == [
        relayed,
        "/ip4/192.168.1.2/tcp/4001",
    ]
    assert dialable(["/p2p-circuit", "/ip4/1.2.3.4/tcp/1/p2p-circuit"], A) == []  # no relay


HOSTILE_SUMMARIES = [
    b"\xc1garbage",
    msgpack.packb(None),
    msgpack.packb([1, 2, 3]),
    msgpack.packb([True, 1, 1, [], [], []]),  # true is no round
    msgpack.packb([1.0, 1, 1, [], [], []]),
    msgpack.packb([-2, 1, 1, [], [], []]),
    msgpack.packb([1, 1, 1, [[0, 1, b"short"]], [], []]),
    msgpack.packb([1, 1, 1, [[0, 1, b"1" * 32], [0, 1, b"1" * 32]], [], []]),  # twice
    msgpack.packb([1, 1, 1, [[0, 1, b"12345678"]], [], []]),  # 8 bytes: not a SHA-256
    msgpack.packb([1, 1, 1, [], ["not/an/addr"], []]),
    msgpack.packb([1, 1, 1, [], ["/" + "x" * 300], []]),
    msgpack.packb([1, 1, 1, [], ["/ip4/1.1.1.1\n"], []]),
    msgpack.packb([1, 1, 1, [], ["/a"] * (MAX_ADDRS + 1), []]),
    msgpack.packb([1, 1, 1, [], [], [[b"", []]]], use_bin_type=True),
    msgpack.packb([1, 1, 1, [], [], [[b"p" * 38, [7]]]], use_bin_type=True),
    msgpack.packb([1, 1, 1, [], [], [[b"p" * 38, []]] * (MAX_SUMMARY_PEERS + 1)]),
    msgpack.packb({"round": 1}),
]


@pytest.mark.parametrize("data", HOSTILE_SUMMARIES)
def test_hostile_summaries_are_rejected_as_bad_reply(data):
    with pytest.raises(Rejected) as info:
        decode_summary(data)
    assert info.value.reason == "bad_reply"


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", msgpack.packb(["run"]), msgpack.packb(["run", "addr"]), msgpack.packb([1, []])],
)
def test_malformed_summary_requests_are_answered_empty(data):
    assert decode_summary_request(data) is None


class _StubP2P:
    """What FloodNode reads of a daemon before it starts: an id and a socket path."""

    def __init__(self, peer: str) -> None:
        self.peer_id = PeerID.from_base58(peer)
        self.daemon_listen_maddr = {"unix": "/nonexistent/p2pd.sock"}


def _node(tmp_path) -> FloodNode:
    config = RunConfig(model="tiny-llama", dataset="synthetic-sentiment")
    ledger = Ledger(tmp_path / "ledger.sqlite", config.run_id)
    ledger.claim(config, "")
    return FloodNode(_StubP2P(A), ledger, config, NodeMetrics(), NodeSettings())


def _accepted(peer: bytes, round_: int) -> Verdict:
    return Verdict(Outcome.ACCEPTED, peer, UpdateMessage(round_, peer, (0.5,)))


def test_a_recently_repaired_peer_counts_as_alive_once_the_node_is_in_step(tmp_path):
    node = _node(tmp_path)
    other, old = b"o" * 38, b"x" * 38
    node.admission.newest_round = 100
    node.not_ready = "starting"  # catching up: repaired rows show nothing about liveness
    node._track([_accepted(other, 99)], heard=False)
    assert node.peers[other].last_seen == -math.inf
    node.not_ready = None  # in step: a recent repaired row is a sign of life
    node._track([_accepted(other, 100 - LIVE_ROUNDS)], heard=False)
    assert time.monotonic() - node.peers[other].last_seen < 5
    node._track([_accepted(old, 100 - LIVE_ROUNDS - 1)], heard=False)  # history: no
    assert node.peers[old].last_seen == -math.inf
    node._track([_accepted(old, 3)], heard=True)  # gossip always is
    assert node.peers[old].last_seen > -math.inf


def test_status_lines_name_the_partition():
    from seedflood_p2p.apps.status import format_status

    text = format_status(
        {
            "peer_id": A,
            "state": "training",
            "network": {
                "state": "partitioned",
                "connected_peers": 1,
                "known_peers": 4,
                "unreachable": [B],
                "diverged": [],
                "for_s": 12.0,
            },
        }
    )
    assert "PARTITIONED" in text and B[-8:] in text


def _peer_ids(folder, n: int) -> list[str]:
    from seedflood_p2p.network.transport.identity import load_or_create_identity

    folder.mkdir(exist_ok=True)
    return [load_or_create_identity(folder / f"{i}.key").to_base58() for i in range(n)]


def test_a_hint_list_filled_by_many_identities_still_takes_the_founders(tmp_path):
    """Fresh keys are free: an attacker's identities can fill the bounded list of peers a
    node heard of (DHT records, summaries), first come first served. The run's founders
    still get in, each in place of the non-founder named longest ago."""
    from seedflood_p2p.network.peers.peer_book import MAX_HINTS
    from seedflood_p2p.network.peers.reconnect import Reconnector, run_founders

    me, *founders = _peer_ids(tmp_path / "keys", 3)
    run = RunConfig(model="tiny-llama", extra={"probation": {"founders": founders}})
    assert run_founders(run) == set(founders)
    assert run_founders(RunConfig(model="tiny-llama")) == frozenset()

    class StubP2P:
        peer_id = PeerID.from_base58(me)

    r = Reconnector(StubP2P(), tmp_path, [], NodeSettings(), NodeMetrics())
    r.hints.founders = run_founders(run)
    sybils = _peer_ids(tmp_path / "sybils", MAX_HINTS + 1)
    addr = ["/ip4/127.0.0.1/tcp/4001"]
    hinted = r.hints.addrs
    for sybil in sybils:
        r.add_hints({sybil: addr}, "dht")
    assert len(hinted) == MAX_HINTS and sybils[-1] not in hinted  # full: the rest dropped
    r.add_hints({founders[0]: addr}, "dht")
    assert founders[0] in hinted and len(hinted) == MAX_HINTS
    assert sybils[0] not in hinted  # the one named longest ago made room
    r.add_hints({founders[1]: addr}, "summary")
    assert set(founders) <= set(hinted) and sybils[1] not in hinted
    r.add_hints({sybils[0]: addr}, "dht")  # still full: a non-founder waits for room
    assert sybils[0] not in hinted


def test_a_caller_asking_often_gets_our_summary_hashed_at_most_once_per_freshness(
    tmp_path, monkeypatch
):
    """Serving a summary hashes the ledger's bucket digests (the newest one changes with
    every row): however often callers ask, they are hashed at most once per SUMMARY_FRESH
    seconds, and a later ask sees the rows that came meanwhile."""
    import asyncio
    import types

    from seedflood_p2p.network.peers import summaries

    ledger = Ledger(tmp_path / "ledger.sqlite", "ab" * 32)
    ledger.add([UpdateMessage(r, b"o" * 38, (0.5,)) for r in range(3)])
    flood = types.SimpleNamespace(run_id=ledger.run_id, ledger=ledger, peers={})
    book = types.SimpleNamespace(entries={}, met=lambda peer, addrs: None)
    links = types.SimpleNamespace(own_addrs=["/ip4/127.0.0.1/tcp/1"])
    exchange = summaries.SummaryExchange(
        None, book, types.SimpleNamespace(addrs={}), links, None, set, lambda p, s: None
    )
    exchange.flood = flood
    made = []
    own = summaries.SummaryExchange.own_summary
    monkeypatch.setattr(exchange, "own_summary", lambda: made.append(1) or own(exchange))
    clock = [1000.0]
    monkeypatch.setattr(summaries.time, "monotonic", lambda: clock[0])
    caller = types.SimpleNamespace(to_base58=lambda: A)
    request = encode_summary_request(ledger.run_id, [])
    replies = [asyncio.run(exchange.serve(caller, request)) for _ in range(50)]
    assert len(made) == 1 and decode_summary(replies[-1]).rows == 3
    ledger.add([UpdateMessage(3, b"o" * 38, (0.5,))])
    clock[0] += summaries.SUMMARY_FRESH
    assert decode_summary(asyncio.run(exchange.serve(caller, request))).rows == 4
    assert len(made) == 2
    ledger.close()
