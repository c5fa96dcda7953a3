#!/usr/bin/env bash
# PolyStrata: set up with the test extras, then lint, check the import rules and run the CPU test suite.
#   ./test.sh               everything CI runs
#   ./test.sh tests/engine  pytest arguments are passed on
set -euo pipefail
cd "$(dirname "$0")"
STRATA_EXTRAS=test,build ./start.sh --setup-only
PY=.venv/bin/python
echo "[polystrata] ruff"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
echo "[polystrata] import rules"
"$PY" -m tests.import_rules
echo "[polystrata] tests (CPU, Qt offscreen)"
export QT_QPA_PLATFORM=offscreen
exec "$PY" -m pytest -q "$@"
