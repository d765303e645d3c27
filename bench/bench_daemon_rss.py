#!/usr/bin/env python
"""Memory of one tiny-model `seedflood peer` daemon: where its RSS goes, and what cuts it.

    python bench/bench_daemon_rss.py [--variants default,arena2,...] [--seconds 30]
        [--round-interval 0.5] [--threads 1] [--work DIR] [--out daemon-rss] [--no-breakdown]
    taskset -c 0 python bench/bench_daemon_rss.py      # as run for bench/results/daemon-rss.*

Issue 46, item 3 (goal: at most 200 MB RSS per tiny-model daemon; bench_swarm.py measured
about 456 MiB). Two parts:

1. Breakdown (unless --no-breakdown): a fresh python process imports what the peer daemon
   imports, step by step (numpy, torch, transformers and the Llama modules, hivemind,
   the rest of peer.command), then loads the tiny model and tokenizer as the daemon does
   (workload.models.load_model), printing VmRSS (anonymous and file-backed), PSS and USS
   (Private_Clean + Private_Dirty, /proc/self/smaps_rollup) after each step.
2. Variants: per variant, a bootstrap node of the tests' tiny run (harness.cluster.RUN:
   tiny-llama on synthetic-sentiment) and 2 peers on 127.0.0.1 (--min-peers 2, 0.5 s rounds,
   --threads 1 and OMP_NUM_THREADS=1 as the tests start them, apps/localnet.py); once both
   peers train, each peer's python process (not its p2pd child) is sampled every second
   for --seconds: VmRSS, RssAnon, RssFile, PSS, USS and its thread count. A variant is an
   environment (e.g. MALLOC_ARENA_MAX=2) and/or a sitecustomize.py put first on the
   daemons' PYTHONPATH (e.g. a thread that calls glibc's malloc_trim), applied to the
   bootstrap node and both peers. At the end, peer0's largest mappings (/proc/PID/smaps).

PSS divides shared pages among the processes mapping them (the 3 daemons here, and any
other process of this machine with the same libraries mapped, e.g. another torch run), so
it depends on what else runs; USS (private pages) does not.

Writes bench/results/OUT.json and OUT.md. Every process started here is stopped by PID.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# sitecustomize.py bodies (run by every daemon of the variant before its own code).
_TRIM_THREAD = """
import ctypes, threading, time
_libc = ctypes.CDLL("libc.so.6")
def _trim():
    while True:
        time.sleep({every})
        _libc.malloc_trim(0)
threading.Thread(target=_trim, daemon=True, name="malloc-trim").start()
"""
# The daemons defer scipy.optimize (apps/lean_imports.py); this loads it first, as before.
_EAGER_SCIPY = """
import scipy.optimize
"""

# name -> (what it is, environment, sitecustomize body or "")
VARIANTS: dict[str, tuple[str, dict[str, str], str]] = {
    "default": ("as the code is (tests' launch: OMP_NUM_THREADS=1, --threads 1)", {}, ""),
    "arena2": ("MALLOC_ARENA_MAX=2", {"MALLOC_ARENA_MAX": "2"}, ""),
    "arena1": ("MALLOC_ARENA_MAX=1", {"MALLOC_ARENA_MAX": "1"}, ""),
    "trim-threshold": (
        "MALLOC_TRIM_THRESHOLD_=131072 (fixed: glibc returns free heap tops above 128 KiB)",
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        "",
    ),
    "malloc-trim": ("a thread calling malloc_trim(0) every 5 s", {}, _TRIM_THREAD.format(every=5)),
    "eager-scipy": (
        "scipy.optimize imported at start (sitecustomize): the daemons before lean_imports.py",
        {},
        _EAGER_SCIPY,
    ),
    "threads2": ("--threads 2 (OMP_NUM_THREADS=2): a second intra-op thread", {}, ""),
}

# In the order that attributes each library's own cost (what it pulls and nothing loaded
# before counts again); each a statement run in one fresh process.
BREAKDOWN_STEPS = [
    (
        "scipy.optimize deferred, as the daemons do (imports scipy, numpy)",
        "from seedflood_p2p.apps.lean_imports import defer_scipy_optimize; defer_scipy_optimize()",
    ),
    ("numpy", "import numpy"),
    ("torch", "import torch"),
    ("sympy (torch.fx symbolic shapes; via transformers)", "import sympy"),
    ("torch._dynamo (transformers.masking_utils)", "import torch._dynamo"),
    ("torch.distributed.tensor (transformers sharding_utils)", "import torch.distributed.tensor"),
    ("accelerate + boto3 (transformers, as installed)", "import accelerate.hooks"),
    ("transformers (top level)", "import transformers"),
    ("transformers Llama modules", "import transformers.models.llama.modeling_llama"),
    ("hivemind (as the daemon imports it)", "import seedflood_p2p.network.transport.p2pd"),
    ("rest of peer.command (seedflood, aiohttp, ...)", "import peer.command"),
    (
        "tiny-llama model + tokenizer (load_model)",
        "from seedflood_p2p.workload.models import load_model; m, t = load_model('tiny-llama')",
    ),
    ("gc.collect()", "import gc; gc.collect()"),
    ("malloc_trim(0)", "import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)"),
    (
        "scipy.optimize, loaded for real (what the daemons no longer load)",
        "import sys; sys.modules.pop('scipy.optimize'); import scipy.optimize",
    ),
]


def mem_of(pid: int | str) -> dict[str, float] | None:
    """MiB figures of PID (or "self"): VmRSS, RssAnon, RssFile, Pss, USS, threads."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out: dict[str, float] = {}
    for text in (status, rollup):
        for line in text.splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0])
    if "VmRSS" not in out:
        return None
    return {
        "rss": out["VmRSS"] / 1024,
        "anon": out.get("RssAnon", 0) / 1024,
        "file": out.get("RssFile", 0) / 1024,
        "pss": out.get("Pss", 0) / 1024,
        "uss": (out.get("Private_Clean", 0) + out.get("Private_Dirty", 0)) / 1024,
        "threads": out.get("Threads", 0),
    }


def top_mappings(pid: int, top: int = 12) -> list[dict]:
    """PID's mappings grouped by file name ([heap], [anon], libtorch_cpu.so, ...), by Rss."""
    agg: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    name = "?"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split(None, 5)
                name = parts[5].strip() if len(parts) > 5 else "[anon]"
                name = name.rsplit("/", 1)[-1]
                agg[name]["maps"] += 1
            else:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss", "Anonymous", "Private_Clean", "Private_Dirty"):
                    agg[name][key] += int(value.split()[0])
    rows = [
        {
            "mapping": n,
            "maps": c["maps"],
            "rss": c["Rss"] / 1024,
            "pss": c["Pss"] / 1024,
            "anon": c["Anonymous"] / 1024,
            "uss": (c["Private_Clean"] + c["Private_Dirty"]) / 1024,
        }
        for n, c in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["rss"])[:top]


# -- part 1: the import / load breakdown ------------------------------------------------


def breakdown() -> list[dict]:
    """Run BREAKDOWN_STEPS in a fresh python (cwd ROOT); one row per step."""
    code = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT / "bench")!r})
        from bench_daemon_rss import mem_of
        rows = [dict(step="python interpreter", **mem_of("self"))]
        scope = {{}}  # the steps' own names (they keep the model alive)
        for name, stmt in {BREAKDOWN_STEPS!r}:
            t0 = time.perf_counter()
            exec(stmt, scope)
            rows.append(dict(step=name, s=time.perf_counter() - t0, **mem_of("self")))
        rows.append(dict(step="modules loaded", n=len(sys.modules),
                         transformers=sum(k.startswith("transformers") for k in sys.modules),
                         scipy=sum(k.startswith("scipy") for k in sys.modules), rss=0))
        print(json.dumps(rows))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # as seedflood/cli.py sets it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"the breakdown process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- part 2: real daemons ----------------------------------------------------------------


def run_variant(name: str, args: argparse.Namespace, work: Path) -> dict:
    from harness.cluster import RUN
    from seedflood_p2p.apps.localnet import NodeProcess, start_bootstrap

    what, env_extra, site = VARIANTS[name]
    work.mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    os.environ.update(env_extra)
    pythonpath = [str(ROOT)]
    if site:
        (work / "site").mkdir(exist_ok=True)
        (work / "site" / "sitecustomize.py").write_text(site)
        pythonpath.insert(0, str(work / "site"))
    os.environ["PYTHONPATH"] = os.pathsep.join(pythonpath + [saved.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    threads = 2 if name == "threads2" else args.threads
    procs: list = []
    samples: dict[str, list[dict]] = {"peer0": [], "peer1": [], "bootstrap": []}
    result: dict = {"variant": name, "what": what, "env": env_extra, "threads_flag": threads}
    try:
        boot, address = start_bootstrap(work, RUN, timeout=args.startup_timeout)
        procs.append(boot)
        peers = {}
        for i in range(2):
            peer_args = [
                "peer", "--bootstrap", address, "--listen", "/ip4/127.0.0.1/tcp/0",
                "--data-dir", str(work / f"peer{i}"), "--threads", str(threads),
                "--until-round", "100000", "--round-interval", str(args.round_interval),
                "--min-peers", "2", "--linger", "1",
            ]  # fmt: skip
            p = NodeProcess(f"peer{i}", peer_args, work, threads)  # OMP_NUM_THREADS=threads
            procs.append(p)
            peers[f"peer{i}"] = p
        for p in peers.values():
            p.wait_round(1, timeout=args.startup_timeout)
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            for nm, p in [*peers.items(), ("bootstrap", boot)]:
                m = mem_of(p.proc.pid)
                if m is not None:
                    samples[nm].append({"t": round(time.monotonic() - t0, 1), **m})
            time.sleep(1)
        result["rounds"] = {nm: p.last_round() for nm, p in peers.items()}
        result["top_mappings_peer0"] = top_mappings(peers["peer0"].proc.pid)
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop(timeout=30)
        os.environ.clear()
        os.environ.update(saved)
    result["samples"] = samples
    result["summary"] = summarize(samples)
    return result


def summarize(samples: dict[str, list[dict]]) -> dict:
    """Per process: the last sample and the largest RSS; 'peers': the mean of the peers'."""
    out = {}
    for nm, ss in samples.items():
        if not ss:
            continue
        last = ss[-1]
        out[nm] = {
            **{k: last[k] for k in ("rss", "anon", "file", "pss", "uss", "threads")},
            "rss_max": max(s["rss"] for s in ss),
            "rss_first": ss[0]["rss"],
        }
    peers = [out[n] for n in ("peer0", "peer1") if n in out]
    if peers:
        out["peers"] = {k: statistics.fmean(p[k] for p in peers) for k in peers[0]}
    return out


# -- output --------------------------------------------------------------------------


def _f(x: float | None, d: int = 1) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def markdown(doc: dict) -> str:
    lines = [
        "# Memory of one tiny-model peer daemon",
        "",
        "`bench/bench_daemon_rss.py` (issue 46, item 3; goal <= 200 MB RSS per tiny-model "
        "daemon). MiB throughout.",
        "",
        f"Command: `{doc['command']}` at {doc['started']}; nproc {doc['nproc']}, affinity "
        f"{doc['affinity']}, load {doc['load_start']} -> {doc['load_end']}.",
        "",
    ]
    if doc.get("breakdown"):
        lines += [
            "## Breakdown: one fresh python importing what the daemon imports, then loading "
            "the model",
            "",
            "| step | RSS | +RSS | anon | file-backed | PSS | USS | s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        prev = None
        for r in doc["breakdown"]:
            if r["step"] == "modules loaded":
                continue
            delta = r["rss"] - prev if prev is not None else r["rss"]
            prev = r["rss"]
            lines.append(
                f"| {r['step']} | {_f(r['rss'])} | {_f(delta)} | {_f(r['anon'])} | "
                f"{_f(r['file'])} | {_f(r['pss'])} | {_f(r['uss'])} | {_f(r.get('s'), 2)} |"
            )
        mods = next((r for r in doc["breakdown"] if r["step"] == "modules loaded"), None)
        if mods:
            lines += [
                "",
                f"Modules loaded at the end: {mods['n']} ({mods['transformers']} transformers.*, "
                f"{mods['scipy']} scipy.*).",
            ]
        lines.append("")
    lines += [
        "## Variants: bootstrap node + 2 tiny peers on 127.0.0.1, peers sampled every second "
        "while training",
        "",
        "Figures: the mean of the 2 peers' python processes (not p2pd) at the last sample; "
        "RSS max: the largest sample of either peer; bootstrap: its RSS at the last sample.",
        "",
        "| variant | RSS MiB | RSS max | anon | file-backed | PSS MiB | USS MiB | threads | "
        "rounds | bootstrap RSS | what |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in doc["variants"]:
        if v.get("error"):
            lines.append(f"| {v['variant']} | error: {v['error'][:80]} |||||||||{v['what']} |")
            continue
        s, p = v["summary"], v["summary"].get("peers", {})
        rss_max = max(s[n]["rss_max"] for n in ("peer0", "peer1") if n in s)
        lines.append(
            f"| {v['variant']} | {_f(p.get('rss'))} | {_f(rss_max)} | {_f(p.get('anon'))} | "
            f"{_f(p.get('file'))} | {_f(p.get('pss'))} | {_f(p.get('uss'))} | "
            f"{_f(p.get('threads'), 0)} | {min(v['rounds'].values())} | "
            f"{_f(s.get('bootstrap', {}).get('rss'))} | {v['what']} |"
        )
    first = next((v for v in doc["variants"] if v.get("top_mappings_peer0")), None)
    if first:
        lines += [
            "",
            f"## peer0's largest mappings ({first['variant']} variant, end of sampling)",
            "",
            "| mapping | maps | RSS | PSS | anonymous | USS |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in first["top_mappings_peer0"]:
            lines.append(
                f"| {r['mapping']} | {r['maps']} | {_f(r['rss'])} | {_f(r['pss'])} | "
                f"{_f(r['anon'])} | {_f(r['uss'])} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=", ".join(VARIANTS))
    parser.add_argument("--seconds", type=float, default=30, help="sampling time per variant")
    parser.add_argument("--round-interval", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1, help="--threads of each peer")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--out", default="daemon-rss", help="bench/results/OUT.{json,md}")
    parser.add_argument("--no-breakdown", action="store_true")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    sys.path.insert(0, str(ROOT))
    doc = {
        "command": shlex.join(["python", *sys.argv]),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "seconds": args.seconds,
        "round_interval": args.round_interval,
    }
    if not args.no_breakdown:
        doc["breakdown"] = breakdown()
        for r in doc["breakdown"]:
            if "anon" in r:
                print(
                    f"[breakdown] {r['step']}: RSS {r['rss']:.1f} MiB (anon {r['anon']:.1f}, "
                    f"file {r['file']:.1f}), USS {r['uss']:.1f}",
                    flush=True,
                )
    doc["variants"] = []
    work = args.work or Path(tempfile.mkdtemp(prefix="seedflood-daemon-rss-"))
    for name in names:
        print(f"[variant] {name}: starting ({VARIANTS[name][0]})", flush=True)
        try:
            v = run_variant(name, args, work / name)
        except Exception as exc:  # keep the other variants' figures
            v = {
                "variant": name,
                "what": VARIANTS[name][0],
                "error": f"{type(exc).__name__}: {exc}",
            }
        doc["variants"].append(v)
        p = v.get("summary", {}).get("peers")
        if p:
            print(
                f"[variant] {name}: peers RSS {p['rss']:.1f} PSS {p['pss']:.1f} "
                f"USS {p['uss']:.1f} threads {p['threads']:.0f} rounds {v['rounds']}",
                flush=True,
            )
        else:
            print(f"[variant] {name}: {v.get('error')}", flush=True)
    doc["load_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(doc))
    print(f"wrote {RESULTS / args.out}.json and .md")


if __name__ == "__main__":
    main()
