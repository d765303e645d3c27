"""The swarm bench's pure parts (bench/bench_swarm.py): log events into rounds per minute,
delivery, spread and the table, from a synthetic run. No daemons, no timing: fast."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_swarm as swarm  # noqa: E402

N, ROUNDS, INTERVAL = 3, 4, 0.5
T0 = 1_800_000_000.0


def _log_records(peer: int) -> list[dict]:
    """A peer's JSON log: rounds every 0.5 s (peer i starts 0.1*i s later), 0.1 s of work
    a round (published 0.4 s before the event), a duplicate and unrelated records."""
    out = [{"time": T0 - 5, "event": "ready", "round": 0}, {"time": T0 - 4, "message": "x"}]
    for r in range(ROUNDS):
        out.append(
            {"time": T0 + 0.1 * peer + INTERVAL * r, "event": "round", "round": r, "seconds": 0.1}
        )
    out.append({"time": T0 + 99, "event": "round", "round": 1, "seconds": 0.1})  # not first
    out.append({"time": T0 + 99, "event": "eval", "round": 2})
    return out


def _observed() -> dict:
    events = {f"peer{i}": swarm.round_events(_log_records(i)) for i in range(N)}
    # Every ledger holds round r 0.3 s after the first publish (T0 - 0.4 + 0.5 r), but
    # peer2's never holds round 3.
    held = {
        f"peer{i}": {r: T0 - 0.4 + INTERVAL * r + 0.1 + 0.1 * i for r in range(ROUNDS)}
        for i in range(N)
    }
    del held["peer2"][3]
    final = {"round": ROUNDS, "ledger_digest": "d" * 64}
    finals = {
        "peer0": {**final, "ledger_messages": 12, "accepted": {"own": 4, "gossip": 8, "repair": 0}},
        "peer1": {**final, "ledger_messages": 12, "accepted": {"own": 4, "gossip": 6, "repair": 2}},
        "peer2": {
            **final,
            "ledger_messages": 11,
            "accepted": {"own": 4, "gossip": 7, "repair": 0},
            "ledger_digest": "e" * 64,
        },
    }
    samples = []
    for k, t in enumerate((0.0, 2.0, 4.0, 6.0)):
        rnd = min(k, ROUNDS - 1) if k else -1  # the first sample before training
        for i in range(N):
            samples.append(
                {
                    "t": t,
                    "name": f"peer{i}",
                    "kind": "peer",
                    "pid": 100 + i,
                    "round": rnd,
                    "rss_kb": (300 + 10 * i + k) * 1024,
                    "pss_kb": (120 + i + k) * 1024,
                    "uss_kb": (50 + i) * 1024,
                    "cpu_s": 5.0 + 0.2 * max(rnd, 0) * (i + 1),
                }
            )
            samples.append(
                {
                    "t": t,
                    "name": f"peer{i}/p2pd",
                    "kind": "p2pd (peer)",
                    "pid": 200 + i,
                    "round": rnd,
                    "rss_kb": 60 * 1024,
                    "pss_kb": 60 * 1024,
                    "cpu_s": 1.0 + 0.01 * max(rnd, 0),
                }
            )
    return {
        "key": swarm.row_key(N, ROUNDS, INTERVAL, swarm.LOOPBACK, 1),
        "n": N,
        "rounds": ROUNDS,
        "interval": INTERVAL,
        "threads": 1,
        "poll_s": 0.5,
        "network": swarm.LOOPBACK,
        "cpus": 2,
        "load_start": [1.5, 1.0, 0.5],
        "load_end": [2.5, 1.2, 0.6],
        "wall_s": 60.0,
        "events": events,
        "held": held,
        "finals": finals,
        "boot_digest": "d" * 64,
        "samples": samples,
        "error": None,
    }


def test_round_events_keep_the_first_of_each_round():
    evs = swarm.round_events(_log_records(0))
    assert [r for r, _, _ in evs] == [0, 1, 2, 3]
    assert evs[1] == (1, T0 + INTERVAL, 0.1)
    assert swarm.publish_time(T0, 0.1, INTERVAL) == pytest.approx(T0 - 0.4)
    assert swarm.publish_time(T0, 0.8, INTERVAL) == T0  # a round longer than the interval


def test_rounds_per_minute_per_peer_and_swarm():
    events = _observed()["events"]
    rpm = swarm.rounds_per_minute(events, ROUNDS)
    assert rpm["median"] == pytest.approx(120.0)  # 3 rounds in 1.5 s
    # rounds 0..3: from peer0's round 0 (T0) to peer2's round 3 (T0 + 1.7)
    assert rpm["swarm"] == pytest.approx(60 * 3 / 1.7)
    assert rpm["first_rounds"] == [0]
    # a peer ready late starts at round 1: the swarm's rate is unchanged
    late = {**events, "peer1": events["peer1"][1:]}
    assert swarm.rounds_per_minute(late, ROUNDS)["swarm"] == pytest.approx(60 * 3 / 1.7)
    assert swarm.rounds_per_minute(late, ROUNDS)["first_rounds"] == [0, 1]
    assert swarm.rounds_per_minute({**events, "peer1": []}, ROUNDS)["swarm"] is None


def test_delivery_at_the_end_and_before_repair():
    d = swarm.delivery(_observed()["finals"], N, ROUNDS)
    assert d["expected"] == 12
    assert d["end_min"] == pytest.approx(11 / 12)
    assert d["end_mean"] == pytest.approx(35 / 36)
    assert d["gossip_min"] == pytest.approx(10 / 12)
    assert d["gossip_mean"] == pytest.approx(33 / 36)
    assert d["repaired"] == 2
    assert d["published"] == 12 and d["of_published_min"] == pytest.approx(11 / 12)
    gone = swarm.delivery({"peer0": None, "peer1": {"ledger_messages": 12}}, 2, 6)
    assert gone["end_min"] == 0.0 and gone["gossip_min"] is None


def test_spread_from_first_publish_to_the_last_ledger():
    o = _observed()
    s = swarm.spread_times(o["events"], o["held"], ROUNDS, INTERVAL)
    # the last ledger (peer2) holds round r 0.1 + 0.2 s after its first publish
    assert s["rounds_timed"] == 3 and s["incomplete"] == [3]
    assert s["median_s"] == pytest.approx(0.3)
    assert s["p95_s"] == pytest.approx(0.3)
    # peer2 publishes 0.2 s after peer0, its ledger the last to hold the round 0.1 s later
    assert s["from_last_median_s"] == pytest.approx(0.1)
    assert swarm.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert swarm.percentile([], 95) is None


def test_row_and_table_from_a_synthetic_run(tmp_path):
    row = swarm.summarize_row(_observed())
    assert row["complete"]
    assert row["digests"]["distinct"] == 2  # peer2 disagrees with the others and bootstrap
    assert row["final_rounds"] == [ROUNDS]
    assert row["peer"]["count"] == 3
    assert row["peer"]["rss_mib_median"] == pytest.approx(313)
    assert row["peer"]["rss_mib_max"] == pytest.approx(323)
    # cpu from the first sample in training (round 1) to the first at round 3: 0.2*(i+1)
    assert row["peer"]["cpu_s_per_round_median"] == pytest.approx(0.4)
    assert row["p2pd"]["cpu_s_per_round_median"] == pytest.approx(0.01)
    assert row["p2pd"]["rss_mib_max"] == pytest.approx(60)
    line = swarm.table([row])[2]
    assert line.startswith(
        f"| {N} | {swarm.LOOPBACK} | subprocess | 2 | {ROUNDS} | 120.0 / 105.9 |"
    )
    assert "| 91.7% / 97.2% | 83.3% / 91.7% | 0.30 / 0.30 | 0.10 / 0.10 | 2 |" in line
    # PSS: each peer's largest (123 + i), median 124; USS 50 + i, median 51
    assert "| 313 / 323 | 124 / 51 | 60 / 60 | 60 | 0.400 | 0.010 | 1.50 -> 2.50 | - | 60 |" in line
    assert row["peer"]["pss_mib_max"] == pytest.approx(125)

    assert swarm.resummarize(json.loads(json.dumps(row))) == json.loads(json.dumps(row))
    doc = {"invocations": [{"command": "python bench/bench_swarm.py --peers 3"}], "rows": [row]}
    page = swarm.markdown(doc)
    assert "`python bench/bench_swarm.py --peers 3`" in page and line in page
    out = tmp_path / "swarm-x"
    swarm.save_doc(doc, out)
    again = swarm.load_doc(out.with_suffix(".json"))
    assert again["rows"][0]["key"] == row["key"]  # what a rerun skips on
    assert out.with_suffix(".md").read_text() == page


def test_an_incomplete_row_says_so():
    o = _observed()
    o["finals"]["peer1"] = None
    o["error"] = "TimeoutError('x')"
    row = swarm.summarize_row(o)
    assert not row["complete"]
    assert row["digests"]["missing"] == ["peer1"]
    assert swarm.table([row])[2].startswith(f"| {N} (incomplete) |")
    assert "error: TimeoutError" in swarm.markdown({"rows": [row]})


def test_log_and_ledger_readers(tmp_path):
    log = tmp_path / "peer0.log"
    lines = [json.dumps(r) for r in _log_records(0)]
    log.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])  # torn last line
    events = swarm.LogEvents(log)
    events.read()
    assert events.ready and events.last == 0
    log.write_text("\n".join(lines) + "\n")
    events.offset = len("\n".join(lines[:3]) + "\n")
    events.read()
    assert events.last == ROUNDS - 1 and len(events.rounds) == ROUNDS

    db = tmp_path / "ledger.sqlite"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE messages (round INTEGER, peer INTEGER)")
        c.executemany("INSERT INTO messages VALUES (?, ?)", [(0, 1), (0, 2), (1, 1)])
    poll = swarm.LedgerPoll(db, 2, ROUNDS)
    poll.poll(10.0)
    assert poll.held == {0: 10.0}
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO messages VALUES (1, 2)")
    poll.poll(11.0)
    assert poll.held == {0: 10.0, 1: 11.0}
    poll.close()
    assert swarm.LedgerPoll(tmp_path / "none.sqlite", 2, 2).held == {}


# -- --prometheus: the dashboard's queries, the scrape config, coverage, the views -------
def test_dashboard_queries_are_concrete():
    dash = json.loads(swarm.DASHBOARD.read_text())
    queries = swarm.dashboard_queries(dash)
    assert len(queries) >= 20
    for q in queries:
        assert "$" not in q["query"] and q["panel"]
        assert swarm.metric_names(q["query"]), q  # every query selects some metric
    nested = {
        "panels": [
            {
                "title": "row",
                "panels": [
                    {
                        "title": "x",
                        "targets": [
                            {"expr": 'rate(a_total{instance=~"$instance"}[$__rate_interval])'},
                            {"expr": 'b{instance=~"${instance:regex}"}'},
                            {"refId": "no expr"},
                        ],
                    }
                ],
            }
        ]
    }
    got = [q["query"] for q in swarm.dashboard_queries(nested, instance="h:1")]
    assert got == ['rate(a_total{instance=~"h:1"}[1m])', 'b{instance=~"h:1"}']
    with pytest.raises(ValueError, match="unknown template variable"):
        swarm.dashboard_queries({"panels": [{"targets": [{"expr": 'x{a="$job"}'}]}]})


def test_per_daemon_adds_instance_to_every_grouping():
    q = "histogram_quantile(0.99, sum by (le, source) (rate(x_bucket[5m])))"
    assert swarm.per_daemon(q) == (
        "histogram_quantile(0.99, sum by (le, source, instance) (rate(x_bucket[5m])))"
    )
    assert swarm.per_daemon("sum by (instance) (x)") == "sum by (instance) (x)"
    assert swarm.per_daemon("sum by () (x) > 0") == "sum by (instance) (x) > 0"
    assert swarm.per_daemon('a{instance=~".*"}') == 'a{instance=~".*"}'
    assert swarm.metric_names('sum by (le) (rate(x_bucket{a="b"}[1m])) / y[1m]') == [
        "x_bucket",
        "y",
    ]


def test_prometheus_config_and_targets(tmp_path):
    text = swarm.prometheus_config(tmp_path / "targets.json", 1.5)
    assert "scrape_interval: 1.5s" in text and "file_sd_configs" in text
    assert json.dumps(str(tmp_path / "targets.json")) in text
    targets = swarm.file_sd_targets({"peer1": 9002, "bootstrap": 9000})
    assert targets == [
        {"targets": ["127.0.0.1:9000"], "labels": {"daemon": "bootstrap"}},
        {"targets": ["127.0.0.1:9002"], "labels": {"daemon": "peer1"}},
    ]


def test_coverage_verdicts_and_the_markdown():
    peers = {"h:1": "peer0", "h:2": "peer1"}
    families = swarm.exposed_families(
        "# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
        "# TYPE bans counter\n# TYPE lat_seconds histogram\n"
    )
    assert families == {"a_total": "counter", "bans": "counter", "lat_seconds": "histogram"}
    assert swarm.declared("lat_seconds_bucket", families)
    assert swarm.declared("bans_total", families) and not swarm.declared("nope", families)

    def vec(*instances):
        return [{"metric": {"instance": i}, "value": [0, "1"]} for i in instances]

    def check(query, direct, split):
        c = swarm.query_coverage(
            {"panel": "p", "expr": query, "query": query}, direct, split, peers
        )
        c["verdict"] = swarm.classify(c, families, {"a_total"}, 2)
        return c

    full = check("sum by (s) (rate(a_total[1m]))", vec(None), vec("h:1", "h:2", "h:0"))
    assert full["series"] == 1 and full["covered"] == 2 and full["bootstrap_covered"]
    assert full["verdict"] == "all"
    assert check("a_total", vec("h:1"), vec("h:1"))["verdict"].startswith("some: 1 of 2 (peer1")
    assert check("bans_total", [], [])["verdict"].startswith("empty: declared, no samples")
    assert check("a_total > 5", [], [])["verdict"].startswith("empty: series exist")
    assert check("typo_total", [], [])["verdict"] == "broken: no daemon exports typo_total"

    watch = {"n": 2, "queries": [full, check("bans_total", [], [])], "at_round": 3}
    assert swarm.summarize_prometheus(watch)["line"] == (
        "prometheus: 1 of 2 dashboard queries cover all 2 daemons"
    )
    watch["run_page"] = {"html_status": 200, "html_bytes": 12000, "peers": 2, "states": {}}
    watch["status_bootstrap"] = {"peers_alive": 2, "run_alive": 2, "run_known": 2}
    page = "\n".join(swarm.prometheus_markdown({"n": 2, "prometheus": watch}))
    assert "**prometheus: 1 of 2 dashboard queries cover all 2 daemons**" in page
    assert "/run.json lists 2 of 2 peers" in page and "| p | `bans_total` | 0 | 0 | no |" in page


def test_status_and_run_page_counts():
    screen = (
        "peer        12D3 (bootstrap, seedflood 0.1, up 9 s)\n"
        "run-wide    round 41, 3 peers alive of 4 in the ledger, held-out accuracy n/a\n"
        "peers alive 3\n"
        "peer rounds ..abc: 4  ..def: 5  ..0a1: -1\n"
    )
    assert swarm.status_counts(screen) == {
        "peers_alive": 3,
        "run_alive": 3,
        "run_known": 4,
        "peer_rounds": 3,
    }
    assert swarm.status_counts("")["peers_alive"] is None
    run = {
        "run": {"round": 7, "peers_alive": 2, "peers_known": 3},
        "peers": [{"state": "alive"}, {"state": "alive"}, {"state": "lagging (5 rounds behind)"}],
    }
    assert swarm.run_page_counts(run) == {
        "peers": 3,
        "states": {"alive": 2, "lagging": 1},
        "round": 7,
        "peers_alive": 2,
        "peers_known": 3,
    }


def test_fork_server_rows_memory_and_estimates():
    o = _observed()
    o.update(
        launch="fork-server",
        startup_s=28.0,
        fork_server={"import_s": 15.3, "import_cpu_s": 3.8, "ready_s": 15.5, "forked": 3},
        memory=swarm.memory_summary([(0.0, 24000.0, 20000.0), (2.0, 24000.0, 17000.0)]),
    )
    o["samples"] = o["samples"] + [
        {
            "t": 2.0,
            "name": "zygote",
            "kind": "zygote",
            "pid": 99,
            "round": 1,
            "rss_kb": 400 * 1024,
            "pss_kb": 130 * 1024,
            "uss_kb": 40 * 1024,
            "cpu_s": 4.0,
        },
    ]
    row = swarm.summarize_row(o)
    assert row["memory"] == {
        "total_mib": 24000.0,
        "available_start_mib": 20000.0,
        "available_min_mib": 17000.0,
        "used_peak_mib": 7000.0,
    }
    assert swarm.memory_summary([]) == {"available_min_mib": None}
    assert row["zygote"]["count"] == 1 and row["zygote"]["pss_mib_max"] == pytest.approx(130)
    assert "| fork-server | 2 |" in swarm.table([row])[2]
    assert "| - | 60 |" not in swarm.table([row])[2]  # its start-up is in the table
    page = swarm.markdown({"rows": [row]})
    assert "fork server: imports 15.3 s" in page and "lowest 17000 MiB" in page
    # what a row of N forked peers is estimated to need: PSS of a peer and its p2pd
    assert swarm.fork_mib_per_peer([row]) == pytest.approx(125 + 60)
    assert swarm.fork_mib_per_peer([]) == swarm.DEFAULT_FORK_MIB_PER_PEER
    # ... and a forked peer's RSS (shared pages counted) is no estimate for the normal launch
    assert swarm.mib_per_peer([row]) == swarm.DEFAULT_MIB_PER_PEER
    normal = swarm.summarize_row(_observed())
    assert swarm.mib_per_peer([row, normal]) == pytest.approx(323 + 60)


def test_fork_server_protocol_and_proc_parsing():
    from harness import fork_server

    msgs, rest = fork_server.decode_lines(
        fork_server.encode({"op": "spawned", "id": 1, "pid": 7}) + b'{"op": "ex'
    )
    assert msgs == [{"op": "spawned", "id": 1, "pid": 7}] and rest == b'{"op": "ex'
    assert fork_server.decode_lines(rest + b'it", "pid": 7, "code": 0}\n')[0][0]["op"] == "exit"
    assert fork_server.exit_code(3 << 8) == 3  # exited with 3
    assert fork_server.exit_code(15) == -15  # killed by SIGTERM, as Popen.returncode
    argv = fork_server.daemon_argv(["peer", "--threads", "1"])
    assert argv[0].endswith("seedflood/__main__.py")
    assert argv[1:] == ["--log-format", "json", "peer", "--threads", "1"]
    rollup = (
        "55aaa26d1000-7ffdada8e000 ---p 00000000 00:00 0    [rollup]\n"
        "Rss:                1696 kB\nPss:                 276 kB\n"
        "Pss_Anon:            112 kB\nShared_Clean:       1544 kB\n"
        "Private_Clean:        40 kB\nPrivate_Dirty:       112 kB\n"
    )
    assert fork_server.smaps_rollup(rollup) == {"rss_kb": 1696, "pss_kb": 276, "uss_kb": 152}
    assert fork_server.threads_here() >= 1
