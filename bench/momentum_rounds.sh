#!/usr/bin/env bash
# Issue 47, lever (c): momentum from the ledger (RunConfig.momentum, algorithm/momentum.py),
# on the scaling curve's two-block rows (bench/lever_lib.sh).
#   1. validation (1 seed): per N, the plain row at the step the scaling curve chose
#      (N=4 lr 0.032, N=16 lr 0.064; run again here, side by side) against momentum 0.9 at
#      1/10 and 1/4 of that lr (0.9 carries a row on up to 10 times) and 0.5 at 1/2 of it;
#   2. test (5 seeds, each scored once): per N the best momentum row, if it beat the plain
#      row on validation; the plain rows' test seeds are scaling-test's (same seeds).
# N=4 and N=16 side by side, one core each; resumable: the same command skips finished
# seeds. Cost on one core: N=4 ~2 min a seed, N=16 ~5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lever_lib.sh
rows() {  # rows LR: the plain row and three momentum rows
    local lr=$1 tenth quarter half
    tenth=$(python -c "print(f'{$lr/10:g}')"); quarter=$(python -c "print(f'{$lr/4:g}')")
    half=$(python -c "print(f'{$lr/2:g}')")
    echo "plain-lr$lr=lr:$lr" "m0.9-lr$tenth=momentum:0.9,lr:$tenth" \
        "m0.9-lr$quarter=momentum:0.9,lr:$quarter" "m0.5-lr$half=momentum:0.5,lr:$half"
}
lever_run momentum rows "${1:-all}"
