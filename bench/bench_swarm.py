#!/usr/bin/env python
"""Swarm: one real bootstrap node and N real `seedflood peer` daemons, per N a row.

    python bench/bench_swarm.py [--peers 8,16,32] [--rounds 30] [--round-interval 0.5]
        [--netns [--delay-ms 20] [--loss 0]] [--threads 1] [--out swarm] [--work DIR]
        [--prometheus [--prometheus-at ROUND] [--scrape-interval 1]]
        [--fork-server] [--spawn-gap S] [--summary-interval 2] [--daemon-start-timeout S]
        [--min-available-mib 3072] [--pss-every 10]
    python bench/bench_swarm.py --out NAME --summarize     # redo NAME.md/.png from NAME.json

Issue 46, item 3 ("hundreds of real daemons"). For each N of --peers: a bootstrap node of
the tests' tiny run (harness.cluster.RUN: tiny-llama on synthetic-sentiment) and N peer
daemons (each with its own go-libp2p daemon, p2pd), all founders (--min-peers N, so they
meet before round 0), --until-round ROUNDS (rounds 0..ROUNDS-1), --round-interval as
given, --threads per daemon. On 127.0.0.1 by default; with --netns (root) the daemons are
spread over network namespaces on one bridge (deploy/netns-testnet.sh, as
tests/test_netns.py builds them: the bootstrap node in h1, peer i in its own host up to
199 hosts) with a netem delay of --delay-ms and --loss percent on every host's egress.

Measured, per N (nothing is added to the daemons: their JSON logs, final_status.json,
ledger files read through read-only SQLite, and /proc):
- rounds per minute: from each peer's `round` log events (median over peers), and the
  swarm's: ROUNDS-1 rounds from the first round-0 event to the last peer's last round;
- delivery: the fraction of the N*ROUNDS expected (peer, round) updates each peer's
  ledger holds at the end (final_status.json's ledger_messages), and before repair
  (its `accepted` counters: own + first heard by gossip, not by repair); min and mean;
- spread: per round r, from its first publish (the earliest peer's `round` event time,
  less the round-interval sleep that follows the publish) until every peer's ledger holds
  all N rows of r (the bench polls every ledger every --poll seconds: that is the
  resolution); median and p95 over rounds;
- ledger digests at the end: every peer's (final_status.json) and the bootstrap node's;
  the count of distinct ones (1: all agree);
- RSS per daemon: each process's largest VmRSS sampled from /proc every --sample-every s
  while training, python daemons and their p2pd children apart; median and max;
- CPU seconds per daemon per round: utime+stime from /proc/PID/stat between the first
  sample in training and the first at the daemon's final round, over the rounds between.

--fork-server: the peer daemons are forked from one zygote process (harness/fork_server.py)
that has imported what `seedflood peer` imports (torch, transformers, hivemind: ~7 s of CPU
and ~290 MiB each otherwise) and started no thread; each child sets up its log, working
dir, environment and argv as the normal launch (apps/localnet.NodeProcess: `python -m
seedflood --log-format json peer ...`) and calls seedflood.cli.main. They are real daemons
(own p2pd, own ledger; SIGTERM/SIGINT to the PID stop them), sharing the imported pages
copy-on-write: PSS and USS per daemon (/proc/PID/smaps_rollup, sampled with VmRSS) say
what each costs (read every --pss-every s: smaps_rollup costs ~10-16 ms of CPU a daemon);
the zygote is sampled too (kind "zygote"). The bootstrap node is started
as usual. The row's key and table say which launch it had. --min-available-mib M (any
launch): the row is aborted, every daemon stopped, once MemAvailable drops below M MiB;
the row keeps the lowest MemAvailable seen and the peak of MemTotal - MemAvailable.
--spawn-gap S: S seconds between one peer's start and the next (64 forked at once on 2
cores: 26 p2pd missed their 15 s start timeout; --daemon-start-timeout raises it).
--summary-interval: every daemon's (default 2 s, as before).

--prometheus (issue 46 item 4, loopback only): the bootstrap node gets a metrics port too,
and a real Prometheus (the `prometheus` binary, e.g. Debian's package; its own config and
TSDB under the row's work dir, on a free 127.0.0.1 port) scrapes every daemon's /metrics
every --scrape-interval s, its targets written (file_sd) as daemons write their
status_port. Once the slowest peer reaches --prometheus-at (default ROUNDS/2) and every
target has been up --prometheus-min-scrape s, a thread runs every panel query of
deploy/grafana/seedflood-run.json through /api/v1/query (template variables made concrete,
`$instance` as All) as written and per daemon (`instance` added to its groupings), and
counts the peers whose series each returns; an empty query is told apart: declared by the
daemons but no sample yet (nothing of its kind happened), series filtered out (`> 0`), or
a name no daemon exports (broken). It also reads the bootstrap node's run page (/run and
/run.json's peers) and `seedflood status` of the bootstrap node and of each peer. The row
gets `prometheus` and OUT.md a table; the bench prints "prometheus: K of Q dashboard
queries cover all N daemons".

bench/results/OUT.json and OUT.md: each finished row is written at once; a rerun with the
same OUT skips the rows it already holds (same N, rounds, interval, network, threads).
OUT.png: rounds/min and RSS against N. A progress line every --progress s.
Every process started here is stopped by PID on the way out (Ctrl-C and SIGTERM too);
namespaces are deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import re
import shlex
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

LOOPBACK = "loopback 127.0.0.1 (no network namespaces, no netem)"
SUBNET = "10.79.0"
BOOT_PORT = 31337
MAX_HOSTS = 200  # deploy/netns-testnet.sh's limit
DEFAULT_MIB_PER_PEER = 530.0  # tiny-llama peer ~456 MiB + its p2pd ~67 MiB (measured here)
DEFAULT_FORK_MIB_PER_PEER = 200.0  # --fork-server: peer PSS 87-125 + p2pd 67-71 (N = 4, 7)
FORK_ZYGOTE_MIB = 300.0  # the zygote itself: the imports, shared with every forked peer
MEM_SHARE = 0.85  # a row starts only if N daemons fit in this share of MemAvailable
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --------------------------------------------------------------------------------------
# Pure parts (tests/test_bench_swarm.py): events -> figures -> table
# --------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _median(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _max(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return max(xs) if xs else None


def round_events(records: Iterable[dict]) -> list[tuple[int, float, float]]:
    """(round, time, seconds) of a daemon's `round` log events (JSON records), first
    event of each round kept, in round order."""
    seen: dict[int, tuple[int, float, float]] = {}
    for e in records:
        if e.get("event") != "round":
            continue
        with contextlib.suppress(KeyError, TypeError, ValueError):
            r = int(e["round"])
            seen.setdefault(r, (r, float(e["time"]), float(e.get("seconds", 0.0))))
    return [seen[r] for r in sorted(seen)]


def publish_time(event_time: float, seconds: float, interval: float) -> float:
    """When a round's update was published, from its `round` event: the daemon publishes,
    then sleeps the rest of the round interval, then logs (peer/rounds.py)."""
    return event_time - max(0.0, interval - seconds)


def rounds_per_minute(events: dict[str, list[tuple[int, float, float]]], rounds: int) -> dict:
    """Per peer: 60 * rounds advanced / seconds, first to last `round` event; their median,
    and the swarm's: from the first `round` event of any peer to the last peer's last one,
    over the rounds between (a peer ready late starts at the run's round, not at 0)."""
    per_peer = {}
    for name, evs in events.items():
        if len(evs) >= 2 and evs[-1][1] > evs[0][1]:
            per_peer[name] = 60 * (evs[-1][0] - evs[0][0]) / (evs[-1][1] - evs[0][1])
    have = [evs for evs in events.values() if evs]
    swarm = None
    if have and len(have) == len(events):
        first = min(have, key=lambda evs: evs[0][1])[0]
        last = max(have, key=lambda evs: evs[-1][1])[-1]
        span = last[1] - first[1]
        swarm = 60 * (last[0] - first[0]) / span if span > 0 and last[0] > first[0] else None
    return {
        "median": _median(per_peer.values()),
        "min": min(per_peer.values(), default=None),
        "max": max(per_peer.values(), default=None),
        "swarm": swarm,
        "first_rounds": sorted({evs[0][0] for evs in have}),
        "per_peer": per_peer,
    }


def delivery(finals: dict[str, dict | None], n: int, rounds: int) -> dict:
    """The fraction of the n*rounds expected updates each peer holds: at the end (its
    ledger rows) and before repair (own + accepted from gossip); min and mean over peers.
    A peer without a final status (it did not exit cleanly) counts as 0 at the end."""
    expected = n * rounds
    end, gossip = {}, {}
    for name, final in finals.items():
        final = final or {}
        end[name] = (final.get("ledger_messages") or 0) / expected
        acc = final.get("accepted") or {}
        if acc:
            gossip[name] = ((acc.get("own") or 0) + (acc.get("gossip") or 0)) / expected
    # Updates that exist: each peer's own (a peer ready after round 0 never publishes it).
    published = sum(((f or {}).get("accepted") or {}).get("own", 0) for f in finals.values())
    of_published = [
        (f or {}).get("ledger_messages", 0) / published for f in finals.values() if published
    ]
    return {
        "expected": expected,
        "published": published,
        "of_published_min": min(of_published, default=None),
        "end_min": min(end.values(), default=None),
        "end_mean": statistics.fmean(end.values()) if end else None,
        "gossip_min": min(gossip.values(), default=None),
        "gossip_mean": statistics.fmean(gossip.values()) if gossip else None,
        "repaired": sum(
            ((f or {}).get("accepted") or {}).get("repair", 0) for f in finals.values()
        ),
    }


def spread_times(
    events: dict[str, list[tuple[int, float, float]]],
    held: dict[str, dict[int, float]],
    rounds: int,
    interval: float,
) -> dict:
    """Per round r: from its first publish (any peer) until the last peer's ledger held all
    of r (`held[peer][r]`: the poll time it first did); and from its last publish, which
    leaves out the peers' phase offsets within a round (propagation and ledger write only).
    Rounds some ledger never completed are counted apart (`incomplete`), not timed."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    incomplete = []
    for r in range(rounds):
        pubs = [publish_time(t, s, interval) for v in events.values() for q, t, s in v if q == r]
        done = [h.get(r) for h in held.values()]
        if not pubs or not done or None in done:
            incomplete.append(r)
            continue
        first[r] = max(0.0, max(done) - min(pubs))
        last[r] = max(0.0, max(done) - max(pubs))
    xs, ys = list(first.values()), list(last.values())
    return {
        "median_s": percentile(xs, 50),
        "p95_s": percentile(xs, 95),
        "max_s": max(xs, default=None),
        "from_last_median_s": percentile(ys, 50),
        "from_last_p95_s": percentile(ys, 95),
        "rounds_timed": len(xs),
        "incomplete": incomplete,
        "per_round": {str(r): round(v, 3) for r, v in first.items()},
        "per_round_from_last": {str(r): round(v, 3) for r, v in last.items()},
    }


def process_figures(samples: list[dict]) -> dict[str, dict]:
    """Per process (name): largest VmRSS (MiB) and CPU seconds per round between its first
    sample in training (round >= 0) and its first sample at its last round seen."""
    by_name: dict[str, list[dict]] = {}
    for s in samples:
        by_name.setdefault(s["name"], []).append(s)
    out = {}
    for name, ss in by_name.items():
        ss.sort(key=lambda s: s["t"])
        rss = [s["rss_kb"] / 1024 for s in ss if s.get("rss_kb") is not None]
        pss = [s["pss_kb"] / 1024 for s in ss if s.get("pss_kb") is not None]
        uss = [s["uss_kb"] / 1024 for s in ss if s.get("uss_kb") is not None]
        training = [s for s in ss if s.get("round") is not None and s["round"] >= 0]
        cpu_per_round = None
        if training:
            last_round = max(s["round"] for s in training)
            first = training[0]
            last = next(s for s in training if s["round"] == last_round)
            if last["round"] > first["round"]:
                cpu_per_round = (last["cpu_s"] - first["cpu_s"]) / (last["round"] - first["round"])
        out[name] = {
            "kind": ss[0]["kind"],
            "rss_mib_max": max(rss, default=None),
            "pss_mib_max": max(pss, default=None),
            "uss_mib_max": max(uss, default=None),
            "cpu_s_per_round": cpu_per_round,
        }
    return out


def kind_summary(procs: dict[str, dict], kind: str) -> dict:
    of = [p for p in procs.values() if p["kind"] == kind]
    return {
        "count": len(of),
        "rss_mib_median": _median(p["rss_mib_max"] for p in of),
        "rss_mib_max": _max(p["rss_mib_max"] for p in of),
        "pss_mib_median": _median(p.get("pss_mib_max") for p in of),
        "pss_mib_max": _max(p.get("pss_mib_max") for p in of),
        "uss_mib_median": _median(p.get("uss_mib_max") for p in of),
        "uss_mib_max": _max(p.get("uss_mib_max") for p in of),
        "cpu_s_per_round_median": _median(p["cpu_s_per_round"] for p in of),
        "cpu_s_per_round_max": _max(p["cpu_s_per_round"] for p in of),
    }


def summarize_row(obs: dict) -> dict:
    """One row from what a run observed: `obs` holds n, rounds, interval, network,
    events {peer: [(round, time, seconds)]}, held {peer: {round: t}}, finals
    {peer: final_status or None}, boot_digest, samples [{t, name, kind, round, rss_kb,
    cpu_s}], and passes through config/load/timing fields."""
    n, rounds, interval = obs["n"], obs["rounds"], obs["interval"]
    events = {k: [tuple(e) for e in v] for k, v in obs["events"].items()}
    held = {k: {int(r): t for r, t in v.items()} for k, v in obs["held"].items()}
    digests = {k: (f or {}).get("ledger_digest") for k, f in obs["finals"].items()}
    if obs.get("boot_digest") is not None:
        digests["bootstrap"] = obs["boot_digest"]
    procs = process_figures(obs.get("samples", []))
    final_rounds = [(f or {}).get("round") for f in obs["finals"].values()]
    row = {
        k: obs.get(k)
        for k in (
            "key",
            "n",
            "rounds",
            "interval",
            "network",
            "cpus",
            "threads",
            "poll_s",
            "started",
            "load_start",
            "load_end",
            "startup_s",
            "training_s",
            "wall_s",
            "exit_codes",
            "error",
            "interrupted",
            "prometheus",
            "launch",
            "fork_server",
            "memory",
        )
    }
    row.update(
        complete=obs.get("error") is None
        and len(obs["finals"]) == n
        and all(f is not None for f in obs["finals"].values()),
        rounds_per_min=rounds_per_minute(events, rounds),
        delivery=delivery(obs["finals"], n, rounds),
        spread=spread_times(events, held, rounds, interval),
        digests={
            "distinct": len({d for d in digests.values() if d}),
            "missing": sorted(k for k, d in digests.items() if not d),
            "values": sorted({d[:16] for d in digests.values() if d}),
        },
        final_rounds=sorted({r for r in final_rounds if r is not None}),
        peer=kind_summary(procs, "peer"),
        p2pd=kind_summary(procs, "p2pd (peer)"),
        bootstrap=kind_summary(procs, "bootstrap"),
        bootstrap_p2pd=kind_summary(procs, "p2pd (bootstrap)"),
        zygote=kind_summary(procs, "zygote"),
        processes=procs,
        raw={k: obs[k] for k in ("events", "held", "finals", "boot_digest")},
    )
    return row


def resummarize(row: dict) -> dict:
    """A stored row's figures again from its raw events (after a change to the figures;
    the per-process /proc figures are kept as they were)."""
    if not row.get("raw"):
        return row
    obs = {**row, **row["raw"], "interval": row["interval"], "samples": []}
    again = summarize_row(obs)
    keep = ("processes", "peer", "p2pd", "bootstrap", "bootstrap_p2pd", "zygote", "complete")
    keep += ("note",)
    return {**again, **{k: row[k] for k in keep if k in row}}


def _f(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(rows: list[dict]) -> list[str]:
    """The summary table, one line per row, by network then N."""
    lines = [
        "| N | network | launch | CPUs | rounds | rounds/min (median peer / swarm) "
        "| delivery end (min / mean) | delivery before repair (min / mean) "
        "| spread s from first publish (median / p95) | from last publish (median / p95) "
        "| distinct digests "
        "| peer RSS MiB (median / max) | peer PSS / USS MiB (median) "
        "| p2pd RSS MiB (median / max) | p2pd PSS MiB (median) "
        "| peer CPU s/round (median) | p2pd CPU s/round (median) | load 1-min start -> end "
        "| start-up s | wall s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r.get("network") or "", r["n"], r.get("launch") or "")):
        rpm, d, sp = r["rounds_per_min"], r["delivery"], r["spread"]
        peer, p2pd = r["peer"], r["p2pd"]
        load = (
            f"{r['load_start'][0]:.2f} -> {r['load_end'][0]:.2f}"
            if r.get("load_start") and r.get("load_end")
            else "-"
        )
        digests = str(r["digests"]["distinct"])
        if r["digests"]["missing"]:
            digests += f" ({len(r['digests']['missing'])} missing)"
        flag = "" if r.get("complete") else " (incomplete)"
        lines.append(
            f"| {r['n']}{flag} | {r.get('network')} | {r.get('launch') or 'subprocess'} | "
            f"{r.get('cpus') or '-'} | {r['rounds']} | "
            f"{_f(rpm['median'])} / {_f(rpm['swarm'])} | "
            f"{_pct(d['end_min'])} / {_pct(d['end_mean'])} | "
            f"{_pct(d['gossip_min'])} / {_pct(d['gossip_mean'])} | "
            f"{_f(sp['median_s'], 2)} / {_f(sp['p95_s'], 2)} | "
            f"{_f(sp.get('from_last_median_s'), 2)} / {_f(sp.get('from_last_p95_s'), 2)} | "
            f"{digests} | "
            f"{_f(peer['rss_mib_median'], 0)} / {_f(peer['rss_mib_max'], 0)} | "
            f"{_f(peer.get('pss_mib_median'), 0)} / {_f(peer.get('uss_mib_median'), 0)} | "
            f"{_f(p2pd['rss_mib_median'], 0)} / {_f(p2pd['rss_mib_max'], 0)} | "
            f"{_f(p2pd.get('pss_mib_median'), 0)} | "
            f"{_f(peer['cpu_s_per_round_median'], 3)} | {_f(p2pd['cpu_s_per_round_median'], 3)} | "
            f"{load} | {_f(r.get('startup_s'), 0)} | {_f(r.get('wall_s'), 0)} |"
        )
    return lines


def markdown(doc: dict) -> str:
    """OUT.md: what was run, on what, and the table."""
    rows = doc.get("rows", [])
    lines = [
        "# Swarm: one bootstrap node and N real peer daemons",
        "",
        "`bench/bench_swarm.py` (issue 46, item 3). Run: harness.cluster.RUN (tiny-llama on "
        "synthetic-sentiment), every peer a founder (--min-peers N), --until-round ROUNDS.",
        "",
        "Invocations (command; machine: nproc, CPUs this process may use; 1/5/15-min load "
        "at start and end):",
        "",
    ]
    for inv in doc.get("invocations", []):
        lines.append(
            f"- `{inv.get('command')}` at {inv.get('started')}: nproc {inv.get('nproc')}, "
            f"affinity {inv.get('affinity')}, load {inv.get('load_start')} -> "
            f"{inv.get('load_end')}"
        )
    lines += ["", *table(rows), ""]
    lines += [f"- {note}" for note in doc.get("skipped", [])]
    for r in rows:
        lines += prometheus_markdown(r)
    lines += [
        "Columns: rounds/min: the median peer's (first to last `round` event) and the "
        "swarm's (from the first `round` event of any peer to the last peer's last one); "
        "--round-interval caps it at 60/interval. Delivery: the share of the N x rounds "
        "updates a peer's ledger holds at the end, and before repair (own + first heard "
        "by gossip); below each row, the share of the updates that were published (a "
        "peer ready after the others' round 0 starts at round 1 and never publishes 0). "
        "Spread: a round's first publish until every peer's ledger holds all N "
        "rows of it, polled (resolution: the row's poll interval), over rounds; it includes "
        "the peers' phase offsets within a round (up to a round interval), which the "
        "spread from the round's last publish leaves out. Digests: "
        "distinct ledger digests among the peers and the bootstrap node at the end "
        "(1: all agree). RSS: each process's largest sampled VmRSS; p2pd: each peer's "
        "go-libp2p daemon apart; PSS (shared pages divided among the processes mapping "
        "them) and USS (private pages), /proc/PID/smaps_rollup, largest sampled (rows "
        "before these columns: -). Launch: subprocess (`python -m seedflood peer`, one "
        "interpreter each) or fork-server (forked from one zygote that imported torch, "
        "transformers and hivemind once: harness/fork_server.py). Start-up: from the bench's "
        "start of the row (bootstrap node first) until every peer logged round 0. "
        "CPU s/round: utime+stime per round while training.",
        "",
    ]
    for r in sorted(rows, key=lambda r: (r.get("network") or "", r["n"], r.get("launch") or "")):
        b, bp = r["bootstrap"], r["bootstrap_p2pd"]
        lines.append(
            f"- N={r['n']} ({r.get('network')}): interval {r['interval']} s, threads "
            f"{r.get('threads')}, poll {r.get('poll_s')} s; start-up {_f(r.get('startup_s'), 0)}"
            f" s, training {_f(r.get('training_s'), 0)} s; final rounds {r['final_rounds']}; "
            f"repaired updates {r['delivery']['repaired']}; updates published "
            f"{r['delivery'].get('published')} of {r['delivery']['expected']} expected, the "
            f"least-complete ledger holds {_pct(r['delivery'].get('of_published_min'))} of "
            f"them; first rounds {r['rounds_per_min'].get('first_rounds')}; rounds timed "
            f"{r['spread']['rounds_timed']}/{r['rounds']} (max spread "
            f"{_f(r['spread']['max_s'], 2)} s); bootstrap RSS {_f(b['rss_mib_max'], 0)} MiB, "
            f"its p2pd {_f(bp['rss_mib_max'], 0)} MiB; peer CPU s/round max "
            f"{_f(r['peer']['cpu_s_per_round_max'], 3)}"
            + fork_note(r)
            + memory_note(r.get("memory"))
            + (f"; error: {r['error']}" if r.get("error") else "")
            + (f"; note: {r['note']}" if r.get("note") else "")
        )
    return "\n".join(lines) + "\n"


def fork_note(row: dict) -> str:
    """The zygote's figures of a --fork-server row."""
    fs, z = row.get("fork_server"), row.get("zygote") or {}
    if not fs:
        return ""
    return (
        f"; fork server: imports {_f(fs.get('import_s'))} s ({_f(fs.get('import_cpu_s'))} s "
        f"CPU), ready {_f(fs.get('ready_s'))} s after it started, {fs.get('forked')} daemons "
        f"forked in {_f(fs.get('spawn_s'), 2)} s; zygote RSS {_f(z.get('rss_mib_max'), 0)} "
        f"MiB, PSS {_f(z.get('pss_mib_max'), 0)} MiB"
    )


def memory_note(mem: dict | None) -> str:
    """The machine's memory over a row (MemAvailable sampled with the daemons)."""
    if not mem or mem.get("available_min_mib") is None:
        return ""
    return (
        f"; memory: MemAvailable {_f(mem.get('available_start_mib'), 0)} MiB at start, lowest "
        f"{_f(mem.get('available_min_mib'), 0)} MiB; peak used (MemTotal - MemAvailable) "
        f"{_f(mem.get('used_peak_mib'), 0)} MiB of {_f(mem.get('total_mib'), 0)}"
    )


def memory_summary(meminfo: list[tuple[float, float, float]]) -> dict:
    """From (t, MemTotal MiB, MemAvailable MiB) samples: the lowest MemAvailable, the peak
    used (MemTotal - MemAvailable), and the first sample's MemAvailable."""
    if not meminfo:
        return {"available_min_mib": None}
    return {
        "total_mib": meminfo[0][1],
        "available_start_mib": meminfo[0][2],
        "available_min_mib": min(a for _, _, a in meminfo),
        "used_peak_mib": max(t - a for _, t, a in meminfo),
    }


def plot(rows: list[dict], path: Path) -> Path | None:
    """Rounds/min and RSS against N (one line per network)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lines = sorted({(r.get("network") or "", r.get("launch") or "subprocess") for r in rows})
    for network, launch in lines:
        mine = sorted(
            (
                r
                for r in rows
                if (r.get("network") or "", r.get("launch") or "subprocess") == (network, launch)
            ),
            key=lambda r: r["n"],
        )
        ns = [r["n"] for r in mine]
        label = network.split(" (")[0] + ("" if launch == "subprocess" else f", {launch}")
        a.plot(ns, [r["rounds_per_min"]["swarm"] or math.nan for r in mine], "o-", label=label)
        b.plot(
            ns, [r["peer"]["rss_mib_median"] or math.nan for r in mine], "o-", label=f"peer {label}"
        )
        b.plot(
            ns,
            [r["p2pd"]["rss_mib_median"] or math.nan for r in mine],
            "s--",
            label=f"p2pd {label}",
        )
    a.set(xlabel="peers N", ylabel="rounds per minute (swarm)", title="rounds/min")
    b.set(xlabel="peers N", ylabel="RSS MiB (median daemon)", title="RSS per daemon")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def row_key(n: int, rounds: int, interval: float, network: str, threads: int) -> str:
    return f"n={n} rounds={rounds} interval={interval:g} threads={threads} net={network}"


def load_doc(path: Path) -> dict:
    if path.exists():
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(path.read_text())
    return {"bench": "swarm", "invocations": [], "rows": []}


def save_doc(doc: dict, out: Path) -> None:
    """OUT.json and OUT.md (and OUT.png when matplotlib is there), written whole."""
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(out.with_suffix(".json"))
    out.with_suffix(".md").write_text(markdown(doc))
    with contextlib.suppress(ImportError):
        plot([r for r in doc["rows"] if r.get("complete")] or doc["rows"], out.with_suffix(".png"))


# --------------------------------------------------------------------------------------
# Prometheus (--prometheus, issue 46 item 4): the dashboard's queries over a real scrape
# --------------------------------------------------------------------------------------
DASHBOARD = ROOT / "deploy" / "grafana" / "seedflood-run.json"
SCRAPE_INTERVAL_S = 1.0
# Grafana's built-in variables, made concrete for an instant query through the HTTP API.
GRAFANA_VARS = {"__rate_interval": "1m", "__interval": "2s", "__range": "5m"}


def dashboard_queries(
    dashboard: dict, instance: str = ".*", builtins: dict[str, str] | None = None
) -> list[dict]:
    """Every panel target's `expr` (rows' nested panels too), with the dashboard's
    template variables made concrete: `$instance` (and `${instance}`, `${instance:regex}`)
    -> `instance` (a regex: ".*" is Grafana's "All"), Grafana's built-ins (`$__rate_interval`
    ...) -> GRAFANA_VARS. A variable left over is an error (the query could not be run as
    the dashboard means it). Returns [{panel, legend, ref, expr, query}] in panel order."""
    values = {**GRAFANA_VARS, **(builtins or {}), "instance": instance}
    pattern = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")

    def concrete(expr: str) -> str:
        def sub(m: re.Match) -> str:
            name = m.group(1) or m.group(2)
            if name not in values:
                raise ValueError(f"unknown template variable ${name} in {expr!r}")
            return values[name]

        return pattern.sub(sub, expr)

    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets") or []:
                if t.get("expr"):
                    out.append(
                        {
                            "panel": p.get("title", ""),
                            "legend": t.get("legendFormat", ""),
                            "ref": t.get("refId", ""),
                            "expr": t["expr"],
                            "query": concrete(t["expr"]),
                        }
                    )
            walk(p.get("panels") or [])

    walk(dashboard.get("panels") or [])
    return out


def per_daemon(query: str) -> str:
    """The query with `instance` added to every `by (...)` grouping, so an aggregate over
    daemons (`sum by (source) (...)`) answers per daemon: its instance labels say which
    daemons' series the panel is drawn from. A query without a grouping is kept."""

    def add(m: re.Match) -> str:
        labels = [x.strip() for x in m.group(1).split(",") if x.strip()]
        if "instance" not in labels:
            labels.append("instance")
        return f"by ({', '.join(labels)})"

    return re.sub(r"\bby\s*\(([^)]*)\)", add, query)


PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
PROMQL_WORDS |= {"group_left", "group_right", "inf", "nan"}


def metric_names(query: str) -> list[str]:
    """The metric names a query selects (bare, `name{...}` or `name[...]`), in order, once
    each: strings, label matchers, ranges and groupings dropped, then every identifier
    that is not a function call or a PromQL keyword."""
    q = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)
    q = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", q)
    q = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", q)
    names = re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", q)
    return list(dict.fromkeys(n for n in names if n.lower() not in PROMQL_WORDS))


def exposed_families(metrics_text: str) -> dict[str, str]:
    """`# TYPE name kind` lines of a /metrics page: {name: kind}. A labelled counter that
    never counted (no ban yet) has its TYPE line but no sample."""
    out = {}
    for line in metrics_text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[:2] == ["#", "TYPE"]:
            out[parts[2]] = parts[3]
    return out


def declared(name: str, families: dict[str, str]) -> bool:
    """Whether a queried series name is one a daemon declares (histograms' _bucket, _sum,
    _count; counters' _total and _created under either name)."""
    if name in families:
        return True
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return True
    return any(f"{k}_total" == name for k in families)


def prometheus_config(targets_file: Path, scrape_interval: float = SCRAPE_INTERVAL_S) -> str:
    """prometheus.yml: one job over every daemon's /metrics, its targets from a file the
    bench rewrites as daemons write their status_port (file_sd: re-read on change)."""
    s = f"{scrape_interval:g}s"
    return (
        "# written by bench/bench_swarm.py --prometheus\n"
        "global:\n"
        f"  scrape_interval: {s}\n"
        f"  scrape_timeout: {s}\n"
        f"  evaluation_interval: {s}\n"
        "scrape_configs:\n"
        "  - job_name: seedflood\n"
        "    metrics_path: /metrics\n"
        "    file_sd_configs:\n"
        f"      - files: [{json.dumps(str(targets_file))}]\n"
        f"        refresh_interval: {s}\n"
    )


def file_sd_targets(ports: dict[str, int], host: str = "127.0.0.1") -> list[dict]:
    """file_sd's JSON: one target per daemon, its name as label `daemon`."""
    return [
        {"targets": [f"{host}:{port}"], "labels": {"daemon": name}}
        for name, port in sorted(ports.items())
    ]


def query_coverage(
    check: dict, direct: list[dict], split: list[dict], peers: dict[str, str]
) -> dict:
    """One dashboard query's figures from Prometheus's answers (each a `result` vector):
    `direct` (the query as the dashboard runs it) and `split` (per_daemon of it); `peers`
    maps instance -> peer name (the N training daemons; any other instance is the
    bootstrap node). Daemons covered: the peers among the split answer's instances."""
    instances = {s["metric"].get("instance") for s in split} - {None}
    covered = sorted(peers[i] for i in instances if i in peers)
    return {
        **check,
        "series": len(direct),
        "series_per_daemon": len(split),
        "peers_covered": covered,
        "covered": len(covered),
        "bootstrap_covered": any(i not in peers for i in instances),
        "missing": sorted(set(peers.values()) - set(covered)),
    }


def classify(check: dict, families: dict[str, str], with_samples: set[str], n: int) -> str:
    """all / some / empty: why. `with_samples`: the metric names that have series in
    Prometheus now (any daemon)."""
    if check["covered"] == n:
        return "all"
    names = metric_names(check["query"])
    unknown = [m for m in names if not declared(m, families)]
    if unknown:
        return "broken: no daemon exports " + ", ".join(unknown)
    if check["covered"]:
        return f"some: {check['covered']} of {n} ({', '.join(check['missing'])} missing)"
    silent = [m for m in names if m not in with_samples]
    if silent:
        return "empty: declared, no samples yet (" + ", ".join(silent) + ")"
    return "empty: series exist but the expression selects none (a filter such as > 0)"


def summarize_prometheus(watch: dict) -> dict:
    """K of Q queries that cover all N daemons, and the operator views' peer counts."""
    n = watch.get("n") or 0
    checks = watch.get("queries") or []
    k = sum(1 for c in checks if c.get("verdict") == "all")
    by_kind: dict[str, int] = {}
    for c in checks:
        kind = (c.get("verdict") or "error").split(":")[0]
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return {
        "all": k,
        "queries": len(checks),
        "by_verdict": by_kind,
        "line": f"prometheus: {k} of {len(checks)} dashboard queries cover all {n} daemons",
    }


def status_counts(text: str) -> dict:
    """`seedflood status`'s screen: peers alive, the run-wide line's alive and known counts,
    and the peers listed on its `peer rounds` line (a peer lists the others it heard)."""
    out: dict[str, int | None] = {
        "peers_alive": None,
        "run_alive": None,
        "run_known": None,
        "peer_rounds": None,
    }
    m = re.search(r"^peers alive\s+(\d+)", text, re.M)
    if m:
        out["peers_alive"] = int(m.group(1))
    m = re.search(r"(\d+) peers alive of (\d+) in the ledger", text)
    if m:
        out["run_alive"], out["run_known"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"^peer rounds (.*)$", text, re.M)
    if m:
        out["peer_rounds"] = len(re.findall(r"\.\.\w+: -?\d+", m.group(1)))
    return out


def run_page_counts(run_json: dict) -> dict:
    """/run.json's peers table: how many, by state, and the run-wide head."""
    peers = run_json.get("peers") or []
    states: dict[str, int] = {}
    for p in peers:
        state = str(p.get("state", "?")).split(" (")[0]
        states[state] = states.get(state, 0) + 1
    run = run_json.get("run") or {}
    return {
        "peers": len(peers),
        "states": states,
        "round": run.get("round"),
        "peers_alive": run.get("peers_alive"),
        "peers_known": run.get("peers_known"),
    }


def prometheus_table(watch: dict) -> list[str]:
    """The markdown table: per dashboard query, its series and the daemons it covers."""
    n = watch.get("n")
    lines = [
        f"| panel | query | series | daemons covered of {n} | bootstrap | verdict |",
        "|---|---|---:|---:|---|---|",
    ]
    for c in watch.get("queries") or []:
        expr = c["expr"].replace("|", "\\|")
        lines.append(
            f"| {c['panel']} | `{expr}` | {c.get('series', '-')} | {c.get('covered', '-')} | "
            f"{'yes' if c.get('bootstrap_covered') else 'no'} | {c.get('verdict', '-')} |"
        )
    return lines


def prometheus_markdown(row: dict) -> list[str]:
    """The row's Prometheus section: the summary line, the views' counts and the table."""
    w = row.get("prometheus")
    if not w:
        return []
    s = summarize_prometheus(w)
    lines = [f"### N={row['n']}: Prometheus {w.get('version') or ''}".rstrip(), ""]
    if w.get("error"):
        lines += [f"- error: {w['error']}", ""]
    lines += [
        f"- **{s['line']}** (verdicts: "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["by_verdict"].items()))
        + f"); queried at the slowest peer's round {w.get('at_round')}, "
        f"{_f(w.get('scraping_s'), 0)} s after every target was up, scrape interval "
        f"{w.get('scrape_interval_s')} s, {w.get('targets_up')} of {w.get('targets')} "
        f"targets up",
    ]
    page, boot = w.get("run_page") or {}, w.get("status_bootstrap") or {}
    if page:
        lines.append(
            f"- run page: GET /run {page.get('html_status')} ({page.get('html_bytes')} bytes); "
            f"/run.json lists {page.get('peers')} of {w.get('n')} peers "
            f"(states {page.get('states')}), run-wide {page.get('peers_alive')} alive of "
            f"{page.get('peers_known')} known at round {page.get('round')}"
        )
    if boot:
        lines.append(
            f"- `seedflood status` (bootstrap): peers alive {boot.get('peers_alive')}, "
            f"run-wide {boot.get('run_alive')} alive of {boot.get('run_known')} in the ledger"
        )
    peers = w.get("status_peers") or {}
    if peers:
        listed = [v.get("peer_rounds") for v in peers.values()]
        lines.append(
            f"- `seedflood status` on each peer: {sum(v.get('rc') == 0 for v in peers.values())}"
            f" of {w.get('n')} answered; each lists {sorted(set(listed), key=str)} other "
            f"peers on its `peer rounds` line (of {(w.get('n') or 1) - 1})"
        )
    return [*lines, "", *prometheus_table(w), ""]


# --------------------------------------------------------------------------------------
# The run: real processes
# --------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float | None:
    """utime + stime of PID (s); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class LogEvents:
    """A daemon's `round` events and whether it logged `ready`, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.rounds: list[tuple[int, float, float]] = []
        self.ready = False

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = []
        for line in complete.splitlines():
            if b'"event": "round"' in line or b'"event": "ready"' in line:
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        self.ready = self.ready or any(r.get("event") == "ready" for r in records)
        have = {r for r, _, _ in self.rounds}
        self.rounds += [e for e in round_events(records) if e[0] not in have]

    @property
    def last(self) -> int:
        return self.rounds[-1][0] if self.rounds else -1


class LedgerPoll:
    """When a peer's ledger first holds all n rows of each round (read-only SQLite)."""

    def __init__(self, path: Path, n: int, rounds: int) -> None:
        self.path, self.n, self.rounds = path, n, rounds
        self.held: dict[int, float] = {}
        self.db: sqlite3.Connection | None = None

    def poll(self, now: float) -> None:
        lo = next((r for r in range(self.rounds) if r not in self.held), None)
        if lo is None:
            return
        try:
            if self.db is None:
                if not self.path.exists():
                    return
                self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=0.2)
            counts = self.db.execute(
                "SELECT round, COUNT(*) FROM messages WHERE round >= ? AND round < ? "
                "GROUP BY round",
                (lo, self.rounds),
            ).fetchall()
        except sqlite3.Error:
            self.close()
            return
        for r, c in counts:
            if c >= self.n and r not in self.held:
                self.held[r] = now

    def close(self) -> None:
        if self.db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
            self.db = None


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class PromWatch:
    """A real Prometheus (the `prometheus` binary: Debian's package) scraping every daemon's
    /metrics on 127.0.0.1, its own config and a temporary TSDB under WORK/prometheus; then
    the operator's views checked once: the Grafana dashboard's queries, the bootstrap
    node's run page and `seedflood status`."""

    def __init__(self, work: Path, names: list[str], scrape_interval: float) -> None:
        import shutil
        import subprocess

        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("--prometheus: no `prometheus` binary (apt-get install prometheus)")
        self.dir = work / "prometheus"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.work, self.names, self.scrape_interval = work, names, scrape_interval
        self.targets_file = self.dir / "targets.json"
        self.targets_file.write_text("[]")
        self.ports: dict[str, int] = {}
        self.all_up_since: float | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.dir / "prometheus.yml").write_text(
            prometheus_config(self.targets_file, scrape_interval)
        )
        version = subprocess.run([binary, "--version"], capture_output=True, text=True)
        self.version = (version.stdout or version.stderr).splitlines()[0].strip()
        self.log = open(self.dir / "prometheus.log", "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        import urllib.parse

        status, body = http_get(f"{self.url}{path}?{urllib.parse.urlencode(params)}")
        doc = json.loads(body)
        if status != 200 or doc.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {status} {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("/api/v1/query", query=expr)
        if data.get("resultType") != "vector":
            raise RuntimeError(f"{expr}: a {data.get('resultType')}, not a vector")
        return data["result"]

    def tick(self, now: float) -> None:
        """New status_port files -> the targets file; when every target is first up."""
        found = False
        for name in self.names:
            if name not in self.ports:
                with contextlib.suppress(OSError, ValueError):
                    self.ports[name] = int((self.work / name / "status_port").read_text())
                    found = True
        if found:
            tmp = self.targets_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(file_sd_targets(self.ports), indent=1))
            tmp.replace(self.targets_file)
        if self.all_up_since is None and len(self.ports) == len(self.names):
            with contextlib.suppress(Exception):
                up = self.query('up{job="seedflood"}')
                if len(up) == len(self.names) and all(s["value"][1] == "1" for s in up):
                    self.all_up_since = now

    def instances(self) -> dict[str, str]:
        return {f"127.0.0.1:{port}": name for name, port in self.ports.items()}

    def check(self, n: int, at_round: int, scraping_s: float) -> dict:
        """Every dashboard query (and per daemon), the run page, `seedflood status`."""
        import subprocess

        inst = self.instances()
        peers = {i: name for i, name in inst.items() if name != "bootstrap"}
        up = self.query('up{job="seedflood"}')
        watch: dict[str, Any] = {
            "n": n,
            "version": self.version,
            "at_round": at_round,
            "scraping_s": round(scraping_s, 1),
            "scrape_interval_s": self.scrape_interval,
            "targets": len(inst),
            "targets_up": sum(s["value"][1] == "1" for s in up),
            "config": (self.dir / "prometheus.yml").read_text(),
        }
        families: dict[str, str] = {}
        for port in self.ports.values():  # what the daemons declare (TYPE lines)
            with contextlib.suppress(Exception):
                families.update(
                    exposed_families(http_get(f"http://127.0.0.1:{port}/metrics")[1].decode())
                )
        with_samples = {
            s["metric"]["__name__"]
            for s in self.query('count by (__name__) ({job="seedflood",__name__=~".+"})')
        }
        watch["families"] = len(families)
        checks = []
        for q in dashboard_queries(json.loads(DASHBOARD.read_text())):
            try:
                c = query_coverage(
                    q, self.query(q["query"]), self.query(per_daemon(q["query"])), peers
                )
                c["verdict"] = classify(c, families, with_samples, n)
            except Exception as exc:
                c = {**q, "verdict": f"error: {exc}"}
            checks.append(c)
        watch["queries"] = checks
        boot_port = self.ports.get("bootstrap")
        if boot_port is not None:
            page = f"http://127.0.0.1:{boot_port}"
            with contextlib.suppress(Exception):
                status, body = http_get(f"{page}/run")
                watch["run_page"] = {"html_status": status, "html_bytes": len(body)}
                status, body = http_get(f"{page}/run.json")
                watch["run_page"].update(json_status=status, **run_page_counts(json.loads(body)))
        statuses: dict[str, dict] = {}
        for name, port in sorted(self.ports.items()):
            cmd = [sys.executable, "-m", "seedflood", "status", f"127.0.0.1:{port}"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                statuses[name] = {"rc": done.returncode, **status_counts(done.stdout)}
                if name == "bootstrap":
                    statuses[name]["screen"] = done.stdout
            except subprocess.TimeoutExpired:
                statuses[name] = {"rc": None, "error": "timeout"}
        watch["status_bootstrap"] = statuses.pop("bootstrap", None)
        watch["status_peers"] = statuses
        watch["up_after"] = sum(s["value"][1] == "1" for s in self.query('up{job="seedflood"}'))
        watch["summary"] = summarize_prometheus(watch)
        return watch

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.log.close()


class Stop(Exception):
    """SIGTERM to the bench: leave as Ctrl-C does, through the cleanup."""


def daemon_env(threads: int) -> dict[str, str]:
    """A daemon's environment, as apps/localnet.NodeProcess gives it."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def forked_node(server: Any, name: str, args: list[str], workdir: Path, threads: int) -> Any:
    """A NodeProcess whose process is forked by the fork server (harness/fork_server.py):
    the same log file (appended), environment and command line, `proc` a ForkedProc."""
    from seedflood_p2p.apps.localnet import NodeProcess

    node = NodeProcess.__new__(NodeProcess)
    node.name, node.args = name, args
    node.log_path = workdir / f"{name}.log"
    node._log = open(node.log_path, "ab")  # noqa: SIM115 - closed in stop(), as NodeProcess's
    node._offset, node._events = 0, []
    node.proc = server.spawn(args, daemon_env(threads), node.log_path)
    return node


def mem_of(pid: int) -> dict[str, int] | None:
    """Rss, Pss and USS (kB) of PID from /proc/PID/smaps_rollup; None if unreadable."""
    from harness.fork_server import smaps_rollup

    try:
        return smaps_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except OSError:
        return None


def meminfo_mib() -> tuple[float, float] | None:
    """(MemTotal, MemAvailable) in MiB."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(fields["MemTotal"].split()[0]) / 1024, int(
            fields["MemAvailable"].split()[0]
        ) / 1024
    except (OSError, KeyError, ValueError):
        return None


class Swarm:
    """One row: start the bootstrap node and N peers, follow them, collect, stop."""

    def __init__(self, args: argparse.Namespace, n: int, work: Path) -> None:
        self.args, self.n, self.work = args, n, work
        self.procs: list[Any] = []  # every NodeProcess started, for the cleanup
        self.peers: dict[str, Any] = {}
        self.logs: dict[str, LogEvents] = {}
        self.ledgers: dict[str, LedgerPoll] = {}
        self.p2pd_seen: set[int] = set()
        self.samples: list[dict] = []
        self.net = None
        self.watch: PromWatch | None = None  # --prometheus
        self.checking: Any = None  # its check's thread, then its answer
        self.checked: dict = {}
        self.server: Any = None  # --fork-server: the zygote (fork_server.ForkServer)
        self.fork_info: dict | None = None
        self.meminfo: list[tuple[float, float, float]] = []
        self.next_pss = 0.0  # PSS/USS (smaps_rollup: ~10-16 ms a daemon) every --pss-every s
        self.t0 = time.monotonic()
        if args.netns:
            from harness.partition import NamespaceNet

            self.net = NamespaceNet(f"sfsw{os.getpid() % 100000}", SUBNET)
            self.hosts = min(n + 1, MAX_HOSTS)

    @property
    def network(self) -> str:
        return network_label(self.args, self.n)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- processes ----------------------------------------------------------------------
    def host_prefix(self, host: int) -> tuple[str, ...]:
        """Run a command in namespaced host `host`: `exec` ends in `ip netns exec`, which
        execs python, so the PID is the daemon's (harness/partition.py)."""
        return (str(self.net.script), "--prefix", self.net.prefix, "exec", f"h{host}")

    def peer_args(self, name: str, address: str, host: int | None) -> list[str]:
        a = self.args
        listen = f"/ip4/{SUBNET}.{host}/tcp/0" if host else "/ip4/127.0.0.1/tcp/0"
        return [
            "peer",
            *("--bootstrap", address, "--listen", listen),
            *("--data-dir", str(self.work / name), "--threads", str(a.threads)),
            *("--until-round", str(a.rounds), "--round-interval", str(a.round_interval)),
            *("--min-peers", str(self.n), "--startup-wait", str(a.startup_timeout)),
            *("--round-deadline", str(a.round_deadline), "--metrics-port", "0"),
            *("--summary-interval", f"{a.summary_interval:g}"),
            *(
                ("--daemon-start-timeout", f"{a.daemon_start_timeout:g}")
                if a.daemon_start_timeout
                else ()
            ),
        ]

    def start(self) -> None:
        from harness.cluster import RUN
        from seedflood_p2p.apps.localnet import NodeProcess
        from seedflood_p2p.core.flags import to_toml

        run_file = self.work / "run.toml"
        run_file.write_text(to_toml(RUN))
        metrics = ()
        if self.args.prometheus:  # the run page and /metrics of the bootstrap node too
            metrics = ("--metrics-port", "0")
            names = ["bootstrap", *(f"peer{i}" for i in range(self.n))]
            self.watch = PromWatch(self.work, names, self.args.scrape_interval)
            self.progress(f"prometheus {self.watch.version} on {self.watch.url}")
        listen, prefix = "/ip4/127.0.0.1/tcp/0", ()
        if self.net is not None:
            delay = ["--delay", f"{self.args.delay_ms:g}ms"] if self.args.delay_ms else []
            loss = ["--loss", f"{self.args.loss:g}%"] if self.args.loss else []
            up = self.net.net("--hosts", str(self.hosts), *delay, *loss, "up", timeout=600)
            print(up.stderr.strip(), flush=True)
            listen = f"/ip4/{SUBNET}.1/tcp/{BOOT_PORT}"
            prefix = self.host_prefix(1)
        boot = NodeProcess(
            "bootstrap",
            [
                "bootstrap",
                *("--config", str(run_file), "--listen", listen),
                *("--data-dir", str(self.work / "bootstrap")),
                *("--summary-interval", f"{self.args.summary_interval:g}"),
                *metrics,
            ],
            self.work,
            prefix=prefix,
        )
        self.procs.append(boot)  # before anything can fail: close() stops it
        if self.args.fork_server:  # imports while the bootstrap node starts
            from harness.fork_server import ForkServer

            self.server = ForkServer(self.work / "fork-server.log", daemon_env(self.args.threads))
            self.fork_info = dict(self.server.info)
            self.progress(
                f"fork server pid={self.server.pid} ready in {self.fork_info['ready_s']} s "
                f"(imports {self.fork_info['import_s']} s, {self.fork_info['modules']} modules, "
                f"{self.fork_info['threads']} thread)"
            )
        address_file = self.work / "bootstrap" / "address.txt"
        deadline = time.monotonic() + 600
        # The file can exist before its text is written (apps/localnet.py): wait for it.
        while not (address_file.exists() and address_file.read_text().split()):
            if not boot.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap node did not start:\n{boot.tail()}")
            time.sleep(0.2)
        address = address_file.read_text().split()[0]
        self.boot = boot
        self.progress(f"bootstrap up pid={boot.proc.pid} address={address}")
        spawn_t = time.monotonic()
        for i in range(self.n):
            if i and self.args.spawn_gap:  # a herd of p2pd starts can miss their timeout
                time.sleep(self.args.spawn_gap)
            name = f"peer{i}"
            host = 2 + i % (self.hosts - 1) if self.net is not None else None
            args = self.peer_args(name, address, host)
            prefix = self.host_prefix(host) if host is not None else ()
            if self.server is not None:
                proc = forked_node(self.server, name, args, self.work, self.args.threads)
            else:
                proc = NodeProcess(name, args, self.work, self.args.threads, prefix=prefix)
            self.procs.append(proc)
            self.peers[name] = proc
            self.logs[name] = LogEvents(proc.log_path)
            self.ledgers[name] = LedgerPoll(
                self.work / name / "ledger.sqlite", self.n, self.args.rounds
            )
        if self.fork_info is not None:
            self.fork_info.update(forked=self.n, spawn_s=round(time.monotonic() - spawn_t, 2))

    # -- sampling -----------------------------------------------------------------------
    def sample(self) -> None:
        from bench_soak import p2pd_of, proc_stats

        t = round(self.elapsed(), 2)
        with_pss = bool(self.args.pss_every) and t >= self.next_pss
        if with_pss:
            self.next_pss = t + self.args.pss_every
        mem = meminfo_mib()
        if mem is not None:
            self.meminfo.append((t, *mem))
        pairs = [("bootstrap", "bootstrap", self.boot, None)]
        pairs += [(n, "peer", p, self.logs[n]) for n, p in self.peers.items()]
        if self.server is not None:
            pairs.append(("zygote", "zygote", self.server, None))
        for name, kind, proc, log in pairs:
            if not proc.alive:
                continue
            pid = proc.pid if kind == "zygote" else proc.proc.pid
            if log is not None:
                rnd = log.last
            else:  # the bootstrap node: the median peer's round
                rnd = int(_median(lg.last for lg in self.logs.values()) or -1)
            p2pds = [] if kind == "zygote" else p2pd_of(pid)
            for p, k, nm in [(pid, kind, name)] + [
                (c, f"p2pd ({kind})", f"{name}/p2pd") for c in p2pds
            ]:
                if k.startswith("p2pd"):
                    self.p2pd_seen.add(p)
                stats, cpu = proc_stats(p), cpu_seconds(p)
                if stats is None or cpu is None:
                    continue
                rollup = (mem_of(p) if with_pss else None) or {}
                self.samples.append(
                    {
                        "t": t,
                        "name": nm,
                        "kind": k,
                        "pid": p,
                        "round": rnd,
                        "rss_kb": stats["rss_kb"],
                        "pss_kb": rollup.get("pss_kb"),
                        "uss_kb": rollup.get("uss_kb"),
                        "cpu_s": cpu,
                    }
                )
        floor = self.args.min_available_mib
        if floor and mem is not None and mem[1] < floor:
            raise MemoryError(
                f"MemAvailable {mem[1]:.0f} MiB < --min-available-mib {floor:.0f}: row aborted "
                f"at {t:.0f} s (every daemon is stopped)"
            )

    def progress(self, what: str = "") -> None:
        rounds = [lg.last for lg in self.logs.values()]
        alive = sum(p.alive for p in self.peers.values())
        held = [len(lp.held) for lp in self.ledgers.values()]
        ready = sum(lg.ready for lg in self.logs.values())
        avail = f" avail={self.meminfo[-1][2]:.0f}MiB" if self.meminfo else ""
        print(
            f"[swarm] N={self.n} elapsed={self.elapsed():.1f}s "
            f"slowest={min(rounds, default=-1)} fastest={max(rounds, default=-1)} "
            f"of={self.args.rounds} alive={alive}/{self.n} ready={ready} "
            f"ledger_rounds_complete_min={min(held, default=0)} "
            f"load={os.getloadavg()[0]:.2f}{avail}" + (f" {what}" if what else ""),
            flush=True,
        )

    # -- the run ------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        obs: dict[str, Any] = {
            "n": self.n,
            "rounds": a.rounds,
            "interval": a.round_interval,
            "threads": a.threads,
            "poll_s": a.poll,
            "network": self.network,
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "load_start": list(os.getloadavg()),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "launch": "fork-server" if a.fork_server else "subprocess",
            "error": None,
        }
        startup_s = training_s = None
        try:
            self.start()
            next_sample = next_progress = next_poll = 0.0
            deadline = self.elapsed() + a.startup_timeout + a.rounds * (a.round_deadline + 5)
            training_t = None
            while True:
                now = self.elapsed()
                for lg in self.logs.values():
                    lg.read()
                if training_t is None and all(lg.last >= 0 for lg in self.logs.values()):
                    training_t = now
                    startup_s = now
                    self.progress("training: every peer past round 0")
                if now >= next_poll:
                    wall = time.time()
                    for lp in self.ledgers.values():
                        lp.poll(wall)
                    next_poll = now + a.poll
                if now >= next_sample:
                    self.sample()
                    next_sample = now + a.sample_every
                if now >= next_progress:
                    self.progress()
                    next_progress = now + a.progress
                if self.watch is not None and "prometheus" not in obs:
                    self.watch_tick(now, obs)
                if not any(p.alive for p in self.peers.values()):
                    break
                if training_t is None and any(not p.alive for p in self.peers.values()):
                    dead = [n for n, p in self.peers.items() if not p.alive]
                    raise RuntimeError(
                        f"peer(s) {dead} exited before training:\n{self.peers[dead[0]].tail(15)}"
                    )
                if not self.boot.alive:
                    raise RuntimeError(f"the bootstrap node exited:\n{self.boot.tail(15)}")
                if now > deadline:
                    raise TimeoutError(f"the row did not finish in {deadline:.0f} s")
                time.sleep(min(0.25, a.poll / 2))
            if training_t is not None:
                training_s = self.elapsed() - training_t
            if self.watch is not None and "prometheus" not in obs:
                self.watch_done(obs, wait=120)
            wall = time.time()
            for lp in self.ledgers.values():  # the last rows (a peer's ledger is closed now)
                lp.poll(wall)
        except (KeyboardInterrupt, Stop) as exc:
            obs["error"] = f"interrupted ({type(exc).__name__})"
            obs["interrupted"] = True
        except Exception as exc:
            obs["error"] = repr(exc)[:2000]
            print(f"[swarm] N={self.n} error: {exc}", flush=True)
        finally:
            obs.update(self.collect())
            obs["startup_s"], obs["training_s"] = startup_s, training_s
            obs["load_end"] = list(os.getloadavg())
            obs["wall_s"] = self.elapsed()
            obs["fork_server"] = self.fork_info
            obs["memory"] = memory_summary(self.meminfo)
        return obs

    def watch_tick(self, now: float, obs: dict) -> None:
        """--prometheus: keep its targets current; once the slowest peer reached
        --prometheus-at and every target was up for --prometheus-min-scrape s, check once,
        in a thread (the loop keeps polling ledgers meanwhile); its answer into obs."""
        import threading

        w, a = self.watch, self.args
        if self.checking is not None:
            if not self.checking.is_alive():
                self.watch_done(obs)
            return
        w.tick(now)
        slowest = min((lg.last for lg in self.logs.values()), default=-1)
        at = a.prometheus_at if a.prometheus_at is not None else a.rounds // 2
        if w.all_up_since is None or slowest < at or now - w.all_up_since < a.prometheus_min_scrape:
            return
        self.progress(f"prometheus: querying the dashboard at round {slowest}")

        def check() -> None:
            try:
                self.checked = w.check(self.n, slowest, now - w.all_up_since)
            except Exception as exc:
                self.checked = {"n": self.n, "error": repr(exc)[:2000]}
            self.checked["check_s"] = round(self.elapsed() - now, 1)

        self.checking = threading.Thread(target=check, name="prometheus-check", daemon=True)
        self.checking.start()

    def watch_done(self, obs: dict, wait: float = 0.0) -> None:
        if self.checking is None:
            obs["prometheus"] = {
                "n": self.n,
                "error": "the peers finished before the check (lower --prometheus-at)",
            }
            return
        self.checking.join(wait)
        if self.checking.is_alive():
            obs["prometheus"] = {"n": self.n, "error": f"the check took over {wait:.0f} s"}
            return
        obs["prometheus"] = self.checked
        summary = self.checked.get("summary") or {}
        self.progress(
            f"{summary.get('line', 'prometheus: failed')} (checked in "
            f"{self.checked.get('check_s')} s)"
        )

    def collect(self) -> dict:
        """Final statuses, exit codes, the bootstrap node's digest; every process stopped."""
        finals: dict[str, dict | None] = {}
        codes: dict[str, int | None] = {}
        for name, proc in self.peers.items():
            codes[name] = proc.proc.poll()
            path = self.work / name / "final_status.json"
            finals[name] = None
            if codes[name] == 0 and path.exists():
                with contextlib.suppress(ValueError):
                    full = json.loads(path.read_text())
                    finals[name] = {
                        k: full.get(k)
                        for k in ("round", "ledger_messages", "accepted", "ledger_digest")
                    }
        boot_digest = None
        known = [f["ledger_digest"] for f in finals.values() if f and f.get("ledger_digest")]
        boot = getattr(self, "boot", None)
        with contextlib.suppress(Exception):
            from harness.open_run import wait_ledger_digest
            from harness.partition import ledger_prefix

            boot_ledger = self.work / "bootstrap" / "ledger.sqlite"
            if known and boot is not None and boot.alive:
                wait_ledger_digest(boot_ledger, statistics.mode(known), timeout=30)
            held = ledger_prefix(boot_ledger, 2**62)
            boot_digest = held[1] if held else None
        for lp in self.ledgers.values():
            lp.close()
        return {
            "events": {n: lg.rounds for n, lg in self.logs.items()},
            "held": {n: lp.held for n, lp in self.ledgers.items()},
            "finals": finals,
            "boot_digest": boot_digest,
            "samples": self.samples,
            "exit_codes": codes,
        }

    def close(self) -> None:
        """Stop everything started here, by PID: SIGTERM to all, SIGKILL stragglers and
        any p2pd child seen still running; then the namespaces."""
        from bench_soak import comm, p2pd_of

        if self.watch is not None:
            with contextlib.suppress(Exception):
                self.watch.close()
        for p in self.procs:
            if p.alive:
                self.p2pd_seen.update(p2pd_of(p.proc.pid))
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.stop(max(1.0, deadline - time.monotonic()))
        if self.server is not None:  # its children are gone: it exits
            with contextlib.suppress(Exception):
                self.server.close()
        time.sleep(0.5)
        for pid in self.p2pd_seen:
            if comm(pid) == "p2pd":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.net is not None:
            down = self.net.net("--kill", "down", check=False, timeout=600)
            if down.returncode != 0:
                print(f"[swarm] namespaces down failed: {down.stderr.strip()}", flush=True)


def mem_available_mib() -> float | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(
            x for x in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in x
        )
        return int(line.split()[1]) / 1024
    return None


def mib_per_peer(rows: list[dict], default: float = DEFAULT_MIB_PER_PEER) -> float:
    """A peer daemon and its p2pd, in MiB: the largest finished row's medians, else default.
    Only rows of the normal launch (a forked daemon's RSS counts the pages it shares)."""
    done = [
        r
        for r in rows
        if r.get("complete")
        and r["peer"]["rss_mib_median"]
        and (r.get("launch") or "subprocess") == "subprocess"
    ]
    if not done:
        return default
    big = max(done, key=lambda r: r["n"])
    return big["peer"]["rss_mib_max"] + (big["p2pd"]["rss_mib_max"] or 0)


def fork_mib_per_peer(rows: list[dict], default: float = DEFAULT_FORK_MIB_PER_PEER) -> float:
    """--fork-server: a forked peer and its p2pd, in MiB of PSS (what each adds, its share
    of the zygote's pages included): the largest finished fork-server row's, else default."""
    done = [
        r
        for r in rows
        if r.get("complete") and r.get("launch") == "fork-server" and r["peer"].get("pss_mib_max")
    ]
    if not done:
        return default
    big = max(done, key=lambda r: r["n"])
    return big["peer"]["pss_mib_max"] + (big["p2pd"].get("pss_mib_max") or 0)


def link_emulation() -> tuple[bool, bool]:
    """(netem, loss) this kernel can apply (deploy/netns-testnet.sh check): without netem
    there is no delay, and --loss is applied by nftables where it can be."""
    from harness.partition import NamespaceNet

    net = NamespaceNet(f"sfswc{os.getpid() % 100000}", SUBNET)
    return net.has_netem(), net.has_loss()


def network_label(args: argparse.Namespace, n: int) -> str:
    if not args.netns:
        return LOOPBACK
    hosts = min(n + 1, MAX_HOSTS)
    if not args.netem and args.loss and args.nft_loss:
        return (
            f"netns: {hosts} hosts on one bridge, NO netem (kernel lacks it: no delay), "
            f"loss {args.loss:g}% on arrival at every host (nftables)"
        )
    if not args.netem:
        return f"netns: {hosts} hosts on one bridge, NO netem (kernel lacks it: no delay/loss)"
    return (
        f"netns: {hosts} hosts on one bridge, netem delay {args.delay_ms:g} ms "
        f"loss {args.loss:g}% per host egress"
    )


def parse_peers(text: str) -> list[int]:
    ns = [int(x) for x in text.replace(" ", "").split(",") if x]
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError("--peers: a comma-separated list of counts >= 1")
    return ns


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=parse_peers, default=[8, 16, 32], help="e.g. 8,16,32")
    parser.add_argument("--rounds", type=int, default=30, help="--until-round of every peer")
    parser.add_argument("--round-interval", type=float, default=0.5, help="s, a round's floor")
    parser.add_argument("--round-deadline", type=float, default=10.0, help="s (peer flag)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    parser.add_argument("--netns", action="store_true", help="network namespaces (root)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="netem one-way, --netns")
    parser.add_argument("--loss", type=float, default=0.0, help="loss %%, --netns")
    parser.add_argument(
        "--out", default="swarm", help="bench/results/OUT.json and .md (with a /: that path)"
    )
    parser.add_argument("--work", default="", help="data dirs and logs (default: tmp dir)")
    parser.add_argument("--poll", type=float, default=0.5, help="s between ledger polls")
    parser.add_argument("--sample-every", type=float, default=2.0, help="s between /proc reads")
    parser.add_argument("--progress", type=float, default=5.0, help="s between progress lines")
    parser.add_argument(
        "--pss-every",
        type=float,
        default=10.0,
        help="s between PSS/USS reads (smaps_rollup, ~10-16 ms a daemon; 0: never)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=1200.0, help="s for all N to reach round 0"
    )
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="a real Prometheus scrapes every daemon; check the Grafana dashboard's queries, "
        "the run page and `seedflood status` once while training (loopback only)",
    )
    parser.add_argument(
        "--prometheus-at", type=int, default=None, help="the check's round (default ROUNDS/2)"
    )
    parser.add_argument(
        "--prometheus-min-scrape", type=float, default=15.0, help="s every target was up before"
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=SCRAPE_INTERVAL_S, help="s, --prometheus"
    )
    parser.add_argument(
        "--fork-server",
        action="store_true",
        help="fork the peer daemons from one zygote that imported torch/transformers/hivemind "
        "once (harness/fork_server.py) instead of one `python -m seedflood peer` each",
    )
    parser.add_argument(
        "--summary-interval",
        type=float,
        default=2.0,
        help="s, every daemon's --summary-interval (each summary is flooded to all N)",
    )
    parser.add_argument(
        "--spawn-gap",
        type=float,
        default=0.0,
        help="s between starting one peer daemon and the next (0: all at once)",
    )
    parser.add_argument(
        "--daemon-start-timeout",
        type=float,
        default=0.0,
        help="the peers' --daemon-start-timeout (s for p2pd to start; 0: the daemon's default)",
    )
    parser.add_argument(
        "--min-available-mib",
        type=float,
        default=0.0,
        help="abort the row (stop every daemon) once MemAvailable drops below this (0: never)",
    )
    parser.add_argument("--summarize", action="store_true", help="only redo .md/.png")
    parser.add_argument(
        "--force", action="store_true", help="start a row even if N daemons may not fit in RAM"
    )
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if "/" in args.out else RESULTS / args.out  # a path: elsewhere
    doc = load_doc(out.with_suffix(".json"))
    if args.summarize:
        doc["rows"] = [resummarize(r) for r in doc["rows"]]
        save_doc(doc, out)
        print(markdown(doc))
        return
    if args.prometheus and args.netns:
        parser.error("--prometheus: loopback only (each namespace's /metrics is its own)")
    if args.fork_server and args.netns:
        parser.error("--fork-server: loopback only (a forked daemon cannot enter a namespace)")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root (network namespaces)")
    if max(args.peers) + 1 > MAX_HOSTS and args.netns:
        print(f"[swarm] more daemons than {MAX_HOSTS} hosts: peers share hosts", flush=True)

    args.netem, args.nft_loss = link_emulation() if args.netns else (False, False)
    if args.netns and not args.netem and args.delay_ms:
        print("[swarm] WARNING: no netem in this kernel: --delay-ms NOT applied", flush=True)
    if args.netns and not args.netem and args.loss and not args.nft_loss:
        print("[swarm] WARNING: neither netem nor nftables: --loss NOT applied", flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise Stop()

    signal.signal(signal.SIGTERM, on_term)
    invocation = {
        "command": shlex.join(["python", *(sys.argv if argv is None else ["bench_swarm", *argv])]),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "load_end": None,
    }
    doc["invocations"].append(invocation)
    base_work = Path(args.work or tempfile.mkdtemp(prefix="sf-swarm-"))
    try:
        for n in args.peers:
            network = network_label(args, n)
            key = row_key(n, args.rounds, args.round_interval, network, args.threads)
            key += " prometheus" if args.prometheus else ""
            key += " fork-server" if args.fork_server else ""
            if any(r.get("key") == key and r.get("complete") for r in doc["rows"]):
                print(f"[swarm] N={n}: already in {out.with_suffix('.json')}, skipped", flush=True)
                continue
            if args.fork_server:
                need = FORK_ZYGOTE_MIB + n * fork_mib_per_peer(doc["rows"])
            else:
                need = n * mib_per_peer(doc["rows"])
            free = mem_available_mib()
            if free is not None and need > MEM_SHARE * free and not args.force:
                note = (
                    f"N={n} skipped: {n} daemons need ~{need / 1024:.1f} GiB, more than "
                    f"{MEM_SHARE:.0%} of the {free / 1024:.1f} GiB available (--force to try)"
                )
                print(f"[swarm] {note}", flush=True)
                doc.setdefault("skipped", []).append(note)
                continue
            base_work.mkdir(parents=True, exist_ok=True)  # fresh data dirs, even in a reused --work
            work = Path(tempfile.mkdtemp(prefix=f"n{n}-", dir=base_work))
            swarm = Swarm(args, n, work)
            print(f"[swarm] N={n}: {swarm.network}; work dir {work}", flush=True)
            try:
                obs = swarm.run()
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):  # a second one must not skip this
                    signal.signal(sig, signal.SIG_IGN)
                swarm.close()
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, on_term)
            obs["key"] = key
            row = summarize_row(obs)
            doc["rows"] = [r for r in doc["rows"] if r.get("key") != key] + [row]
            invocation["load_end"] = [round(x, 2) for x in os.getloadavg()]
            save_doc(doc, out)
            print("\n".join(table([row])), flush=True)
            if row.get("prometheus"):
                print("\n".join(prometheus_markdown(row)), flush=True)
                print(summarize_prometheus(row["prometheus"])["line"], flush=True)
            if obs.get("interrupted"):
                break
    finally:
        invocation["load_end"] = [round(x, 2) for x in os.getloadavg()]
        save_doc(doc, out)
        print(f"[swarm] wrote {out.with_suffix('.json')} and .md; logs in {base_work}", flush=True)


if __name__ == "__main__":
    main()
