"""Join through any live peer after the bootstrap node is killed (harness/join_any_peer.py),
with real daemons on 127.0.0.1: D is given A's address only and must find B and C through
the DHT's signed peer records, connect to them, train, and end with the same ledger."""

from __future__ import annotations

import pytest

from harness.join_any_peer import run_join_any_peer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    return run_join_any_peer(tmp_path_factory.mktemp("join_any_peer"))


def test_the_new_peer_joins_through_a_non_bootstrap_peer_and_trains(joined):
    assert joined["codes"] == {"a": 0, "b": 0, "c": 0, "d": 0}, joined["codes"]
    assert joined["ready"]["round"] >= joined["run_round_at_join"] - 1
    assert joined["first_round"] is not None


def test_the_new_peer_connects_to_peers_it_was_not_given_found_in_the_dht(joined):
    ids = joined["ids"]
    assert ids["a"] in joined["entry"]  # the only address D was given
    assert {ids["b"], ids["c"]} <= set(joined["d_connected"])
    # D read B's and C's signed "peer" records from the DHT (not only a peer's summary).
    found = set(joined["finals"]["d"]["discovery"]["peers_found"])
    assert {ids["a"], ids["b"], ids["c"]} <= found, found
    assert joined["finals"]["d"]["discovery"]["rejected"] == {}


def test_every_ledger_ends_identical(joined):
    digests = {name: final["ledger_digest"] for name, final in joined["finals"].items()}
    assert len(set(digests.values())) == 1, digests


def test_a_toml_bootstrap_list_with_a_dead_first_entry_is_used(joined):
    # D's only addresses came from `bootstrap = [dead bootstrap, A]` in its TOML file.
    assert joined["bootstrap"] != joined["entry"]
    assert joined["ids"]["a"] in joined["d_connected"]
