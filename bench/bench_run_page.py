"""The run page's weight: its size, and the serving node's CPU cost of several viewers.

    nice -n 5 python bench/bench_run_page.py [--viewers 8,32] [--every 5] [--seconds 40]
        [--rows-peers 16] [--rows-rounds 5000] [--name run_page]

Two parts:

1. In process, over a synthetic ledger of ROWS_PEERS x ROWS_ROUNDS rows (a long run): the
   sizes of /run (the page) and of /run.json (a full first window, and the poll a page
   makes every few seconds: since_round = newest - 8), and the node's CPU seconds to
   answer each (`RunPage.snapshot` + JSON encoding, which is all the handler does).
2. Live: a bootstrap node (page on, no page evaluations) and 3 tiny-llama peers on
   127.0.0.1; the bootstrap process's CPU time (/proc/PID/stat) over SECONDS with no
   viewer, then over SECONDS with each count of VIEWERS clients that load the page and
   its JSON once and then poll /run.json every EVERY seconds, as the page does.

Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
for path in (ROOT,):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from seedflood_p2p.network.monitoring.runpage import Observed, RunPage, page_html  # noqa: E402
from seedflood_p2p.protocol.message import UpdateMessage  # noqa: E402
from seedflood_p2p.storage.ledger import Ledger  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, children excluded (p2pd is its own)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_process(peers: int, rounds: int, workdir: Path) -> dict:
    ledger = Ledger(workdir / "ledger.sqlite", "bench")
    ids = [bytes([0, 36, 8, 1, 18, 32]) + i.to_bytes(32, "big") for i in range(peers)]
    ledger.add(UpdateMessage(r, p, (0.5,)) for r in range(rounds) for p in ids)
    newest = rounds - 1

    def observe() -> Observed:
        return Observed(newest, "serving", {p: newest for p in ids}, 10**6, 0, [], None)

    page = RunPage(ledger, {"model": "bench"}, "server", "bootstrap", observe, "none")
    for i in range(rounds):  # one sample per round, as a live node keeps
        page.samples.append({"t": float(i), "round": i, "peers_alive": peers, "ledger": i})
    for r in range(0, rounds, 10):
        page.record_eval(r, 0.7, 0.5, 0.69)

    def answer(since: int) -> tuple[int, float]:
        page._totals = None  # as if the ledger had grown since the last answer
        start = time.process_time()
        body = json.dumps(page.snapshot(since)).encode()
        return len(body), time.process_time() - start

    full = [answer(0) for _ in range(5)]
    poll = [answer(newest - 8) for _ in range(20)]
    cached_start = time.process_time()
    for _ in range(20):
        json.dumps(page.snapshot(newest - 8))  # the per-peer totals reused (< 10 s old)
    cached = (time.process_time() - cached_start) / 20
    pages_to_load = -(-rounds // 500)
    ledger.close()
    return {
        "ledger_rows": peers * rounds,
        "peers": peers,
        "rounds": rounds,
        "page_bytes": len(page_html()),
        "json_window_bytes": full[0][0],
        "json_window_cpu_ms": round(statistics.median(t for _, t in full) * 1e3, 2),
        "json_windows_to_load_all": pages_to_load,
        "json_poll_bytes": poll[0][0],
        "json_poll_cpu_ms": round(statistics.median(t for _, t in poll) * 1e3, 2),
        "json_poll_cached_cpu_ms": round(cached * 1e3, 2),
    }


def viewer(base: str, every: float, stop: threading.Event, counts: list) -> None:
    urllib.request.urlopen(f"{base}/run", timeout=10).read()
    since = 0
    while not stop.is_set():
        data = json.loads(urllib.request.urlopen(f"{base}/run.json?since_round={since}").read())
        counts.append(1)
        since = max(0, data["run"]["round"] - 8)
        stop.wait(every)


def live(viewers: list[int], every: float, seconds: float, workdir: Path) -> dict:
    from harness.cluster import start_bootstrap, start_peer

    boot, address = start_bootstrap(workdir, ["--metrics-port", "0"])
    flags = ["--metrics-port", "0", "--round-interval", "0.5", "--until-round", "100000"]
    peers = [start_peer(workdir, f"p{i}", address, flags) for i in range(3)]
    try:
        for peer in peers:
            peer.wait_round(3)
        base = f"http://127.0.0.1:{(workdir / 'bootstrap' / 'status_port').read_text()}"
        pid = boot.proc.pid
        out = {"rows": []}
        for n in (0, *viewers):
            stop, counts = threading.Event(), []
            threads = [
                threading.Thread(target=viewer, args=(base, every, stop, counts), daemon=True)
                for _ in range(n)
            ]
            r0, c0, t0 = max(p.last_round() for p in peers), cpu_seconds(pid), time.monotonic()
            for t in threads:
                t.start()
            time.sleep(seconds)
            c1, t1 = cpu_seconds(pid), time.monotonic()
            stop.set()
            for t in threads:
                t.join(10)
            out["rows"].append(
                {
                    "viewers": n,
                    "requests": len(counts),
                    "rounds": max(p.last_round() for p in peers) - r0,
                    "cpu_s": round(c1 - c0, 3),
                    "cpu_percent": round(100 * (c1 - c0) / (t1 - t0), 2),
                }
            )
        idle = out["rows"][0]["cpu_percent"]
        for row in out["rows"]:
            row["extra_cpu_percent"] = round(row["cpu_percent"] - idle, 2)
        data = json.loads(urllib.request.urlopen(f"{base}/run.json").read())
        out["json_bytes_at_end"] = len(json.dumps(data))
        out["ledger_rows_at_end"] = data["run"]["ledger_messages"]
        return out
    finally:
        for peer in peers:
            peer.stop()
        boot.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", default="8,32", help="viewer counts, comma-separated")
    parser.add_argument("--every", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rows-peers", type=int, default=16)
    parser.add_argument("--rows-rounds", type=int, default=5000)
    parser.add_argument("--name", default="run_page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        part1 = in_process(args.rows_peers, args.rows_rounds, Path(tmp))
        print(json.dumps(part1), flush=True)
        (Path(tmp) / "live").mkdir()
        part2 = live(
            [int(v) for v in args.viewers.split(",")], args.every, args.seconds, Path(tmp) / "live"
        )
        print(json.dumps(part2), flush=True)
    result = {
        "args": vars(args),
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "in_process": part1,
        "live": part2,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    p, v = part1, part2
    (RESULTS / f"{args.name}.md").write_text(
        f"""# Run page: size and serving cost

`python bench/bench_run_page.py --viewers {args.viewers} --every {args.every} --seconds \
{args.seconds}` on {result["machine"]} (shared with other jobs: CPU percentages are of
one core and noisy).

## Size and CPU per answer (in process, {p["ledger_rows"]:,} ledger rows: {p["peers"]} \
peers x {p["rounds"]:,} rounds)

| what | bytes | node CPU per answer |
|---|---:|---:|
| `GET /run` (the page, static) | {p["page_bytes"]:,} | ~0 (bytes held in memory) |
| `GET /run.json` first window (500 rounds) | {p["json_window_bytes"]:,} | \
{p["json_window_cpu_ms"]} ms |
| `GET /run.json?since_round=newest-8` (a poll), ledger grew | {p["json_poll_bytes"]:,} | \
{p["json_poll_cpu_ms"]} ms |
| the same poll, per-peer totals reused (< 10 s old) | {p["json_poll_bytes"]:,} | \
{p["json_poll_cached_cpu_ms"]} ms |

A first load of the whole run takes {p["json_windows_to_load_all"]} windows.

## Live: bootstrap node of a 3-peer tiny-llama run, {args.seconds:.0f} s per row

| viewers | requests | rounds trained | bootstrap CPU s | CPU % of one core | extra |
|---:|---:|---:|---:|---:|---:|
"""
        + "".join(
            f"| {r['viewers']} | {r['requests']} | {r['rounds']} | {r['cpu_s']} | "
            f"{r['cpu_percent']} | {r['extra_cpu_percent']:+} |\n"
            for r in v["rows"]
        )
        + f"""
Viewers load the page and a full /run.json once, then poll
`/run.json?since_round=newest-8` every {args.every:g} s, as the page does. "extra" is the
CPU over the row without viewers, in percentage points of one core. /run.json at the end
of the run: {v["json_bytes_at_end"]:,} bytes for {v["ledger_rows_at_end"]} ledger rows. In
the in-process table, "ledger grew" answers include the per-peer scan of the whole ledger,
done at most once per 10 s whatever the number of viewers.
"""
    )
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
