"""How long a new peer takes to join through a non-bootstrap peer after the bootstrap node died.

    nice -n 19 python bench/bench_join.py [--out PATH] [--repeats N]

Runs harness/join_any_peer.py on 127.0.0.1 (bootstrap + A, B, C training the tiny model;
the bootstrap node SIGKILLed; D started with the TOML list [dead bootstrap, A]) with
discovery on, then the same with --no-discovery on every node (the control: no DHT
records, only p2pd's own Kademlia and the peers' summaries). Reports, per run, seconds from
D's start to: "ready" (manifest, sync and replay done), its connection to B and C (peers it
was not given), and when it first heard of them and from where. Writes PATH.json and
PATH.md (default bench/results/join).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.join_any_peer import run_join_any_peer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out or ROOT / "bench" / "results" / "join")
    runs = []
    for _ in range(args.repeats):
        for discovery in (True, False):  # interleaved: the machine's load drifts
            work = tempfile.mkdtemp(prefix="sf-join-")  # kept if the run fails, for its logs
            began = time.monotonic()
            try:
                result = run_join_any_peer(Path(work), discovery=discovery, connect_timeout=90)
            except Exception as exc:  # one failed run is a result too, not the end of the bench
                runs.append({"discovery": discovery, "failed": repr(exc)[:2000], "work": work})
                continue
            shutil.rmtree(work, ignore_errors=True)
            digests = {n: f["ledger_digest"] for n, f in result["finals"].items()}
            runs.append(
                {
                    "discovery": discovery,
                    "ready_s": result["ready_s"],
                    "ready_round": result["ready"]["round"],
                    "run_round_at_join": result["run_round_at_join"],
                    "connected_s": result["connected_s"],
                    "timeline": result["timeline"],
                    "phases": result["phases"],
                    "peers_found_in_dht": len(
                        (result["finals"]["d"].get("discovery") or {}).get("peers_found", [])
                    ),
                    "codes": result["codes"],
                    "ledgers_identical": len(set(digests.values())) == 1,
                    "wall_s": round(time.monotonic() - began, 1),
                }
            )
    report = {
        "command": "nice -n 19 python bench/bench_join.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "runs": runs,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# Join through a non-bootstrap peer, bootstrap node dead (`{report['command']}`)",
        "",
        "Loopback, tiny model, bootstrap + A, B, C; bootstrap SIGKILLed; D given "
        "`bootstrap = [dead bootstrap, A]` in its TOML file. Seconds from D's start. "
        f"{report['cpus']} cores shared with other jobs (load average at the end "
        f"{report['load_average_at_end'][0]:.1f}): the times are dominated by process start "
        "and model loading under that load.",
        "",
        "| discovery | ready (s) | daemon up / manifest / attached / synced (s) | "
        "connected to A; B, C (s) | heard of B, C (s, from) | DHT peer records read | "
        "ledgers identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "failed" in r:
            first_line = r["failed"].splitlines()[0][:200]
            lines.append(f"| {'on' if r['discovery'] else 'off'} | FAILED: {first_line} |")
            continue
        heard = ", ".join(
            f"{t['heard_of']} ({t['heard_from']})" if t["heard_of"] is not None else "-"
            for name, t in r["timeline"].items()
            if name in "bc"
        )
        phases = " / ".join(
            str(r["phases"].get(p, "-")) for p in ("http", "join", "own_addrs", "caught_up")
        )
        lines.append(
            f"| {'on' if r['discovery'] else 'off (control)'} | {r['ready_s']} | {phases} | "
            f"{r['timeline']['a']['connected']}; "
            f"{r['connected_s']['b']}, {r['connected_s']['c']} | {heard} | "
            f"{r['peers_found_in_dht']} | {r['ledgers_identical']} |"
        )
    lines += [
        "",
        '"connected" is when D\'s reconnector first saw the connection (it polls the daemon '
        "once a second); a connection p2pd's own Kademlia made while D loaded its model shows "
        'up at D\'s first poll after the load. "heard of" is logged only for a peer not yet '
        "connected (a hint to dial), so it is empty when the connection came first.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
