"""A network run with an activation or K-FAC basis (127.0.0.1, tiny model, real daemons): the
bootstrap node computes the run's one basis artifact at the base weights and the manifest
names its SHA-256; peers that never had it fetch it by digest, keep it beside their
ledgers, train and audit along it, and their live models equal the replay of their
ledgers with that artifact (and differ from a replay without it: it was used). A late
joiner rebuilds its model by replaying the synced rows: along the artifact too. The K-FAC
run trains with momentum from the ledger (algorithm/momentum.py) as well."""

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.cluster import RUN, start_peer
from harness.replay_check import replay_equals_live
from harness.scenario import STATUS_PORT, finish_when, run_to_the_end
from seedflood_p2p.algorithm.basis import load_schedule
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.apps.local import counted_updates
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.storage.artifacts import ArtifactStore, read_schedule
from seedflood_p2p.storage.ledger import Ledger
from seedflood_p2p.workload.models import load_model, weights_sha256

ACTIVATION = dataclasses.replace(
    RUN, basis="activation", basis_examples=32, extra={"audit": {"cpu_share": 1.0}}
)
# Open-ended: once the founders passed ROUNDS and the late joiner trained JOINER_ROUNDS,
# every peer finishes at one common round (`finish_when`); a fixed end let the joiner, slow
# to start under load, publish a round after one founder had stopped. ROUNDS_CAP: a bound.
ROUNDS, JOINER_ROUNDS, ROUNDS_CAP = 12, 2, 80
PEER_FLAGS = [
    *("--until-round", str(ROUNDS_CAP), "--round-interval", "1.0", "--min-peers", "2"),
    *("--round-deadline", "10", "--linger", "6", "--repair-interval", "1"),
    *("--connect-retries", "20", *STATUS_PORT),
]
BASES = ["activation", "kfac"]


def test_a_refreshed_basis_is_refused_by_the_daemons_and_a_peer_needs_the_digest():
    from bootstrap.node import BootstrapSettings, resolve_manifest
    from peer.daemon import check_manifest_reply

    refreshed = dataclasses.replace(ACTIVATION, basis_refresh=1)
    assert "basis_refresh 1" in refreshed.daemon_problem()
    with pytest.raises(UserError, match="cannot serve this run: basis_refresh 1"):
        resolve_manifest(BootstrapSettings(), refreshed)
    assert ACTIVATION.daemon_problem() is None
    reply = {"time": time.time(), "version": "0.1.0", "manifest": ACTIVATION.to_json()}
    with pytest.raises(UserError, match="names no basis artifact"):
        check_manifest_reply(reply, time.time(), "0.1.0")
    with pytest.raises(UserError, match="basis_sha256 must be empty or 64"):
        dataclasses.replace(ACTIVATION, basis_sha256="abc")
    with pytest.raises(UserError, match="needs basis 'activation'"):
        dataclasses.replace(RUN, basis_sha256="a" * 64)
    # the default run's id is unchanged by the new field (omitted when empty)
    assert "basis_sha256" not in RUN.to_json()


def _run(work, basis: str) -> dict:
    def start(address):
        return {n: start_peer(work, n, address, PEER_FLAGS) for n in ("a", "b")}

    def join_late(peers, address):
        peers["a"].wait_round(4)
        peers["c"] = start_peer(work, "c", address, PEER_FLAGS)  # restores by replay

        def shown(statuses) -> bool:
            trained = [e for e in peers["c"].events() if e.get("event") == "round"]
            return len(trained) >= JOINER_ROUNDS and peers["a"].last_round() >= ROUNDS

        finish_when(peers, work, shown)

    # the K-FAC run also trains with momentum 0.9 (a fixed basis: both sides, once), so its
    # audits recompute on rewound states and the joiner's replay rebuilds the velocity
    run = dataclasses.replace(ACTIVATION, basis=basis, momentum=0.9 * (basis == "kfac"))
    return run_to_the_end(work, run, start, join_late, exit_timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both bases' runs at once (each mostly waits for its round clock; the runs differ,
    so do their ids): {basis: its finished future}."""
    with ThreadPoolExecutor(2) as pool:
        return {b: pool.submit(_run, tmp_path_factory.mktemp(b), b) for b in BASES}


@pytest.mark.slow
@pytest.mark.parametrize("basis", BASES)
def test_peers_fetch_the_organisers_basis_train_audit_and_replay_along_it(runs, basis):
    result = runs[basis].result()
    work, peers, boot = result["work"], result["peers"], result["bootstrap"]
    assert all(c == 0 for c in result["codes"].values()), {n: peers[n].tail() for n in peers}
    computed = [e for e in boot.events() if e.get("event") == "basis"]
    assert len(computed) == 1, boot.tail()
    sha = computed[0]["sha256"]
    assert ArtifactStore.beside(work / "bootstrap" / "ledger.sqlite").has(sha)
    finals = {n: json.loads((work / n / "final_status.json").read_text()) for n in peers}
    # the late joiner may end a row or two short under load; its own replay is the check
    assert finals["a"]["ledger_digest"] == finals["b"]["ledger_digest"]
    replayed = {}
    for name, proc in peers.items():
        fetched = [e for e in proc.events() if "fetched the run's basis" in e.get("message", "")]
        assert len(fetched) == 1, proc.tail()
        with Ledger.open_existing(work / name / "ledger.sqlite") as ledger:
            config = ledger.config
            assert config.basis_sha256 == sha
            assert read_schedule(ledger) == [(0, sha)]
            schedule = load_schedule(ledger)  # the bytes beside the ledger, digest checked
            messages, _ = counted_updates(ledger, config)
        assert len(messages) >= ROUNDS
        assert bool(schedule.artifacts[sha].u) == (basis == "kfac")  # K-FAC: U sides too
        assert config.momentum == (0.9 if basis == "kfac" else 0.0)
        replayed[name], _ = replay_equals_live(work / name, config, messages, schedule=schedule)
        without, _ = load_model(config.model)
        replay(without, config, messages)  # random +-1 sides instead of the artifact's
        assert weights_sha256(without) != replayed[name]
        audits = finals[name]["audits"]
        assert audits["banned"] == [] and audits["mismatches"] == 0, (name, audits)
    assert replayed["a"] == replayed["b"]
    assert sum(f["audits"]["done"] for f in finals.values()) >= 2  # audits recomputed along it
