#!/usr/bin/env bash
# Issue 46, item 3 at scale: bench/bench_swarm.py with N = 64, 128 and 256 real peer
# daemons (tiny-llama, CPU, one torch thread each) on a lent 16-core machine (the H200 box:
# 16 cores, 128 GiB RAM, 64 GiB disk, no network). The GPU itself is not used: the machine
# is wanted for its cores and memory.
#
#   bash bench/swarm_gpu.sh            # rows N = 64, 128, 256 on 127.0.0.1
#   PEERS=64 ROUNDS=20 bash bench/swarm_gpu.sh
#   NETNS=1 DELAY_MS=20 LOSS=0.5 bash bench/swarm_gpu.sh   # namespaces + netem (root)
#
# NOT RUNNABLE THERE YET. That machine's image has Python, torch and transformers but not
# hivemind (the p2pd binary every daemon starts) nor the project's other dependencies
# (msgpack, multiaddr, base58, pydantic(-settings), aiohttp, prometheus-client, uvloop,
# grpcio/protobuf as hivemind pins them, ...), and it cannot reach PyPI. They would have to
# be carried as wheels for its Python (cp3xx, manylinux x86_64; hivemind's wheel holds
# p2pd), in a folder ignored by git (add it to .git/info/exclude as bench/gpu_prepare.sh
# does) named in the run tool's `carry` (64 MiB per transfer:
# hivemind's wheel alone is ~30 MB, so likely two calls as bench/gpu_prepare.sh does for
# the model), and installed with `pip install --no-index --target /tmp/site`. That wheel
# set has not been built; this script installs it from $WHEELS when it is there and
# otherwise stops after saying what is missing.
#
# Memory: a tiny-llama peer measured ~456 MiB RSS and its p2pd ~67 MiB on the 2-core CPU
# machines (bench/results/swarm.md), so N = 256 needs ~131 GiB: more than the 128 GiB
# there. bench_swarm.py starts a row only if N daemons fit in 85% of MemAvailable (from
# the largest finished row's figures), so N = 256 will likely be skipped with a note
# unless FORCE=1 (which risks the OOM killer). Rows are written as they finish
# ($OUT/swarm-16core.json, .md): a call cut off by the 10-minute limit keeps what finished,
# and the same command skips those rows next time.
#
# Time: start-up is ~10 CPU-s per daemon (torch import, model, p2pd), so N = 128 needs
# ~1.5 min on 16 cores before round 0 and N = 256 ~3 min; ROUNDS rounds at
# ROUND_INTERVAL s take at least ROUNDS x ROUND_INTERVAL s more.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PEERS=${PEERS:-64,128,256} ROUNDS=${ROUNDS:-30} ROUND_INTERVAL=${ROUND_INTERVAL:-0.5}
WHEELS=${WHEELS:-.dev-swarm}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1

if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
fi
if ! python3 -c "import hivemind, seedflood_p2p.network.transport.p2pd" 2>/dev/null; then
  echo "swarm_gpu: hivemind / the project's dependencies are missing here: carry them as" \
    "wheels in $WHEELS (see this script's header); nothing run" >&2
  exit 2
fi
nproc; free -g; python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"  # 2 processes and their sockets a peer

ARGS=(--peers "$PEERS" --rounds "$ROUNDS" --round-interval "$ROUND_INTERVAL" --threads 1
  --out "$OUT/swarm-16core" --work /tmp/sf-swarm)
[ "${NETNS:-0}" = 1 ] && ARGS+=(--netns --delay-ms "${DELAY_MS:-20}" --loss "${LOSS:-0}")
[ "${FORCE:-0}" = 1 ] && ARGS+=(--force)
mkdir -p "$OUT"
python3 bench/bench_swarm.py "${ARGS[@]}"
