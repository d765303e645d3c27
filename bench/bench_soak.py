#!/usr/bin/env python
"""Soak: does a run of hours with churn end as it began (flat memory and file handles)?

    nice -n 5 python bench/bench_soak.py [--minutes 60] [--peers 6] [--churn-every 60]
        [--sample-every 15] [--pause 10] [--join-every 0] [--warmup 120] [--settle 60]
        [--round-interval 0.4]
        [--netns [--delay-ms 10] [--loss 5]] [--trace-memory] [--name NAME] [--work DIR]
        [--resume]
    python bench/bench_soak.py --summarize --name NAME     # redo .json/.md/.png from the JSONL

A real bootstrap node and PEERS peer daemons (the tests' tiny run, harness.cluster.RUN, and
harness/open_run.py's fast-round flags) on 127.0.0.1 (loopback, no netem), or with
--netns (root) each in its own network namespace on one bridge (deploy/netns-testnet.sh:
h1 the bootstrap node, h2.. the peers; a restarted peer comes back in its own host) with a
netem delay of --delay-ms and --loss percent on every host's egress (a kernel without netem
has no delay, so pass --delay-ms 0; its --loss is applied by nftables on each host's
arrivals: deploy/netns-testnet.sh). The output says which.
MINUTES count from the first round of every peer. Every
CHURN_EVERY seconds one peer (round-robin) is stopped, alternately with SIGTERM and SIGKILL,
and restarted from its data dir PAUSE seconds after it exited; with --join-every K every
Kth stop retires the peer for good and a fresh joiner (new identity, empty data dir) takes
its place. A peer that dies on its own is logged ("died") and restarted the same way.

Every SAMPLE_EVERY seconds, for every process started here (bootstrap node, peers, and
each one's p2pd child): VmRSS and Threads from /proc/PID/status, open fds
(/proc/PID/fd), and for peers their /status round and ledger rows and the data dir's size.
Each sample is appended to bench/results/soak-NAME.jsonl at once, so a run cut short keeps
what it measured; a rerun with the same NAME appends a new segment (every line carries its
segment id) and the summary is of the last segment. A soak longer than a session goes on
with --resume and the same --work and NAME: every process comes back from its data dir
(the peers through --min-peers, as at the start), and the new segment names the one it
resumes, so the summary is of the whole chain, its clock without the time between.

At the end every live peer is asked to stop after one common round (apps.demo.finish_all)
and their ledger digests are compared, with the bootstrap node's. Written:
bench/results/soak-NAME.{json,md,png}: per process kind, RSS and fds at the start (after
warm-up) and the end, and their least-squares slope per hour, pooled and within a process;
rounds per minute over time; restarts; whether the ledgers ended identical.

With --trace-memory (loopback) peer0 runs as harness/hooked_peer.py --trace-memory:
tracemalloc's top allocation sites, and those that grew most, every minute in
WORK/<log name>.mem.jsonl, to find what grows (tracemalloc slows that peer several-fold).

Warm-up: samples in the first WARMUP s of training, and of a restarted process the first
SETTLE s of its life, are left out of the figures (the JSONL keeps them).
Everything started here is stopped by PID on the way out, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NETWORK = "loopback 127.0.0.1 (no network namespaces, no netem delay or loss)"
SUBNET = "10.79.0"  # --netns: the soak's own testnet (the tests use 10.77/10.78)
BOOT_PORT = 31337
METRICS_PORT = 9100  # --netns: each host has its own loopback


def network_label(args: argparse.Namespace) -> str:
    if not getattr(args, "netns", False):
        return NETWORK
    hosts = f"network namespaces: {args.peers + 1} hosts on one bridge"
    if not (args.delay_ms or args.loss):
        return f"{hosts}, no delay or loss"
    if getattr(args, "loss_by", "netem") == "nftables":  # main: no netem, so no delay
        return f"{hosts}, {args.loss:g}% of packets lost on arrival at every host (nftables)"
    return (
        f"{hosts}, netem delay {args.delay_ms:g} ms and loss {args.loss:g}% on every host's egress"
    )


WINDOW_TICKS = 3  # samples averaged for a "start" and an "end" figure
KINDS = ("bootstrap", "peer", "p2pd (bootstrap)", "p2pd (peer)")
GOAL_PCT_PER_H = 5.0  # issue 45's bound on growth after warm-up


# --------------------------------------------------------------------------------------
# Pure parts: fits and the summary of a JSONL (tests/test_bench_soak.py, no daemons)
# --------------------------------------------------------------------------------------
def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys on xs; None with fewer than two distinct xs (no fit)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def within_slope(groups: Iterable[Sequence[tuple[float, float]]]) -> float | None:
    """One slope shared by groups with their own intercepts (fixed effects): growth inside
    each process's life, blind to a restarted process starting higher or lower."""
    sxy = sxx = 0.0
    for points in groups:
        if len(points) < 2:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        sxx += sum((x - mx) ** 2 for x, _ in points)
        sxy += sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx if sxx > 0 else None


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of `path` (a run killed mid-write leaves a torn last line)."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def last_segment(records: list[dict]) -> str | None:
    """The id of the last segment the file holds (a rerun with the same name appends one)."""
    ids = [r["segment"] for r in records if r.get("type") == "segment"]
    return ids[-1] if ids else None


def chain_of(records: list[dict], segment: str | None = None) -> list[str]:
    """The segments one soak ran in, oldest first, ending with `segment` (default: the
    last): a segment started with --resume names the one it continues (`resumes`)."""
    heads = {r["segment"]: r for r in records if r.get("type") == "segment"}
    seg, chain = segment or last_segment(records), []
    while seg in heads and seg not in chain:
        chain.append(seg)
        seg = heads[seg].get("resumes")
    return chain[::-1]


def merged(records: list[dict], chain: Sequence[str]) -> list[dict]:
    """The chain's records as one run: each segment's clock continues where the one before
    it stopped (the time between sessions left out), its ticks and pids made its own (a
    new machine reuses pids)."""
    out: list[dict] = []
    offset = 0.0
    for i, seg in enumerate(chain):
        for r in records:
            if r.get("segment") != seg:
                continue
            r = {**r, "t": r.get("t", 0.0) + offset}
            if "born_t" in r:
                r["born_t"] += offset
            if i and "tick" in r:
                r["tick"] += i * 10**7
            if i and "pid" in r:
                r["pid"] = f"{i}:{r['pid']}"
            out.append(r)
        offset = max((r["t"] for r in out), default=offset)
    return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _window(samples: list[dict], key: str, ticks: set[int]) -> float | None:
    return _mean([s[key] for s in samples if s["tick"] in ticks and s.get(key) is not None])


def kind_figures(samples: list[dict]) -> dict[str, Any]:
    """Start, end and slopes per hour of one kind's RSS (MiB), fds and threads, from its
    (already warm-up-filtered) samples."""
    ticks = sorted({s["tick"] for s in samples})
    first, last = set(ticks[:WINDOW_TICKS]), set(ticks[-WINDOW_TICKS:])
    out: dict[str, Any] = {
        "processes": len({s["pid"] for s in samples}),
        "samples": len(samples),
        "span_h": (max(s["t"] for s in samples) - min(s["t"] for s in samples)) / 3600,
    }
    for key, scale, label in (
        ("rss_kb", 1 / 1024, "rss_mib"),
        ("fds", 1.0, "fds"),
        ("threads", 1.0, "threads"),
        ("disk_bytes", 1 / 2**20, "disk_mib"),
        ("ledger_messages", 1.0, "ledger_rows"),
    ):
        have = [s for s in samples if s.get(key) is not None]
        xs = [s["t"] / 3600 for s in have]
        ys = [s[key] * scale for s in have]
        by_pid: dict[int, list[tuple[float, float]]] = {}
        for x, y, s in zip(xs, ys, have):
            by_pid.setdefault(s["pid"], []).append((x, y))
        start, end = _window(have, key, first), _window(have, key, last)
        start = start * scale if start is not None else None
        end = end * scale if end is not None else None
        slope, within = fit_slope(xs, ys), within_slope(by_pid.values())
        out[label] = {
            "start": start,
            "end": end,
            "slope_per_h": slope,
            "within_slope_per_h": within,
            "pct_per_h": 100 * slope / start if slope is not None and start else None,
            "within_pct_per_h": 100 * within / start if within is not None and start else None,
        }
    return out


def rounds_over_time(samples: list[dict], bucket_s: float) -> dict[str, Any]:
    """The run's round (the largest any peer reports) per sample, and rounds per minute in
    buckets of `bucket_s` and over the whole run (least squares)."""
    per_tick: dict[int, tuple[float, int]] = {}
    for s in samples:
        r = s.get("round") if s.get("round") is not None else s.get("log_round")
        if s["kind"] == "peer" and r is not None and r >= 0:
            t, best = per_tick.get(s["tick"], (s["t"], -1))
            per_tick[s["tick"]] = (min(t, s["t"]), max(best, r))
    points = sorted(per_tick.values())
    buckets = []
    if points:
        t0 = points[0][0]
        index: dict[int, list[tuple[float, int]]] = {}
        for t, r in points:
            index.setdefault(int((t - t0) // bucket_s), []).append((t, r))
        previous: tuple[float, int] | None = None
        for b in sorted(index):
            inside = index[b]
            begin = previous or inside[0]
            end = inside[-1]
            rate = 60 * (end[1] - begin[1]) / (end[0] - begin[0]) if end[0] > begin[0] else None
            buckets.append(
                {
                    "from_min": (t0 + b * bucket_s) / 60,
                    "to_min": (t0 + (b + 1) * bucket_s) / 60,
                    "round": end[1],
                    "rounds_per_min": rate,
                }
            )
            previous = end
    slope = fit_slope([t / 60 for t, _ in points], [r for _, r in points])
    return {
        "points": [[round(t, 1), r] for t, r in points],
        "buckets": buckets,
        "rounds_per_min": slope,
        "first_round": points[0][1] if points else None,
        "last_round": points[-1][1] if points else None,
    }


def summarize(records: list[dict], segment: str | None = None) -> dict[str, Any]:
    """The figures of one soak of a JSONL: the segment `segment` (default: the last) and
    the segments it resumed (`chain_of`), as one run (`merged`)."""
    chain = chain_of(records, segment)
    mine = merged(records, chain)
    heads = [r for r in mine if r.get("type") == "segment"]
    head = heads[0] if heads else {}
    config = {**(heads[-1].get("config", {}) if heads else {})}
    config["minutes"] = sum(float(h.get("config", {}).get("minutes", 0) or 0) for h in heads)
    events = [r for r in mine if r.get("type") == "event"]
    samples = [r for r in mine if r.get("type") == "sample"]
    training_t = next((e["t"] for e in events if e["event"] == "training"), 0.0)
    warmup, settle = float(config.get("warmup_s", 0)), float(config.get("settle_s", 0))

    def valid(s: dict) -> bool:
        return s["t"] >= training_t + warmup and s["t"] - s.get("born_t", 0.0) >= settle

    kinds: dict[str, Any] = {}
    warm_enough = True
    for kind in sorted(
        {s["kind"] for s in samples},
        key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k),
    ):
        of_kind = [s for s in samples if s["kind"] == kind]
        kept = [s for s in of_kind if valid(s)]
        if len({s["tick"] for s in kept}) < 2:  # too short a run: say so, use all samples
            kept, warm_enough = of_kind, False
        kinds[kind] = kind_figures(kept)
    stops = [e for e in events if e["event"] == "stop"]
    last_t = max((r.get("t", 0.0) for r in mine), default=0.0)
    minutes = float(config.get("minutes", 0) or 0)
    bucket_s = 60.0 * max(1, round(minutes / 12)) if minutes else 60.0
    ledgers = next((e for e in reversed(events) if e["event"] == "ledgers"), None)
    return {
        "segment": chain[-1] if chain else None,
        "segments": [
            {
                "segment": h["segment"],
                "started": h.get("started"),
                "from_min": round(h["t"] / 60, 1),
                "ledgers_identical": next(
                    (
                        e.get("identical")
                        for e in events
                        if e["event"] == "ledgers" and e["segment"] == h["segment"]
                    ),
                    None,
                ),
                "final_round": next(
                    (
                        e.get("final_round")
                        for e in events
                        if e["event"] == "ledgers" and e["segment"] == h["segment"]
                    ),
                    None,
                ),
            }
            for h in heads
        ],
        "started": head.get("started"),
        "command": head.get("command"),
        "network": head.get("network", NETWORK),
        "config": config,
        "work": head.get("work"),
        "training_t": training_t,
        "duration_min": (last_t - training_t) / 60,
        "warmup_reached": warm_enough,
        "kinds": kinds,
        "rounds": rounds_over_time([s for s in samples if s["t"] >= training_t], bucket_s),
        "restarts": {
            "stops": len(stops),
            "sigterm": sum(e.get("signal") == "SIGTERM" for e in stops),
            "sigkill": sum(e.get("signal") == "SIGKILL" for e in stops),
            "restarted": sum(e["event"] == "start" and e.get("restart", False) for e in events),
            "fresh_joiners": sum(e["event"] == "start" and e.get("fresh", False) for e in events),
            "died_unasked": sum(e["event"] == "died" for e in events),
            "orphaned_p2pd": sum(e["event"] == "orphan_p2pd" for e in events),
        },
        "ledgers": (
            {k: ledgers.get(k) for k in ("identical", "final_round", "digests", "rows", "note")}
            if ledgers
            else None
        ),
        "interrupted": any(e["event"] == "interrupted" for e in events),
        "restores": restore_sources(Path(head["work"])) if head.get("work") else None,
    }


def restore_sources(work: Path) -> dict[str, int] | None:
    """How the peers of a soak built their model at each start, from their logs' `ready`
    lines (peer/daemon.py): replay, own checkpoint (+ rows after it, - rows it held past
    the settled state), a fetched one. None when the logs are gone."""
    logs = sorted(work.glob("peer*.log")) if work.is_dir() else []
    if not logs:
        return None
    kinds: Counter[str] = Counter()
    for log_path in logs:
        for line in log_path.read_text(errors="replace").splitlines():
            if '"event": "ready"' not in line:
                continue
            try:
                source = json.loads(line).get("source", "")
            except json.JSONDecodeError:
                continue
            if source.startswith("replay of 0 "):
                kinds["first start (nothing to restore)"] += 1
            elif source.startswith("replay"):
                kinds["replay of the ledger"] += 1
            elif " it holds that this state does not" in source:
                kinds["own checkpoint, rows past the settled state taken back"] += 1
            elif source.startswith("checkpoint"):
                kinds["own checkpoint (+ rows after it)"] += 1
            else:
                kinds[source.split(" of ")[0]] += 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def _num(value: float | None, digits: int = 1, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def markdown(summary: dict[str, Any]) -> str:
    """The summary as the page an operator reads (bench/results/soak-NAME.md)."""
    c = summary["config"]
    lines = [
        f"# Soak: {c.get('peers', '?')} peers, {summary['duration_min']:.1f} minutes of training",
        "",
        f"- command: `{summary.get('command') or '?'}`",
        f"- network: {summary['network']}",
        f"- run: {c.get('run', 'tiny-llama')}; churn every {c.get('churn_every_s')} s "
        f"(pause {c.get('pause_s')} s; "
        + (
            f"every {c['join_every']}th stop a fresh joiner"
            if c.get("join_every")
            else "no fresh joiners"
        )
        + "), "
        f"sample every {c.get('sample_every_s')} s",
        f"- warm-up left out: first {c.get('warmup_s')} s of training, first "
        f"{c.get('settle_s')} s of each restarted process"
        + ("" if summary["warmup_reached"] else " (NOT reached for some kind: all samples used)"),
        f"- segment {summary['segment']}, started {summary.get('started')}; work dir "
        f"{summary.get('work')}",
    ]
    segments = summary.get("segments") or []
    if len(segments) > 1:
        lines.append(
            f"- {len(segments)} segments (a session each; every process restarted from its "
            "data dir at each resume; minutes count training time, the time between "
            "sessions left out):"
        )
        for seg in segments:
            verdict = {True: "identical", False: "**NOT identical**", None: "not checked"}
            lines.append(
                f"  - {seg['segment']} from minute {seg['from_min']}, started "
                f"{seg['started']}: ledgers {verdict[seg['ledgers_identical']]} after round "
                f"{seg['final_round']}"
            )
    if summary.get("interrupted"):
        lines.append("- **interrupted** before the planned end: figures cover what ran")
    lines += [
        "",
        "## Memory and file handles per process kind",
        "",
        "Start/end: mean of the first/last "
        f"{WINDOW_TICKS} samples after warm-up over the processes of that kind. Slope: least "
        "squares per hour over all their samples (pooled), and within each process's life "
        f"(own intercept per process). Issue 45's goal: under {GOAL_PCT_PER_H:g} %/h.",
        "",
        "| kind | procs | RSS start MiB | RSS end MiB | RSS MiB/h (pooled) | RSS MiB/h "
        "(within) | RSS %/h (pooled / within) | fds start | fds end | fds/h (pooled) | "
        "fds/h (within) | threads start | threads end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, k in summary["kinds"].items():
        r, f, th = k["rss_mib"], k["fds"], k["threads"]
        lines.append(
            f"| {kind} | {k['processes']} | {_num(r['start'])} | {_num(r['end'])} | "
            f"{_num(r['slope_per_h'], sign=True)} | {_num(r['within_slope_per_h'], sign=True)} | "
            f"{_num(r['pct_per_h'], sign=True)} / {_num(r['within_pct_per_h'], sign=True)} | "
            f"{_num(f['start'])} | {_num(f['end'])} | "
            f"{_num(f['slope_per_h'], sign=True)} | {_num(f['within_slope_per_h'], sign=True)} | "
            f"{_num(th['start'])} | {_num(th['end'])} |"
        )
    lines += [
        "",
        "Disk (the data dir) and ledger rows (a peer's /status), per process, same windows:",
        "",
        "| kind | disk start MiB | disk end MiB | disk MiB/h | ledger rows start | "
        "ledger rows end | rows/h |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, k in summary["kinds"].items():
        d, rows = k.get("disk_mib") or {}, k.get("ledger_rows") or {}
        if d.get("start") is None and rows.get("start") is None:
            continue
        lines.append(
            f"| {kind} | {_num(d.get('start'), 2)} | {_num(d.get('end'), 2)} | "
            f"{_num(d.get('slope_per_h'), 2, sign=True)} | {_num(rows.get('start'), 0)} | "
            f"{_num(rows.get('end'), 0)} | {_num(rows.get('slope_per_h'), 0, sign=True)} |"
        )
    rounds = summary["rounds"]
    lines += [
        "",
        "## Rounds",
        "",
        f"Run round (largest any peer reports) {rounds['first_round']} -> "
        f"{rounds['last_round']}; {_num(rounds['rounds_per_min'])} rounds per minute "
        "(least squares over the run).",
        "",
        "| minutes | run round at end | rounds/min |",
        "|---|---:|---:|",
    ]
    for b in rounds["buckets"]:
        lines.append(
            f"| {b['from_min']:.1f}-{b['to_min']:.1f} | {b['round']} | "
            f"{_num(b['rounds_per_min'])} |"
        )
    r = summary["restarts"]
    lines += [
        "",
        "## Churn",
        "",
        f"{r['stops']} stops ({r['sigterm']} SIGTERM, {r['sigkill']} SIGKILL), "
        f"{r['restarted']} restarts from the data dir, {r['fresh_joiners']} fresh joiners, "
        f"{r['died_unasked']} peers died unasked, {r['orphaned_p2pd']} p2pd left orphaned.",
        *(
            [
                "",
                "How each (re)started peer built its model (its `ready` line): "
                + ", ".join(f"{n} {how}" for how, n in summary["restores"].items())
                + ".",
            ]
            if summary.get("restores")
            else []
        ),
        "",
        "## Ledgers at the end",
        "",
    ]
    ledgers = summary["ledgers"]
    if ledgers is None:
        lines.append("Not checked: the run did not reach its end.")
    else:
        verdict = "identical" if ledgers["identical"] else "**NOT identical**"
        lines.append(
            f"All peers stopped after round {ledgers.get('final_round')}: ledgers {verdict}."
        )
        if ledgers.get("note"):
            lines.append(f"({ledgers['note']})")
        lines += ["", "| node | digest | rows |", "|---|---|---:|"]
        for node, digest in sorted((ledgers.get("digests") or {}).items()):
            rows = (ledgers.get("rows") or {}).get(node)
            lines.append(f"| {node} | {str(digest)[:16]} | {rows if rows is not None else '-'} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], summary: dict[str, Any], path: Path) -> Path:
    """RSS, fds and the run's round over time, one line per process life (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = merged(records, [s["segment"] for s in summary["segments"]])
    mine = [r for r in everything if r.get("type") == "sample"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9), sharex=True)
    panels = {
        (0, 0): ("rss_kb", 1 / 1024, "RSS MiB (python: bootstrap, peers)", False),
        (0, 1): ("rss_kb", 1 / 1024, "RSS MiB (p2pd)", True),
        (1, 0): ("fds", 1.0, "open fds (all processes)", None),
    }
    names = sorted({s["name"] for s in mine})
    colours = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    for (row, col), (key, scale, title, p2pd) in panels.items():
        ax = axes[row][col]
        seen: set[str] = set()
        lives: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for s in mine:
            is_p2pd = s["kind"].startswith("p2pd")
            if (p2pd is not None and is_p2pd != p2pd) or s.get(key) is None:
                continue
            lives.setdefault((s["name"], s["pid"]), []).append((s["t"] / 60, s[key] * scale))
        # a resumed chain's pids are tagged with their segment (strings): sort as text
        for (name, _pid), points in sorted(lives.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            label = None if name in seen else name
            seen.add(name)
            ax.plot(*zip(*points), color=colours[name], label=label, lw=1)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if seen:
            ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    points = summary["rounds"]["points"]
    if points:
        ax.plot([t / 60 for t, _ in points], [r for _, r in points], color="black")
    for e in everything:
        if e.get("event") == "stop":
            ax.axvline(
                e["t"] / 60,
                color="red" if e.get("signal") == "SIGKILL" else "orange",
                lw=0.5,
                alpha=0.6,
            )
    ax.set_title("run round (red: SIGKILL, orange: SIGTERM)")
    ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minutes since the bench started")
    training = summary["training_t"] / 60
    warm = training + float(summary["config"].get("warmup_s", 0)) / 60
    for row in axes:
        for ax in row:
            ax.axvspan(0, warm, color="grey", alpha=0.1)
    fig.suptitle(f"soak {summary['segment']}: {summary['network']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(jsonl: Path, segment: str | None = None) -> dict[str, Any]:
    """soak-NAME.{json,md,png} next to soak-NAME.jsonl, from what it holds."""
    records = read_jsonl(jsonl)
    summary = summarize(records, segment)
    base = jsonl.with_suffix("")
    summary["plot"] = str(plot(records, summary, base.with_suffix(".png")))
    base.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str))
    base.with_suffix(".md").write_text(markdown(summary))
    return summary


# --------------------------------------------------------------------------------------
# The run: real processes, sampled from /proc
# --------------------------------------------------------------------------------------
def proc_stats(pid: int) -> dict[str, int] | None:
    """VmRSS (kB), Threads and open fds of PID; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie has no memory left
        return None
    return {
        "rss_kb": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"].split()[0]),
        "fds": fds,
    }


def children(pid: int) -> list[int]:
    """PID's children, from every one of its threads (a thread may have spawned them)."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
                found += [int(c) for c in text.split()]
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def p2pd_of(pid: int) -> list[int]:
    return [c for c in children(pid) if comm(c) == "p2pd"]


def dir_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, f)).st_size
    return total


class LogRounds:
    """The last round a daemon's JSON log names, read incrementally and keeping nothing
    else: NodeProcess.events() keeps every record, which over hours grows the bench."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last = path, 0, -1

    def __call__(self) -> int:
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
            for line in complete.splitlines():
                if b'"event": "round"' in line:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        self.last = max(self.last, int(json.loads(line)["round"]))
        return self.last


class Stop(Exception):
    """SIGTERM to the bench: leave as Ctrl-C does, through the cleanup."""


@dataclass
class Life:
    """One process life: a daemon started once (a restart is a new Life)."""

    name: str
    kind: str
    proc: Any  # NodeProcess
    born_t: float
    stopping: str = ""  # the signal sent, while we wait for it to exit
    stop_sent_t: float = 0.0
    fresh_next: bool = False  # once stopped, a fresh joiner takes its place
    last_round: LogRounds | None = None

    def __post_init__(self) -> None:
        self.last_round = LogRounds(self.proc.log_path)

    def round(self) -> int:
        return self.last_round() if self.last_round else -1


class Soak:
    """Starts, churns, samples and stops the run; writes JSON lines as it goes."""

    def __init__(self, args: argparse.Namespace, work: Path, jsonl: Path) -> None:
        self.args, self.work, self.jsonl = args, work, jsonl
        self.t0 = time.monotonic()
        self.segment = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.out = open(jsonl, "a")  # noqa: SIM115 - closed in close()
        self.lives: dict[str, Life] = {}  # current life of each name
        self.started: list[Any] = []  # every NodeProcess ever started, for the cleanup
        self.p2pd_seen: set[int] = set()
        self.pending: list[tuple[float, str, bool]] = []  # (due t, name, restart as fresh?)
        self.restarts: dict[str, int] = {}
        self.stops = 0
        self.joiners = 0
        self.tick = 0
        self.address = ""
        self.last_victim = ""
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.resumes: dict | None = None  # --resume: the last "state" event it continues
        self.net: Any = None  # --netns: harness.partition.NamespaceNet
        self.host_of: dict[str, int] = {}  # --netns: name -> host number (h1: bootstrap)
        if args.netns:
            from harness.partition import NamespaceNet

            self.net = NamespaceNet(f"sfsk{os.getpid() % 100000}", SUBNET)

    # -- output ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def write(self, record: dict) -> None:
        self.out.write(
            json.dumps({"segment": self.segment, "t": round(self.now(), 2), **record}) + "\n"
        )
        self.out.flush()

    def event(self, event: str, **fields: Any) -> None:
        self.write({"type": "event", "event": event, **fields})
        print(
            f"[{self.now() / 60:6.1f} min] {event} "
            + " ".join(f"{k}={v}" for k, v in fields.items() if k != "tail"),
            flush=True,
        )

    # -- processes ------------------------------------------------------------------------
    def peer_flags(self, first: bool) -> list[str]:
        from harness.open_run import PEER_FLAGS

        # the last --round-interval wins: PEER_FLAGS' 0.4 s unless --round-interval says
        flags = [*PEER_FLAGS, "--round-interval", f"{self.args.round_interval:g}"]
        if first:  # all founders meet before round 0; restarts and joiners go straight in
            return [*flags, "--min-peers", str(self.args.peers), "--startup-wait", "900"]
        return flags

    def start_peer(self, name: str, first: bool = False, fresh: bool = False) -> None:
        from seedflood_p2p.apps.localnet import start_peer

        k = self.restarts.get(name, -1) + 1
        self.restarts[name] = k
        log_name = name if k == 0 else f"{name}.{k}"
        if self.net is None:
            flags, program = self.peer_flags(first), ()
            if self.args.trace_memory and name == "peer0":  # hooked_peer.py: tracemalloc
                from harness.cluster import HOOKED_PEER

                program = HOOKED_PEER
                flags = [*flags, "--trace-memory", str(self.work / f"{log_name}.mem.jsonl")]
            proc = start_peer(self.work, name, self.address, flags, log_name, program=program)
        else:
            proc = self.start_namespaced_peer(name, log_name, first)
        self.started.append(proc)
        self.lives[name] = Life(name, "peer", proc, self.now())
        if not first:
            self.event("start", name=name, pid=proc.proc.pid, restart=k > 0, fresh=fresh)

    def start_namespaced_peer(self, name: str, log_name: str, first: bool) -> Any:
        """A peer in its own host: the one it had, or the next free one (a fresh joiner
        takes the host of the peer it replaces: restart_due)."""
        host = self.host_of.setdefault(name, 2 + len(self.host_of))
        args = [
            "peer",
            *("--bootstrap", self.address, "--listen", f"/ip4/{SUBNET}.{host}/tcp/0"),
            *("--data-dir", str(self.work / name), "--threads", "1"),
            *self.peer_flags(first),
            *("--metrics-port", str(METRICS_PORT)),  # after PEER_FLAGS' 0: the last wins
        ]
        return self.net.process(host, log_name, args, self.work)

    def start_bootstrap(self) -> tuple[Any, str]:
        from harness.cluster import RUN
        from harness.open_run import NODE_FLAGS
        from seedflood_p2p.apps.localnet import start_bootstrap
        from seedflood_p2p.core.flags import to_toml

        if self.net is None:
            return start_bootstrap(self.work, RUN, NODE_FLAGS)
        a = self.args
        delay = ["--delay", f"{a.delay_ms:g}ms"] if a.delay_ms else []
        loss = ["--loss", f"{a.loss:g}%"] if a.loss else []
        up = self.net.net(
            "--hosts", str(a.peers + 1), "--require-netem", *delay, *loss, "up", timeout=300
        )
        print(up.stderr.strip(), flush=True)
        run_file = self.work / "run.toml"
        run_file.write_text(to_toml(RUN))
        args = [
            "bootstrap",
            *("--config", str(run_file), "--listen", f"/ip4/{SUBNET}.1/tcp/{BOOT_PORT}"),
            *("--data-dir", str(self.work / "bootstrap"), *NODE_FLAGS),
        ]
        return self.net.start_bootstrap(1, args, self.work, timeout=600)

    def status(self, life: Life) -> dict | None:
        """A live peer's /status (None while it has none): on loopback through its
        status_port file, with --netns from inside its host."""
        from harness.scenario import peer_status

        if life.kind != "peer" or life.stopping:
            return None
        if self.net is None:
            return peer_status(self.work, life.name)
        try:
            return self.net.status(self.host_of[life.name])
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def save_state(self) -> None:
        """What --resume needs to carry on: which peers the run has, how often each was
        started, their hosts, the churn's place."""
        peers = sorted(
            {n for n, v in self.lives.items() if v.kind == "peer"}
            | {name for _, name, _ in self.pending}
        )
        self.write(
            {
                "type": "event",
                "event": "state",
                "peers": peers,
                "restarts": self.restarts,
                "host_of": self.host_of,
                "joiners": self.joiners,
                "stops": self.stops,
                "last_victim": self.last_victim,
            }
        )

    def start(self) -> None:
        if self.resumes is not None:  # everything back from its data dir
            (self.work / "bootstrap" / "address.txt").unlink(missing_ok=True)  # a stale one
            state = self.resumes
            self.restarts = {k: int(v) for k, v in state["restarts"].items()}
            self.host_of = {k: int(v) for k, v in state["host_of"].items()}
            self.joiners, self.stops = int(state["joiners"]), int(state["stops"])
            self.last_victim = state["last_victim"]
            names = list(state["peers"])
        else:
            names = [f"peer{i}" for i in range(self.args.peers)]
        boot, self.address = self.start_bootstrap()
        self.started.append(boot)
        self.lives["bootstrap"] = Life("bootstrap", "bootstrap", boot, self.now())
        self.event("bootstrap", pid=boot.proc.pid, address=self.address)
        for name in names:
            self.start_peer(name, first=True)
        self.event("peers_started", pids={n: v.proc.proc.pid for n, v in self.lives.items()})
        deadline = time.monotonic() + 1200
        while True:
            rounds = {n: v.round() for n, v in self.lives.items() if v.kind == "peer"}
            if all(r >= 1 for r in rounds.values()):
                break
            dead = [n for n, v in self.lives.items() if not v.proc.alive]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"start-up failed ({dead or 'timeout'}): {rounds}\n"
                    + "\n".join(self.lives[n].proc.tail(15) for n in dead)
                )
            self.maybe_sample()
            time.sleep(1)
        self.event("training", rounds=rounds)
        self.save_state()

    # -- sampling -------------------------------------------------------------------------
    _next_sample = 0.0

    def maybe_sample(self) -> None:
        if self.now() >= self._next_sample:
            self.sample()
            self._next_sample = max(self._next_sample + self.args.sample_every, self.now() + 1)

    def sample(self) -> None:
        self.tick += 1
        lives = list(self.lives.values())
        rss_kb = fds = 0
        statuses = dict(zip([v.name for v in lives], self.pool.map(self.status, lives)))
        for v in lives:
            pid = v.proc.proc.pid
            stats = proc_stats(pid) if v.proc.alive else None
            if stats is None:
                continue
            record: dict[str, Any] = {
                "type": "sample",
                "tick": self.tick,
                "name": v.name,
                "kind": v.kind,
                "pid": pid,
                "born_t": round(v.born_t, 2),
                **stats,
            }
            if v.kind == "peer":
                status = statuses.get(v.name) or {}
                record.update(
                    round=status.get("round"),
                    state=status.get("state"),
                    ledger_messages=status.get("ledger_messages"),
                    log_round=v.round(),
                    disk_bytes=dir_bytes(self.work / v.name),
                )
            else:
                record["disk_bytes"] = dir_bytes(self.work / "bootstrap")
            self.write(record)
            rss_kb, fds = rss_kb + stats["rss_kb"], fds + stats["fds"]
            for child in p2pd_of(pid):
                self.p2pd_seen.add(child)
                child_stats = proc_stats(child)
                if child_stats is not None:
                    rss_kb, fds = rss_kb + child_stats["rss_kb"], fds + child_stats["fds"]
                    self.write(
                        {
                            "type": "sample",
                            "tick": self.tick,
                            "name": f"{v.name}/p2pd",
                            "kind": f"p2pd ({v.kind})",
                            "pid": child,
                            "parent": pid,
                            "born_t": round(v.born_t, 2),
                            **child_stats,
                        }
                    )

        if self.tick % max(1, round(60 / self.args.sample_every)) == 0:
            top = max((v.round() for v in lives if v.kind == "peer"), default=-1)
            alive = sum(v.kind == "peer" and v.proc.alive for v in lives)
            print(
                f"[{self.now() / 60:6.1f} min] round {top}, {alive} peers up, all processes: "
                f"RSS {rss_kb / 1024:.0f} MiB, {fds} fds",
                flush=True,
            )

    # -- churn ----------------------------------------------------------------------------
    def churn(self) -> None:
        """Stop the next peer round-robin, alternately SIGTERM and SIGKILL (the order
        flips every cycle, so each peer meets both)."""
        candidates = sorted(
            n for n, v in self.lives.items() if v.kind == "peer" and not v.stopping and v.proc.alive
        )
        if not candidates:
            return
        name = next((n for n in candidates if n > self.last_victim), candidates[0])
        self.last_victim = name
        flip = self.stops // max(1, self.args.peers)
        sig = signal.SIGTERM if (self.stops + flip) % 2 == 0 else signal.SIGKILL
        self.stops += 1
        fresh = bool(self.args.join_every) and self.stops % self.args.join_every == 0
        life = self.lives[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(life.proc.proc.pid, sig)
        life.stopping, life.stop_sent_t = sig.name, self.now()
        life.fresh_next = fresh
        self.event(
            "stop",
            name=name,
            pid=life.proc.proc.pid,
            signal=sig.name,
            round=life.round(),
            fresh_next=fresh,
        )

    def reap(self) -> None:
        """Lives that exited: stopped by us (restart after the pause) or on their own."""
        for name, life in list(self.lives.items()):
            if life.stopping and life.proc.alive and self.now() - life.stop_sent_t > 90:
                life.proc.proc.kill()  # SIGTERM did not end it in 90 s
                self.event("stop_timeout", name=name, pid=life.proc.proc.pid)
            if life.proc.alive:
                continue
            code = life.proc.proc.wait()
            life.proc.stop()  # closes its log
            del self.lives[name]
            self.started.remove(life.proc)  # gone: nothing to clean up, nothing to keep
            self.check_orphans()
            if life.kind == "bootstrap":
                self.event("died", name=name, code=code, tail=life.proc.tail(20))
                raise RuntimeError(f"the bootstrap node exited ({code}):\n{life.proc.tail(20)}")
            if life.stopping:
                self.event(
                    "exited", name=name, code=code, after_s=round(self.now() - life.stop_sent_t, 1)
                )
                fresh = life.fresh_next
            else:
                self.event("died", name=name, code=code, tail=life.proc.tail(20))
                fresh = False
            self.pending.append((self.now() + self.args.pause, name, fresh))

    def check_orphans(self) -> None:
        """A p2pd whose python parent is gone should have gone too (setpriv --pdeathsig)."""
        parents = {v.proc.proc.pid for v in self.lives.values()}
        for pid in list(self.p2pd_seen):
            if comm(pid) != "p2pd":
                self.p2pd_seen.discard(pid)
                continue
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid not in parents:
                deadline = time.monotonic() + 15  # pdeathsig's SIGTERM: p2pd's own shutdown
                while comm(pid) == "p2pd" and time.monotonic() < deadline:
                    time.sleep(0.5)
                if comm(pid) == "p2pd":
                    self.event("orphan_p2pd", pid=pid, ppid=ppid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.p2pd_seen.discard(pid)

    def restart_due(self, force: bool = False) -> None:
        for item in sorted(self.pending):
            due, name, fresh = item
            if force or self.now() >= due:
                self.pending.remove(item)
                if fresh:
                    self.joiners += 1
                    self.event("retired", name=name)
                    joiner = f"joiner{self.joiners}"
                    if name in self.host_of:  # --netns: the joiner takes the retired host
                        self.host_of[joiner] = self.host_of.pop(name)
                    self.start_peer(joiner, fresh=True)
                else:
                    self.start_peer(name)
                self.save_state()

    # -- the run --------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        config = {
            "run": "harness.cluster.RUN (tiny-llama, synthetic-sentiment)",
            "peers": a.peers,
            "minutes": a.minutes,
            "churn_every_s": a.churn_every,
            "sample_every_s": a.sample_every,
            "pause_s": a.pause,
            "round_interval_s": a.round_interval,
            "join_every": a.join_every,
            "warmup_s": a.warmup,
            "settle_s": a.settle,
            "nice": os.nice(0),
            "cpus": os.cpu_count(),
            "netns": a.netns,
            "delay_ms": a.delay_ms if a.netns else None,
            "loss_pct": a.loss if a.netns else None,
            "loss_by": a.loss_by if a.netns and a.loss else None,
        }
        self.write(
            {
                "type": "segment",
                "resumes": a.resume_of,
                "started": dt.datetime.now(dt.UTC).isoformat(),
                "command": a.command,
                "network": network_label(a),
                "work": str(self.work),
                "config": config,
            }
        )
        print(
            f"soak {self.segment}: {network_label(a)}; work dir {self.work}; "
            f"samples -> {self.jsonl}",
            flush=True,
        )
        self.start()
        end = self.now() + a.minutes * 60
        next_churn = self.now() + a.churn_every if a.churn_every > 0 else math.inf
        while self.now() < end:
            self.maybe_sample()
            if self.now() >= next_churn:
                self.churn()
                next_churn += a.churn_every
            self.reap()
            self.restart_due()
            time.sleep(0.5)
        self.finish()

    def finish(self) -> None:
        """Every peer back, then all stop after one common round; compare the ledgers."""
        from harness.open_run import wait_ledger_digest
        from harness.partition import ledger_prefix
        from seedflood_p2p.apps.demo import finish_all

        deadline = time.monotonic() + 300  # let stopping peers exit and come back
        while (
            any(v.stopping for v in self.lives.values()) or self.pending
        ) and time.monotonic() < deadline:
            self.reap()
            self.restart_due(force=True)
            self.maybe_sample()
            time.sleep(0.5)
        while time.monotonic() < deadline:  # restarted peers training again
            behind = [n for n, v in self.lives.items() if v.kind == "peer" and v.round() < 0]
            if not behind:
                break
            self.reap()
            self.maybe_sample()
            time.sleep(1)
        self.sample()  # the end figures, all processes live
        peers = {n: v.proc for n, v in self.lives.items() if v.kind == "peer"}
        for name in peers:  # a SIGTERMed life's file is stale: only this finish counts
            (self.work / name / "final_status.json").unlink(missing_ok=True)
        if self.net is None:
            final_round = finish_all(peers, self.work)
        else:
            top = max(v.round() for n, v in self.lives.items() if n in peers)
            hosts = [self.host_of[n] for n in peers]
            final_round = self.net.finish_all(hosts, top + 1)
            if final_round is None:  # none could be asked: SIGTERM, as finish_all does
                for proc in peers.values():
                    proc.proc.send_signal(signal.SIGTERM)
        self.event("finish", final_round=final_round, peers=sorted(peers))
        codes = {}
        for name, proc in peers.items():
            try:
                codes[name] = proc.wait_exit(600)
            except TimeoutError:
                codes[name] = None
        digests: dict[str, str | None] = {}
        rows: dict[str, int | None] = {}
        for name in peers:
            path = self.work / name / "final_status.json"
            final = json.loads(path.read_text()) if path.exists() else {}
            digests[name] = final.get("ledger_digest")
            rows[name] = final.get("ledger_messages")
        known = [d for d in digests.values() if d]
        boot_ledger = self.work / "bootstrap" / "ledger.sqlite"
        if known:
            wait_ledger_digest(boot_ledger, known[0], timeout=60)
        held = ledger_prefix(boot_ledger, 2**62)
        digests["bootstrap"], rows["bootstrap"] = (held[1], held[0]) if held else (None, None)
        identical = None not in digests.values() and len(set(digests.values())) == 1
        self.event(
            "ledgers",
            identical=identical,
            final_round=final_round,
            digests=digests,
            rows=rows,
            codes=codes,
            note=None if all(c == 0 for c in codes.values()) else f"exit codes {codes}",
        )

    def close(self) -> None:
        """Stop everything started here, by PID: SIGTERM to all, then SIGKILL stragglers."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        alive = [p for p in self.started if p.alive]
        for p in alive:
            self.p2pd_seen.update(p2pd_of(p.proc.pid))
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for p in self.started:
            with contextlib.suppress(Exception):
                p.stop(max(1.0, deadline - time.monotonic()))
        for pid in self.p2pd_seen:
            if comm(pid) == "p2pd":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.net is not None:
            self.net.net("down", check=False)
        self.out.close()


def resumable(jsonl: Path, work: Path) -> tuple[str | None, dict | None]:
    """(segment, its last "state" event) of the last soak in `jsonl` that ran in `work`."""
    records = read_jsonl(jsonl) if jsonl.exists() else []
    heads = [r for r in records if r.get("type") == "segment" and r.get("work") == str(work)]
    if not heads:
        return None, None
    segment = heads[-1]["segment"]
    states = [r for r in records if r.get("segment") == segment and r.get("event") == "state"]
    return segment, (states[-1] if states else None)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="of training, after start")
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--churn-every", type=float, default=60.0, help="s; 0: no churn")
    parser.add_argument("--sample-every", type=float, default=15.0, help="s")
    parser.add_argument("--pause", type=float, default=10.0, help="s a stopped peer stays down")
    parser.add_argument(
        "--join-every",
        type=int,
        default=0,
        help="every Kth stop is replaced by a fresh joiner (0: never)",
    )
    parser.add_argument("--warmup", type=float, default=120.0, help="s of training left out")
    parser.add_argument(
        "--settle", type=float, default=60.0, help="s of each restarted process's life left out"
    )
    parser.add_argument(
        "--round-interval", type=float, default=0.4, help="s; a round is never shorter"
    )
    parser.add_argument("--netns", action="store_true", help="network namespaces (root)")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="netem one-way, --netns")
    parser.add_argument("--loss", type=float, default=5.0, help="netem loss %%, --netns")
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="peer0 runs harness/hooked_peer.py --trace-memory (WORK/peer0*.mem.jsonl; loopback)",
    )
    parser.add_argument("--name", default="soak")
    parser.add_argument("--work", default="", help="data dirs and logs (default: a new tmp dir)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="carry on the soak NAME that ran in --work: every process back from its data "
        "dir, a new segment of the same run (a soak longer than a session)",
    )
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="only rewrite .json/.md/.png from the JSONL's last segment",
    )
    args = parser.parse_args(argv)
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root (network namespaces)")
    if args.netns and args.trace_memory:
        parser.error("--trace-memory runs on loopback only: drop --netns")
    from harness.partition import NamespaceNet

    probe = NamespaceNet(f"sfskc{os.getpid() % 100000}", SUBNET)
    if args.netns and args.delay_ms and not probe.has_netem():
        parser.error(
            "this kernel has no netem (CONFIG_NET_SCH_NETEM): --delay-ms cannot be applied; "
            "pass --delay-ms 0 (--loss is applied with nftables where netem is missing)"
        )
    if args.netns and args.loss and not probe.has_loss():
        parser.error("this kernel has neither netem nor nftables: pass --loss 0")
    args.loss_by = "netem" if args.netns and args.loss and probe.has_netem() else "nftables"
    args.command = shlex.join([Path(sys.executable).name, *sys.argv])
    RESULTS.mkdir(parents=True, exist_ok=True)
    jsonl = RESULTS / f"soak-{args.name}.jsonl"
    if args.summarize:
        print(markdown(write_outputs(jsonl)))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix=f"sf-soak-{args.name}-")).resolve()
    args.resume_of, state = None, None
    if args.resume:
        args.resume_of, state = resumable(jsonl, work)
        if state is None:
            parser.error(
                f"--resume: {jsonl.name} has no soak that ran in {work} with its peers "
                "recorded: run it without --resume first (and the same --work)"
            )
    work.mkdir(parents=True, exist_ok=True)

    def on_term(signum: int, frame: Any) -> None:
        raise Stop()

    signal.signal(signal.SIGTERM, on_term)
    soak = Soak(args, work, jsonl)
    soak.resumes = state
    try:
        soak.run()
    except (KeyboardInterrupt, Stop) as exc:
        soak.event("interrupted", by=type(exc).__name__)
    except Exception as exc:
        soak.event("failed", error=repr(exc)[:4000])
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second one must not skip cleanup
            signal.signal(sig, signal.SIG_IGN)
        soak.close()
        summary = write_outputs(jsonl, soak.segment)
        print(markdown(summary), flush=True)
        print(f"wrote {jsonl.with_suffix('.json')}, .md, .png; logs in {work}", flush=True)


if __name__ == "__main__":
    main()
