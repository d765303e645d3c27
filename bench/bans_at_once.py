"""Bans act at once (issue 45): the founders' pace and deadline waits, from the logs of runs
kept by bench/bench_sybil_daemon.py (--keep DIR).

    PYTHONPATH=. python bench/bans_at_once.py DIR [--name bans-at-once]

Per kept run (one folder per scenario row): for each founder, its rounds trained, the
rounds per minute between its first and its last round, its deadline waits ("going on
without N slow peer(s)": `deadline` events) and how many of them waited for a peer it had
banned by an audit verdict (`audit_ban`) before the wait ended: the target is 0. Written
into bench/results/NAME.json (key "pace") and as a section of NAME.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
FOUNDERS = ["a", "b", "c", "d"]


def events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def founder_pace(log: Path) -> dict:
    """Rounds, rounds per minute, deadline waits and those for an already banned peer."""
    evs = events(log)
    rounds = [e for e in evs if e.get("event") == "round"]
    banned_at: dict[str, float] = {}
    for e in evs:
        if e.get("event") == "audit_ban":
            banned_at.setdefault(e["peer"], e["time"])
    deadlines = [e for e in evs if e.get("event") == "deadline"]
    for_banned = [
        e
        for e in deadlines
        if any(p in banned_at and banned_at[p] <= e["time"] for p in e.get("slow", []))
    ]
    span = rounds[-1]["time"] - rounds[0]["time"] if len(rounds) > 1 else 0.0
    return {
        "rounds": len(rounds),
        "rounds_per_minute": round(60 * (len(rounds) - 1) / span, 2) if span else None,
        "deadline_waits": len(deadlines),
        "deadline_waits_for_banned": len(for_banned),
        "keys_banned": len(banned_at),
    }


def pace_of(run: Path) -> dict:
    per = {f: founder_pace(run / f"{f}.log") for f in FOUNDERS if (run / f"{f}.log").exists()}
    rpm = [p["rounds_per_minute"] for p in per.values() if p["rounds_per_minute"]]
    return {
        "founders": per,
        "rounds_per_minute_mean": round(sum(rpm) / len(rpm), 2) if rpm else None,
        "deadline_waits": sum(p["deadline_waits"] for p in per.values()),
        "deadline_waits_for_banned": sum(p["deadline_waits_for_banned"] for p in per.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("keep", type=Path)
    parser.add_argument("--name", default="bans-at-once")
    args = parser.parse_args()
    runs = sorted(p for p in args.keep.iterdir() if p.is_dir())
    pace = {run.name: pace_of(run) for run in runs}
    out_json, out_md = OUT / f"{args.name}.json", OUT / f"{args.name}.md"
    result = json.loads(out_json.read_text()) if out_json.exists() else {}
    result["pace"] = pace
    result["pace_command"] = "python bench/bans_at_once.py " + " ".join(sys.argv[1:])
    out_json.write_text(json.dumps(result, indent=1, default=str))
    reference = next((v for k, v in pace.items() if "honest-only" in k), None)
    lines = [
        "",
        "## Pace of the founders (bench/bans_at_once.py)",
        "",
        f"`{result['pace_command']}`. Rounds per minute: each founder's rounds between its "
        "first and last round event, mean over the founders; vs honest-only: the ratio to "
        "the honest-only run of the same seed. Deadline waits: `deadline` events (going on "
        "without slow peers), summed over the founders; for a banned peer: a wait whose slow "
        "peers include one the founder had logged `audit_ban` for before the wait ended "
        "(target 0).",
        "",
        "| run | rounds per minute (founders a/b/c/d) | mean | vs honest-only | "
        "deadline waits | for a banned peer | keys banned (per founder) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in pace.items():
        per = p["founders"]
        ratio = (
            f"{p['rounds_per_minute_mean'] / reference['rounds_per_minute_mean']:.2f}"
            if reference and reference["rounds_per_minute_mean"] and p["rounds_per_minute_mean"]
            else "-"
        )
        lines.append(
            f"| {name} | {' / '.join(str(v['rounds_per_minute']) for v in per.values())} | "
            f"{p['rounds_per_minute_mean']} | {ratio} | {p['deadline_waits']} | "
            f"{p['deadline_waits_for_banned']} | "
            f"{' / '.join(str(v['keys_banned']) for v in per.values())} |"
        )
    text = out_md.read_text() if out_md.exists() else ""
    marker = "\n## Pace of the founders"
    text = text.split(marker)[0].rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    out_md.write_text(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
