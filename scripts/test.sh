#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs the whole suite (unit, distributed, integration) on every
# core (pytest-xdist; a test file's tests stay on one worker, so module-scoped servers start once per file).
# Pass pytest arguments to narrow it, e.g. `-m distributed`, or `-n 0` to run in one process.
# The fast tier: `scripts/test.sh -m unit` runs the single-process tests alone, and never a slow one (tests/conftest.py
# refuses a test marked both unit and slow).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"
