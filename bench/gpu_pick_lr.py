"""The learning rate of a bench_rounds sweep with the lowest validation loss at a round.

python bench/gpu_pick_lr.py bench/results/gpu/gpu-lr-sweep.json 12
"""

import json
import math
import sys


def main() -> None:
    path, round_ = sys.argv[1], sys.argv[2]
    runs = json.load(open(path))["runs"]
    losses = {
        r["settings"]["lr"]: r["curve"][round_]["loss"]
        for r in runs
        if round_ in r["curve"] and math.isfinite(r["curve"][round_]["loss"])
    }
    if not losses:
        sys.exit(f"error: no finished sweep run in {path} reached round {round_}")
    print(min(losses, key=losses.get))


if __name__ == "__main__":
    main()
