#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs the whole suite (unit, distributed, integration) on every
# core (pytest-xdist; a test file's tests stay on one worker, so module-scoped servers start once per file).
# Pass pytest arguments to narrow it, e.g. `scripts/test.sh -m unit`, or `-n 0` to run in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"
