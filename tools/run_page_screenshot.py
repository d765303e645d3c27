"""Screenshot the run page of a live tiny-model run (docs/run-page.png).

    python tools/run_page_screenshot.py [--peers 4] [--rounds 40] [--stop-one-at 25]
        [--out docs/run-page.png]

Starts a bootstrap node (run page on, evaluating base + ledger every 5 rounds) and PEERS
tiny-llama peers on synthetic sentiment on 127.0.0.1, stops one peer at round STOP_ONE_AT
(so the table shows a silent peer and the plots a peer leaving), waits for ROUNDS rounds
and at least 65 s after the stop (the liveness window),
and loads http://127.0.0.1:PORT/run in headless Chromium (`chromium` on PATH).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seedflood_p2p.apps.localnet import start_bootstrap, start_peer  # noqa: E402
from seedflood_p2p.core.config import RunConfig  # noqa: E402

RUN = RunConfig(
    model="tiny-llama",
    dataset="synthetic-sentiment",
    rank=4,
    refresh_period=5,
    lr=8e-3,
    n_ref=4,
    batch_size=8,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--stop-one-at", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "run-page.png")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("needs chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        boot, address = start_bootstrap(
            work,
            RUN,
            ["--metrics-port", "0", "--page-eval-every", "5", "--page-eval-examples", "64"],
        )
        flags = ["--metrics-port", "0", "--round-interval", "0.5", "--until-round", "100000"]
        peers = [start_peer(work, f"p{i}", address, flags) for i in range(args.peers)]
        try:
            peers[-1].wait_round(args.stop_one_at)
            peers[-1].stop()
            stopped = time.monotonic()
            for peer in peers[:-1]:
                peer.wait_round(args.rounds)
            # past the liveness window (60 s), so the stopped peer shows as silent
            time.sleep(max(0.0, stopped + 65 - time.monotonic()))
            port = (work / "bootstrap" / "status_port").read_text()
            subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    "--window-size=1400,1300",
                    "--virtual-time-budget=8000",
                    f"--screenshot={args.out}",
                    f"http://127.0.0.1:{port}/run",
                ],
                check=True,
                capture_output=True,
                timeout=180,
            )
        finally:
            for peer in peers:
                peer.stop()
            boot.stop()
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
