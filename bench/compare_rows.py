#!/usr/bin/env python
"""One row's test accuracy minus another's, with both standard errors (issue 47's protocol).

    python bench/compare_rows.py momentum-test:m0.9-lr0.008:4 scaling-test:sentiment-lr0.032:4

Each argument is FILE:ROW:N (FILE a bench_rounds results file under bench/results, without
.json; N the peers). Prints, per evaluated round both rows share, each row's mean +- SE
over seeds and the difference with its SE over seeds and its sampling SE: paired over the
same sentences when both rows kept per-sentence marks (`correct`), else the unpaired bound
sqrt(2) x the binomial SE. Only test-scored rows with at least 5 seeds make a claim;
fewer are printed with a warning. Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_scaling import RESULTS, marks, summarise  # noqa: E402


def load_row(spec: str) -> tuple[str, list[dict], int]:
    try:
        name, row, n = spec.rsplit(":", 2)
        peers = int(n)
    except ValueError:
        raise SystemExit(
            f"error: {spec!r} is not FILE:ROW:N (e.g. scaling-test:sentiment-lr0.032:4)"
        ) from None
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"error: no results file {path}")
    data = json.loads(path.read_text())
    runs = [r for r in data["runs"] if r["row"] == row and r["peers"] == peers]
    if not runs:
        raise SystemExit(f"error: {path.name} has no row {row!r} at N = {peers}")
    return spec, runs, data["meta"]["eval_examples"]


def compare(a: tuple[str, list[dict], int], b: tuple[str, list[dict], int]) -> list[dict]:
    (_, runs_a, n_a), (_, runs_b, _) = a, b
    shared = sorted(set.intersection(*(set(map(int, r["curve"])) for r in runs_a + runs_b)) - {0})
    out = []
    for round_ in shared:
        sa = summarise([r["curve"][str(round_)]["accuracy"] for r in runs_a], n_a)
        sb = summarise([r["curve"][str(round_)]["accuracy"] for r in runs_b], n_a)
        ma, mb = marks(runs_a, round_), marks(runs_b, round_)
        if ma and mb and len(ma) == len(mb):
            diffs = [x - y for x, y in zip(ma, mb, strict=True)]
            sampling, paired = statistics.stdev(diffs) / math.sqrt(len(diffs)), True
        else:
            sampling, paired = math.sqrt(2) * sb["se_sampling"], False
        seeds = math.hypot(sa["se_seeds"], sb["se_seeds"])
        out.append(
            {
                "round": round_,
                "a": sa,
                "b": sb,
                "difference": sa["mean"] - sb["mean"],
                "se_seeds": seeds,
                "se_sampling": sampling,
                "paired": paired,
                "se_combined": math.hypot(seeds, sampling),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="FILE:ROW:N")
    parser.add_argument("b", help="FILE:ROW:N (subtracted)")
    args = parser.parse_args()
    a, b = load_row(args.a), load_row(args.b)
    for spec, runs, _ in (a, b):
        if len(runs) < 5 or any(r.get("scored_on") != "test" for r in runs):
            print(
                f"warning: {spec}: {len(runs)} seeds, scored on "
                f"{sorted({r.get('scored_on') for r in runs})}: not a claim"
            )
    for c in compare(a, b):
        kind = "paired" if c["paired"] else "unpaired bound"
        print(
            f"round {c['round']}: {c['a']['mean']:.3f} +- {c['a']['se_seeds']:.3f} minus "
            f"{c['b']['mean']:.3f} +- {c['b']['se_seeds']:.3f} = {c['difference']:+.3f} "
            f"(SE seeds {c['se_seeds']:.3f}, sampling {c['se_sampling']:.3f} {kind}, "
            f"combined {c['se_combined']:.3f}: {c['difference'] / c['se_combined']:+.1f} SE)"
        )


if __name__ == "__main__":
    main()
