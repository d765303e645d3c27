#!/usr/bin/env bash
# Issue 47: is the 512-sentence pool what holds rounds near 0.80? A round of N peers draws
# N x 16 sentences; at N = 16 that is 256 a round, so 40 rounds pass over a pool of 512
# twenty times (Adam's 40 steps of 16: 1.25 times). The scaling curve's two-block row at
# N = 16 (lr 0.064, chosen on validation at pool 512) and Adam (lr 1e-4), each at pools of
# 512, 2,400 and 8,605 (every MR training sentence outside the validation split), scored
# on validation (1 seed): a choice of pool, made where choices are made.
# One core, resumable (the same command skips finished seeds). ~5 min a zeroth-order row,
# plus caching the pool's frozen prefix once per row: ~30 min for 8,605 sentences on a
# shared core (POOLS="512 2400" leaves that pool out).
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1 --eval-split validation)
for POOL in ${POOLS:-512 2400 8605}; do
    python bench/bench_rounds.py "${COMMON[@]}" --train-examples "$POOL" --peers 16 --seeds 1 \
        --rows "" --row "pool$POOL-lr0.064=$ROW,lr:0.064" \
        --row "adam-pool$POOL-lr1e-4=method:adam,lr:0.0001,$P" --out pool-val
done
