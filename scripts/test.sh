#!/usr/bin/env bash
# The test command: installs what the tests need, runs the lint, format and type checks
# (scripts/lint.sh), then the whole suite
# on every core (slow multi-process tests included; `-m "not slow"` runs the quick ones alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/lint.sh
python3 scripts/clean_shm.py
# one pytest-xdist worker per core (GRT_TEST_WORKERS overrides; 0: none); a module is one unit of
# work, the cluster modules one together (tests/conftest.py)
workers="${GRT_TEST_WORKERS:-$(nproc)}"
# -rfEs: every failure, error and skip (with its reason) in the summary; the 30 slowest
python3 -m pytest -q -rfEs --durations=30 -n "$workers" --dist loadgroup tests "$@"
