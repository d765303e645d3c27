#!/usr/bin/env bash
# p2pd's dropping queues and seen-message TTL (our p2pd build, network/transport/
# p2pd_build.py), side by side on one machine: GossipSub's 32-deep queues against 4096, for
# one real daemon fed at rising rates (bench_ingest.py) and for p2pd alone with its CPU
# profile (--bare --p2pd-profile); and p2pd alone with a 30 s seen TTL against 120 s (its
# RSS after each step). Each bench_ingest row is resumable.
#     bash bench/queue_rounds.sh            # ~10 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
rates=(2000 4000 8000)
for q in 32 4096; do
  python bench/bench_ingest.py --model tiny-llama --directions 16 --identities 1000 \
    --rates "${rates[@]}" --no-stages --p2pd-queues "$q" --out "ingest-queues-$q"
  python bench/bench_ingest.py --bare --identities 1000 --rates "${rates[@]}" \
    --p2pd-queues "$q" --p2pd-profile --out "ingest-bare-queues-$q"
done
python bench/bench_ingest.py --bare --identities 1000 --rates "${rates[@]}" \
  --p2pd-queues 4096 --seen-ttl 30 --out ingest-bare-queues-4096-seen30
