#!/usr/bin/env bash
# Lint, format and type checks on the whole tree (settings: pyproject.toml); scripts/test.sh runs
# them with the tests. `ruff check --fix . && ruff format .` mends most of what it reports.
#   bash scripts/lint.sh          all of them
#   bash scripts/lint.sh style    ruff only (a second)
#   bash scripts/lint.sh types    mypy only (about a minute of one core without its cache)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in all|style|types) ;; *) echo "usage: scripts/lint.sh [style|types]" >&2; exit 2 ;; esac
if [ "$what" != types ]; then
  ruff check .
  ruff format --check .
fi
if [ "$what" != style ]; then
  mypy  # the code: files and settings in [tool.mypy] of pyproject.toml
  # the tests: pytest's test functions take untyped fixtures, so their bodies are not checked (typing
  # every fixture would find no bug); their typed helpers and module-level code are
  mypy --no-check-untyped-defs tests
fi
