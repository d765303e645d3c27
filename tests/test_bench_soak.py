"""The soak bench's pure parts (bench/bench_soak.py): the slope fits, and the summary and
page it makes from a JSONL. A small synthetic JSONL stands for a run: no daemons, fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_soak as soak  # noqa: E402

SEGMENT = "20260101T000000Z"
RSS_GROWTH_KB_PER_S = 2.0  # 7200 kB/h: 7.03 MiB/h
ROUNDS_PER_S = 2.0


def _records() -> list[dict]:
    """One 10-minute segment: a bootstrap node (RSS growing), two peers, peer1 killed at
    300 s and back at 310 s (a new pid, lower RSS), p2pd children; an older segment first."""
    old = [
        {"type": "segment", "segment": "old", "t": 0, "config": {"peers": 9}},
        {
            "type": "sample",
            "segment": "old",
            "t": 1,
            "tick": 1,
            "name": "bootstrap",
            "kind": "bootstrap",
            "pid": 1,
            "rss_kb": 10**9,
            "fds": 10**6,
            "threads": 1,
        },
    ]
    config = {
        "peers": 2,
        "minutes": 10,
        "churn_every_s": 300,
        "sample_every_s": 15,
        "pause_s": 10,
        "join_every": 0,
        "warmup_s": 60,
        "settle_s": 30,
    }
    out = [
        *old,
        {
            "type": "segment",
            "segment": SEGMENT,
            "t": 0,
            "config": config,
            "command": "x",
            "network": soak.NETWORK,
            "started": "2026-01-01T00:00:00+00:00",
            "work": "/tmp/w",
        },
        {"type": "event", "segment": SEGMENT, "t": 30.0, "event": "training"},
        {
            "type": "event",
            "segment": SEGMENT,
            "t": 300.0,
            "event": "stop",
            "name": "peer1",
            "signal": "SIGKILL",
        },
        {
            "type": "event",
            "segment": SEGMENT,
            "t": 200.0,
            "event": "stop",
            "name": "peer0",
            "signal": "SIGTERM",
        },
        {
            "type": "event",
            "segment": SEGMENT,
            "t": 310.0,
            "event": "start",
            "name": "peer1",
            "restart": True,
            "fresh": False,
        },
    ]
    for tick, t in enumerate(range(0, 631, 15), start=1):
        base = {"type": "sample", "segment": SEGMENT, "t": float(t), "tick": tick}
        out.append(
            {
                **base,
                "name": "bootstrap",
                "kind": "bootstrap",
                "pid": 100,
                "born_t": 0.0,
                "rss_kb": 100_000 + RSS_GROWTH_KB_PER_S * t,
                "fds": 40,
                "threads": 9,
            }
        )
        out.append(
            {
                **base,
                "name": "bootstrap/p2pd",
                "kind": "p2pd (bootstrap)",
                "pid": 101,
                "born_t": 0.0,
                "rss_kb": 30_000,
                "fds": 20,
                "threads": 12,
            }
        )
        rnd = int(ROUNDS_PER_S * max(0, t - 30))
        out.append(
            {
                **base,
                "name": "peer0",
                "kind": "peer",
                "pid": 200,
                "born_t": 0.0,
                "rss_kb": 300_000 + RSS_GROWTH_KB_PER_S * t,
                "fds": 50,
                "threads": 10,
                "round": rnd,
                "ledger_messages": 2 * rnd,
                "disk_bytes": 2**20,
            }
        )
        if t < 300:
            pid, born, level = 300, 0.0, 400_000
        elif t >= 315:
            pid, born, level = 301, 310.0, 200_000  # the restarted life, lower
        else:
            continue
        out.append(
            {
                **base,
                "name": "peer1",
                "kind": "peer",
                "pid": pid,
                "born_t": born,
                "rss_kb": level + RSS_GROWTH_KB_PER_S * t,
                "fds": 50,
                "threads": 10,
                "round": rnd - 1,
            }
        )
    out.append(
        {
            "type": "event",
            "segment": SEGMENT,
            "t": 640.0,
            "event": "ledgers",
            "identical": True,
            "final_round": 1300,
            "digests": {"peer0": "ab", "peer1": "ab", "bootstrap": "ab"},
            "rows": {"peer0": 2600, "peer1": 2600, "bootstrap": 2600},
        }
    )
    return out


def _write(path: Path, records: list[dict]) -> Path:
    lines = [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + '\n{"type": "sample", "segm')  # torn last line
    return path


def test_fit_slope_is_least_squares():
    xs = [0.0, 1.0, 2.0, 3.0]
    assert soak.fit_slope(xs, [1 + 3 * x for x in xs]) == pytest.approx(3.0)
    assert soak.fit_slope(xs, [0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)
    assert soak.fit_slope([1.0], [2.0]) is None
    assert soak.fit_slope([1.0, 1.0], [2.0, 5.0]) is None


def test_within_slope_ignores_each_process_level():
    # Two lives growing 2/h, the second restarted much lower: pooled says it shrinks.
    first = [(x, 100 + 2 * x) for x in (0.0, 1.0, 2.0)]
    second = [(x, 10 + 2 * x) for x in (3.0, 4.0, 5.0)]
    points = first + second
    assert soak.fit_slope(*zip(*points)) < 0
    assert soak.within_slope([first, second]) == pytest.approx(2.0)
    assert soak.within_slope([[(1.0, 1.0)]]) is None


def test_summary_of_a_synthetic_run(tmp_path):
    records = soak.read_jsonl(_write(tmp_path / "soak-x.jsonl", _records()))
    assert soak.last_segment(records) == SEGMENT
    s = soak.summarize(records)
    assert s["segment"] == SEGMENT and s["warmup_reached"]
    assert list(s["kinds"]) == ["bootstrap", "peer", "p2pd (bootstrap)"]
    per_h = RSS_GROWTH_KB_PER_S * 3600 / 1024
    boot = s["kinds"]["bootstrap"]
    assert boot["rss_mib"]["slope_per_h"] == pytest.approx(per_h)
    assert boot["rss_mib"]["within_slope_per_h"] == pytest.approx(per_h)
    # the first samples after warm-up (t >= 90 s): 90, 105, 120
    assert boot["rss_mib"]["start"] == pytest.approx((100_000 + 2 * 105) / 1024)
    assert boot["rss_mib"]["end"] == pytest.approx((100_000 + 2 * 615) / 1024)
    assert boot["rss_mib"]["pct_per_h"] == pytest.approx(100 * per_h / ((100_000 + 210) / 1024))
    assert boot["fds"]["slope_per_h"] == pytest.approx(0.0)
    assert boot["fds"]["start"] == boot["fds"]["end"] == 40
    peers = s["kinds"]["peer"]
    assert peers["processes"] == 3  # peer0, and peer1's two lives
    assert peers["rss_mib"]["within_slope_per_h"] == pytest.approx(per_h)
    # after warm-up (t >= 90): peer0 37 samples, peer1's first life 14 (90..285), its
    # second 20 (t >= 340: the first 30 s of its life, born at 310, are left out)
    assert peers["samples"] == 37 + 14 + 20
    assert peers["ledger_rows"]["slope_per_h"] == pytest.approx(2 * ROUNDS_PER_S * 3600)
    assert peers["disk_mib"]["start"] == peers["disk_mib"]["end"] == 1.0
    assert s["kinds"]["p2pd (bootstrap)"]["ledger_rows"]["start"] is None
    assert s["rounds"]["rounds_per_min"] == pytest.approx(60 * ROUNDS_PER_S)
    assert all(b["rounds_per_min"] == pytest.approx(120) for b in s["rounds"]["buckets"][1:])
    assert s["restarts"] == {
        "stops": 2,
        "sigterm": 1,
        "sigkill": 1,
        "restarted": 1,
        "fresh_joiners": 0,
        "died_unasked": 0,
        "orphaned_p2pd": 0,
    }
    assert s["ledgers"]["identical"] and s["ledgers"]["final_round"] == 1300
    assert not s["interrupted"]


def test_markdown_page_says_what_an_operator_needs(tmp_path):
    s = soak.summarize(soak.read_jsonl(_write(tmp_path / "soak-x.jsonl", _records())))
    page = soak.markdown(s)
    assert "loopback 127.0.0.1" in page
    assert "| bootstrap | 1 | 97.9 | 98.9 | +7.0 | +7.0 | +7.2 / +7.2 |" in page
    assert "2 stops (1 SIGTERM, 1 SIGKILL)" in page
    assert "| peer | 1.00 | 1.00 | +0.00 |" in page
    assert "ledgers identical" in page
    assert "120.0 rounds per minute" in page


def test_a_run_cut_short_still_summarizes(tmp_path):
    cut = [r for r in _records() if r.get("t", 0) <= 45 and r.get("event") != "ledgers"]
    cut.append({"type": "event", "segment": SEGMENT, "t": 46.0, "event": "interrupted"})
    s = soak.summarize(soak.read_jsonl(_write(tmp_path / "soak-x.jsonl", cut)))
    assert not s["warmup_reached"] and s["interrupted"] and s["ledgers"] is None
    page = soak.markdown(s)
    assert "NOT reached" in page and "Not checked" in page and "interrupted" in page


def test_write_outputs_makes_json_md_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = _write(tmp_path / "soak-x.jsonl", _records())
    summary = soak.write_outputs(path)
    assert json.loads((tmp_path / "soak-x.json").read_text())["segment"] == SEGMENT
    assert (tmp_path / "soak-x.md").read_text() == soak.markdown(summary)
    assert (tmp_path / "soak-x.png").stat().st_size > 10_000


def _resumed(first: list[dict]) -> list[dict]:
    """A second segment resuming SEGMENT (the next session): the same pids again (a new
    machine reuses them), its own clock from 0, the bootstrap's RSS growing as before."""
    seg = "20260102T000000Z"
    out = [
        *first,
        {
            "type": "segment",
            "segment": seg,
            "t": 0,
            "resumes": SEGMENT,
            "config": first[2]["config"],
        },
        {"type": "event", "segment": seg, "t": 20.0, "event": "training"},
    ]
    for tick, t in enumerate(range(0, 301, 15), start=1):
        out.append(
            {
                "type": "sample",
                "segment": seg,
                "t": float(t),
                "tick": tick,
                "name": "bootstrap",
                "kind": "bootstrap",
                "pid": 100,
                "born_t": 0.0,
                "rss_kb": 100_000 + RSS_GROWTH_KB_PER_S * t,
                "fds": 40,
                "threads": 9,
            }
        )
    out.append(
        {
            "type": "event",
            "segment": seg,
            "t": 310.0,
            "event": "ledgers",
            "identical": True,
            "final_round": 1900,
            "digests": {"bootstrap": "cd"},
            "rows": {"bootstrap": 3800},
        }
    )
    return out


def test_a_resumed_soak_is_summarized_as_one_run(tmp_path):
    records = soak.read_jsonl(_write(tmp_path / "soak-x.jsonl", _resumed(_records())))
    assert soak.chain_of(records) == [SEGMENT, "20260102T000000Z"]
    assert soak.chain_of(records, SEGMENT) == [SEGMENT]  # "old" is not resumed by anyone
    s = soak.summarize(records)
    # the second segment's clock starts where the first stopped (640 s): 640 + 310 - 30
    assert s["duration_min"] == pytest.approx((640 + 310 - 30) / 60)
    assert s["config"]["minutes"] == 20
    boot = s["kinds"]["bootstrap"]
    assert boot["processes"] == 2  # pid 100 in each segment: two lives, not one
    # each life grows 7 MiB/h and the second starts low again: within sees the growth
    assert boot["rss_mib"]["within_slope_per_h"] == pytest.approx(RSS_GROWTH_KB_PER_S * 3600 / 1024)
    assert [x["ledgers_identical"] for x in s["segments"]] == [True, True]
    assert [x["final_round"] for x in s["segments"]] == [1300, 1900]
    assert s["ledgers"]["final_round"] == 1900
    page = soak.markdown(s)
    assert "2 segments" in page and "after round 1900" in page


def test_resume_finds_the_soak_of_that_work_dir(tmp_path):
    records = _records() + [
        {"type": "event", "segment": SEGMENT, "t": 40.0, "event": "state", "peers": ["peer0"]},
        {"type": "event", "segment": SEGMENT, "t": 50.0, "event": "state", "peers": ["peer1"]},
    ]
    path = _write(tmp_path / "soak-x.jsonl", records)
    assert soak.resumable(path, Path("/tmp/w")) == (SEGMENT, records[-1])
    assert soak.resumable(path, Path("/tmp/other")) == (None, None)
    assert soak.resumable(tmp_path / "missing.jsonl", Path("/tmp/w")) == (None, None)


def test_the_page_says_how_each_restarted_peer_built_its_model(tmp_path):
    """From the peers' `ready` lines: a first start, a replay, its own checkpoint (with
    rows after it, or with rows past the settled state taken back)."""
    sources = [
        "replay of 0 ledger messages (settled state of round 0)",
        "replay of 6148 ledger messages (settled state of round 1043)",
        "checkpoint of round 507 + 178 ledger messages after it (settled state of round 547)",
        "checkpoint of round 900 - 18 it holds that this state does not (settled state of 900)",
        "checkpoint of round 950 + 3 ledger messages after it (settled state of round 990)",
    ]
    for i, source in enumerate(sources):
        line = {"level": "info", "event": "ready", "round": 1, "source": source}
        (tmp_path / f"peer{i}.log").write_text("not json\n" + json.dumps(line) + "\n")
    assert soak.restore_sources(tmp_path) == {
        "own checkpoint (+ rows after it)": 2,
        "first start (nothing to restore)": 1,
        "replay of the ledger": 1,
        "own checkpoint, rows past the settled state taken back": 1,
    }
    assert soak.restore_sources(tmp_path / "gone") is None
