#!/usr/bin/env bash
# Issue 47, lever (c): momentum from the ledger (RunConfig.momentum, algorithm/momentum.py),
# on the scaling curve's two-block rows (the demo's prompt, K-FAC fixed at the base, rank 32,
# 16 directions, round_mean, n_ref 16, the first 512 training sentences).
#   1. validation (1 seed): per N, the plain row at the step the scaling curve chose
#      (N=4 lr 0.032, N=16 lr 0.064; run again here, side by side) against momentum 0.9 at
#      1/10 and 1/4 of that lr (0.9 carries a row on up to 10 times) and 0.5 at 1/2 of it;
#   2. test (5 seeds, each scored once): per N the best momentum row, if it beat the plain
#      row on validation; the plain rows' test seeds are scaling-test's (same seeds).
# One core (`taskset -c 1 nice -n 10`); resumable: the same command skips finished seeds.
# Cost on one core: N=4 ~2 min a seed, N=16 ~5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1)
val() {  # val N PLAIN_LR: the plain row and three momentum rows
    local n=$1 lr=$2
    local tenth quarter half
    tenth=$(python -c "print(f'{$lr/10:g}')"); quarter=$(python -c "print(f'{$lr/4:g}')")
    half=$(python -c "print(f'{$lr/2:g}')")
    python bench/bench_rounds.py "${COMMON[@]}" --eval-split validation --peers "$n" --seeds 1 \
        --rows "" --row "plain-lr$lr=$ROW,lr:$lr" \
        --row "m0.9-lr$tenth=$ROW,momentum:0.9,lr:$tenth" \
        --row "m0.9-lr$quarter=$ROW,momentum:0.9,lr:$quarter" \
        --row "m0.5-lr$half=$ROW,momentum:0.5,lr:$half" --out momentum-val
}
val 4 0.032
val 16 0.064
for n in 4 16; do
    # the best momentum row at N on validation, if it beat the plain row there
    best=$(python - "$n" <<'PY'
import json, sys
n = int(sys.argv[1])
runs = [r for r in json.load(open("bench/results/momentum-val.json"))["runs"] if r["peers"] == n]
acc = {r["row"]: r["curve"]["40"]["accuracy"] for r in runs}
plain = max(v for k, v in acc.items() if k.startswith("plain"))
moving = {k: v for k, v in acc.items() if k.startswith("m")}
row = max(moving, key=moving.get)
print(row if moving[row] > plain else "")
PY
)
    if [ -z "$best" ]; then echo "N=$n: no momentum row beat the plain one on validation"; continue; fi
    m=${best#m}; m=${m%%-*}; lr=${best##*-lr}
    python bench/bench_rounds.py "${COMMON[@]}" --eval-split test --peers "$n" --seeds 5 \
        --chosen-on "validation (bench/results/momentum-val.json)" \
        --rows "" --row "$best=$ROW,momentum:$m,lr:$lr" --out momentum-test
done
