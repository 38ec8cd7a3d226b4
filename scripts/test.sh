#!/usr/bin/env bash
# The test command: installs what the tests need, runs the lint, format and type checks
# (scripts/lint.sh), then the whole suite
# (slow multi-process tests included; `-m "not slow"` runs the quick ones alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/lint.sh
python3 scripts/clean_shm.py
python3 -m pytest -q -rfEs --durations=30 tests "$@"  # -rfEs: every failure, error and skip (with its reason) in the summary; the 30 slowest
