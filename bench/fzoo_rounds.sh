#!/usr/bin/env bash
# Issue 47, lever (b): one-sided estimates sharing one unperturbed pass (FZOO's arithmetic,
# RunConfig.one_sided_passes), on the scaling curve's two-block rows (bench/lever_lib.sh;
# normalize unit, eps 1e-3 unless the row says).
#   1. validation (1 seed): per N (4, 16), the plain two-point row at the step the scaling
#      curve chose (N=4 lr 0.032, N=16 lr 0.064; run again here, side by side) against
#        os1       m = 1: one unperturbed + one +eps pass, batch 16 (the same passes)
#        os2-b8    m = 2 on a batch of 8: 3 passes of 8, one example behind each estimate
#        os4-b4    m = 4 on a batch of 4: 5 passes of 4, one example an estimate
#        os4       m = 4 on a batch of 16: 5 passes of 16, four examples an estimate
#        ...-eps1e-4  the same at eps 1e-4: the one-sided bias, eps/2 z'Hz, is 10x smaller
#      each at the plain row's lr (normalize unit scales every message to the same size).
#      Estimates per CPU-second: `python bench/bench_step_cost.py --estimators`.
#   2. test (5 seeds, each scored once): per N the best one-sided row, if it reached the
#      plain row's validation accuracy at round 40.
# N=4 and N=16 side by side, one core each; resumable: the same command skips finished
# seeds. Cost: N=4 ~2-3 min a row, N=16 ~4-10 min.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lever_lib.sh
rows() {  # rows LR
    local lr=$1
    echo "plain-lr$lr=lr:$lr" "os1-lr$lr=lr:$lr,one_sided_passes:1" \
        "os2-b8-lr$lr=lr:$lr,one_sided_passes:2,batch_size:8" \
        "os4-b4-lr$lr=lr:$lr,one_sided_passes:4,batch_size:4" \
        "os4-lr$lr=lr:$lr,one_sided_passes:4" \
        "os1-eps1e-4-lr$lr=lr:$lr,one_sided_passes:1,eps:0.0001" \
        "os4-b4-eps1e-4-lr$lr=lr:$lr,one_sided_passes:4,batch_size:4,eps:0.0001"
}
lever_run fzoo rows "${1:-all}"
