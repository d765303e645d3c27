"""Late join, side by side: sync then replay versus replay while syncing.

    python bench/bench_latejoin_overlap.py [--sequential REV] [--overlapped REV] [--repeats 2]

One synthetic ledger of ROUNDS x 8 peers on SmolLM2-135M and one donor peer serve both
variants (bench_network.py's late-join builders). Each repeat launches a real
`seedflood peer --threads 1` from each revision (checked out in temporary git worktrees),
alternately, and times launch -> "ready" (model = base + the whole ledger). The overlap
(56076ff: the model thread replays each fetched batch while the next is verified) was
measured here to gain nothing on 2 cores and was taken out again; this script is how
to measure it on other machines. Each joiner trains a round before it is stopped,
so a later joiner may fetch a few more messages (counts in the ready lines). Writes
bench/results/latejoin_overlap.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_network as bn  # noqa: E402

SEQUENTIAL = "fb76b8e"  # syncs first, then replays (as the code does again now)
OVERLAPPED = "56076ff"  # replays fetched batches while syncing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequential", default=SEQUENTIAL, help="git revision: sync, replay")
    parser.add_argument("--overlapped", default=OVERLAPPED, help="git revision: overlapped")
    parser.add_argument("--rounds", type=int, default=bn.LATE_ROUNDS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(bn.RESULTS / "latejoin_overlap"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="latejoin-overlap-"))
    repo = bn.ROOT
    trees = {"sync, then replay": work / "sequential", "overlapped": work / "overlapped"}
    for tree, rev in zip(trees.values(), (args.sequential, args.overlapped), strict=True):
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
    procs: list[subprocess.Popen] = []
    runs: list[dict] = []
    out = {
        "command": "python bench/bench_latejoin_overlap.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sequential": args.sequential,
        "overlapped": args.overlapped,
        "rounds": args.rounds,
        "peers": bn.LATE_PEERS,
        "loadavg_start": bn._loadavg(),
    }
    try:
        source = work / "source.sqlite"
        build = {"path": str(source), "out": str(work / "build.json"), "rounds": args.rounds}
        p = bn._spawn("_build-ledger", {**build, "peers": bn.LATE_PEERS}, work / "build.log")
        if p.wait(900) != 0:
            raise RuntimeError(f"ledger build failed:\n{bn._tail(work / 'build.log')}")
        out["build"] = json.loads((work / "build.json").read_text())
        print(f"ledger: {out['build']['messages']} messages", flush=True)
        donor = bn._spawn("_donor", {"work": str(work), "ledger": str(source)}, work / "donor.log")
        procs.append(donor)
        bn._wait_file(work / "donor.json", procs, 60)
        donor_addr = json.loads((work / "donor.json").read_text())["addr"]
        for repeat in range(args.repeats):
            for variant, root in trees.items():
                bn.ROOT = root  # _e2e_peer runs `python -m seedflood` from ROOT
                run_dir = work / f"{repeat}-{root.name}"
                run_dir.mkdir()
                r = bn._e2e_peer(run_dir, donor_addr, 0, 1800, args.rounds)
                runs.append({"repeat": repeat, "variant": variant, **r})
                print(f"{variant:18s} launch -> ready {r['launch_to_ready_s']} s", flush=True)
    finally:
        bn._stop(procs)
        for tree in trees.values():
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
            )
    out["runs"] = runs
    out["loadavg_end"] = bn._loadavg()
    mean = {}
    for variant in ("sync, then replay", "overlapped"):
        times = [r["launch_to_ready_s"] for r in runs if r["variant"] == variant]
        mean[variant] = round(sum(times) / len(times), 2) if None not in times else None
    out["mean_launch_to_ready_s"] = mean
    a, b = mean["sync, then replay"], mean["overlapped"]
    out["speedup"] = round(a / b, 3) if a and b else None
    target = out["build"]["fp32_bytes"] * 8 / (bn.DOWNLOAD_MBIT * 1e6)
    out["download_s_at_100_mbit"] = round(target, 1)

    path = Path(args.out)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1))
    lines = [
        "# Late join: sync then replay vs overlapped (real `seedflood peer --threads 1`)\n",
        f"{out['started']}, `{out['command']}`; ledger {out['build']['messages']:,} messages "
        f"({args.rounds:,} rounds x {bn.LATE_PEERS} peers), SmolLM2-135M, rank "
        f"{out['build']['rank']}, T {out['build']['refresh_period']}; sync then replay = "
        f"`{args.sequential}`, overlapped = `{args.overlapped}`. Load average "
        f"{out['loadavg_start']} -> {out['loadavg_end']}.\n",
        "| repeat | variant | launch -> ready s | ready line |",
        "|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['repeat']} | {r['variant']} | {r['launch_to_ready_s']} | {r['ready_message']} |"
        )
    lines.append(
        f"\nMean: sync then replay {a} s, overlapped {b} s: **{out['speedup']}x**; the fp32 "
        f"download at {bn.DOWNLOAD_MBIT:.0f} Mbit/s takes {out['download_s_at_100_mbit']} s."
    )
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
