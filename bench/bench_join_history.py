"""A late joiner's ready time on real daemons over a long history: the whole history
first (`--history-sync first`, the default) against the quorum's link trusted
(`--history-sync background`), side by side in one run.

    nice -n 5 python bench/bench_join_history.py [--peers 500] [--rounds 1000]
        [--period 50] [--work-dir /tmp/join-history] [--name join-history]

A signed, replayable history of PEERS x ROUNDS rows (bench/bench_ledger_scale.py's
synthesis, resumable) of a run with a checkpoint chain every PERIOD rounds and no
audits; a bootstrap node and two founders on 127.0.0.1, each holding a copy of it (their
start checks every row's signature once), the founders training on from round ROUNDS and
building and serving the chain's links. Then two joiners, one after the other, each a new `seedflood
peer` process with an empty data dir and `--checkpoint-fetch always`:

- first: syncs the whole history (signatures checked), then fetches the link and restores;
- background: fetches the link, syncs the rows after it, is ready; the history, its
  check against the link's digest and the link's rebuild follow while it trains.

Timed from the joiner's process start to its `ready` log line, then to `history_checked`
and `link_checked` (background). Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

FLAGS = dict(
    until_round=1_000_000,
    round_interval=1.0,
    round_deadline=3,
    liveness_timeout=20,
    min_peers=1,
    checkpoint_settle=4,
    max_staleness=2,
)


def _event(proc, name: str, timeout: float) -> dict:
    from harness.open_run import wait_event

    return wait_event(proc, name, timeout=timeout)


def _tree_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds of each process and its descendants, by command name ("daemon" for the
    processes themselves; p2pd, python (signature workers), ...); a process gone since is
    simply not counted."""
    from bench_ingest import cpu_seconds, descendants

    out: dict[str, float] = {}
    for root in pids:
        for pid in [root, *descendants(root)]:
            try:
                comm = "daemon" if pid == root else Path(f"/proc/{pid}/comm").read_text().strip()
                out[comm] = out.get(comm, 0.0) + cpu_seconds(pid)
            except (OSError, ValueError, IndexError):
                continue
    return out


def _cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 1) for k, v in after.items() if v > before.get(k, 0.0)}


def join(
    work: Path,
    address: str,
    name: str,
    mode: str,
    timeout: float,
    founders: list[int] = (),
    profile: Path | None = None,
) -> dict:
    """One joiner, timed from its start to `ready` (and, trusting, to both checks); the CPU
    seconds the joiner and the founders spent until ready; with `profile`, py-spy's GIL
    samples of the joiner until ready (bench_ingest's summary: top functions)."""
    from bench_ingest import finish_profile, start_profile

    from harness.cluster import peer_flags
    from seedflood_p2p.apps.localnet import start_peer

    flags = peer_flags(
        "--checkpoint-fetch", "always", "--history-sync", mode, **FLAGS, metrics_port=0
    )
    founders_before = _tree_cpu(list(founders))
    started = time.time()
    proc = start_peer(work, name, address, flags)
    spy = start_profile(profile, proc.proc.pid, f"{name}-until-ready", timeout)
    founder_spies = [
        start_profile(profile, pid, f"{name}-founder{i}-until-ready", timeout)
        for i, pid in enumerate(founders)
    ]
    try:
        ready = _event(proc, "ready", timeout)
        joiner_cpu = _tree_cpu([proc.proc.pid])
        founders_cpu = _cpu_between(founders_before, _tree_cpu(list(founders)))
        for each in [spy, *founder_spies]:
            if each is not None:
                each[0].send_signal(signal.SIGINT)  # py-spy writes what it has and exits
        out = {
            "mode": mode,
            "ready_s": round(ready["time"] - started, 1),
            "round": ready["round"],
            "source": ready["source"],
            "rows_fetched_before_ready": ready["fetched"],
            "ledger_rows_at_ready": ready["ledger_rows"],
            "cpu_s_until_ready": {
                "joiner": {k: round(v, 1) for k, v in joiner_cpu.items()},
                "founders": founders_cpu,
            },
        }
        if spy is not None:
            out["profile_until_ready"] = finish_profile(spy)
            out["founder_profiles_until_ready"] = [finish_profile(f) for f in founder_spies]
        print(name, out, flush=True)
        if mode == "background":
            for event in ("history_checked", "link_checked"):
                seen = _event(proc, event, timeout)
                out[f"{event}_s"] = round(seen["time"] - started, 1)
                out[f"{event}_match"] = seen["match"]
                print(name, event, out[f"{event}_s"], flush=True)
        return out
    finally:
        proc.stop()


def bootstrap_config(config):
    """The run as the bootstrap node completes it (bootstrap/node.py: the base weights'
    and the examples' hashes), so the synthesised ledger is of the run it serves."""
    from seedflood_p2p.workload.data import examples_sha256
    from seedflood_p2p.workload.models import load_model, weights_sha256
    from seedflood_p2p.workload.tasks import load_run_task

    model, _ = load_model(config.model)
    return config.replace(
        base_sha256=weights_sha256(model), dataset_sha256=examples_sha256(load_run_task(config))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--period", type=int, default=50)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "join-history"))
    parser.add_argument("--name", default="join-history")
    parser.add_argument(
        "--audited",
        action="store_true",
        help="audits on (the default of a real run): a chain of settled states, each link "
        "with its standing summary; the joiners restore the settled state",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--modes", default="first,background", help="the joiners to run, in this order"
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=0,
        help="first measure the nodes' CPU over this many seconds with no joiner",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="record py-spy (GIL samples) on each joiner into this folder",
    )
    args = parser.parse_args()
    # SIGTERM stops the daemons too (the finally below), as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from bench_ledger_scale import run_config, synthesise

    from harness.cluster import peer_flags
    from seedflood_p2p.apps.localnet import start_bootstrap, start_peer

    extra = {"checkpoint_every": args.period}
    if not args.audited:
        extra["audit"] = False
    run = bootstrap_config(run_config(1, extra=extra))
    audited = "-audited" if args.audited else ""
    work = Path(args.work_dir) / f"p{args.peers}-r{args.rounds}-P{args.period}{audited}"
    work.mkdir(parents=True, exist_ok=True)
    history = work / "history.sqlite"
    res = {
        "command": "nice -n 5 python bench/bench_join_history.py " + " ".join(sys.argv[1:]),
        "peers": args.peers,
        "rounds": args.rounds,
        "period": args.period,
        "audited": args.audited,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "synthesis": synthesise(history, args.peers, args.rounds, 1, config=run),
    }
    procs = []
    try:
        for name in ("bootstrap", "a", "b", "first", "background"):  # a fresh run each time
            shutil.rmtree(work / name, ignore_errors=True)
            (work / f"{name}.log").unlink(missing_ok=True)
        # The bootstrap node holds the history too, as a node in the run all along does:
        # starting empty, it synced the whole history itself while the joiners were timed.
        (work / "bootstrap").mkdir()
        shutil.copy(history, work / "bootstrap" / "ledger.sqlite")
        boot, address = start_bootstrap(work, run)
        procs.append(boot)
        founders = {}
        t = time.time()
        for name in ("a", "b"):
            (work / name).mkdir()
            shutil.copy(history, work / name / "ledger.sqlite")
            flags = peer_flags(**FLAGS, metrics_port=0)
            founders[name] = start_peer(work, name, address, flags)
            procs.append(founders[name])
        for name, proc in founders.items():
            _event(proc, "ready", args.timeout)
            link = _event(proc, "chain_link", args.timeout)
            print(name, "serves link", link["round"], flush=True)
        if args.audited:
            # the link of round ROUNDS (every synthetic row), and only the founders' own
            # updates recent: a joiner's self-check recomputes recent updates, and the
            # synthetic ones are random scalars, no step anyone could recompute
            from seedflood_p2p.algorithm.chain import SETTLED_MARGIN

            settle = args.rounds + SETTLED_MARGIN + FLAGS["checkpoint_settle"] + 1
            for proc in founders.values():
                proc.wait_round(settle, timeout=args.timeout)
        res["founders_serving_s"] = round(time.time() - t, 1)
        if args.idle:  # what a node holding the history spends in steady state
            nodes = {"bootstrap": boot.proc.pid, **{n: p.proc.pid for n, p in founders.items()}}
            before = {n: _tree_cpu([pid]) for n, pid in nodes.items()}
            time.sleep(args.idle)
            res["idle"] = {"seconds": args.idle}
            for n, pid in nodes.items():
                spent = _cpu_between(before[n], _tree_cpu([pid]))
                res["idle"][n] = {k: round(100 * v / args.idle, 1) for k, v in spent.items()}
            print("idle, % of a core:", res["idle"], flush=True)
        pids = [p.proc.pid for p in founders.values()]
        profile = Path(args.profile) if args.profile else None
        res["joiners"] = [
            join(work, address, mode, mode, args.timeout, pids, profile)
            for mode in args.modes.split(",")
            if mode
        ]
    finally:
        for proc in procs:
            proc.stop()
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


def markdown(res: dict) -> str:
    rows = res["synthesis"]["rows"]
    lines = [
        f"# A late joiner over {rows:,} rows of history: whole history first, or the link trusted",
        "",
        f"`{res['command'].strip()}`",
        "",
        f"{res['peers']:,} synthetic peers x {res['rounds']:,} rounds (signed, replayable), a "
        f"checkpoint chain every {res['period']} rounds, "
        f"{'audits on (settled links)' if res.get('audited') else 'no audits'}; a bootstrap "
        "node and two founders on 127.0.0.1 hold the history, the founders serve the links; "
        "each joiner is a new `seedflood peer` process with its own p2pd, timed from its "
        "start (interpreter, imports, p2pd, "
        f"join included). Load average {res['loadavg_start']} at start, "
        f"{res['loadavg_end']} at the end; 2 cores shared by everything.",
        "",
        "| joiner | ready | ledger rows at ready | model from | history checked | "
        "link rebuilt and checked |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for j in res["joiners"]:
        checked = (
            f"{j['history_checked_s']} s ({'match' if j['history_checked_match'] else 'DIFFER'})"
            if "history_checked_s" in j
            else "before ready"
        )
        link = (
            f"{j['link_checked_s']} s ({'match' if j['link_checked_match'] else 'DIFFER'})"
            if "link_checked_s" in j
            else "after ready (not timed)"
        )
        lines.append(
            f"| `--history-sync {j['mode']}` | **{j['ready_s']} s** | "
            f"{j['ledger_rows_at_ready']:,} | {j['source']} | {checked} | {link} |"
        )
    if "idle" in res:
        idle = res["idle"]
        lines += [
            "",
            f"Idle, before any joiner ({idle['seconds']:.0f} s), in % of a core: "
            + "; ".join(
                f"{n} " + ", ".join(f"{k} {v}" for k, v in idle[n].items())
                for n in idle
                if n != "seconds"
            )
            + ".",
        ]
    cpu = [j for j in res["joiners"] if "cpu_s_until_ready" in j]
    if cpu:
        lines += [
            "",
            "CPU seconds until ready (`/proc`; the joiner's daemon, its signature workers and "
            "its p2pd; both founders with their p2pd):",
            "",
            "| joiner | daemon | signature workers | p2pd | founders |",
            "|---|---:|---:|---:|---:|",
        ]
        for j in cpu:
            mine, theirs = j["cpu_s_until_ready"]["joiner"], j["cpu_s_until_ready"]["founders"]
            lines.append(
                f"| `{j['mode']}` | {mine.get('daemon', 0)} | {mine.get('python', 0)} | "
                f"{mine.get('p2pd', 0)} | {round(sum(theirs.values()), 1)} |"
            )
    lines += [
        "",
        "The synthetic peers stop at round ROUNDS, so here the rows after the link are the "
        "founders' few; in a run of PEERS live peers they are up to (period + "
        "--checkpoint-settle) rounds of every peer's rows, each signature checked (~130 us "
        "a row on one core, bench/results/ledger-scale-10m.md), still independent of the "
        "history's length.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
