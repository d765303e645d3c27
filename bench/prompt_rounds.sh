#!/usr/bin/env bash
# Issue 47: training on the validation-chosen generic sentiment prompt
# (`Review: {text}\nSentiment:` with " negative"/" positive", 3rd of 160 on validation at
# 0.770 against the best's 0.774, and the only one of the top 3 that names no movie, so it
# carries to an organiser's review data; bench/results/prompts-mr.md).
#   1. the demo's length (240 rounds, 4 peers) on validation, three steps, uncalibrated
#      (calibration lost 0.16 at round 0 on this prompt: prompt-val.md);
#   2. Adam on the same prompt and data, three rates, on validation;
#   3. the best of each at round 40 (prompt-val), 5 seeds, scored once on test;
#   4. then the old default's baseline (bench/protocol_baseline.sh).
# One core (run it under `taskset -c 1 nice -n 10`), resumable like protocol_baseline.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--train-examples 512 --eval-examples 1000 --threads 1)
python bench/bench_rounds.py "${COMMON[@]}" --rounds 240 --eval-at 0,40,120,240 \
    --eval-split validation --peers 4 --seeds 1 --rows "" \
    --row "sentiment-raw-lr0.016=$ROW,lr:0.016,calibration:" \
    --row "sentiment-raw-lr0.032=$ROW,lr:0.032,calibration:" \
    --row "sentiment-raw-lr0.064=$ROW,lr:0.064,calibration:" \
    --out prompt-demo-val
python bench/bench_rounds.py "${COMMON[@]}" --rounds 40 --eval-at 0,20,40 \
    --eval-split validation --peers 4 --seeds 1 --rows "" \
    --row "adam-sentiment-lr1e-4=method:adam,lr:0.0001,$P,calibration:" \
    --row "adam-sentiment-lr3e-4=method:adam,lr:0.0003,$P,calibration:" \
    --row "adam-sentiment-lr1e-3=method:adam,lr:0.001,$P,calibration:" \
    --out prompt-val
python bench/bench_rounds.py "${COMMON[@]}" --rounds 40 --eval-at 0,20,40 \
    --eval-split test --peers 4 --seeds 5 --choose-from prompt-val --out prompt-test
bash bench/protocol_baseline.sh
