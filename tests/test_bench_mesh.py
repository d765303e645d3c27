"""The mesh bench (bench/bench_mesh.py) on real p2pd daemons on 127.0.0.1: every message
reaches every other node, the rows are written as they finish, and a rerun keeps them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_mesh  # noqa: E402


def test_a_node_dials_every_other_or_a_random_few():
    import random

    assert len(bench_mesh.topology(5, "all", random.Random(0))) == 10
    sparse = bench_mesh.topology(40, "3", random.Random(0))
    assert all(i < j for i, j in sparse)
    dialled = {i for pair in sparse for i in pair}
    assert dialled == set(range(40)) and 40 * 3 / 2 <= len(sparse) <= 40 * 3


def test_a_calibration_row_gives_the_hops_of_the_others():
    unit = bench_mesh.calibration(5.0)
    rows = {
        unit.key: {"setting": {"loss": 5.0}, "rx_bytes_per_message_node": 100.0},
        "x": {"setting": {"loss": 5.0}, "rx_bytes_per_message_node": 1000.0},
        "y": {"setting": {"loss": 0.0}, "rx_bytes_per_message_node": 1000.0},
    }
    bench_mesh.add_hops(rows)
    assert rows["x"]["hops_in_per_message_node"] == 5.0  # one hop: 2 x 100 B
    assert "hops_in_per_message_node" not in rows["y"]  # no row at its loss


@pytest.mark.slow
def test_the_bench_delivers_every_message_and_resumes(tmp_path):
    out, results = "mesh-test", tmp_path
    args = [
        sys.executable, str(ROOT / "bench" / "bench_mesh.py"), "--peers", "4",
        "--degree", "3", "--gossip-factor", "0.25,0", "--rate", "20", "--seconds", "2",
        "--drain", "1", "--idle", "1", "--out", out, "--results", str(results),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((results / f"{out}.json").read_text())["rows"]
    assert set(rows) == {"n4-d3-h5-hb1-lall-loss0", "n4-d3-h5-hb1-lall-loss0-gf0"}
    for row in rows.values():
        assert row["messages"] == 40 and row["delivered"] == 1.0
        assert row["connections_per_node"] >= 3  # every other node
        assert row["latency_ms"]["p50"] is not None and row["rss_mib_mean"] > 0
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "running" not in again.stdout  # nothing redone
    assert "| 4 | 3 | 5 | 0 |" in (results / f"{out}.md").read_text()
    assert (results / f"{out}.png").stat().st_size > 0
