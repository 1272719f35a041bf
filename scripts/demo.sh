#!/usr/bin/env bash
# The README's main command: sets up .venv, then runs the embedded default job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p outputs
exec .venv/bin/sagegrpo inspect-sde --variant all --steps 20 --shift 5 --eta 0.5 --plot outputs/sde_schedules.png "$@"
