#!/usr/bin/env bash
# The paper's comparison at GPU scale, in one call on one H200, under 9 minutes including
# set-up (issue 19; docs/comparison.md, "At GPU scale"). Run from anywhere in the checkout:
#
#   docs/comparison/run_gpu_comparison.sh               # on the GPU machine
#   docs/comparison/run_gpu_comparison.sh --cpu-smoke   # the same steps at a tiny size on CPU
#
# `grt compare --match flops` of dense, GRT, Huginn, RRT, Ouro and MoR, GRT with its gate bias
# at +4 (the default) and 0, and a second seed of GRT and of dense: 9 runs, one after another,
# at d 512, layout 1+2x4+1 (dense and the others FLOPs-matched to it), seq 512, a vocabulary of
# 8,192, on the Gutenberg books in runs/gpu-corpus/ (an ignored folder that the device call
# carries: train-00000..00002.jsonl.gz and val.jsonl.gz of the shared corpus, 38 MB). The
# tokens per run are sized by measurement (`--time-budget`: one step of each run is timed
# first); the early-exit curve goes to 2R. The table is printed; the table, JSON, plot, sizing
# and logs go to $OUT (default: <work>/results).
# The GPU machine has no network: missing Python packages come from the wheels in .whl/.
set -euo pipefail
cd "$(dirname "$0")/../.."

TOTAL_S=540      # 9 minutes, set-up included
COPY_S=15        # kept for copying the results out
smoke=0
case "${1:-}" in
  "") ;;
  --cpu-smoke) smoke=1 ;;
  *) echo "run_gpu_comparison.sh: unknown argument '$1' (accepted: --cpu-smoke)" >&2; exit 2 ;;
esac

. scripts/gpu_env.sh
gpu_env_install
grt() { python3 -m pretrain.cli "$@"; }
configs=tiny-grt,tiny-dense,tiny-huginn,tiny-rrt,tiny-ouro,tiny-mor,docs/comparison/grt-gate-bias-0.json,docs/comparison/tiny-grt-seed2.json,docs/comparison/tiny-dense-seed2.json

if [ "$smoke" = 1 ]; then
  TOTAL_S=110
  work=runs/gpu-comparison-smoke
  rm -rf "$work"
  mkdir -p "$work"
  grt data tokenizer -i examples/data/tinyshakespeare.txt --txt-mode paragraph --vocab-size 512 -o "$work/tok" -q
  grt data prepare -i examples/data/tinyshakespeare.txt --txt-mode paragraph -t "$work/tok.model" \
      -o "$work/shards" --seq-len 64 --shard-size-mb 0.2 --val-fraction 0.05 -q
  size=(--set model.d_model=32 --set model.n_heads=2 --set model.max_seq_len=64 --micro-batch-size 8 --lr 1e-2
        --min-tokens 1e4 --timing-steps 1 --evals 2 --eval-batches 2 --log-every 5)
else
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "run_gpu_comparison.sh: no CUDA device (for a CPU check, pass --cpu-smoke)" >&2; exit 2; }
  corpus=runs/gpu-corpus
  ls "$corpus"/train-*.jsonl.gz "$corpus/val.jsonl.gz" >/dev/null 2>&1 \
    || { echo "run_gpu_comparison.sh: $corpus/ needs train-*.jsonl.gz and val.jsonl.gz (copy them from the shared corpus)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  # DeepSpeed's FusedAdam is JIT-built for this GPU on first use (once, in the step timing)
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}"
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  work=runs/gpu-comparison
  rm -rf "$work"
  mkdir -p "$work"
  grt data tokenizer -i "$corpus/train-00000.jsonl.gz" --vocab-size 8192 --max-chars 5000000 -o "$work/tok" -q
  train_inputs=()
  for f in "$corpus"/train-*.jsonl.gz; do train_inputs+=(-i "$f"); done
  grt data prepare "${train_inputs[@]}" --val-input "$corpus/val.jsonl.gz" -t "$work/tok.model" -o "$work/shards" \
      --seq-len 512 --shard-size-mb 16 -q
  size=(--set model.d_model=512 --set model.n_heads=8 --set model.max_seq_len=512 --micro-batch-size 64 --lr 1.5e-3
        --min-tokens 3e7 --evals 4 --eval-batches 20 --log-every 20)
fi
out="${OUT:-$work/results}"
mkdir -p "$out"
budget=$((TOTAL_S - SECONDS - COPY_S))
echo "set-up took ${SECONDS} s; grt compare gets ${budget} s"
set +e
grt compare --data "$work/shards/manifest.json" --out "$work/compare" --configs "$configs" --match flops \
    --time-budget "$budget" --exit-depth-factor 2 --set train.activation_checkpointing=off "${size[@]}" \
    2>&1 | tee "$out/compare.log"
rc=${PIPESTATUS[0]}
set -e
# the results without the checkpoints
cp "$work"/compare/comparison.* "$work"/compare/loss_curves.png "$work"/compare/sizing.json "$work"/compare/*.log "$out"/ 2>/dev/null || true
for run in "$work"/compare/*/summary.json; do
  [ -e "$run" ] || continue
  dir=$(dirname "$run")
  mkdir -p "$out/runs/$(basename "$dir")"
  cp "$dir"/summary.json "$dir"/train.log "$dir"/metrics.jsonl "$dir"/config.json "$out/runs/$(basename "$dir")/" 2>/dev/null || true
done
echo "run_gpu_comparison.sh: grt compare exited $rc after ${SECONDS} s in all; results in $out"
exit "$rc"
