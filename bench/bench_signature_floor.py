"""The floor one Ed25519 check per update sets on a daemon core's ingest (issue 46).

    python bench/bench_signature_floor.py [--seconds 5] [--name signature-floor]

Every gossiped update carries the GossipSub Ed25519 signature the ledger keeps, and the
receiving node checks it once (p2pd in Go for gossip, the Python side for repair rows).
Whatever else a daemon does, a core cannot take more updates a second than it can check
signatures. This measures that ceiling on this machine two ways, side by side in one run:

- `cryptography` (OpenSSL), the Python side's checker until the eighteenth session, one
  verify call at a time over GossipSub-signed bytes of an update's size (call overhead
  included);
- `sigcheck.verify_ed25519`, the Python side's checker now (libsodium through PyNaCl,
  OpenSSL only for its no), the same way;
- `openssl speed ed25519` (OpenSSL's own loop, no Python), where the binary is present.

and states it against issue 46's goal of 20,000 tiny-model updates per core-second.
Writes bench/results/NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "bench" / "results"
GOAL = 20_000  # tiny-model updates per daemon core-second (issue 46)


def python_verifies(seconds: float, checker: str = "cryptography") -> dict:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    public = key.public_key()
    message = b"libp2p-pubsub:" + os.urandom(150)  # a signed GossipSub message's size
    signature = key.sign(message)
    if checker == "cryptography":
        check = public.verify
    else:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from seedflood_p2p.network.transport.sigcheck import verify_ed25519

        raw = public.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)

        def check(sig: bytes, msg: bytes) -> None:
            assert verify_ed25519(raw, sig, msg)

    n, start = 0, time.process_time()
    while (elapsed := time.process_time() - start) < seconds:
        for _ in range(200):
            check(signature, message)
        n += 200
    return {"verifies": n, "cpu_s": round(elapsed, 3), "us_each": round(1e6 * elapsed / n, 1)}


def openssl_speed(seconds: int) -> dict | None:
    binary = shutil.which("openssl")
    if binary is None:
        return None
    out = subprocess.run(
        [binary, "speed", "-seconds", str(seconds), "ed25519"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    match = re.search(r"EdDSA \(Ed25519\)\s+\S+s\s+\S+s\s+([\d.]+)\s+([\d.]+)", out)
    if match is None:
        return None
    verify_per_s = float(match.group(2))
    return {"verify_per_s": verify_per_s, "us_each": round(1e6 / verify_per_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--name", default="signature-floor")
    args = parser.parse_args()
    res = {
        "command": "python bench/bench_signature_floor.py "
        + (f"--seconds {args.seconds:g}" if args.seconds != 5.0 else ""),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "python": python_verifies(args.seconds),
        "sodium": python_verifies(args.seconds, "sigcheck"),
        "openssl": openssl_speed(max(1, round(args.seconds))),
        "goal_updates_per_core_s": GOAL,
    }
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = [
        ("cryptography (Python, one call each)", res["python"]["us_each"]),
        ("sigcheck.verify_ed25519: libsodium (Python, one call each)", res["sodium"]["us_each"]),
    ]
    if res["openssl"]:
        rows.append(("openssl speed ed25519 (no Python)", res["openssl"]["us_each"]))
    lines = [
        "# The signature floor: Ed25519 checks a core can make",
        "",
        f"`{res['command'].strip()}`; load average {res['loadavg_start']} at start, "
        f"{res['loadavg_end']} at the end.",
        "",
        "| checker | us a verify | at most updates per core-second | goal |",
        "|---|---:|---:|---:|",
    ]
    for name, us in rows:
        lines.append(f"| {name} | {us} | {1e6 / us:,.0f} | {GOAL:,} |")
    best = min(us for _, us in rows)
    budget = 1e6 / GOAL
    lines += [
        "",
        f"Each update is checked once, so a core takes at most {1e6 / best:,.0f} updates a "
        f"second on signatures alone with the fastest checker here, before decoding, "
        f"admission, SQLite and SubCGE. The goal of {GOAL:,} needs each update handled in "
        f"under {budget:.0f} us, the check included: "
        + (
            "the check alone is past that on this CPU."
            if best >= budget
            else f"libsodium's check leaves {budget - best:.0f} us for everything else, "
            "and the rest of the path takes more: p2pd's Go check (go-libp2p-pubsub, on "
            "every gossiped update) costs about OpenSSL's, three quarters of p2pd's "
            "100-120 us an update, and the daemon's own work about 80 us "
            "(bench/results/ingest.md)."
        ),
        "",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    (OUT / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
