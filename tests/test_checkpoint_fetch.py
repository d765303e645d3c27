"""Late joiners fetch a checkpoint of the run's chain from peers: real
bootstrap and peer daemons on 127.0.0.1 (tiny model), each with its own p2pd.

    honest:  A and B train and serve chain links; J joins late with --checkpoint-fetch
             always: it takes the link A and B both offer, fetching chunks from both, and
             ends with the same ledger digest and replay hash as them.
    hostile: A and B serve chunks with a flipped byte, C offers a forged link (other
             weights, consistent hashes), each harness/hooked_peer.py with
             --checkpoint corrupt or forge: J refuses the chunks (bad_chunk, counted, the
             senders penalized) and the forged offer (no quorum), becomes ready by replay,
             and still ends with the same ledger and replay hash. (It asks with
             --history-sync background: with nothing to trust it syncs everything first.)
    background: A and B collude, both offering the same forged link (a quorum); C is honest.
             J joins with --history-sync background: ready with only the rows after the
             link, it fetches and checks the history (rows as the link recorded), then
             rebuilds the link from them, finds the weights forged, names A and B, replaces
             the link and rebuilds its model; it ends with the same ledger and replay hash.

Both joiners decode real nodes' offer and chunk replies (checkpoint.decode_checkpoint_offer,
checkpoint.check_chunk, protocol/checkpoint.py): the honest one uses them, the hostile one
refuses them.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from harness.cluster import RUN, peer_flags, start_hooked_peer, start_peer
from harness.open_run import wait_event, wait_events
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.apps.demo import finish_all
from seedflood_p2p.apps.localnet import start_bootstrap
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model, weights_sha256

pytestmark = pytest.mark.slow
# Open-ended: the peers are told to finish at one round (apps.demo.finish_all) once the
# joiner has shown what the tests assert; ROUNDS is only a cap, long enough for a joiner
# started at round 13 as a new interpreter (~60 s under load; forked: seconds).
ROUNDS = 120
# audits off: audited runs have no chain (their model is a settled state, not the ledger)
CHAIN_RUN = dataclasses.replace(RUN, extra={"checkpoint_every": 8, "audit": False})
PEER_FLAGS = peer_flags(
    until_round=ROUNDS,
    metrics_port=0,  # the status port, for finish_all
    round_interval=1.0,
    max_staleness=2,
    round_deadline=3,
    liveness_timeout=20,
    min_peers=1,
    checkpoint_settle=4,
)
LIVE_VS_REPLAY_ATOL = 1e-5  # as tests/test_p2p.py: the same sums in another order


def _run(
    work,
    run,
    servers: dict[str, list[str]],
    links: int,
    joiner: list[str] = (),
    flags: list[str] = PEER_FLAGS,
    wait_for: str | None = None,
    join_round: int = 13,  # link 8 is built at round 12 (settle 4) and served
) -> dict:
    """SERVERS: {name: hooked_peer.py flags}, a `seedflood peer` for those with none, each
    with `flags`; the joiner starts once the first is at `join_round`; the run finishes once
    the joiner is ready and logged `links` chain links (two rounds on), and, with
    `--history-sync background` among its `joiner` flags, checked its history (or logged the
    event `wait_for`)."""
    procs = []
    try:
        boot, address = start_bootstrap(work, run)
        procs.append(boot)
        peers = {}
        for name, extra in servers.items():
            start = start_hooked_peer if extra else start_peer
            peers[name] = start(work, name, address, flags + extra)
            procs.append(peers[name])
        first = next(iter(peers.values()))
        first.wait_round(join_round)
        peers["j"] = start_peer(
            work, "j", address, [*flags, "--checkpoint-fetch", "always", *joiner]
        )
        procs.append(peers["j"])
        ready = wait_event(peers["j"], "ready", timeout=600)
        if "background" in joiner and links:  # (a link fetched: its history checked)
            wait_event(peers["j"], "history_checked", timeout=300)
        if wait_for is not None:
            wait_event(peers["j"], wait_for, timeout=300)
        shown = wait_events(peers["j"], "chain_link", links, timeout=300)
        peers["j"].wait_round(max(e["round"] for e in [ready, *shown]) + 2, timeout=120)
        finish_all(peers, work)
        codes = {n: p.wait_exit() for n, p in peers.items()}
        return {"work": work, "peers": peers, "codes": codes}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The honest, hostile and background runs at once (each mostly waits for its round
    clock), as three runs (salts) on their own bootstrap nodes: {name: its future}."""
    hooks = {"a": "corrupt", "b": "corrupt", "c": "forge"}
    with ThreadPoolExecutor(3) as pool:
        return {
            # 2 links: the one it fetched, then one of its own (it serves the chain too)
            "honest": pool.submit(
                _run, tmp_path_factory.mktemp("ckpt-honest"), CHAIN_RUN, {"a": [], "b": []}, 2
            ),
            "hostile": pool.submit(
                _run,
                tmp_path_factory.mktemp("ckpt-hostile"),
                dataclasses.replace(CHAIN_RUN, salt="checkpoint-fetch-hostile"),
                {n: ["--checkpoint", h] for n, h in hooks.items()},
                0,
                # nothing to trust: the fallback syncs the whole history, then replays
                ["--history-sync", "background"],
            ),
            # 1 link: one it built itself, after its history and the link were checked
            "background": pool.submit(
                _run,
                tmp_path_factory.mktemp("ckpt-background"),
                dataclasses.replace(CHAIN_RUN, salt="checkpoint-fetch-background"),
                {"a": ["--checkpoint", "forge"], "b": ["--checkpoint", "forge"], "c": []},
                1,
                ["--history-sync", "background"],
            ),
        }


@pytest.fixture(scope="module")
def honest(runs):
    return runs["honest"].result()


@pytest.fixture(scope="module")
def hostile(runs):
    return runs["hostile"].result()


@pytest.fixture(scope="module")
def background(runs):
    return runs["background"].result()


def _final(run, name) -> dict:
    return json.loads((run["work"] / name / "final_status.json").read_text())


def _ready(run, name) -> dict:
    return next(e for e in run["peers"][name].events() if e.get("event") == "ready")


def _replay(run, name) -> tuple[str, dict]:
    """What `seedflood replay` rebuilds from NAME's ledger: the updates that count (a
    convicted peer's are void) onto the base."""
    from seedflood_p2p.apps.local import counted_updates

    with Ledger.open_existing(run["work"] / name / "ledger.sqlite") as ledger:
        config = ledger.config
        model, _ = load_model(config.model)
        replay(model, config, counted_updates(ledger, config)[0])
    weights = {m.name: m.weight.detach().clone() for m in make_estimator(model, config).matrices}
    return weights_sha256(model), weights


def _ends_equal(run, names: list[str]) -> None:
    assert all(code == 0 for code in run["codes"].values()), run["codes"]
    digests = {n: _final(run, n)["ledger_digest"] for n in names}
    assert len(set(digests.values())) == 1, digests
    hashes = {}
    for name in names:
        hashes[name], replayed = _replay(run, name)
        live = load_file(run["work"] / name / "checkpoint.safetensors")
        for key, tensor in replayed.items():
            torch.testing.assert_close(live[key], tensor, atol=LIVE_VS_REPLAY_ATOL, rtol=0)
    assert len(set(hashes.values())) == 1, hashes


def test_late_joiner_takes_the_checkpoint_two_peers_offer(honest):
    ready = _ready(honest, "j")
    assert ready["source"].startswith("fetched checkpoint of round"), ready
    assert ready["source"].endswith("from 2 peers"), ready
    fetched = _final(honest, "j")["checkpoint"]["fetched"]
    assert fetched["round"] >= 8 and fetched["bytes"] > 0 and len(fetched["peers"]) == 2
    a, b = (_final(honest, n)["peer_id"] for n in ("a", "b"))
    assert set(fetched["peers"]) == {a, b}
    assert _final(honest, "j")["checkpoint"]["refused"] == {}
    # rebuilt from its rows after ready: the same tensors
    check = _final(honest, "j")["checkpoint"]["link_check"]
    assert check["match"] is True and check["round"] == fetched["round"], check
    _ends_equal(honest, ["a", "b", "j"])


def test_joiner_serves_the_chain_too(honest):
    links = [e for e in honest["peers"]["j"].events() if e.get("event") == "chain_link"]
    theirs = [e for e in honest["peers"]["a"].events() if e.get("event") == "chain_link"]
    same = {e["round"]: e["file_sha256"] for e in theirs}
    assert len(links) >= 2  # the link it fetched, then one it built itself
    assert all(same.get(e["round"], e["file_sha256"]) == e["file_sha256"] for e in links)


def test_corrupt_chunks_and_a_forged_offer_are_refused_and_the_joiner_replays(hostile):
    ready = _ready(hostile, "j")
    assert ready["source"].startswith("replay of"), ready
    status = _final(hostile, "j")
    refused = status["checkpoint"]["refused"]
    assert refused.get("bad_chunk", 0) >= 2, refused  # from A and from B
    assert refused.get("no_quorum", 0) >= 1, refused  # C's forged link
    assert status["checkpoint"]["fetched"] is None
    assert status["dropped"].get("bad_reply", 0) >= 2  # counted like any bad reply
    logs = hostile["peers"]["j"].events()
    assert any(e.get("event") == "checkpoint_refused" and e.get("why") == "bad_chunk" for e in logs)
    # nothing trusted: the history was synced before ready (its progress logged), and the
    # offers asked for once
    assert status["checkpoint"]["history"] is None
    progress = [e for e in logs if e.get("event") == "sync_progress"]
    ready_at = next(e["time"] for e in logs if e.get("event") == "ready")
    assert progress and all(e["time"] <= ready_at and e["rows"] > 0 for e in progress)
    assert len([e for e in logs if e.get("event") == "checkpoint_fetch"]) == 1
    _ends_equal(hostile, ["a", "b", "c", "j"])


def test_a_joiner_trusting_the_link_is_ready_before_it_holds_the_history(background):
    ready = _ready(background, "j")
    assert ready["source"].startswith("fetched trusted checkpoint of round"), ready
    fetched = _final(background, "j")["checkpoint"]["fetched"]
    # ready holding none of the link's rows: only the rows after it, not the history
    assert fetched["round"] >= 8 and fetched["rows"] > 0, fetched
    history = _final(background, "j")["checkpoint"]["history"]
    assert history["held_at_ready"] == 0 and ready["ledger_rows"] > 0, (history, ready)
    logs = background["peers"]["j"].events()
    checked = next(e for e in logs if e.get("event") == "history_checked")
    assert checked["match"] is True and checked["trusted_round"] == fetched["round"]
    assert history["checked"] and history["match"] and history["trusted_round"] == fetched["round"]


def test_colluding_offerers_forged_weights_are_found_and_the_model_rebuilt(background):
    fetched = _final(background, "j")["checkpoint"]["fetched"]
    a, b = (_final(background, n)["peer_id"] for n in ("a", "b"))
    assert set(fetched["peers"]) == {a, b}  # the forged link had the quorum
    logs = background["peers"]["j"].events()
    kinds = [
        e["event"]
        for e in logs
        if e.get("event") in ("history_checked", "link_checked", "rebuilt", "chain_link")
    ]
    # rows first, then the weights (forged), the rebuild, and only then links of its own
    assert kinds[:3] == ["history_checked", "link_checked", "rebuilt"], kinds
    assert "chain_link" in kinds[3:], kinds
    check = next(e for e in logs if e.get("event") == "link_checked")
    assert check["match"] is False and set(check["offered_by"]) == {a, b}, check
    refused = _final(background, "j")["checkpoint"]["refused"]
    assert refused.get("forged_weights") == 1, refused  # (and C's lone honest offer: no_quorum)
    # its links are the honest peer's, not the forgers'
    honest = {
        e["round"]: e["file_sha256"]
        for e in background["peers"]["c"].events()
        if e.get("event") == "chain_link"
    }
    own = [e for e in logs if e.get("event") == "chain_link"]
    assert own and all(honest.get(e["round"], e["file_sha256"]) == e["file_sha256"] for e in own)
    assert any(e["round"] in honest for e in own), (own, honest)
    _ends_equal(background, ["a", "b", "c", "j"])
