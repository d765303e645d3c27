"""An audited peer's restart, by ledger size: memory and time of the old path (the whole
ledger read into lists, then a replay: a restart right after its stop restores the settled
state, lag rounds short of the checkpoint written at stop, which the old path refused)
against the streamed one (`LateJoin.restore_settled`: a snapshot read in one pass, the
checkpoint used and the rows past the settled state taken back).

    python bench/bench_restart_memory.py [--rows 100000,300000,1000000] [--peers 100]
        [--directions 16] [--name restart-memory]

For each size a ledger of PEERS x (ROWS / PEERS) rounds (tiny model, audited run, N(0,1)
scalars, unsigned: the restore does not read signatures; `check_ledger` is measured in
bench_ledger_scale.py) and the checkpoint a peer writes at stop (every row) are built once
under $SEEDFLOOD_BENCH_CACHE (default /tmp/seedflood-bench-cache). Each path then runs in a
fresh process: RSS once the model and audits are built, the peak (ru_maxrss) during the
restore, RSS after it, its seconds; and what it restored (the audits' held-state digest
must agree). Each finished size is written to bench/results/NAME.json at once; a rerun
resumes after the sizes already there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CACHE = Path(os.environ.get("SEEDFLOOD_BENCH_CACHE", "/tmp/seedflood-bench-cache"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
LAG = 3  # the audits' default lag (extra.audit.lag)


def _config(directions: int):
    from seedflood_p2p.core.config import RunConfig

    return RunConfig(model="tiny-llama", rank=4, refresh_period=5, lr=1e-3, directions=directions)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def build(directory: Path, rows: int, peers: int, directions: int) -> dict:
    """The ledger and the checkpoint written at stop, once per size (resumable)."""
    done = directory / "built.json"
    if done.exists():
        return json.loads(done.read_text())
    import numpy as np
    import torch

    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.protocol.message import UpdateMessage, quantize_scalars
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    torch.set_num_threads(1)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*"):
        stale.unlink()
    config = _config(directions)
    ids = [bytes.fromhex("002408011220") + i.to_bytes(32, "big") for i in range(1, peers + 1)]
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    ledger = Ledger(directory / "ledger.sqlite", config.run_id)
    ledger.claim(config, "")
    rounds = rows // peers
    for first in range(0, rounds, 100):
        batch = [
            UpdateMessage(t, p, quantize_scalars(rng.normal(size=directions)))
            for t in range(first, min(first + 100, rounds))
            for p in ids
        ]
        ledger.add(batch)
    model, _ = load_model(config.model)
    live = LiveModel(make_estimator(model, config), ledger)
    live.restore(live.cut())
    live.checkpoint(directory, live.cut(), {"round": rounds})
    ledger.close()
    out = {
        "rows": rounds * peers,
        "rounds": rounds,
        "peers": peers,
        "directions": directions,
        "build_s": round(time.perf_counter() - started, 1),
    }
    done.write_text(json.dumps(out))
    return out


def restart(directory: Path, path: str) -> dict:
    """One restart of the peer (in this process): `path` "lists" or "stream"."""
    import asyncio
    import types

    import torch

    from peer.audit_duty import PeerAudits
    from peer.latejoin import LateJoin
    from seedflood_p2p.algorithm.live import LedgerCut, LiveModel
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.storage.digests import digest_of
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.models import load_model

    torch.set_num_threads(1)
    ledger = Ledger.open_existing(directory / "ledger.sqlite")
    config = ledger.config
    model, _ = load_model(config.model)
    live = LiveModel(make_estimator(model, config), ledger)
    audits = PeerAudits(config.audit, b"secret", b"\0" * 38, ledger, live, None, config.probation)
    first = ledger.max_round() + 1
    gc.collect()
    before = _rss_mib()
    started = time.perf_counter()
    if path == "stream":
        join = LateJoin.__new__(LateJoin)  # what restore_settled reads

        async def on_model_thread(function, *args):
            return function(*args)

        join.s = types.SimpleNamespace(data_dir=directory)
        join.live, join.audits, join.run = live, audits, on_model_thread
        how = asyncio.run(join.restore_settled(first))
    else:  # the path before: the whole ledger as lists (peer/latejoin.py before this change)
        judged = audits.judge()
        audits.standing, audits.banned = judged, dict(judged.banned)
        audits.round = first
        cut = live.cut()
        limit = first - audits.settings.lag
        earlier = [m for m in cut.messages if m.round < limit]
        settled = [m for m in earlier if judged.counts_in(m.peer, m.round, first)]
        later = [m for m in cut.messages if m.round >= limit]
        how = live.restore(LedgerCut(settled, digest_of(settled), []), directory)
        live.advance(limit)
        audits.applied = list(settled)
        audits.waiting = [m for m in earlier if not judged.counts_in(m.peer, m.round, first)]
        live.receive(later)
        del cut, earlier, settled, later
    seconds = time.perf_counter() - started
    gc.collect()
    return {
        "how": how,
        "seconds": round(seconds, 2),
        "rss_before_mib": round(before, 1),
        "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_mib": round(_rss_mib(), 1),
        "held_digest": audits.held_digest(),
        "applied_rows": sum(1 for _ in audits.applied),
        "pending_rows": len(live.pending),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000,300000,1000000")
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--directions", type=int, default=16)
    parser.add_argument("--name", default="restart-memory")
    args = parser.parse_args()
    out_path = RESULTS / f"{args.name}.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    out.setdefault("command", "python bench/bench_restart_memory.py " + " ".join(sys.argv[1:]))
    out.setdefault("sizes", {})
    for rows in [int(x) for x in args.rows.split(",")]:
        if str(rows) in out["sizes"]:
            print(f"{rows:,} rows: done before, kept", flush=True)
            continue
        directory = CACHE / f"restart-memory-{rows}-{args.peers}-{args.directions}"
        print(f"{rows:,} rows: building the ledger and the checkpoint ...", flush=True)
        built = build(directory, rows, args.peers, args.directions)
        row = {**built, "loadavg": [round(x, 2) for x in os.getloadavg()]}
        for path in ("lists", "stream"):
            done = subprocess.run(
                [sys.executable, __file__, "_restart", str(directory), path],
                check=True,
                capture_output=True,
                text=True,
                cwd=str(ROOT),
            )
            row[path] = json.loads(done.stdout.strip().splitlines()[-1])
            r = row[path]
            print(
                f"  {path}: {r['seconds']} s, peak +{r['peak_mib'] - r['rss_before_mib']:.0f} MiB, "
                f"after +{r['rss_after_mib'] - r['rss_before_mib']:.0f} MiB ({r['how']})",
                flush=True,
            )
        if row["lists"]["held_digest"] != row["stream"]["held_digest"]:
            raise SystemExit(f"{rows} rows: the two paths hold different rows")
        out["sizes"][str(rows)] = row
        RESULTS.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1))
        (RESULTS / f"{args.name}.md").write_text(markdown(out))
        plot(out, RESULTS / f"{args.name}.png")
    print(markdown(out))
    return 0


def plot(out: dict, path: Path) -> None:
    """Peak and kept RSS, and seconds, against the ledger's rows, for both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(out["sizes"].items(), key=lambda kv: int(kv[0]))
    rows = [int(n) / 1e6 for n, _ in sizes]
    fig, (mem, secs) = plt.subplots(1, 2, figsize=(10, 4))
    for path_name, label, color in (
        ("lists", "before: lists + replay", "tab:red"),
        ("stream", "now: streamed", "tab:blue"),
    ):
        runs = [row[path_name] for _, row in sizes]
        mem.plot(
            rows,
            [r["peak_mib"] - r["rss_before_mib"] for r in runs],
            "o-",
            color=color,
            label=f"{label}, peak",
        )
        mem.plot(
            rows,
            [r["rss_after_mib"] - r["rss_before_mib"] for r in runs],
            "o--",
            color=color,
            alpha=0.6,
            label=f"{label}, kept after",
        )
        secs.plot(rows, [r["seconds"] for r in runs], "o-", color=color, label=label)
    mem.set(
        xlabel="ledger rows (millions)",
        ylabel="RSS added by the restart (MiB)",
        title="An audited restart's memory",
    )
    secs.set(xlabel="ledger rows (millions)", ylabel="seconds", title="... and its time")
    mem.legend(fontsize=8)
    secs.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(out: dict) -> str:
    lines = [
        "# An audited peer's restart by ledger size: memory and time",
        "",
        f"`{out['command']}` (tiny model, audited run, each path in a fresh process, 1 torch "
        "thread; memory above the RSS once the model and audits are built).",
        "",
        "| rows | path | restored by | seconds | peak RSS added | RSS added after |",
        "|---|---|---|---|---|---|",
    ]
    for rows, row in sorted(out["sizes"].items(), key=lambda kv: int(kv[0])):
        for path, label in (("lists", "before: lists + replay"), ("stream", "now: streamed")):
            r = row[path]
            lines.append(
                f"| {int(rows):,} | {label} | {r['how']} | {r['seconds']} | "
                f"{r['peak_mib'] - r['rss_before_mib']:.0f} MiB | "
                f"{r['rss_after_mib'] - r['rss_before_mib']:.0f} MiB |"
            )
    lines += [
        "",
        "Both paths leave the audits the same account of what the weights hold (their "
        "held-state digests are compared, equal in every row), and the same rows pending.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_restart":
        print(json.dumps(restart(Path(sys.argv[2]), sys.argv[3])))
        sys.exit(0)
    sys.exit(main())
