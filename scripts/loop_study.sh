#!/usr/bin/env bash
# The paper's orderings at the largest scale this machine trains (docs/comparison.md, "The loop
# study"): the tiny ablation ladder (loop only -> + prelude/coda -> + state noise -> + re-injection
# -> + gate = the GRT), the GRT's ungated neighbour (ladder-3) and the dense model of equal FLOPs
# (tiny-dense), on the Gutenberg corpus, over seeds, each run `grt train` with the real DeepSpeed
# engine. Finished runs are reused, so the command can be run again to finish the table in parts;
# the table (mean ± sd over seeds, the orderings against the seed spread) is <out>/seeds.md.
#
#   bash scripts/loop_study.sh                 (TOKENS=5e6 SEEDS=0,1,2 PARALLEL=2 OUT=runs/loop-study)
#   CORPUS=../shared/data/corpus TOKENS=1e6 SEEDS=0 bash scripts/loop_study.sh
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${CORPUS:-../shared/data/corpus} out=${OUT:-runs/loop-study}
tokens=${TOKENS:-5e6} seeds=${SEEDS:-0,1,2} parallel=${PARALLEL:-2}
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
  --configs ladder-0-loop-only,ladder-1-prelude-coda,ladder-2-noise,ladder-3-reinject,ladder-4-gate,tiny-dense \
  --data "$data/shards/manifest.json" --out "$out" --tokens "$tokens" --seeds "$seeds" \
  --micro-batch-size 16 --lr 2e-3 --parallel "$parallel" --threads 1 --evals 4 --eval-batches 20
