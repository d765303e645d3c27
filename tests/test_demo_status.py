"""`seedflood demo` end to end with a tiny model, and `seedflood status` on a live peer.

The status and finish tests share one bootstrap node and peer (`live_peer`): the status
test only reads it, and the finish test, after it in this file, ends it.
"""

import json

import pytest

from harness.cluster import RUN, run_toml, start_bootstrap, start_peer
from seedflood.cli import main
from seedflood_p2p.core.flags import to_toml

pytestmark = pytest.mark.slow
TEST_EXAMPLES = 400  # synthetic-sentiment's test split: the final score takes all of it


def test_demo_runs_end_to_end_and_writes_plot_and_summary(tmp_path, capsys):
    work = tmp_path / "demo"
    # calibrated, as the demo's default is (RUN's TOML sets every field, so say it here)
    config = tmp_path / "run.toml"
    config.write_text(to_toml(RUN.replace(calibration="content-free")))
    code = main(
        [
            "demo",
            "--config",
            str(config),
            "--peers",
            "3",
            "--rounds",
            "12",
            "--eval-every",
            "6",
            "--eval-examples",
            "64",
            "--work-dir",
            str(work),
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads((work / "summary.json").read_text())
    assert summary["ledgers_identical"]
    assert len(summary["ledger_digests"]) == 3
    assert summary["devices"] == {f"peer{i}": "cpu" for i in range(3)}  # each peer said so
    assert all(v < 1e-5 for v in summary["max_live_deviation"].values())
    assert [e["rounds_done"] for e in summary["evals"]][:1] == [0]  # zero-shot point
    assert {e["eval_examples"] for e in summary["evals"]} == {64}  # each eval says on how many
    final = summary["final_eval"]  # the replayed model on up to 1000 test examples
    assert final["eval_examples"] == TEST_EXAMPLES and 0 <= final["accuracy"] <= 1
    assert final["calibration"] == "content-free"  # read through real daemons and replay
    assert f"replayed model on {TEST_EXAMPLES} held-out examples" in out
    assert (work / "demo.png").stat().st_size > 20_000
    assert summary["progress"]["round"] in (11, 12)  # progress read from the peers' events
    assert summary["time_budget_final_round"] is None  # ended by --rounds, not the clock


def test_demo_time_budget_ends_every_peer_at_the_same_round(tmp_path, capsys):
    work = tmp_path / "demo"
    args = ["--config", str(run_toml(tmp_path)), "--peers", "2", "--rounds", "100000"]
    args += ["--minutes", "0.3"]
    args += ["--eval-every", "0", "--final-eval-examples", "0"]
    code = main(["demo", *args, "--work-dir", str(work)])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads((work / "summary.json").read_text())
    assert summary["time_budget_final_round"] is not None  # the clock ended the run
    assert summary["final_eval"] is None
    assert summary["ledgers_identical"]
    assert len({final["round"] for final in summary["finals"].values()}) == 1
    assert all(v < 1e-5 for v in summary["max_live_deviation"].values())


@pytest.fixture(scope="module")
def live_peer(tmp_path_factory):
    """A bootstrap node and one peer training (work dir, peer); stopped at the end."""
    work = tmp_path_factory.mktemp("live_peer")
    boot, address = start_bootstrap(work)
    peer = start_peer(
        work,
        "p",
        address,
        ["--metrics-port", "0", "--round-interval", "0.3", "--until-round", "400"],
    )
    try:
        yield work, peer
    finally:
        peer.stop()
        boot.stop()


def test_status_reads_a_live_peer(live_peer, capsys):
    work, peer = live_peer
    peer.wait_round(3)
    port = (work / "p" / "status_port").read_text()
    assert main(["status", f"127.0.0.1:{port}"]) == 0
    screen = capsys.readouterr().out
    assert "run " in screen and "round " in screen and "ledger " in screen
    assert main(["status", f"127.0.0.1:{port}", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["round"] >= 3 and status["ledger_messages"] >= 3
    metrics = (
        __import__("urllib.request")
        .request.urlopen(f"http://127.0.0.1:{port}/metrics")
        .read()
        .decode()
    )
    assert "seedflood_messages_accepted_total" in metrics
    assert 'seedflood_messages_dropped_total{reason="malformed"}' in metrics
    assert 'seedflood_model_info{round="0",sha256="' in metrics  # hashed when ready


def test_finish_after_round_ends_the_peer_at_that_round(live_peer, capsys):
    import urllib.error
    import urllib.request

    work, peer = live_peer
    port = (work / "p" / "status_port").read_text()
    peer.wait_round(2)
    base = f"http://127.0.0.1:{port}"
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(urllib.request.Request(f"{base}/finish", method="POST"))
    assert bad.value.code == 400
    first = json.loads(urllib.request.urlopen(f"{base}/status").read())["round"] + 3

    def finish(after: int) -> dict:
        request = urllib.request.Request(f"{base}/finish?after_round={after}", method="POST")
        return json.loads(urllib.request.urlopen(request).read())

    assert finish(first) == {"final_round": first}
    peer.wait_round(first)  # trained through `first`: now lingering (5 s) before exit
    assert finish(first - 2) == {"final_round": first}  # a finished round stays finished
    target = first + 2  # another peer was already further: agree on its round instead
    assert finish(target) == {"final_round": target}
    assert peer.wait_exit(120) == 0
    assert main(["status", f"127.0.0.1:{port}"]) == 2  # peer gone: one readable line
    assert "cannot read a peer's status" in capsys.readouterr().err
    final = json.loads((work / "p" / "final_status.json").read_text())
    assert final["round"] == target + 1  # rounds 0..target trained, then a clean exit
    rounds = [e["round"] for e in peer.events() if e.get("event") == "round"]
    assert sorted(rounds) == list(range(target + 1))
