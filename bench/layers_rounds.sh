#!/usr/bin/env bash
# Issue 47, lever (d): which weights train, on the scaling curve's two-block row at N = 16
# (lr 0.064, chosen on validation for the whole two blocks): the whole of blocks 28-29
# against per-matrix scaling by K-FAC's Fisher (basis_fisher_power p: each matrix's
# directions scaled by (its Fisher / the typical matrix's)^p, DiZO-like per-layer steps)
# and against training only the MLPs or only the attention of the same blocks (rank 32
# each). Validation, 1 seed, 40 rounds; one lr per row (the whole blocks' step), so a row
# that would want another step is not given it here: a screen, not a tuned comparison.
# One core, resumable (the same command skips finished seeds). ~4 min a row.
set -euo pipefail
cd "$(dirname "$0")/.."
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P,lr:0.064"
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1
        --eval-split validation --peers 16 --seeds 1)
# The whole two blocks at these settings: momentum-val's plain-lr0.064 row at N = 16 (the same
# run, seed and split: 0.824 at round 40; runs are deterministic, so it is not run again).
python bench/bench_rounds.py "${COMMON[@]}" --rows "" \
    --row "fisher0.25=$ROW,basis_fisher_power:0.25" --row "fisher0.5=$ROW,basis_fisher_power:0.5" \
    --out layers-val
python bench/bench_rounds.py "${COMMON[@]}" --train-only 'model.layers.2[89].mlp.*' --rows "" \
    --row "mlp-only=$ROW" --out layers-val-mlp
python bench/bench_rounds.py "${COMMON[@]}" --train-only 'model.layers.2[89].self_attn.*' \
    --rows "" --row "attention-only=$ROW" --out layers-val-attn
