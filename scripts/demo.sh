#!/usr/bin/env bash
# The main job: installs what it needs, then trains a tiny GRT on the bundled corpus on CPU
# (tokenizer -> shards -> DeepSpeed ZeRO-3 training with TensorBoard -> early-exit evaluation).
set -euo pipefail
cd "$(dirname "$0")/.."
GRT_MINIMAL=1 bash scripts/install.sh
exec python3 -m pretrain.cli demo "$@"
