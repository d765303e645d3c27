"""The checkpoint chain and the checkpoint offer/chunk codecs, without processes:
equal rows give byte-equal links however they were reached; a late row rebuilds
the chain; a link + tail restores base + ledger; garbage replies are `bad_reply`; a joiner
trusts a link before it holds the link's rows (`--history-sync background`)."""

import dataclasses
import hashlib
import json

import msgpack
import numpy as np
import pytest
import torch

from seedflood_p2p.algorithm.chain import CheckpointChain, link_round, write_link
from seedflood_p2p.algorithm.live import LiveModel
from seedflood_p2p.algorithm.replay import estimate_replay_seconds, replay
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.gossip.repair import _Exchange, plan
from seedflood_p2p.network.transfer.checkpoints import file_offer, pick_offer
from seedflood_p2p.protocol.checkpoint import (
    CHECKPOINT_CHUNK_BYTES,
    CheckpointOffer,
    check_chunk,
    decode_checkpoint_offer,
    decode_checkpoint_offer_request,
    decode_chunk_request,
    encode_checkpoint_offer,
    encode_checkpoint_offer_request,
    encode_chunk_request,
)
from seedflood_p2p.protocol.framing import Rejected
from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.storage.checkpoint import read_checkpoint_meta, tensors_sha256
from seedflood_p2p.storage.digests import digest_of
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model

CONFIG = RunConfig(
    model="tiny-llama", rank=4, refresh_period=5, lr=1e-2, n_ref=3, extra={"checkpoint_every": 4}
)
ED25519_ID = bytes.fromhex("002408011220")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _messages(rounds: int, peers: int, seed: int = 0) -> list[UpdateMessage]:
    rng = np.random.default_rng(seed)
    return [
        UpdateMessage(t, ED25519_ID + bytes([p + 1]) * 32, quantize_scalars(rng.normal(size=1)))
        for t in range(rounds)
        for p in range(peers)
    ]


def _chain(directory) -> CheckpointChain:
    return CheckpointChain(load_model(CONFIG.model)[0], CONFIG, directory)


def _files(directory) -> tuple[bytes, bytes]:
    return (directory / "checkpoint.safetensors").read_bytes(), (
        directory / "checkpoint.json"
    ).read_bytes()


def test_equal_rows_give_byte_equal_links_however_reached(tmp_path):
    rows = _messages(12, 3)
    step = _chain(tmp_path / "step")
    for target in (4, 8):  # link 4, then link 8 from it
        step.build([m for m in rows if m.round < target], target)
    direct = _chain(tmp_path / "direct")
    direct.build([m for m in rows if m.round < 8], 8)  # link 8 from the base
    assert _files(tmp_path / "step") == _files(tmp_path / "direct")
    assert file_offer(tmp_path / "step") == file_offer(tmp_path / "direct")
    assert json.loads(_files(tmp_path / "step")[1])["ledger_messages"] == 24


def test_a_check_rebuilds_a_link_bit_for_bit_a_period_at_a_time(tmp_path):
    rows = _messages(12, 3)
    chain = _chain(tmp_path)
    meta = chain.build([m for m in rows if m.round < 8], 8)
    chain.build([m for m in rows if m.round < 4], 4)  # the scratch holds something else now
    chain.reset()
    for low in (0, 4):
        chain.add([m for m in rows if low <= m.round < low + 4])
    assert tensors_sha256(chain.weights()) == meta["weights_sha256"]
    chain.add(rows[:1])  # one row more: other tensors
    assert tensors_sha256(chain.weights()) != meta["weights_sha256"]


def test_a_late_row_rebuilds_the_chain_from_the_base(tmp_path):
    rows = _messages(12, 3)
    late = UpdateMessage(1, ED25519_ID + b"\x09" * 32, (0.5,))
    chain = _chain(tmp_path / "a")
    chain.build([m for m in rows if m.round < 4], 4)
    with_late = sorted([*rows, late], key=lambda m: (m.round, m.peer))
    chain.build([m for m in with_late if m.round < 8], 8)  # link 4 no longer matches
    fresh = _chain(tmp_path / "b")
    fresh.build([m for m in with_late if m.round < 8], 8)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_a_link_extended_by_its_period_s_rows_is_the_link_built_from_all_rows(tmp_path):
    """`extend` (the newest link built here + the rows after it, what a peer does each
    period) writes the same bytes as `build` of every row, and reads no row below it."""
    rows = _messages(16, 3)
    step = _chain(tmp_path / "step")
    step.build([m for m in rows if m.round < 4], 4)
    for target in (8, 12):
        new = [m for m in rows if step.tail.round <= m.round < target]
        assert step.extend(new, target, rows_below=step.tail.rows, replaced=0) is not None
        direct = _chain(tmp_path / f"direct{target}")
        direct.build([m for m in rows if m.round < target], target)
        assert _files(tmp_path / "step") == _files(tmp_path / f"direct{target}")
    assert step.tail.round == 12 and step.tail.rows == 36


def test_a_link_is_not_extended_over_rows_below_it_that_changed(tmp_path):
    """A late row below the newest link (the count differs), a replaced row (the ledger's
    replacement count moved) or a scratch model used for a check: `extend` declines, and
    `build` of all rows makes the link."""
    rows = _messages(12, 3)
    chain = _chain(tmp_path)
    chain.build([m for m in rows if m.round < 4], 4, replaced=2)
    new = [m for m in rows if 4 <= m.round < 8]
    assert chain.extend(new, 8, rows_below=13, replaced=2) is None  # a late row came
    assert chain.extend(new, 8, rows_below=12, replaced=3) is None  # a row was replaced
    assert chain.extend(new, 10, rows_below=12, replaced=2) is None  # not a link round
    chain.reset()
    assert chain.tail is None and chain.extend(new, 8, rows_below=12, replaced=2) is None
    chain.build([m for m in rows if m.round < 8], 8)
    assert chain.tail is not None
    chain.add(new)  # a fetched link's check uses the scratch model
    assert chain.tail is None


def test_the_ledger_counts_rows_below_a_round_and_its_replacements(tmp_path):
    from test_admission import RUN, Peer

    alice, bob = Peer(), Peer()
    ledger = Ledger(tmp_path / "ledger.sqlite", RUN)
    rows = [p.row(r, (0.5,)) for r in range(6) for p in (alice, bob)]
    ledger.add([m for m, _ in rows], [e for _, e in rows])
    assert [ledger.count_below(r) for r in (0, 1, 3, 6, 99)] == [0, 2, 6, 12, 12]
    ledger.bucket_digests(4)  # from here on, from the bucket counts add() keeps
    later = [p.row(r, (0.5,)) for r in range(6, 9) for p in (alice, bob)]
    ledger.add([m for m, _ in later], [e for _, e in later])
    assert [ledger.count_below(r) for r in (0, 1, 3, 4, 6, 7, 8, 9, 99)] == [
        0, 2, 6, 8, 12, 14, 16, 18, 18,
    ]  # fmt: skip
    assert ledger.replacements == 0
    twin, envelope = alice.row(2, (0.25,))
    ledger.replace(twin, envelope)
    assert ledger.replacements == 1 and ledger.count_below(6) == 12


def test_a_link_plus_the_rows_after_it_restores_base_plus_ledger(tmp_path):
    rows = _messages(12, 3)
    _chain(tmp_path).build([m for m in rows if m.round < 8], 8)
    ledger = Ledger(":memory:", CONFIG.run_id)
    ledger.add(rows)
    model, _ = load_model(CONFIG.model)
    live = LiveModel(make_estimator(model, CONFIG), ledger)
    assert (
        live.restore(live.cut(), tmp_path) == "checkpoint of round 8 + 12 ledger messages after it"
    )
    reference, _ = load_model(CONFIG.model)
    replay(reference, CONFIG, rows)
    expected = {m.name: m.weight for m in make_estimator(reference, CONFIG).matrices}
    for name, tensor in live.weights().items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0)


def test_chain_settings():
    assert CONFIG.checkpoint_every == 4 and RunConfig(model="tiny-llama").checkpoint_every == 0
    with pytest.raises(UserError, match="checkpoint_every"):
        RunConfig(model="tiny-llama", extra={"checkpoint_every": "x"})
    assert [link_round(r, 4, 3) for r in (0, 6, 7, 11, 12)] == [0, 0, 4, 8, 8]
    # The joiner's cost model grows with rows and with epochs x model size.
    small = estimate_replay_seconds(80_000, 10_000, RunConfig(), 90_000)
    big = estimate_replay_seconds(80_000, 10_000, RunConfig(), 135_000_000)
    assert 1 < small < big


def _offer(size: int = CHECKPOINT_CHUNK_BYTES + 5) -> tuple[CheckpointOffer, bytes]:
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    chunks = tuple(
        hashlib.sha256(data[i : i + CHECKPOINT_CHUNK_BYTES]).digest()
        for i in range(0, size, CHECKPOINT_CHUNK_BYTES)
    )
    meta = {
        "run_id": CONFIG.run_id,
        "round": 8,
        "ledger_messages": 24,
        "ledger_digest": "0" * 64,
        "weights_sha256": "1" * 64,
        "ledger_cut": {},
    }
    offer = CheckpointOffer(
        json.dumps(meta, sort_keys=True), size, hashlib.sha256(data).digest(), chunks
    )
    return offer, data


def test_the_offer_of_a_thousand_peer_run_is_served_and_taken(tmp_path):
    # its cut alone is ~92 KB: 64 KiB, the old bound, refused it (bench_join_history.py)
    peers = [ED25519_ID + i.to_bytes(32, "big") for i in range(1, 1001)]
    rows = [UpdateMessage(t, p, (0.0,)) for t in range(3) for p in peers]
    model = load_model(CONFIG.model)[0]
    weights = {m.name: m.weight.detach().clone() for m in make_estimator(model, CONFIG).matrices}
    write_link(tmp_path, weights, CONFIG, rows, 4)
    offer = file_offer(tmp_path)
    assert len(offer.meta_json) > 64 << 10
    reply = encode_checkpoint_offer(offer)
    assert len(reply) < 1 << 20  # serve_bytes' reply limit
    assert decode_checkpoint_offer(reply, CONFIG.run_id) == offer
    # a meta past the bound is not offered at all (no honest server sends a bad reply)
    many = [ED25519_ID + i.to_bytes(32, "big") for i in range(1, 9001)]
    write_link(tmp_path, weights, CONFIG, [UpdateMessage(0, p, (0.0,)) for p in many], 4)
    with pytest.raises(ValueError, match="over an offer's"):
        file_offer(tmp_path)


def test_offer_and_chunk_codecs_round_trip_and_refuse_garbage():
    offer, data = _offer()
    assert decode_checkpoint_offer(encode_checkpoint_offer(offer), CONFIG.run_id) == offer
    assert decode_checkpoint_offer(encode_checkpoint_offer(None), CONFIG.run_id) is None
    assert decode_checkpoint_offer_request(encode_checkpoint_offer_request("r" * 64)) == "r" * 64
    request = encode_chunk_request(CONFIG.run_id, offer.file_sha256, 1)
    assert decode_chunk_request(request) == (CONFIG.run_id, offer.file_sha256, 1)
    assert decode_chunk_request(msgpack.packb([CONFIG.run_id, b"x", 1])) is None
    assert decode_chunk_request(msgpack.packb([CONFIG.run_id, offer.file_sha256, True])) is None
    bad = [
        b"\xc1garbage",
        msgpack.packb([offer.meta_json, offer.size]),
        msgpack.packb([offer.meta_json, offer.size, b"short", list(offer.chunk_hashes)]),
        msgpack.packb(
            [
                offer.meta_json,
                offer.size + CHECKPOINT_CHUNK_BYTES,
                offer.file_sha256,
                list(offer.chunk_hashes),
            ]
        ),  # sizes and chunk count disagree
        msgpack.packb(["{not json", offer.size, offer.file_sha256, list(offer.chunk_hashes)]),
        msgpack.packb(
            [
                json.dumps({"run_id": "other"}),
                offer.size,
                offer.file_sha256,
                list(offer.chunk_hashes),
            ]
        ),
        msgpack.packb([offer.meta_json, True, offer.file_sha256, list(offer.chunk_hashes)]),
    ]
    for reply in bad:
        with pytest.raises(Rejected) as caught:
            decode_checkpoint_offer(reply, CONFIG.run_id)
        assert caught.value.reason == "bad_reply"
    check_chunk(offer, 0, data[:CHECKPOINT_CHUNK_BYTES])
    check_chunk(offer, 1, data[CHECKPOINT_CHUNK_BYTES:])
    flipped = bytes([data[0] ^ 1]) + data[1:CHECKPOINT_CHUNK_BYTES]
    for index, chunk in [(0, flipped), (1, data[CHECKPOINT_CHUNK_BYTES:-1])]:
        with pytest.raises(Rejected, match="bad_reply|chunk"):
            check_chunk(offer, index, chunk)


class _Peer:
    def __init__(self, n: int) -> None:
        self.n = n

    def to_bytes(self) -> bytes:
        return bytes([self.n])


def test_only_an_offer_made_by_a_quorum_of_distinct_peers_is_taken():
    offer, _ = _offer()
    forged = CheckpointOffer(offer.meta_json, offer.size, b"\x07" * 32, offer.chunk_hashes)
    groups = {offer.key: (offer, [_Peer(1), _Peer(2)]), forged.key: (forged, [_Peer(3)])}
    (picked, peers), lone = pick_offer(groups)
    assert picked == offer and len(peers) == 2 and lone == 1
    assert pick_offer({forged.key: (forged, [_Peer(3), _Peer(3)])}) == (None, 1)  # one identity


async def test_offers_that_disagree_for_a_moment_are_asked_for_again(monkeypatch):
    """Each peer offers its newest link: right after one peer made the next link, two honest
    peers offer different ones (seen in CI). The joiner asks again; the refusals it
    reports are those of the answer it acted on."""
    from seedflood_p2p.network.transfer import checkpoints

    offer, _ = _offer()
    newer = CheckpointOffer(offer.meta_json, offer.size, b"\x09" * 32, offer.chunk_hashes)
    answers = [
        {offer.key: (offer, [_Peer(1)]), newer.key: (newer, [_Peer(2)])},  # b is a link behind
        {newer.key: (newer, [_Peer(1), _Peer(2)])},
    ]
    asked = []

    async def gather(node, peers, timeout):
        asked.append(len(asked))
        return answers[min(len(asked) - 1, 1)], {}

    async def download(node, picked, offerers, directory, timeout):
        return checkpoints.FetchResult(picked, [str(p.n) for p in offerers], 0, 0, 0.0)

    monkeypatch.setattr(checkpoints, "gather_offers", gather)
    monkeypatch.setattr(checkpoints, "download", download)
    result = await checkpoints.fetch_checkpoint(None, [], None, 1.0, lambda o: None, 0.01)
    assert result.offer == newer and len(asked) == 2 and result.refused == {}
    asked.clear()
    answers[1] = answers[0]  # they keep disagreeing (or one forges): asked 3 times, refused
    with pytest.raises(checkpoints.FetchFailed) as failed:
        await checkpoints.fetch_checkpoint(None, [], None, 1.0, lambda o: None, 0.01)
    assert len(asked) == checkpoints.OFFER_ATTEMPTS and failed.value.refused == {"no_quorum": 2}


@pytest.mark.slow
def test_checkpoint_decoders_let_nothing_but_rejected_out():
    """As tests/test_fuzz.py for the other decoders: random bytes and random msgpack."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    packable = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.binary(max_size=40)
        | st.text(max_size=40),
        lambda inner: st.lists(inner, max_size=5),
        max_leaves=12,
    )

    @settings(max_examples=300, deadline=None)
    @given(st.one_of(st.binary(max_size=200), packable.map(msgpack.packb)))
    def check(data: bytes) -> None:
        try:
            decode_checkpoint_offer(data, CONFIG.run_id)
        except Rejected as exc:
            assert exc.reason == "bad_reply"
        assert decode_chunk_request(data) is None or len(decode_chunk_request(data)) == 3
        request = decode_checkpoint_offer_request(data)
        assert request is None or isinstance(request, str)

    check()


def test_a_resumed_download_keeps_the_chunks_that_hash_right(tmp_path):
    """The partial file of an interrupted download: chunks already right are not fetched
    again, a damaged or missing one is."""
    import os

    from seedflood_p2p.network.transfer.checkpoints import _chunks_present

    offer, data = _offer(3 * CHECKPOINT_CHUNK_BYTES + 10)
    part = tmp_path / "x.part"
    damaged = bytearray(data)
    damaged[CHECKPOINT_CHUNK_BYTES + 7] ^= 1  # chunk 1 damaged
    damaged[3 * CHECKPOINT_CHUNK_BYTES :] = b"\0" * 10  # chunk 3 never written
    part.write_bytes(bytes(damaged))
    fd = os.open(part, os.O_RDONLY)
    try:
        assert _chunks_present(fd, offer) == {0, 2}
    finally:
        os.close(fd)


# -- a link trusted before its rows are held (`--history-sync background`): the link + only
# the rows after it make base + the whole ledger; the link's rows arriving later are not
# applied twice; the history is checked against the link's digest (incomplete, matching,
# differing); repair asks only for buckets after the floor; rules it cannot hold refused
LINK = 8


def _replayed_weights(rows) -> dict[str, torch.Tensor]:
    reference, _ = load_model(CONFIG.model)
    replay(reference, CONFIG, rows)
    return {m.name: m.weight for m in make_estimator(reference, CONFIG).matrices}


def _joiner(tmp_path, held):
    """A link of round LINK built by a peer with every row, and a joiner whose ledger
    holds only `held`, restored trusting it."""
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    ledger = Ledger(":memory:", CONFIG.run_id)
    ledger.add(held(rows))
    live = LiveModel(make_estimator(load_model(CONFIG.model)[0], CONFIG), ledger)
    live.trust(read_checkpoint_meta(tmp_path))
    how = live.restore_trusting(live.cut(), tmp_path)
    return rows, ledger, live, how


def _close(live: LiveModel, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in live.weights().items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0)


def test_the_link_and_only_its_tail_make_base_plus_the_whole_ledger(tmp_path):
    rows, _, live, how = _joiner(tmp_path, lambda rows: [m for m in rows if m.round >= LINK])
    assert how == "trusted checkpoint of round 8 + 12 ledger messages after it"
    _close(live, _replayed_weights(rows))


def test_history_arriving_later_is_logged_not_applied_and_then_checked(tmp_path):
    rows, ledger, live, _ = _joiner(tmp_path, lambda rows: [m for m in rows if m.round >= LINK])
    history = [m for m in rows if m.round < LINK]
    assert live.check_history(ledger.messages()) is None  # none of the link's rows yet
    ledger.add(history[:5])
    live.receive(history[:5])
    assert live.take() == [] and live.check_history(ledger.messages()) is None  # 5 of 24
    late = UpdateMessage(3, ED25519_ID + b"\x09" * 32, (0.5,))  # a row the link lacks
    ledger.add([*history[5:], late])
    live.receive([*history[5:], late])
    assert live.take() == [late]  # only the late row is new to the weights
    live.apply([late])
    assert live.check_history(ledger.messages()) is True
    live.end_trust()
    assert live.trusted is None
    _close(live, _replayed_weights(ledger.messages()))  # base + the whole ledger again
    live.receive([late])
    assert live.take() == [late]  # no filter any more


def test_a_history_other_than_the_links_is_found(tmp_path):
    rows, ledger, live, _ = _joiner(tmp_path, lambda rows: [m for m in rows if m.round >= LINK])
    history = [m for m in rows if m.round < LINK]
    forged = dataclasses.replace(history[7], scalars=quantize_scalars(np.array([9.0])))
    ledger.add([*history[:7], forged, *history[8:]])
    assert live.check_history(ledger.messages()) is False


def test_the_history_check_runs_in_a_child_process_with_the_same_answers(tmp_path):
    """The daemon checks the history in a bare child process (peer/latejoin.py
    `_digest_in_child`: a pass over 10M rows held its GIL for a minute): the same (count,
    digest) as in process, for a ledger that lacks rows, holds them, or holds other ones;
    a child that fails is a RuntimeError naming why (the daemon then checks in a thread)."""
    import asyncio

    from peer.latejoin import _digest_in_child
    from seedflood_p2p.storage.cut import cut_contains, encode_cut
    from seedflood_p2p.storage.digests import digest_within

    rows = _messages(12, 3)
    link_rows = [m for m in rows if m.round < LINK]
    cut = encode_cut((m.peer, m.round) for m in link_rows)
    forged = dataclasses.replace(link_rows[7], scalars=quantize_scalars(np.array([9.0])))
    for name, held in (
        ("lacking", rows[len(rows) // 2 :]),
        ("holding", rows),
        ("other", [*link_rows[:7], forged, *rows[8:]]),
    ):
        ledger = Ledger(tmp_path / f"{name}.sqlite", CONFIG.run_id)
        ledger.add(held)
        ledger.flush()
        in_child = asyncio.run(_digest_in_child(ledger.path, cut))
        assert in_child == digest_within(ledger.messages(), cut_contains(cut))
        if name == "holding":
            assert in_child == (len(link_rows), digest_of(link_rows))
        ledger.close()
    with pytest.raises(RuntimeError, match="exit 1"):
        asyncio.run(_digest_in_child(tmp_path / "none" / "ledger.sqlite", cut))


def test_a_link_with_tampered_weights_is_refused_and_the_trust_lifted(tmp_path):
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    meta = read_checkpoint_meta(tmp_path)
    meta["weights_sha256"] = "00" * 32
    (tmp_path / "checkpoint.json").write_text(json.dumps(meta))
    ledger = Ledger(":memory:", CONFIG.run_id)
    live = LiveModel(make_estimator(load_model(CONFIG.model)[0], CONFIG), ledger)
    base = {k: v.clone() for k, v in live.weights().items()}
    live.trust(meta)
    assert live.restore_trusting(live.cut(), tmp_path) is None
    assert live.trusted is None
    for name, tensor in live.weights().items():
        assert torch.equal(tensor, base[name])  # the base weights, for the replay after


@pytest.mark.parametrize("rule", ["round_mean", "round_sqrt"])
def test_round_sized_step_rules_are_refused(tmp_path, rule):
    # (momentum is refused too, and a chain run cannot have it: core/config.py)
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    config = dataclasses.replace(CONFIG, step_rule=rule)
    live = LiveModel(make_estimator(load_model(config.model)[0], config))
    with pytest.raises(ValueError, match="round-sized"):
        live.trust(read_checkpoint_meta(tmp_path))


def test_a_cut_that_does_not_hold_its_stated_rows_is_refused(tmp_path):
    rows = _messages(12, 3)
    CheckpointChain(load_model(CONFIG.model)[0], CONFIG, tmp_path).build(
        [m for m in rows if m.round < LINK], LINK
    )
    meta = {**read_checkpoint_meta(tmp_path), "ledger_messages": 5}
    live = LiveModel(make_estimator(load_model(CONFIG.model)[0], CONFIG))
    with pytest.raises(ValueError, match="as many rows"):
        live.trust(meta)


def test_repair_plans_no_bucket_wholly_below_the_floor():
    theirs = {b: (10, bytes([b]) * 32) for b in range(5)}
    floor = 2 * BUCKET_ROUNDS + 5  # inside bucket 2: it is asked for, 0 and 1 are not

    def wanted(floor_round: int) -> list[int]:
        runs = plan(theirs, {}, 10**6, _Exchange(deadline=0.0), {}, b"s", True, 4096, floor_round)
        return [bucket for run in runs for bucket, _ in run]

    assert wanted(0) == [0, 1, 2, 3, 4]
    assert wanted(floor) == [2, 3, 4]


def test_a_link_is_built_a_step_at_a_time_with_the_same_bytes(tmp_path, monkeypatch):
    """`build_steps` (what a peer runs on its model thread, training between the steps)
    yields after every STEP_ROWS rows of each pass and after each period's replay, and
    writes the bytes `build` writes, from the base or from an older link on disk."""
    import seedflood_p2p.algorithm.chain as chain_module

    monkeypatch.setattr(chain_module, "STEP_ROWS", 5)
    rows = _messages(12, 3)
    below8 = [m for m in rows if m.round < 8]
    stepped = _chain(tmp_path / "stepped")
    steps = stepped.build_steps(below8, 8)
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            meta = done.value
            break
        yields += 1
    assert yields == 24 // 5 + 1 + 2  # a pass over 24 rows, 5 a step; two periods replayed
    assert meta["round"] == 8 and stepped.tail.round == 8
    whole = _chain(tmp_path / "whole")
    whole.build(below8, 8)
    assert _files(tmp_path / "stepped") == _files(tmp_path / "whole")
    # from the link on disk: its rows checked a step at a time, one period replayed
    later = _chain(tmp_path / "stepped")  # a new process: the link on disk, no tail
    later.build([m for m in rows if m.round < 12], 12)
    _chain(tmp_path / "whole12").build([m for m in rows if m.round < 12], 12)
    assert _files(tmp_path / "stepped") == _files(tmp_path / "whole12")
