#!/usr/bin/env bash
# The CPU rows of the scaling curve (bench/results/scaling-test.json: N = 4 lr 0.032, N = 16
# lr 0.064, Adam lr 1e-4; 5 test seeds each) run again with a per-sentence mark kept at
# every evaluation (they kept round 40's only), so margins at round 20 are paired over the
# same sentences too. The runs are deterministic (same seeds, settings and split), so the
# accuracies repeat scaling-test's; only the marks are new. One core, resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1
        --eval-split test --seeds 5 --chosen-on validation --out scaling-test-marks)
python bench/bench_rounds.py "${COMMON[@]}" --peers 4 --rows "" \
    --row "adam-sentiment-lr1e-4=method:adam,lr:0.0001,$P" --row "sentiment-lr0.032=$ROW,lr:0.032"
python bench/bench_rounds.py "${COMMON[@]}" --peers 16 --rows "" --row "sentiment-lr0.064=$ROW,lr:0.064"
