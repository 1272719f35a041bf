#!/usr/bin/env bash
# The README's main command: sets up .venv, then runs the demo training job on its embedded default
# (tiny HunyuanVideo 1.5 on CPU, local MLflow store and checkpoints under runs/demo). Extra arguments are
# config overrides or flags for `sagegrpo run`, e.g. `scripts/demo.sh run.max_iterations=4`. --fresh-start: running
# the demo again starts a new run (a new MLflow run beside the old one) instead of being refused because runs/demo's
# checkpoints belong to the previous run; those are kept, never pruned.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/sagegrpo run configs/demo.yaml --fresh-start "$@"
