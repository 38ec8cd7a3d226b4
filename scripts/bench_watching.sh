#!/usr/bin/env bash
# What watching a run costs in training throughput (docs/training.md, "Watching a run"):
# `grt train` tokens/s with the step-time breakdown (on every step by default: LOG_EVERY=1, its
# worst case, every step a logging step) against train.time_breakdown=false, and, given a checkout
# of the code before the breakdown and the profiler existed (BASELINE=<dir>), that code with
# the same settings: the cost of tracing off. The arms alternate, ROUNDS times each, so that
# a burst of other work on the machine hits every arm; each arm's tokens/s is the harmonic
# mean of its logged windows after the first (warm-up).
#
#   bash scripts/bench_watching.sh                     (ROUNDS=3 STEPS=120 LOG_EVERY=1 PRESET=micro-grt)
#   BASELINE=/path/to/old/checkout bash scripts/bench_watching.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3} steps=${STEPS:-120} log_every=${LOG_EVERY:-1} preset=${PRESET:-micro-grt}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
python3 -m pretrain.cli data tokenizer -i examples/data/tinyshakespeare.txt --txt-mode paragraph --vocab-size 512 \
  -o "$work/tok" -q
python3 -m pretrain.cli data prepare -i examples/data/tinyshakespeare.txt -t "$work/tok.model" -o "$work/shards" \
  --seq-len 64 --val-fraction 0.05 -q

# arm NAME CODE_DIR SETTINGS...: one run, its windows' tokens/s appended to $work/NAME.tps
arm() {
  local name=$1 code=$2
  shift 2
  rm -rf "$work/run"
  (cd "$code" && PYTHONPATH="$code" python3 -m pretrain.cli train --preset "$preset" --data "$work/shards/manifest.json" \
    --out "$work/run" --steps "$steps" --micro-batch-size 4 --ds-config ds_configs/zero1.json \
    --set train.eval_every=0 --set train.save_final=false --set "train.log_every=$log_every" "$@") > "$work/log" 2>&1 ||
    { tail -20 "$work/log"; exit 1; }
  grep -o '[0-9.]* tok/s' "$work/log" | awk -v skip=$(( 10 / log_every )) 'NR > skip { print $1 }' >> "$work/$name.tps"
}

arms=(breakdown off)
[ -n "${BASELINE:-}" ] && arms+=(baseline)
for ((i = 0; i < rounds; i++)); do
  arm breakdown "$PWD"
  arm off "$PWD" --set train.time_breakdown=false
  [ -n "${BASELINE:-}" ] && arm baseline "$BASELINE"
done
echo "# reproduce: ${BASELINE:+BASELINE=$BASELINE }ROUNDS=$rounds STEPS=$steps LOG_EVERY=$log_every PRESET=$preset bash scripts/bench_watching.sh"
for name in "${arms[@]}"; do
  awk -v n="$name" '{ k++; s += 1 / $1 } END { printf "%-10s %8.0f tok/s (harmonic mean of %d logged windows)\n", n, k / s, k }' \
    "$work/$name.tps"
done
