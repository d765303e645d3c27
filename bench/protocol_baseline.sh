#!/usr/bin/env bash
# Issue 47: today's default two-block row (the demo's: calibrated K-FAC fixed at the base,
# rank 32, 16 directions, round_mean, n_ref 16, the first 512 training sentences) rescored
# under the validation protocol (docs/LEARNING.md, "The validation protocol").
#   1. lr chosen on the fixed validation split (1,000 MR training sentences), seed 0:
#      3 steps at N = 4, 2 at N = 16, Adam (calibrated, same data) at 3 rates;
#   2. the best of each (per N, and Adam) run again with 5 seeds, scored once on the
#      1,000 test sentences.
# One core (run it under `taskset -c 1 nice -n 10`), resumable: the same command again skips
# every finished (row, N, seed) and resumes an unfinished one from its ledger.
set -euo pipefail
cd "$(dirname "$0")/.."
ROW=rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,calibration:content-free
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1)
python bench/bench_rounds.py "${COMMON[@]}" --eval-split validation --peers 4 --seeds 1 \
    --rows "" --row "kfac-cal-lr0.032=$ROW,lr:0.032" --row "kfac-cal-lr0.064=$ROW,lr:0.064" \
    --row "kfac-cal-lr0.128=$ROW,lr:0.128" \
    --row "adam-cal-lr1e-4=method:adam,lr:0.0001,calibration:content-free" \
    --row "adam-cal-lr3e-4=method:adam,lr:0.0003,calibration:content-free" \
    --row "adam-cal-lr1e-3=method:adam,lr:0.001,calibration:content-free" \
    --out protocol-val
python bench/bench_rounds.py "${COMMON[@]}" --eval-split validation --peers 16 --seeds 1 \
    --rows "" --row "kfac-cal-lr0.032=$ROW,lr:0.032" --row "kfac-cal-lr0.064=$ROW,lr:0.064" \
    --out protocol-val
python bench/bench_rounds.py "${COMMON[@]}" --eval-split test --peers 4,16 --seeds 5 \
    --choose-from protocol-val --out protocol-test
