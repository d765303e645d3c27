#!/usr/bin/env bash
# Issue 47, item 5: do the demo's defaults carry to an organiser's data? Two sentiment sets
# beside MR (bench/review_sets.py: Amazon product-review sentences and tweets, crowd-rated,
# from the same pinned sdist), each with its own validation split (the last tenth of its
# training rows). 4 peers, 40 rounds, the demo's fast setting (2 blocks, 512 sentences):
#   old: the demo's default before the prompt search (`{text}\nIt was` " terrible"/" great",
#        content-free calibration, lr 0.064);
#   new: the demo's default now (`Review: {text}\nSentiment:` " negative"/" positive",
#        uncalibrated, lr $LR).
# Validation first (1 seed), then test (5 seeds, each row scored once). One core, resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
LR=${LR:-0.016}
python bench/review_sets.py
BASE="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0"
NEW="$BASE,template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:,lr:$LR"
OLD="$BASE,calibration:content-free,lr:0.064"
for SPLIT in validation test; do  # both sets' validation rows first
    for SET in amazon tweets; do
        DATA=~/.cache/seedflood/reviews/$SET.csv
        SEEDS=1; CHOSEN=(); [ "$SPLIT" = test ] && SEEDS=5 && CHOSEN=(--chosen-on "mr validation")
        python bench/bench_rounds.py --task "$DATA" --train-examples 512 --rounds 40 \
            --eval-at 0,20,40 --eval-examples 1000 --threads 1 --eval-split "$SPLIT" "${CHOSEN[@]}" \
            --peers 4 --seeds "$SEEDS" --rows "" --row "old-default=$OLD" --row "new-default=$NEW" \
            --out "carry-$SET-$SPLIT"
    done
done
