#!/usr/bin/env bash
# The GPU check (docs/gpu.md), planned for the GPU machine's limits: 15 minutes of device time in
# all (the machine's start, 2-3 of them, included), at most 10 minutes a call, at most 8 files back.
# The budgets leave one rerun of either call at a 240 s start: start + call 1 + call 2 + a rerun <= 15 minutes.
#
#   scripts/gpu_check.sh [1]     call 1 (215 s of work): `grt train` throughput of dense-small (first: the
#                                baseline) and grt-small, ZeRO-2 and 3, eager and compiled: every goal's ratio
#   scripts/gpu_check.sh 2       call 2 (155 s): the CUDA numerics (`grt bench loss` against its reference,
#                                the bf16 loop state), a functional smoke at GPT-2 size (train with eval and
#                                a checkpoint, resume, export, eval, generate), the host syncs, the ZeRO-3
#                                persistence A/B, checkpointing with compile, medium/large, then decode,
#                                bf16 training and train-step benches
#   scripts/gpu_check.sh --cpu [1|2]   the same rows at a tiny size on the CPU (micro presets, seq 64)
#   scripts/gpu_check.sh --plan [--cpu] [1|2]   print the call's budget and the device's sum, then its
#                                rows (name, limit, estimated seconds on a cold H200, command) and what
#                                the estimates leave of the budget, without running them (it writes only
#                                the persistence A/B's DeepSpeed file, which its rows name)
#
# Every row is its own process under `timeout -k`, given at most what is left of the call's budget
# (GPU_CHECK_BUDGET_S, counted from the script's start, the wheels' install included). A row that would
# start with under GPU_CHECK_MIN_LEFT_S (10) left, or that the budget cut, is "skipped (budget)". A failed
# `data` row, or a failed first dense row of call 1 (the baseline: no ratio without it), ends the call at
# once; a failed GRT row ends nothing. A row that needs another (the smoke's) is skipped when that failed. Each row is
# printed and appended to $OUT/results.tsv the moment it ends, its log to $OUT/log.txt (the last 40
# lines, a failed row's whole log) and to $OUT/logs.tar.gz (every row's whole log), and $OUT/summary.md
# is rewritten after it, so a call killed halfway keeps every row it finished. $OUT (default
# ./gpu_check; emptied, not removed: it may be a mount point) gets 6 files: env.txt, results.tsv,
# log.txt, logs.tar.gz, summary.md, bench.txt; runs, shards and caches go to $GPU_CHECK_WORK (default
# $TMPDIR/gpu_check_work).
#
#   GPU_CHECK_ROWS='^(data|perf-)' scripts/gpu_check.sh   only the rows whose name matches (a bash regex)
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0 plan=0 call=1
for arg in "$@"; do
  case "$arg" in
    --cpu) cpu=1 ;;
    --plan) plan=1 ;;
    1|2) call=$arg ;;
    *) echo "usage: scripts/gpu_check.sh [--cpu] [--plan] [1|2]" >&2; exit 2 ;;
  esac
done
started=$(date +%s)
out="${OUT:-gpu_check}"
work="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check_work}"
# the device call's timeout_s is the budget plus SPARE_S: a cut row's 5 s to die (`timeout -k 5`), the last
# archive and summary. DEVICE_S in all, START_S of it the machine's start (240 s: the longest seen):
# START_S + call 1 + call 2 + a rerun of the longer <= DEVICE_S, the rest for the pauses between calls
# (tests/launch/test_gpu_check.py)
DEVICE_S=900 START_S=240 SPARE_S=15 BUDGET_1=215 BUDGET_2=155
BUDGET_S=$([ "$call" = 1 ] && echo "$BUDGET_1" || echo "$BUDGET_2")
budget="${GPU_CHECK_BUDGET_S:-$([ "$cpu" = 1 ] && echo 1800 || echo "$BUDGET_S")}"
min_left="${GPU_CHECK_MIN_LEFT_S:-10}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the rows share one compile cache: a later row reuses the kernels an earlier one compiled
export TORCHINDUCTOR_CACHE_DIR="$work/cache/inductor" TRITON_CACHE_DIR="$work/cache/triton"

if [ "$cpu" = 1 ]; then
  # TRITON_INTERPRET: the fused gate's Triton kernel runs (interpreted) in the eager rows, as on CUDA
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 TRITON_INTERPRET=1
  grt_small=micro-grt dense_small=micro-dense grt_medium=micro-grt grt_large=micro-grt
  seq=64 mbs=2 perf_steps=6 log_every=3 smoke_steps=4 resume_steps=6 eval_batches=1  # 2 logged windows a perf row
  limit_train=240 limit_big=240 limit_compiled=400 limit_other=240 limit_first=240
  decode=(--prompt-len 16 --new-tokens 16) bench_d=64 bench_heads=4 precision=(micro-grt 20) loss_tokens=1024
else
  grt_small=grt-small dense_small=dense-small grt_medium=grt-medium grt_large=grt-large
  # 24 steps logged every 8: 16 measured after the first window (a row's cost is its start, not its steps)
  seq=1024 mbs=16 perf_steps=24 log_every=8 smoke_steps=20 resume_steps=30 eval_batches=4
  # limit_first: a call's first training row pays the cold start (CUDA context, cuBLAS, the gate's Triton
  # kernel, the loss chunk's inductor compile: ~35 s on top of a row's ~20 s)
  limit_train=60 limit_big=90 limit_compiled=100 limit_other=60 limit_first=120
  decode=() bench_d=768 bench_heads=12 precision=(tiny-grt 100) loss_tokens=16384  # the loss of one micro-batch
fi
data="$work/data/manifest.json"
tokenizer=examples/tokenizers/gutenberg-50257.model  # GPT-2's vocabulary size: the head and loss cost what they cost

# empty DIR: made if absent, its contents removed (the folder itself may be a mount point)
empty() { mkdir -p "$1" && find "$1" -mindepth 1 -delete; }

if [ "$plan" = 0 ]; then
  # the compile caches stay: a rerun, or call 2 after call 1 on the same machine, reuses their kernels
  empty "$out" && mkdir -p "$work" && find "$work" -mindepth 1 -maxdepth 1 ! -name cache -exec rm -rf {} + \
    && mkdir -p "$work/logs" || exit 1
  : > "$out/results.tsv"; : > "$out/log.txt"; : > "$out/bench.txt"; : > "$out/summary.md"
  . scripts/gpu_env.sh
  gpu_env_install "$out/env.txt" || exit 1
else
  mkdir -p "$work"
  printf '# call %s: budget %s s, timeout_s %s\n' "$call" "$budget" "$((budget + SPARE_S))"
  call1_s=$((BUDGET_1 + SPARE_S)) call2_s=$((BUDGET_2 + SPARE_S))
  rerun_s=$((call1_s > call2_s ? call1_s : call2_s))
  [ "$cpu" = 0 ] && printf '# device: start %s + call 1 %s + call 2 %s + a rerun of either %s = %s s of %s\n' \
    "$START_S" "$call1_s" "$call2_s" "$rerun_s" "$((START_S + call1_s + call2_s + rerun_s))" "$DEVICE_S"
fi
# the ZeRO-3 persistence A/B's other arm: DeepSpeed's default threshold of 1e5 elements
python3 - "$work/zero3-persist1e5.json" <<'EOF'
import json, sys
ds = json.load(open("ds_configs/zero3.json"))
ds["zero_optimization"]["stage3_param_persistence_threshold"] = 100000
json.dump(ds, open(sys.argv[1], "w"), indent=2)
EOF

# record NAME SECONDS TOKENS_S MFU PEAK_MB RESULT: one line of results.tsv, printed as it is written
record() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$call" "$2" "$3" "$4" "$5" "$6" >> "$out/results.tsv"
  printf 'gpu_check: %-40s %-16s %6ss  %s tok/s  MFU %s%%  peak %s MB\n' "$1" "$6" "$2" "$3" "$4" "$5"
}

# after each row: the whole logs archived and the summary rewritten, each written whole then renamed,
# so that a call killed meanwhile keeps the previous ones, never half of one
publish() {
  tar -czf "$work/logs.tar.gz" -C "$work" logs && mv "$work/logs.tar.gz" "$out/logs.tar.gz"
  python3 scripts/gpu_check_summary.py "$out/results.tsv" > "$work/summary.md" && mv "$work/summary.md" "$out/summary.md"
}

wanted() { [[ $1 =~ ${GPU_CHECK_ROWS:-.} ]]; }

# estimate NAME: seconds the row takes on a warm H200 (guesses, none measured on a GPU yet; docs/gpu.md has the
# CPU rehearsal's times): a row's start ~12 s (imports, DeepSpeed, the engine). The callers add the cold starts
# (`extra_s`): ~28 s to the call's first training row (CUDA, cuBLAS, the loss chunk's compile, the fused paths'
# trials), ~5 s to its first GRT row (the gate's Triton kernel) and ~18 s to each model's first compiled row
# (inductor's kernels: a later compiled row of the same model finds them in the shared cache)
cold_first=1 cold_grt=1 cold_compiled="" planned_s=0 first_cut=""
estimate() {
  local s
  case "$1" in
    data) s=10 ;;
    perf-*-compiled | ckpt-*-compiled) s=20 ;;
    perf-* | persist-*) s=14 ;;
    smoke-train | smoke-resume) s=25 ;;
    smoke-*) s=10 ;;
    bench-loss) s=20 ;;  # two fresh processes: the reference and the compiled chunk, one micro-batch's tokens
    bench-precision) s=10 ;;  # the loop state's errors, no training
    syncs-*) s=20 ;;
    medium-*) s=30 ;;
    large-*) s=45 ;;
    bench-decode) s=25 ;;
    bench-precision-train) s=60 ;;  # three short `grt train` runs
    *) s=40 ;;
  esac
  echo $((s + ${extra_s:-0}))
}

# row NAME LIMIT_S COMMAND...: run it under `timeout` (at most what is left of the budget), then record
# it. A training row's tokens/s and MFU are over its logged windows after the first (warm-up and compile).
# With gate=1 (the data row, call 1's first dense row) a failure ends the call; with needs=ROW, the row is
# skipped unless ROW passed in this call.
declare -A passed=()
row() {
  local name=$1 limit=$2 left start rc log seconds status tps mfu peak cut=0
  shift 2
  wanted "$name" || return 0
  if [ "$plan" = 1 ]; then
    local est
    if [ "$cpu" = 1 ]; then est=-; else
      est=$(estimate "$name")
      planned_s=$((planned_s + est))
      (( planned_s > budget )) && [ -z "$first_cut" ] && first_cut=$name
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$limit" "$est" "$(printf '%q ' "$@")"
    return 0
  fi
  if [ -n "${needs:-}" ] && [ -z "${passed[$needs]:-}" ]; then
    record "$name" 0 - - - "skipped (needs $needs)"
    publish
    return 0
  fi
  left=$(( budget - ($(date +%s) - started) ))
  if (( left < min_left )); then
    record "$name" 0 - - - "skipped (budget)"
    publish
    return 0
  fi
  (( limit > left )) && { limit=$left; cut=1; }
  log="$work/logs/$name.log"
  # `grt` is the checkout's own CLI: the GPU machine has the dependencies' wheels, not this package installed
  [ "$1" = grt ] && { shift; set -- python3 -m pretrain.cli "$@"; }
  start=$(date +%s%N)
  # --foreground: the row stays in the call's process group, so that whoever ends the call ends its row too
  timeout --foreground -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  seconds=$(awk -v s="$start" -v e="$(date +%s%N)" 'BEGIN { printf "%.1f", (e - s) / 1e9 }')
  status=pass
  if [ "$rc" != 0 ]; then
    if [ "$cut" = 1 ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; }; then
      status="skipped (budget)"  # stopped by what was left of the budget, not by its own limit
    else
      status="FAIL (exit $rc$([ "$rc" = 124 ] && echo ": timed out after ${limit}s"))"
    fi
  fi
  # harmonic means over the windows after the first: equal tokens per window, so tokens over time
  tps=$(grep -o '[0-9.]* tok/s' "$log" | awk 'NR > 1 { n++; s += 1 / $1 } END { if (n) printf "%.0f", n / s; else print "-" }')
  mfu=$(grep -o 'MFU [0-9.]*%' "$log" | tr -d '%' | awk 'NR > 1 { n++; s += 1 / $2 } END { if (n) printf "%.2f", n / s; else print "-" }')
  peak=$(grep -o 'peak mem [0-9]* MB' "$log" | tail -1 | awk '{ print $3 }')
  if [ "$status" = pass ]; then
    { echo "===== $name ($status, ${seconds}s): the last 40 lines of its log"; tail -40 "$log"; } >> "$out/log.txt"
  else
    { echo "===== $name ($status, ${seconds}s): its whole log"; cat "$log"; } >> "$out/log.txt"
  fi
  grep -q '^# reproduce' "$log" && { echo "## $name"; sed -n '/^# reproduce/,$p' "$log"; echo; } >> "$out/bench.txt"
  record "$name" "$seconds" "$tps" "$mfu" "${peak:--}" "$status"
  [ "$status" = pass ] && passed[$name]=1
  publish
  if [ "${gate:-0}" = 1 ] && [[ $status == FAIL* ]]; then
    echo "gpu_check: $name failed, and the rows after it need it: the call ends here. Its whole log:" >&2
    cat "$log" >&2
    exit 1
  fi
}

# train ROW LIMIT PRESET STAGE STEPS RUN [args]: `grt train` at the check's sequence length and micro-batch,
# in bf16 (what `auto` is on CUDA; on the CPU, so that --cpu rehearses DeepSpeed's bf16 mode). The call's
# first training row is given the cold start's time (limit_first); in call 1 it is the dense baseline and a
# gate (every ratio needs it); a GRT row is never one. compiled=true: a compiled row (the estimate's cold compile).
train() {
  local name=$1 limit=$2 preset=$3 stage=$4 steps=$5 run=$6 gate=0 extra_s=0
  shift 6
  if wanted "$name"; then
    if [ "$cold_first" = 1 ]; then
      cold_first=0 extra_s=28
      (( limit < limit_first )) && limit=$limit_first
      [ "$call" = 1 ] && [[ $preset == *dense* ]] && gate=1
    fi
    [[ $preset != *dense* ]] && [ "$cold_grt" = 1 ] && { cold_grt=0 extra_s=$((extra_s + 5)); }
    if [ "${compiled:-false}" = true ] && [[ " $cold_compiled " != *" $preset "* ]]; then
      cold_compiled="$cold_compiled $preset" extra_s=$((extra_s + 18))
    fi
  fi
  row "$name" "$limit" grt train --preset "$preset" --data "$data" --out "$work/$run" --steps "$steps" \
    --micro-batch-size "$mbs" --ds-config "ds_configs/zero$stage.json" --set "train.log_every=$log_every" \
    --set train.precision=bf16 "$@"
}

# perf ROW PRESET STAGE COMPILE CHECKPOINTING [args]: a throughput row at the trained depth R every step (the
# GRT and dense-small at equal FLOPs), without evaluation or checkpoints
perf() {
  local name=$1 preset=$2 stage=$3 compile=$4 ckpt=$5 limit=$limit_train
  shift 5
  [ "$compile" = true ] && limit=$limit_compiled
  compiled=$compile train "$name" "$limit" "$preset" "$stage" "$perf_steps" "run-$name" --set train.depth_sampling=fixed \
    --set train.eval_every=0 --set train.save_every=0 --set train.save_final=false \
    --set "train.compile=$compile" --set "train.activation_checkpointing=$ckpt" --set train.warmup_steps=5 "$@"
}

smoke() {  # train with eval and a checkpoint, resume it, export, eval, generate (run directory $work/smoke)
  train smoke-train "$limit_train" "$grt_small" 3 "$smoke_steps" smoke --set "train.eval_every=$smoke_steps" \
    --set "train.eval_batches=$eval_batches" --set "train.save_every=$smoke_steps"
  needs=smoke-train train smoke-resume "$limit_train" "$grt_small" 3 "$resume_steps" smoke --set "train.eval_every=$smoke_steps" \
    --set "train.eval_batches=$eval_batches" --set "train.save_every=$smoke_steps" --resume
  needs=smoke-train row smoke-export "$limit_other" grt export --checkpoint "$work/smoke" --out "$work/export" --no-hf
  needs=smoke-export row smoke-eval "$limit_other" grt eval "$work/export" --tasks val --data "$data" --max-batches "$eval_batches" \
    --json-out "$work/eval.json"
  needs=smoke-export row smoke-generate "$limit_other" grt generate "$work/export" --prompt "ROMEO:" --max-new-tokens 32 --kv-cache first
}

# syncs ROW STAGE: the host syncs of `grt train` per step by call site, with the time the host waited in each
syncs() {
  row "$1" "$limit_train" python3 scripts/gpu_syncs.py "$work/$1.json" --preset "$grt_small" --data "$data" \
    --out "$work/run-$1" --steps 12 --micro-batch-size "$mbs" --ds-config "ds_configs/zero$2.json" \
    --set train.log_every=4 --set train.precision=bf16 --set train.depth_sampling=fixed --set train.eval_every=0 \
    --set train.save_every=0 --set train.save_final=false
}

gate=1 row data "$limit_other" grt data prepare -i examples/data/tinyshakespeare.txt --txt-mode paragraph \
  -t "$tokenizer" -o "$work/data" --seq-len "$seq" --shard-size-mb 1 --val-fraction 0.05 -q
if [ "$call" = 1 ]; then
  # ZeRO-2 eager, then compiled, then ZeRO-3 compiled and eager, dense first in each pair: the dense baseline
  # before any GRT row, and a pair's two rows next to each other (a cut takes whole pairs)
  for how in 2-false 2-true 3-true 3-false; do
    stage=${how%-*} compile=${how#*-}
    for preset in "$dense_small" "$grt_small"; do
      perf "perf-$preset-z$stage-$([ "$compile" = true ] && echo compiled || echo eager)" "$preset" "$stage" "$compile" off
    done
  done
else
  # in the order of what a row tells that no other does: the rows at the end are the first the budget cuts.
  # First the CUDA numerics: the loss (reference and compiled chunk, one micro-batch's tokens) and the bf16 loop
  # state's error (no training: the bf16 runs come at the end)
  row bench-loss "$limit_other" grt bench loss --rows plain,compiled --tokens "$loss_tokens"
  row bench-precision "$limit_other" grt bench precision --preset "${precision[0]}" --train-steps 0 --seq-len 64
  smoke
  syncs syncs-z2 2
  syncs syncs-z3 3
  # the ZeRO-3 knob with the depth changing every step: every parameter resident (the trainer's setting
  # on one GPU, perf-*-z3 rows of call 1) against DeepSpeed's 1e5
  perf "persist-$grt_small-z3-1e5-uniform" "$grt_small" 3 false off --ds-config "$work/zero3-persist1e5.json" \
    --set train.depth_sampling=uniform
  perf "persist-$grt_small-z3-trainer-uniform" "$grt_small" 3 false off --set train.depth_sampling=uniform
  # checkpointing composed with compile (ZeRO-2: ZeRO-3 refuses selective)
  perf "ckpt-$grt_small-z2-loop_step-compiled" "$grt_small" 2 true loop_step
  perf "ckpt-$grt_small-z2-selective-compiled" "$grt_small" 2 true selective
  # medium and large on one GPU, checkpointing as `auto` picks it
  limit_train=$limit_big perf "medium-$grt_medium-z3-auto" "$grt_medium" 3 false auto
  limit_train=$limit_big perf "large-$grt_large-z3-auto" "$grt_large" 3 false auto
  needs=smoke-export row bench-decode "$limit_other" grt bench decode --model "$work/export" --dense-preset "$dense_small" \
    --batch-sizes 1 ${decode[@]+"${decode[@]}"} --json "$work/decode.json"
  row bench-precision-train "$limit_compiled" grt bench precision --preset "${precision[0]}" \
    --train-steps "${precision[1]}" --seq-len 64
  row bench-train-step "$limit_compiled" grt bench train-step --layout 1+1x10+1 --d-model "$bench_d" --n-heads "$bench_heads" \
    --seq-len "$seq" --batch "$mbs" --vocab 50257 --steps 10 --warmup 3 --dtype bf16 --compile
fi

if [ "$plan" = 1 ]; then
  [ "$cpu" = 1 ] && exit 0
  printf '# estimated %s s of work for the budget of %s s (a cold machine; estimates, not measurements)' \
    "$planned_s" "$budget"
  if [ -n "$first_cut" ]; then printf ': from %s on, rows are expected to be skipped (budget)\n' "$first_cut"
  else printf ': every row is expected to run\n'; fi
  exit 0
fi
echo
cat "$out/summary.md"
if grep -q $'\tFAIL' "$out/results.tsv"; then
  echo "gpu_check: some rows failed; their whole logs are in $out/log.txt (every row's in $out/logs.tar.gz)" >&2
  exit 1
fi
