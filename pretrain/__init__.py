"""GRT pretraining: models (plain PyTorch) and the DeepSpeed trainer."""

import os
from pathlib import Path

# The checkout: ds_configs/ and examples/ beside the package.
PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Idle OpenMP workers sleep instead of spinning. On a CPU host a spinning pool (one per
# thread that runs torch ops, e.g. DeepSpeed's or gloo's) steals cores from the training
# threads: ZeRO-1/2 steps ran 3-7x slower on 2 cores. Set on the first import of any
# pretrain module (every entry point: grt, python -m pretrain.train, pretrain/train.py),
# before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
