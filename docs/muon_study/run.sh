#!/bin/sh
# Reproduces docs/performance.md's "Muon against AdamW" tables (run from the repository root; per seed
# four runs, two at a time: about 20 minutes of an idle 2-core CPU, over an hour on one loaded by
# other jobs). Output under runs/muon-study/ (not committed).
# docs/comparison.md's CPU scale: a 2,048-piece tokenizer, ~6 MB of the shared Gutenberg corpus in
# 128-token sequences, 300k tokens per run, d 64; tiny-grt and the dense model of equal forward FLOPs
# (--match flops: 11 layers), AdamW (lr 3e-3, grad_clip 1) against Muon (muon_lr 0.02 for the hidden
# matrices, AdamW at 3e-3 for the rest, grad_clip 0), seeds 1234, 2 and 3; then the step-time cost of the
# orthogonalisation, both optimizers stepped in turn in one process (step_cost.py).
set -e
CORPUS=${CORPUS:-../shared/data/corpus}
D=runs/muon-study
python -m pretrain.cli data tokenizer -i "$CORPUS/train-00000.jsonl.gz" -o $D/data/tok \
    --vocab-size 2048 --max-chars 3000000 --workers 1 -q
python -m pretrain.cli data prepare -i "$CORPUS/" -t $D/data/tok.model -o $D/data/shards \
    --seq-len 128 --shard-size-mb 1 --val-fraction 0.12 --seed 1 --max-mb 6 --workers 1 -q
for seed in 1234 2 3; do
  python -m pretrain.cli compare --data $D/data/shards/manifest.json --out $D/s$seed --tokens 3e5 \
      --micro-batch-size 8 --lr 3e-3 --set model.d_model=64 --set model.n_heads=2 --evals 12 --eval-batches 20 \
      --parallel 2 --threads 1 --seed $seed --match flops --tag muon-s$seed \
      --configs tiny-grt,tiny-dense,docs/muon_study/grt-muon.json,docs/muon_study/dense-muon.json
done
python docs/muon_study/table.py $D/s1234 $D/s2 $D/s3
python docs/muon_study/step_cost.py --steps 30
