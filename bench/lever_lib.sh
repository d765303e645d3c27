# Shared by the lever screens on the scaling curve's two-block rows (fzoo_rounds.sh,
# curvature_rounds.sh): the demo's prompt, K-FAC fixed at the base, rank 32, 16 directions,
# round_mean, n_ref 16, the first 512 training sentences; 40 rounds, scored at 0, 20, 40.
# Source it from the repository root.
P='template:Review: {text}\nSentiment:,label_words: negative| positive,calibration:'
ROW="rank:32,directions:16,step_rule:round_mean,n_ref:16,basis:kfac,basis_refresh:0,$P"
COMMON=(--train-examples 512 --rounds 40 --eval-at 0,20,40 --eval-examples 1000 --threads 1)

# lever_val OUT N CPU NAME=SETTINGS...: $SEEDS seeds (default 1, a screen) of each row on
# validation, on core CPU
lever_val() {
    local out=$1 n=$2 cpu=$3
    shift 3
    local rows=()
    for r in "$@"; do rows+=(--row "${r%%=*}=$ROW,${r#*=}"); done
    taskset -c "$cpu" python bench/bench_rounds.py "${COMMON[@]}" --eval-split validation \
        --peers "$n" --seeds "${SEEDS:-1}" --rows "" "${rows[@]}" --out "$out"
}

# lever_test VAL TEST N CPU: the best row of VAL at N whose name does not start with
# "plain" (mean over its validation seeds at round 40, among rows with as many seeds as the
# plain row), scored on test with 5 seeds, if it reached the plain row's mean (each seed
# scored once); its settings are the ones VAL recorded
lever_test() {
    local val=$1 test=$2 n=$3 cpu=$4 chosen
    chosen=$(python - "$val" "$n" <<'PY'
import json, sys
path, n = f"bench/results/{sys.argv[1]}.json", int(sys.argv[2])
runs = [r for r in json.load(open(path))["runs"] if r["peers"] == n]
seeds = {}
for r in runs:
    seeds.setdefault(r["row"], []).append(r["curve"]["40"]["accuracy"])
acc = {row: sum(a) / len(a) for row, a in seeds.items()}
plain_row = max((k for k in acc if k.startswith("plain")), key=acc.get)
plain = acc[plain_row]
# only rows with as many validation seeds as the plain row: one lucky seed must not pass
lever = {
    k: v for k, v in acc.items()
    if not k.startswith("plain") and len(seeds[k]) >= len(seeds[plain_row])
}
best = max(lever, key=lever.get) if lever else None
if best is not None and lever[best] >= plain:
    settings = next(r["settings"] for r in runs if r["row"] == best)
    skip = {"method", "train_only", "template", "label_words", "calibration"}
    print(best + "=" + ",".join(f"{k}:{v}" for k, v in settings.items() if k not in skip))
PY
)
    if [ -z "$chosen" ]; then
        echo "N=$n: no row of $val reached the plain row on validation at round 40"
        return
    fi
    taskset -c "$cpu" python bench/bench_rounds.py "${COMMON[@]}" --eval-split test \
        --peers "$n" --seeds 5 --chosen-on "validation (bench/results/$val.json)" \
        --rows "" --row "${chosen%%=*}=$ROW,${chosen#*=}" --out "$test"
}

# lever_run NAME ROWS PHASE: the screen of one lever. ROWS is a function that prints the
# rows (NAME=SETTINGS) for an lr; N=4 at lr 0.032 on core 0 and N=16 at lr 0.064 on core 1
# (the scaling curve's steps), side by side. PHASE: val (NAME-val), test (NAME-test from
# NAME-val, lever_test), or all.
lever_run() {
    local name=$1 rows=$2 phase=${3:-all} a b
    if [ "$phase" = all ] || [ "$phase" = val ]; then
        # shellcheck disable=SC2046
        lever_val "$name-val" 4 0 $("$rows" 0.032) & a=$!
        # shellcheck disable=SC2046
        lever_val "$name-val" 16 1 $("$rows" 0.064) & b=$!
        wait "$a" "$b"
    fi
    if [ "$phase" = all ] || [ "$phase" = test ]; then
        lever_test "$name-val" "$name-test" 4 0 & a=$!
        lever_test "$name-val" "$name-test" 16 1 & b=$!
        wait "$a" "$b"
    fi
}
