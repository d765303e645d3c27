#!/usr/bin/env bash
# Issue 47, lever (b): one-sided estimates sharing one unperturbed pass (FZOO's arithmetic,
# RunConfig.one_sided_passes), on the scaling curve's two-block rows (the demo's prompt,
# K-FAC fixed at the base, rank 32, 16 directions, round_mean, n_ref 16, normalize unit,
# the first 512 training sentences, eps 1e-3).
#   1. validation (1 seed): per N (4, 16), the plain two-point row at the step the scaling
#      curve chose (N=4 lr 0.032, N=16 lr 0.064; run again here, side by side) against
#        os1     m = 1: one unperturbed + one +eps pass, batch 16 (the same CPU, one-sided)
#        os2-b8  m = 2 on a batch of 8: 3 passes of 8 (0.75x the examples forwarded), one
#                example behind each estimate, as in the two-point row
#        os4-b4  m = 4 on a batch of 4: 5 passes of 4 (0.625x), one example an estimate
#        os4     m = 4 on a batch of 16: 5 passes of 16 (2.5x), four examples an estimate
#      each at the plain row's lr (normalize unit scales every message to the same size).
#   2. test (5 seeds, each scored once): per N the best one-sided row, if it reached the
#      plain row's validation accuracy at round 40; the plain rows' test seeds are
#      scaling-test's (same seeds).
# N=4 and N=16 run side by side, one core each (`taskset`); resumable: the same command
# skips finished seeds. Cost: N=4 ~1.5-3 min a row, N=16 ~4-8 min.
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1)
val() {  # val N LR CPU
    local n=$1 lr=$2 cpu=$3
    taskset -c "$cpu" python bench/bench_rounds.py "${COMMON[@]}" --eval-split validation \
        --peers "$n" --seeds 1 --rows "" --row "plain-lr$lr=$ROW,lr:$lr" \
        --row "os1-lr$lr=$ROW,lr:$lr,one_sided_passes:1" \
        --row "os2-b8-lr$lr=$ROW,lr:$lr,one_sided_passes:2,batch_size:8" \
        --row "os4-b4-lr$lr=$ROW,lr:$lr,one_sided_passes:4,batch_size:4" \
        --row "os4-lr$lr=$ROW,lr:$lr,one_sided_passes:4" --out fzoo-val
}
test_row() {  # test_row N CPU: the best one-sided row at N on validation, if it reached plain
    local n=$1 cpu=$2 best
    best=$(python - "$n" <<'PY'
import json, sys
n = int(sys.argv[1])
runs = [r for r in json.load(open("bench/results/fzoo-val.json"))["runs"] if r["peers"] == n]
acc = {r["row"]: r["curve"]["40"]["accuracy"] for r in runs}
plain = max(v for k, v in acc.items() if k.startswith("plain"))
one_sided = {k: v for k, v in acc.items() if k.startswith("os")}
row = max(one_sided, key=one_sided.get)
print(row if one_sided[row] >= plain else "")
PY
)
    if [ -z "$best" ]; then echo "N=$n: no one-sided row reached the plain one on validation"; return; fi
    local spec
    spec=$(python -c "
import json, sys
r = next(r for r in json.load(open('bench/results/fzoo-val.json'))['runs'] if r['row'] == '$best')
print(','.join(f'{k}:{v}' for k, v in r['settings'].items() if k in ('lr', 'one_sided_passes', 'batch_size')))")
    taskset -c "$cpu" python bench/bench_rounds.py "${COMMON[@]}" --eval-split test --peers "$n" \
        --seeds 5 --chosen-on "validation (bench/results/fzoo-val.json)" \
        --rows "" --row "$best=$ROW,$spec" --out fzoo-test
}
phase=${1:-all}
if [ "$phase" = all ] || [ "$phase" = val ]; then
    val 4 0.032 0 & a=$!
    val 16 0.064 1 & b=$!
    wait $a $b
fi
if [ "$phase" = all ] || [ "$phase" = test ]; then
    test_row 4 0 & a=$!
    test_row 16 1 & b=$!
    wait $a $b
fi
