"""One-sided estimates (`one_sided_passes`) on real daemons (127.0.0.1, tiny model, audits on
at the test rate): the estimator is a run setting, so a sender and its auditors compute the
same passes. Every peer ends with the same ledger, its live model equals the replay of its
counted updates, and every recomputation of an honest update matches."""

import dataclasses

import pytest

from harness.cluster import RUN, start_peer
from harness.replay_check import replay_equals_live
from harness.scenario import STATUS_PORT, audits_of, finish_when, run_to_the_end
from seedflood_p2p.apps.local import counted_updates
from seedflood_p2p.storage.ledger import Ledger

pytestmark = pytest.mark.slow
ROUNDS = 60  # an upper bound: the run is finished once AUDITS audits are done
AUDITS = 12
# 4 directions in 2 perturbed passes of 2 groups of the batch of 8 (3 passes a round)
ONE_SIDED = dataclasses.replace(
    RUN, directions=4, one_sided_passes=2, extra={"audit": {"cpu_share": 2.0}}
)
PEER_FLAGS = [
    *("--until-round", str(ROUNDS), "--round-interval", "1.0", "--max-staleness", "1"),
    *("--round-deadline", "10", "--linger", "4", "--repair-interval", "1", "--min-peers", "3"),
    *STATUS_PORT,
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    def start(address):
        return {n: start_peer(work, n, address, PEER_FLAGS) for n in ("a", "b", "c")}

    def until_audited(peers, address):
        def shown(statuses):
            return sum(audits_of(s).get("done", 0) for s in statuses.values()) >= AUDITS

        finish_when(peers, work, shown)

    work = tmp_path_factory.mktemp("one_sided")
    return run_to_the_end(work, ONE_SIDED, start, until_audited)


def test_every_peer_finishes_with_the_same_ledger(run):
    assert all(code == 0 for code in run["codes"].values()), {
        n: run["peers"][n].tail() for n, c in run["codes"].items() if c
    }
    digests = {n: f["ledger_digest"] for n, f in run["finals"].items()}
    assert len(digests) == 3 and len(set(digests.values())) == 1, digests


def test_live_models_equal_the_replay_of_the_ledger(run):
    hashes = {}
    for name in run["finals"]:
        with Ledger.open_existing(run["work"] / name / "ledger.sqlite") as ledger:
            config = ledger.config
            assert config.one_sided_passes == 2 and config.directions == 4
            messages, _ = counted_updates(ledger, config)
        assert messages and all(len(m.scalars) == 4 for m in messages)
        hashes[name], _ = replay_equals_live(run["work"] / name, config, messages)
    assert len(set(hashes.values())) == 1, hashes


def test_every_recomputation_of_an_honest_update_matches(run):
    done = 0
    for name, final in run["finals"].items():
        audits = final["audits"]
        assert audits["banned"] == [] and audits["mismatches"] == 0, (name, audits)
        done += audits["done"]
    assert done >= AUDITS
