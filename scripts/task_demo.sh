#!/usr/bin/env bash
# The task demo: a task whose answers need several sequential lookups (chains of assignments,
# data_pipeline/chains.py), where a GRT's loop steps after the first should do work. Writes the
# task's data (`grt data chains`), trains tiny-grt on it with `grt train` (DeepSpeed, CPU) and
# prints answer accuracy by k (lookups needed) and loop step (`grt eval --tasks chains`).
# Run after the main job's install (bash scripts/demo.sh); a few CPU minutes.
#   bash scripts/task_demo.sh [OUT]   (default runs/task_demo)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/task_demo}
grt() { python3 -m pretrain.cli "$@"; }

# the task: TASK_FLAGS, and the recipe: TRAIN_FLAGS (docs/comparison.md, "A task where depth matters")
TASK_FLAGS=(--train-samples 20000 --val-samples 1000 --min-hops 1 --max-hops 4)
TRAIN_FLAGS=(--preset tiny-grt --steps 600 --micro-batch-size 32
  --set train.lr=2e-3 --set train.min_lr=2e-4 --set train.warmup_steps=50
  --set train.eval_every=600 --set train.save_every=600 --set train.log_every=100)

echo "[1/3] the chains task: $OUT/data"
grt data chains -o "$OUT/data" "${TASK_FLAGS[@]}"
echo "[2/3] training tiny-grt on it: $OUT/grt"
grt train --data "$OUT/data/manifest.json" --out "$OUT/grt" "${TRAIN_FLAGS[@]}" > "$OUT/train.log" 2>&1 ||
  { tail -n 20 "$OUT/train.log"; exit 1; }
grep "INFO step .*/" "$OUT/train.log" | tail -n 1 | sed 's/.*INFO //; s/ | lr .*//'
grep "INFO validation at step" "$OUT/train.log" | tail -n 2 | sed 's/.*INFO //'
echo "[3/3] answer accuracy by k and loop step (0 = prelude straight to coda):"
grt eval "$OUT/grt" --tasks chains --json-out "$OUT/chains_eval.json" --quiet 2>&1 | grep -v "real_accelerator\|: start: "
