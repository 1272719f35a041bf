#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs the whole suite (unit, distributed, integration).
# Pass pytest arguments to narrow it, e.g. `scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
