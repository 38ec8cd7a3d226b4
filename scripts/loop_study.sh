#!/usr/bin/env bash
# The paper's orderings at the largest scale this machine trains (docs/comparison.md, "The loop
# study"): the tiny ablation ladder (loop only -> + prelude/coda -> + state noise -> + re-injection
# -> + gate = the GRT), the GRT's ungated neighbour (ladder-3) and the dense model of equal FLOPs
# (tiny-dense), with the GRT's controls (pretrain/tools/compare/controls.py): the dense model of equal
# parameters, the same layout at R = 1 and at depth fixed at R, the paper's start, and the dense
# model of its training FLOPs; on the Gutenberg corpus, over seeds, each run `grt train` with the
# real DeepSpeed engine. Finished runs are reused, so the command can be run again to finish the
# table in parts; the table (mean ± sd over seeds, each ordering and control as a paired difference
# against the seed spread, the seeds that would detect the paper's difference) is <out>/seeds.md.
# METHODS= replaces the list (e.g. METHODS=ladder-4-gate,ladder-4-gate:dense-params,ladder-4-gate:r1).
#
#   bash scripts/loop_study.sh                 (TOKENS=5e6 SEEDS=0,1,2 PARALLEL=2 OUT=runs/loop-study)
#   CORPUS=../shared/data/corpus TOKENS=1e6 SEEDS=0 bash scripts/loop_study.sh
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${CORPUS:-../shared/data/corpus} out=${OUT:-runs/loop-study}
tokens=${TOKENS:-5e6} seeds=${SEEDS:-0,1,2} parallel=${PARALLEL:-2}
ladder=ladder-0-loop-only,ladder-1-prelude-coda,ladder-2-noise,ladder-3-reinject,ladder-4-gate,tiny-dense
controls=ladder-4-gate:dense-params,ladder-4-gate:r1,ladder-4-gate:fixed,ladder-4-gate:paper-start
controls=$controls,ladder-4-gate:dense-train-flops
methods=${METHODS:-$ladder,$controls}
data="$out/data"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
if [ ! -f "$data/shards/manifest.json" ]; then
  # two of the corpus's four training files (61M characters, 18.9M tokens at vocabulary 4096), 2% of
  # their books held out for validation
  python3 -m pretrain.cli data tokenizer -i "$corpus/train-00000.jsonl.gz" --vocab-size 4096 --max-chars 10000000 \
    -o "$data/tok" -q
  python3 -m pretrain.cli data prepare -i "$corpus/train-00000.jsonl.gz" -i "$corpus/train-00001.jsonl.gz" \
    -t "$data/tok.model" -o "$data/shards" --seq-len 256 --val-fraction 0.02 -q
fi
exec python3 -m pretrain.cli compare \
  --configs "$methods" \
  --data "$data/shards/manifest.json" --out "$out" --tokens "$tokens" --seeds "$seeds" \
  --micro-batch-size 16 --lr 2e-3 --parallel "$parallel" --threads 1 --evals 4 --eval-batches 20
