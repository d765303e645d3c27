"""Fuzz every decoder and file loader with over a million inputs; count tracebacks and
wrong accepts.

    nice -n 19 python bench/bench_fuzz.py [--scale 1.0] [--seed 12]

The properties and input generators are harness/fuzz_properties.py, the same ones
tests/test_fuzz.py runs under hypothesis with ~200 inputs per target: random bytes or
text, random msgpack / JSON / TOML structures of edge values, valid inputs, and valid
inputs mutated field by field or byte by byte. For the five wire decoders an independent
reference decides what must be accepted, so wrong rejects are counted too; for the
manifest, TOML and key-file loaders every accepted input must meet each documented bound
(and a manifest must survive to_json / from_json). A traceback is any exception other
than Rejected / UserError escaping a target (decoders that return None return None).
Writes bench/results/fuzz.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import fuzz_properties as F  # noqa: E402

# What the generators in harness/fuzz_properties.py draw (their probabilities).
INPUT_MIX = {
    "decoders": "12% random bytes, 15% random msgpack values of edge values, 2% arrays or "
    "maps nested 100 to 100,000 deep, 10% valid, 30% valid with one field replaced, "
    "dropped or added, 31% valid with 1-8 byte-level mutations (bit flips, type bytes, "
    "insertions, deletions, truncation, splices)",
    "manifests": "6% random text, 19% valid, 35% valid with 1-4 settings set to edge "
    "values (wrong types, bools, NaN, Infinity, 10^30, 10^400, deep nesting, unknown "
    "keys, versions true / 2.0), 40% valid JSON text with character-level mutations",
    "TOML": "0-6 `key = value` lines over every setting name (either spelling, plus "
    "typos) with edge values (nan, inf, 1e999, 5,000-digit integers, dates, arrays and "
    "tables nested up to 3,000 deep, ports past 65535), 30% then mutated character-wise",
    "key files": "valid Ed25519 (64 and 96 bytes), mismatched public halves, other key "
    "types, random or mutated bytes, modes 0600 / 0400 / 0644 / 0640 / 0604 / 0660 / "
    "0700 / 0620 / 0602",
}

# Inputs per target at --scale 1: 1,030,000 in all.
COUNTS = {
    "decode_update": 300_000,
    "decode_rows": 150_000,
    "decode_digests": 150_000,
    "decode_digest_request": 100_000,
    "decode_fetch_request": 150_000,
    "RunConfig.from_json": 100_000,
    "TOML run settings": 30_000,
    "TOML peer settings": 30_000,
    "identity key file": 20_000,
}


def run_target(name: str, make, check, count: int, seed: int) -> dict:
    rng = random.Random(f"{seed}/{name}")
    outcomes: collections.Counter = collections.Counter()
    samples: dict[str, list] = collections.defaultdict(list)
    started = time.perf_counter()
    for i in range(count):
        item = make(rng)
        try:
            outcomes[check(item)] += 1
        except F.Violation as v:
            outcomes[v.kind] += 1
            if len(samples[v.kind]) < 3:
                samples[v.kind].append({"input": repr(item)[:600], "problem": str(v)[:600]})
        except Exception as exc:  # a traceback of the target
            outcomes["traceback"] += 1
            kind = f"traceback {type(exc).__name__}"
            if len(samples[kind]) < 3:
                samples[kind].append(
                    {"input": repr(item)[:600], "traceback": traceback.format_exc()[-1500:]}
                )
        if (i + 1) % 50_000 == 0:
            print(f"  {name}: {i + 1:,} inputs, {time.perf_counter() - started:.0f} s", flush=True)
    seconds = time.perf_counter() - started
    return {
        "inputs": count,
        "accepted": outcomes["accepted"],
        "rejected": outcomes["rejected"],
        "tracebacks": outcomes["traceback"],
        "wrong_accepts": outcomes["wrong_accept"],
        "wrong_rejects": outcomes["wrong_reject"],
        "bad_errors": outcomes["bad_error"],
        "seconds": round(seconds, 1),
        "us_per_input": round(seconds / count * 1e6, 1),
        "samples": dict(samples),
    }


def write_md(out: dict, path: Path) -> None:
    results, total, seed = out["targets"], out["total"], out["seed"]
    lines = [
        "# Fuzzing the decoders and file loaders",
        "",
        f"`{out['command']}` (seed {seed}), {out['date']}, {out['machine']['cpus']} cores, "
        f"load average {out['machine']['load_average_at_end'][0]} at the end "
        "(run under `nice -n 19` beside other work, so the times are upper bounds).",
        "",
        "Properties and inputs: `harness/fuzz_properties.py` (also run by "
        "`tests/test_fuzz.py` under hypothesis). A *traceback* is any exception other "
        "than `Rejected` / `UserError` escaping the target; a *wrong accept* is an input "
        "the target accepted although the reference (decoders) or a documented bound "
        "(loaders) refuses it; a *wrong reject* a valid input refused (decoders and key "
        "files, which have a reference); a *bad error* a UserError that is not one line.",
        "",
        "Inputs: " + "; ".join(f"{k}: {v}" for k, v in out["input_mix"].items()) + ".",
        "",
        "| target | inputs | accepted | rejected | tracebacks | wrong accepts "
        "| wrong rejects | bad errors | seconds | us / input |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['inputs']:,} | {r['accepted']:,} | {r['rejected']:,} | "
            f"{r['tracebacks']} | {r['wrong_accepts']} | {r['wrong_rejects']} | "
            f"{r['bad_errors']} | {r['seconds']} | {r['us_per_input']} |"
        )
    lines.append(
        f"| **total** | **{total['inputs']:,}** | {total['accepted']:,} | "
        f"{total['rejected']:,} | **{total['tracebacks']}** | **{total['wrong_accepts']}** | "
        f"{total['wrong_rejects']} | {total['bad_errors']} | {total['seconds']} | |"
    )
    failures = {n: r["samples"] for n, r in results.items() if r["samples"]}
    if failures:
        lines += ["", "## First failures", ""]
        for name, samples in failures.items():
            for kind, items in samples.items():
                for item in items:
                    lines.append(f"- {name}, {kind}: `{json.dumps(item)[:800]}`")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every count")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz"))
    parser.add_argument("--md-only", action="store_true", help="rewrite OUT.md from OUT.json")
    args = parser.parse_args()
    if args.md_only:
        out = json.loads(Path(args.out).with_suffix(".json").read_text())
        out.setdefault("input_mix", INPUT_MIX)
        write_md(out, Path(args.out))
        return

    targets = F.targets()
    key_dir = Path(tempfile.mkdtemp(prefix="fuzz-keys-"))
    keys = F._key_blobs()
    targets["identity key file"] = (
        lambda r: F.identity_input(r, keys),
        lambda x: F.check_identity(key_dir / "identity.key", *x),
    )
    results = {}
    started = time.perf_counter()
    for name, count in COUNTS.items():
        count = max(1, round(count * args.scale))
        print(f"{name}: {count:,} inputs", flush=True)
        make, check = targets[name]
        results[name] = run_target(name, make, check, count, args.seed)
        r = results[name]
        print(
            f"  accepted {r['accepted']:,}  rejected {r['rejected']:,}  tracebacks "
            f"{r['tracebacks']}  wrong accepts {r['wrong_accepts']}  wrong rejects "
            f"{r['wrong_rejects']}  ({r['seconds']} s)",
            flush=True,
        )
    keys_total = ("inputs", "accepted", "rejected", "tracebacks", "wrong_accepts")
    total = {k: sum(r[k] for r in results.values()) for k in keys_total}
    total.update(
        wrong_rejects=sum(r["wrong_rejects"] for r in results.values()),
        bad_errors=sum(r["bad_errors"] for r in results.values()),
        seconds=round(time.perf_counter() - started, 1),
    )
    out = {
        "command": " ".join(["python", "bench/bench_fuzz.py", *sys.argv[1:]]),
        "input_mix": INPUT_MIX,
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "total": total,
        "targets": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    write_md(out, path)
    print(
        f"{total['inputs']:,} inputs in {total['seconds']} s: {total['tracebacks']} tracebacks, "
        f"{total['wrong_accepts']} wrong accepts, {total['wrong_rejects']} wrong rejects, "
        f"{total['bad_errors']} bad errors; wrote {path}.json and .md"
    )


if __name__ == "__main__":
    main()
