#!/usr/bin/env bash
# Issue 47, item 2: the swarm's scaling curve on two blocks (CPU), on the demo's prompt.
# Per N, the step (lr under round_mean, n_ref 16) is chosen on the validation split
# (1 seed), then the chosen row per N and the best Adam row (prompt-val) are scored once on
# test with 5 seeds. bench/bench_rounds.py --plot draws accuracy at round 40 against N with
# Adam's step 40 as a line (N*: the N whose round beats it).
# Cost on one core of these machines, per seed: N=4 ~2 min, N=16 ~7 min, N=64 ~27 min,
# N=256 ~2 h. N = 64, 256 and 1,024 run on a lent GPU instead (`bash bench/gpu_rounds.sh
# scale`, results in bench/results/gpu/scaling-*-gpu.json); TEST_PEERS picks the N scored
# on test here (default 4,16; 4,16,64 to run N = 64 on this CPU too). Resumable: each finished (row, N,
# seed) is written as it completes, and the same command skips it next time.
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1)
val() {  # val N LR...
    local n=$1; shift
    local rows=()
    for lr in "$@"; do rows+=(--row "sentiment-lr$lr=$ROW,lr:$lr"); done
    python bench/bench_rounds.py "${COMMON[@]}" --eval-split validation --peers "$n" \
        --seeds 1 --rows "" "${rows[@]}" --out scaling-val
}
val 4 0.016 0.032 0.064
val 16 0.032 0.064 0.128
case ",${TEST_PEERS:=4,16}," in *,64,*) val 64 0.064 0.128 0.256 ;; esac
python bench/bench_rounds.py "${COMMON[@]}" --eval-split test --peers "$TEST_PEERS" --seeds 5 \
    --choose-from scaling-val --out scaling-test
