#!/usr/bin/env bash
# GPU benchmark in one call on a single H200 (about 6-8 minutes): GRT-small vs the dense model
# of equal FLOPs (bf16, flash attention, eager and compiled: tokens/s, MFU, ratio), `grt train`
# under ZeRO-2 and ZeRO-3 for grt-small and dense-small on one GPU, and decode latency per KV-cache strategy. Figures go to $OUT (or ./gpu_bench).
# Record the printed tables in docs/performance.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_bench}"; mkdir -p "$out"
python3 -m pip install -q -e . 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pretrain.cli bench train-step --layout 1+1x10+1 --d-model 768 --n-heads 12 --seq-len 1024 \
    --batch 16 --vocab 50257 --steps 10 --warmup 3 --dtype bf16 --compile | tee "$out/train_step.txt"
python3 -m pretrain.cli bench zero --stages 2 3 --ranks 1 --presets grt-small dense-small --compile off --checkpointing off --seq-len 1024 \
    --micro-batch-size 16 --steps 20 | tee "$out/zero.txt"
python3 -m pretrain.cli bench decode | tee "$out/decode.txt"
