"""A network run that trains the upper block only (127.0.0.1, tiny model, real daemons):
a peer keeps the frozen block's output per example and reuses it (its held-out sentences,
the content-free row, training examples seen before); another keeps none of it
(`--prefix-cache-mb 0`) and computes it per example every time. They audit each other's
every update under the run's rounding tolerance: the same states, so nobody is accused,
and both live models equal the replay of the one ledger."""

import dataclasses
import json

import pytest

from harness.cluster import RUN, start_peer
from harness.replay_check import replay_equals_live
from seedflood_p2p.algorithm.subcge import make_estimator
from seedflood_p2p.apps.local import counted_updates
from seedflood_p2p.apps.localnet import start_bootstrap
from seedflood_p2p.storage.ledger import Ledger

UPPER = dataclasses.replace(
    RUN,
    train_only="model.layers.1.*",
    calibration="content-free",
    extra={"audit": {"cpu_share": 1.0}},  # every update audited by the other peer
)
ROUNDS = 10
PEER_FLAGS = [
    *("--until-round", str(ROUNDS), "--round-interval", "0.5", "--min-peers", "2"),
    *("--round-deadline", "10", "--linger", "4", "--repair-interval", "1"),
    *("--connect-retries", "20", "--eval-every", "4", "--eval-examples", "24"),
]


@pytest.mark.slow
def test_a_cached_and_an_uncached_peer_agree_and_audit_each_other_clean(tmp_path):
    procs = []
    try:
        boot, address = start_bootstrap(tmp_path, UPPER)
        procs.append(boot)
        peers = {
            "cached": start_peer(tmp_path, "cached", address, PEER_FLAGS),
            "full": start_peer(tmp_path, "full", address, [*PEER_FLAGS, "--prefix-cache-mb", "0"]),
        }
        procs += peers.values()
        codes = {n: p.wait_exit(600) for n, p in peers.items()}
        assert all(c == 0 for c in codes.values()), {n: peers[n].tail() for n in peers}
    finally:
        for p in procs:
            p.stop()
    finals = {n: json.loads((tmp_path / n / "final_status.json").read_text()) for n in peers}
    assert finals["cached"]["ledger_digest"] == finals["full"]["ledger_digest"]

    for name, mb in (("cached", 64), ("full", 0)):
        said = [e for e in peers[name].events() if e.get("event") == "prefix_cache"]
        assert [(e["frozen_blocks"], e["mb"]) for e in said] == [(1, mb)], peers[name].tail()
    kept_none = finals["full"]["prefix_cache"]["train"]
    assert kept_none["examples"] == kept_none["hits"] == 0 and kept_none["misses"] > 0
    cache = finals["cached"]["prefix_cache"]
    # held-out: scored at rounds 0, 4, 8 and the end; only the first pass computed them
    # (24 sentences and the content-free row each of their batches ends with)
    assert cache["held_out"]["misses"] == 25 and cache["held_out"]["hits"] >= 2 * 24, cache
    # training: the content-free row of every batch after the first (ours and audited)
    assert cache["train"]["hits"] >= ROUNDS and cache["train"]["misses"] >= ROUNDS * 8

    evals = {
        n: [e["eval_accuracy"] for e in p.events() if e.get("event") == "eval"]
        for n, p in peers.items()
    }
    assert len(evals["cached"]) >= 3 and len(evals["full"]) >= 3, evals
    for name, final in finals.items():
        audits = final["audits"]
        assert audits["done"] >= ROUNDS // 2, (name, audits)
        assert audits["mismatches"] == 0 and audits["banned"] == [], (name, audits)
        with Ledger.open_existing(tmp_path / name / "ledger.sqlite") as ledger:
            config = ledger.config
            messages, _ = counted_updates(ledger, config)
        _, model = replay_equals_live(tmp_path / name, config, messages)
        assert all(
            m.name.startswith("model.layers.1.") for m in make_estimator(model, config).matrices
        )
