#!/usr/bin/env bash
# Lint, format and type checks on the whole tree (settings: pyproject.toml); scripts/test.sh runs
# it before the tests. `ruff check --fix . && ruff format .` mends most of what it reports.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy  # the code: files and settings in [tool.mypy] of pyproject.toml
# the tests: pytest's test functions take untyped fixtures, so their bodies are not checked (typing
# every fixture would find no bug); their typed helpers and module-level code are
mypy --no-check-untyped-defs tests
