"""bench/bench_sybil_daemon.py's pace: rounds per minute and the deadlines a founder waited
out, read from its log, with those that named a peer it had already banned counted apart
(issue 45: a ban acts at once, so none should)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_sybil_daemon as sybil  # noqa: E402


def _round(t: float, r: int) -> dict:
    return {"event": "round", "round": r, "time": t}


def test_pace_counts_rounds_per_minute_and_deadlines_for_banned_peers():
    events = [
        _round(0.0, 0),
        {"event": "deadline", "round": 1, "slow": ["12D3KooWslow"], "time": 1.0},
        _round(30.0, 1),
        {"event": "audit_ban", "peer": "12D3KooWcheat", "time": 31.0},
        {"event": "deadline", "round": 2, "slow": ["12D3KooWcheat"], "time": 40.0},
        _round(60.0, 2),
    ]
    pace = sybil.pace_view(events)
    assert pace == {"rounds_per_min": 2.0, "deadline_waits": 2, "deadline_waits_for_banned": 1}
    assert sybil.pace_view([_round(5.0, 0)])["rounds_per_min"] is None  # one round: no pace


def test_the_pace_table_compares_each_row_with_the_honest_only_row_of_its_seed():
    def row(scenario: str, sybils: int, rpm: float, banned_waits: int) -> dict:
        pace = {"rounds_per_min": rpm, "deadline_waits": 1, "deadline_waits_for_banned": 0}
        founders = {n: dict(pace) for n in sybil.FOUNDERS}
        founders["a"]["deadline_waits_for_banned"] = banned_waits
        return {"scenario": scenario, "seed": 0, "sybils": sybils, "founder_pace": founders}

    rows = {"h": row("honest-only", 0, 40.0, 0), "f": row("flip", 20, 30.0, 2)}
    table = "\n".join(sybil.pace_table(rows))
    assert "| flip | 0 | 20 | - | 30.0 | 0.75x | 1 | 0-2 |" in table
    assert "| honest-only | 0 | 0 | - | 40.0 | 1.00x | 1 | 0 |" in table
    assert sybil.pace_table({"old": {"scenario": "flip", "seed": 0, "sybils": 8}}) == []
