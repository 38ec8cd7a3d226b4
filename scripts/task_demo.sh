#!/usr/bin/env bash
# The task demo: a task whose answers need several sequential lookups (chains of assignments,
# data_pipeline/chains.py), where a GRT's loop steps after the first do work. Writes the task's
# data with a loss mask on the answers (`grt data chains --loss-on answers`), trains a loop-only
# GRT (`1x4`: one shared block run 4 times, d 64) on it with `grt train` (DeepSpeed, CPU) and
# prints answer accuracy by k (lookups needed) and loop step (`grt eval --tasks chains`): the
# two-lookup items are answered after the second loop step, not after the first (3,000 steps:
# every seed measured learns that; at 1,500 some do not yet).
# Run after the main job's install (bash scripts/demo.sh); a few CPU minutes.
#   bash scripts/task_demo.sh [OUT]   (default runs/task_demo)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/task_demo}
grt() { python3 -m pretrain.cli "$@"; }

# the task: TASK_FLAGS, and the recipe: TRAIN_FLAGS (docs/comparison.md, "A task where depth matters")
TASK_FLAGS=(--min-hops 1 --max-hops 2 --num-vars 8 --num-values 8 --chains-per-sample 4 --queries all
  --compact --order by-name --train-samples 30000 --val-samples 256 --loss-on answers)
TRAIN_FLAGS=(--preset micro-grt --set model.layout=1x4 --set model.d_model=64 --set model.n_heads=4
  --steps 3000 --micro-batch-size 32 --set train.seed=0
  --set train.lr=3e-3 --set train.min_lr=3e-4 --set train.warmup_steps=150
  --set train.eval_every=3000 --set train.save_every=3000 --set train.log_every=100)

echo "[1/3] the chains task, answers as the only targets: $OUT/data"
grt data chains -o "$OUT/data" "${TASK_FLAGS[@]}"
echo "[2/3] training a loop-only GRT (1x4) on it: $OUT/grt"
grt train --data "$OUT/data/manifest.json" --out "$OUT/grt" "${TRAIN_FLAGS[@]}" > "$OUT/train.log" 2>&1 ||
  { tail -n 20 "$OUT/train.log"; exit 1; }
grep "INFO step .*/" "$OUT/train.log" | tail -n 1 | sed 's/.*INFO //; s/ | lr .*//'
grep "INFO validation at step" "$OUT/train.log" | tail -n 2 | sed 's/.*INFO //'
echo "[3/3] answer accuracy by k and loop step (depths 5, 6: beyond the trained R = 4):"
grt eval "$OUT/grt" --tasks chains --depths 1-6 --allow-beyond-trained --json-out "$OUT/chains_eval.json" --quiet 2>&1 |
  grep -v "real_accelerator\|: start: "
