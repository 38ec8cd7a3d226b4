#!/bin/sh
# Reproduces docs/comparison.md's CPU-scale tables and plots (run from the repository root;
# about 90 minutes of a 2-core CPU shared with other jobs). Output under runs/ (not committed).
set -e
# data: a 2,048-piece tokenizer and ~6 MB of the shared Gutenberg corpus in 128-token sequences
python -m pretrain.cli data tokenizer -i ../shared/data/corpus/train-00000.jsonl.gz -o runs/cmpdata/tok \
    --vocab-size 2048 --max-chars 3000000 --workers 1 -q
python -m pretrain.cli data prepare -i ../shared/data/corpus/ -t runs/cmpdata/tok.model -o runs/cmpdata/shards \
    --seq-len 128 --shard-size-mb 1 --val-fraction 0.12 --seed 1 --max-mb 6 --workers 1 -q
COMMON="--data runs/cmpdata/shards/manifest.json --out runs/compare --tokens 3e5 --micro-batch-size 8 --lr 3e-3 --set model.d_model=64 --set model.n_heads=2 --evals 4 --eval-batches 20 --parallel 2 --threads 1"
python -m pretrain.cli compare $COMMON --configs tiny-grt,tiny-dense,tiny-huginn,tiny-rrt,tiny-ouro,tiny-mor --match flops --tag methods
python -m pretrain.cli compare $COMMON --configs ladder-0-loop-only,ladder-1-prelude-coda,ladder-2-noise,ladder-3-reinject,tiny-grt --match none --tag ladder
python -m pretrain.cli compare $COMMON --configs tiny-grt,docs/comparison/grt-gate-bias-0.json --match none --tag gate
python -m pretrain.cli compare $COMMON --configs place-middle,place-whole,place-bottom,place-top --match none --tag placement
# uniform against fixed depth, trained R in {2, 4, 8} at equal tokens, and the core attending to the anchor's keys
# and values (core_kv='anchor'), three seeds each
SWEEP=tiny-grt,docs/comparison/grt-fixed-depth.json,docs/comparison/grt-r2.json,docs/comparison/grt-r8.json,tiny-grt-anchor-kv
for seed in 1234 2 3; do
  python -m pretrain.cli compare $COMMON --out runs/sweep-s$seed --seed $seed --configs $SWEEP --match none --tag sweep-s$seed
done
# seed repeat (another data order and initialisation) of three runs, for the run-to-run spread
python -m pretrain.cli compare $COMMON --out runs/compare-seed2 --set train.seed=2 --configs tiny-grt,ladder-1-prelude-coda,ladder-2-noise --match none --tag seed2
