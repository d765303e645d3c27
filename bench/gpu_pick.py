"""The settings of the sweep row with the lowest validation loss at a round, as a row suffix.

python bench/gpu_pick.py bench/results/gpu/gpu-sweep.json 8   # -> lr:0.016,refresh_period:5
"""

import json
import math
import sys

KEYS = ("lr", "refresh_period")


def main() -> None:
    path, round_ = sys.argv[1], sys.argv[2]
    runs = json.load(open(path))["runs"]
    finished = [
        r for r in runs if round_ in r["curve"] and math.isfinite(r["curve"][round_]["loss"])
    ]
    if not finished:
        sys.exit(f"error: no finished sweep run in {path} reached round {round_}")
    best = min(finished, key=lambda r: r["curve"][round_]["loss"])
    print(",".join(f"{k}:{best['settings'][k]}" for k in KEYS if k in best["settings"]))


if __name__ == "__main__":
    main()
