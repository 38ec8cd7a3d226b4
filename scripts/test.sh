#!/usr/bin/env bash
# The test command: installs what the tests need, runs the lint and format checks, then the whole
# suite on every core (slow multi-process tests included; `-m "not slow"` runs the quick ones alone)
# with the type checks beside it (scripts/lint.sh), and fails if either does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/lint.sh style
# mypy (about a minute of one core, without its cache) runs beside the suite: run before it, the other
# core would idle for that minute; its report is printed after the suite's
types_log="$(mktemp)"
bash scripts/lint.sh types > "$types_log" 2>&1 &
types=$!
python3 scripts/clean_shm.py
# a pytest-xdist worker per core and one more (GRT_TEST_WORKERS overrides; 0: none): much of the
# suite waits on the processes it starts (ranks meeting, launchers, Slurm), which a third worker
# fills on 2 cores (the suite 1,162-1,218 s against 1,454 s with 2); a module is one unit of work, the
# cluster modules one together (tests/conftest.py)
workers="${GRT_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
# -rfEs: every failure, error and skip (with its reason) in the summary; the 30 slowest
rc=0
# a test skipped for a missing package of setup.py's dev extra (installed above) fails (tests/dev_extra.py)
export GRT_TEST_COMMAND=1
python3 -m pytest -q -rfEs --durations=30 -n "$workers" --dist loadgroup tests "$@" || rc=$?
types_rc=0
wait "$types" || types_rc=$?
echo "== type checks (scripts/lint.sh types): exit $types_rc"
cat "$types_log"
rm -f "$types_log"
[ "$rc" = 0 ] && exit "$types_rc"
exit "$rc"
