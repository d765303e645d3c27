"""The Ed25519 check per row, side by side: OpenSSL alone (what `check_many` did before)
against `sigcheck.verify_ed25519` (libsodium first, OpenSSL for its no).

    taskset -c 0 python bench/bench_ed25519.py [--rows 20000] [--repeats 5]

Rows are what repair pages and restarts check: go-libp2p-pubsub's signed bytes over an
update payload, from 1,000 signers. Each method checks the same rows `--repeats` times in
turn; the table gives the median microseconds a row. Writes
bench/results/ed25519.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parent / "results"


def _openssl_check_many(items) -> list[bool]:
    """`check_many` as it was: pyca/cryptography, one key object per signer."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from seedflood_p2p.network.transport.sigcheck import signed_bytes

    keys, out = {}, []
    for sender, data, seqno, topic, signature in items:
        key = keys.get(sender)
        if key is None:
            key = keys[sender] = Ed25519PublicKey.from_public_bytes(sender[6:])
        try:
            key.verify(signature, signed_bytes(sender, data, seqno, topic))
            out.append(True)
        except InvalidSignature:
            out.append(False)
    return out


def rows(n: int, signers: int = 1000) -> list[tuple]:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from seedflood_p2p.network.transport.sigcheck import ED25519_PREFIX, signed_bytes
    from seedflood_p2p.protocol.update import encode_update

    keys = [
        Ed25519PrivateKey.from_private_bytes(i.to_bytes(32, "big")) for i in range(1, signers + 1)
    ]
    ids = [
        ED25519_PREFIX + k.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        for k in keys
    ]
    topic, out = "seedflood/bench", []
    for i in range(n):
        j, round_ = i % signers, i // signers
        data = encode_update("ab" * 32, round_, (0.5,), 1 << 50)
        seqno = (1_764_300_000_000_000_000 + round_).to_bytes(8, "big")
        out.append(
            (ids[j], data, seqno, topic, keys[j].sign(signed_bytes(ids[j], data, seqno, topic)))
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from seedflood_p2p.network.transport.sigcheck import check_many

    items = rows(args.rows)
    # Forged the costly way: each carries a valid signature of another row (canonical S, a
    # point for R), so neither library can refuse it before the whole computation.
    forged = [(*it[:4], items[i + 1][4]) for i, it in enumerate(items[:2000])]
    methods = {
        "OpenSSL alone (check_many before)": _openssl_check_many,
        "libsodium, OpenSSL for its no (check_many now)": check_many,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            t = time.perf_counter()
            assert all(fn(items))
            times[name].append(1e6 * (time.perf_counter() - t) / len(items))
    bad: dict[str, float] = {}
    for name, fn in methods.items():
        t = time.perf_counter()
        assert not any(fn(forged))
        bad[name] = 1e6 * (time.perf_counter() - t) / len(forged)
    res = {
        "command": "taskset -c 0 python bench/bench_ed25519.py " + " ".join(sys.argv[1:]),
        "rows": args.rows,
        "repeats": args.repeats,
        "cpu": _cpu(),
        "affinity": len(os.sched_getaffinity(0)),
        "us_per_valid_row": {n: round(statistics.median(v), 1) for n, v in times.items()},
        "us_per_valid_row_all": {n: [round(x, 1) for x in v] for n, v in times.items()},
        "us_per_forged_row": {n: round(v, 1) for n, v in bad.items()},
    }
    old, new = (res["us_per_valid_row"][n] for n in methods)
    res["speedup"] = round(old / new, 2)
    OUT.mkdir(exist_ok=True)
    (OUT / "ed25519.json").write_text(json.dumps(res, indent=1))
    lines = [
        "# Ed25519 checks per row: OpenSSL alone against libsodium first",
        "",
        f"`{res['command']}` on {res['cpu']} (affinity {res['affinity']} core). "
        f"{args.rows:,} signed update rows from 1,000 signers, each method {args.repeats} times in "
        "turn (median); 2,000 forged signatures (another row's valid signature) once.",
        "",
        "| method | us a valid row (median) | all runs | us a forged row |",
        "|---|---:|---|---:|",
    ]
    for n in methods:
        lines.append(
            f"| {n} | {res['us_per_valid_row'][n]} | {res['us_per_valid_row_all'][n]} | "
            f"{res['us_per_forged_row'][n]} |"
        )
    lines += [
        "",
        f"Valid rows: {res['speedup']}x faster. A forged row costs both checks (libsodium's "
        "no is asked of OpenSSL, so every answer is OpenSSL's: tests/test_ed25519.py).",
    ]
    (OUT / "ed25519.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
