#!/usr/bin/env bash
# Every command on one GPU machine, in one go (docs/gpu.md): data, train (ZeRO-1, 2 and 3,
# evaluation and checkpoints on), resume, export, eval, generate, analyze, bench decode and a
# two-config compare. Prints one table (command, ZeRO stage, seconds, tokens/s, MFU, pass/fail)
# and exits non-zero if any row failed. Every row runs as its own process under a time limit, so
# a command that does not exit by itself fails its row instead of stalling the script.
#
#   scripts/gpu_check.sh           # on the GPU: tiny-grt and grt-small, about 100 steps each
#   scripts/gpu_check.sh --cpu     # the same rows at a tiny size on the CPU (checks the script)
#
# Outputs go to $OUT (default ./gpu_check): one log per row, rows.tsv and table.md; the benchmark
# rows' own tables (grt bench) are printed after the table.
#
#   GPU_CHECK_PERF=0 scripts/gpu_check.sh                # skip issue 14's throughput rows
#   GPU_CHECK_ROWS='^(data|bench-)' scripts/gpu_check.sh # only the rows whose name matches (a bash regex)
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
case "${1:-}" in
  --cpu) cpu=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--cpu]" >&2; exit 2 ;;
esac
out="${OUT:-gpu_check}"
rm -rf "$out" && mkdir -p "$out" || exit 1
. scripts/gpu_env.sh
gpu_env_install || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
grt() { python3 -m pretrain.cli "$@"; }

if [ "$cpu" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  small=micro-grt; large=micro-dense; dense=micro-dense; steps=4; resume_steps=6
  seq=64; vocab=512; mbs=2; eval_batches=1; compare_tokens=1024; limit=300
  decode=(--prompt-len 16 --new-tokens 32)  # within the micro models' context of 64
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  small=tiny-grt; large=grt-small; dense=tiny-dense; steps=100; resume_steps=120
  seq=1024; vocab=4096; mbs=8; eval_batches=4; compare_tokens=800000; limit=600
  decode=()
fi
data="$out/data/shards/manifest.json"
rows="$out/rows.tsv"
: > "$rows"

# row NAME STAGE COMMAND...: run it (output in $out/NAME.log) and record one table row; tokens/s
# and MFU come from the last step the command logged, if it trains.
row() {
  local name=$1 stage=$2 start rc tps mfu status seconds
  shift 2
  [[ $name =~ ${GPU_CHECK_ROWS:-.} ]] || return 0
  start=$(date +%s%N)
  timeout "${row_limit:-$limit}" "$@" > "$out/$name.log" 2>&1
  rc=$?
  seconds=$(awk -v s="$start" -v e="$(date +%s%N)" 'BEGIN { printf "%.1f", (e - s) / 1e9 }')
  tps=$(grep -o '[0-9.]* tok/s' "$out/$name.log" | tail -1 | cut -d' ' -f1)
  mfu=$(grep -o 'MFU [0-9.]*%' "$out/$name.log" | tail -1 | cut -d' ' -f2)
  status=pass
  [ "$rc" = 0 ] || status="FAIL (exit $rc)"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$stage" "$seconds" "${tps:--}" "${mfu:--}" "$status" >> "$rows"
  echo "$name: $status" >&2
}

train() {  # train ROW RUN PRESET STAGE STEPS [extra args]: run directory $out/RUN
  local name=$1 run=$2 preset=$3 stage=$4 n=$5
  shift 5
  row "$name" "$stage" grt train --preset "$preset" --data "$data" --out "$out/$run" --steps "$n" \
    --micro-batch-size "$mbs" --ds-config "ds_configs/zero$stage.json" --set "train.eval_every=$steps" \
    --set "train.eval_batches=$eval_batches" --set "train.save_every=$steps" --set train.log_every=10 "$@"
}

text=examples/data/tinyshakespeare.txt
row data - bash -c "python3 -m pretrain.cli data tokenizer -i $text --txt-mode paragraph --vocab-size $vocab \
  -o $out/data/tok -q && python3 -m pretrain.cli data prepare -i $text --txt-mode paragraph -t $out/data/tok.model \
  -o $out/data/shards --seq-len $seq --shard-size-mb 1 --val-fraction 0.05 -q"
for stage in 1 2 3; do
  train "train-$small-z$stage" "run-$small-z$stage" "$small" "$stage" "$steps"
done
train "train-$large-z3" "run-$large-z3" "$large" 3 "$steps"
# continue the ZeRO-3 run from its last checkpoint
train "resume-$small-z3" "run-$small-z3" "$small" 3 "$resume_steps" --resume
export_dir="$out/export-$small"
row export 3 grt export --checkpoint "$out/run-$small-z3" --out "$export_dir" --no-hf  # no transformers on the GPU machine
row eval - grt eval "$export_dir" --tasks val --data "$data" --max-batches "$eval_batches" \
  --json-out "$out/eval.json"
row generate - grt generate "$export_dir" --prompt "ROMEO:" --max-new-tokens 64 --kv-cache first
row analyze - grt analyze "$export_dir" --out "$out/analysis" --data "$data" --max-batches "$eval_batches" \
  --freq-batches 10
row bench-decode - grt bench decode --model "$export_dir" --dense-preset "$dense" --batch-sizes 1 \
  "${decode[@]}" --json "$out/decode.json"
row compare 1 grt compare --configs "$small,$dense" --data "$data" --out "$out/compare" --tokens "$compare_tokens" \
  --micro-batch-size "$mbs" --ds-config ds_configs/zero1.json --evals 1 --eval-batches "$eval_batches"
if [ "$cpu" = 1 ]; then
  # the benchmark's flags at a tiny size: ZeRO-3, `auto` checkpointing, the persistence A/B
  row bench-zero 3 grt bench zero --stages 3 --presets "$small" --compile off --checkpointing auto \
    --persistence-threshold trainer 1000 --seq-len "$seq" --micro-batch-size "$mbs" --steps 4
elif [ "${GPU_CHECK_PERF:-1}" = 1 ]; then
  # issue 14's throughput rows (GPU_CHECK_PERF=0 skips them), each a table in $out/bench-*.log:
  # the bare step, GRT vs dense at equal FLOPs, eager and compiled; then real `grt train` runs
  # (tokens/s, MFU, peak memory) per preset x ZeRO stage x compile x checkpointing, as ratios
  # to the bare step. One GPU, seq 1024, micro-batch 16, vocabulary 512 (bench zero's tokenizer).
  row bench-train-step - grt bench train-step --layout 1+1x10+1 --d-model 768 --n-heads 12 --seq-len 1024 \
    --batch 16 --vocab 50257 --steps 10 --warmup 3 --dtype bf16 --compile
  zero=(grt bench zero --ranks 1 --seq-len 1024 --micro-batch-size 16 --steps 20 --persistence-threshold trainer)
  row_limit=1800 row bench-zero-z2 2 "${zero[@]}" --stages 2 --presets grt-small dense-small --compile off on \
    --checkpointing off selective loop_step
  # ZeRO-3 refuses selective checkpointing (wrong gradients, docs/performance.md)
  row_limit=1800 row bench-zero-z3 3 "${zero[@]}" --stages 3 --presets grt-small dense-small --compile off on \
    --checkpointing off loop_step
  # the ZeRO-3 knob: every parameter resident on one GPU (the trainer's) against DeepSpeed's 1e5,
  # with uniform depth sampling (the depth changes every step)
  row bench-zero-z3-persistence 3 "${zero[@]}" --stages 3 --presets grt-small --compile off --checkpointing off \
    --depth-sampling uniform --persistence-threshold trainer 100000
  # grt-medium and grt-large on one GPU, checkpointing as `auto` picks it
  row_limit=1800 row bench-zero-large 2,3 "${zero[@]}" --stages 2 3 --presets grt-medium grt-large --compile off \
    --checkpointing auto
fi

python3 - "$rows" "$out/table.md" <<'EOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
head = ["command", "ZeRO stage", "seconds", "tokens/s", "MFU", "result"]
lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
for log in "$out"/bench-*.log; do
  grep -q "^# reproduce" "$log" 2>/dev/null && { echo; echo "## $(basename "$log" .log)"; sed -n '/^# reproduce/,$p' "$log"; }
done
if grep -q $'\tFAIL' "$rows"; then
  echo "gpu_check: some rows failed; see the logs in $out/" >&2
  exit 1
fi
