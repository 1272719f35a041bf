#!/usr/bin/env bash
# The README's main command: sets up .venv, then runs the demo training job on its embedded default
# (tiny HunyuanVideo 1.5 on CPU, local MLflow store and checkpoints under runs/demo). Extra arguments are
# config overrides or flags for `sagegrpo run`, e.g. `scripts/demo.sh run.max_iterations=4`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/sagegrpo run configs/demo.yaml "$@"
