#!/usr/bin/env bash
# Issue 47, lever (c): a diagonal curvature in the fixed basis's core coordinates, learned
# from the rows (RunConfig.curvature, algorithm/curvature.py; HiSo's idea), on the scaling
# curve's two-block rows (bench/lever_lib.sh).
#   1. validation (1 seed): per N (4, 16), the plain row at the step the scaling curve chose
#      (N=4 lr 0.032, N=16 lr 0.064; run again here, side by side) against curvature 0.9
#      and 0.99 at that lr (the scale keeps each matrix's mean step) and 0.9 at half of it;
#   2. test (5 seeds, each scored once): per N the best curvature row, if it reached the
#      plain row's validation accuracy at round 40.
# N=4 and N=16 side by side, one core each; resumable. Cost: N=4 ~2 min a row, N=16 ~5.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lever_lib.sh
rows() {  # rows LR
    local lr=$1 half
    half=$(python -c "print(f'{$lr/2:g}')")
    echo "plain-lr$lr=lr:$lr" "c0.9-lr$lr=lr:$lr,curvature:0.9" \
        "c0.99-lr$lr=lr:$lr,curvature:0.99" "c0.9-lr$half=lr:$half,curvature:0.9"
}
lever_run curvature rows "${1:-all}"
