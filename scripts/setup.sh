#!/usr/bin/env bash
# Creates .venv at the repo root and installs sage-grpo with its dev extra. Idempotent: a second run only
# re-checks. torch comes first (the CPU build on a machine without an NVIDIA GPU) unless one is installed already,
# so pip never pulls a multi-GB CUDA build as a dependency of something else.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
TORCH=torch==2.13.0
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" install "$TORCH"
  else
    # No GPU: the CPU build, explicitly from PyTorch's CPU index (PyPI's Linux wheel is the multi-GB CUDA one). Where
    # that index cannot be reached (an offline mirror, a local wheel cache), the configured indexes are used instead.
    "${PIP[@]}" install "$TORCH" --index-url https://download.pytorch.org/whl/cpu --timeout 10 --retries 0 2>/dev/null \
      || "${PIP[@]}" install "$TORCH"
  fi
fi
stamp=.venv/.sage-grpo-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "${PIP[@]}" install -e ".[dev]"
  echo "$want" > "$stamp"
fi
# DeepSpeed builds its CPU ops on first use. Build them here, once, rather than inside a training run: a run killed
# mid-build leaves a lock that stalls every later run (core/ops_cache.py also clears such a stale lock). They are
# built in this environment's own folder (~/.cache/torch_extensions/py311_cpu-env-<digest>) unless
# TORCH_EXTENSIONS_DIR is set. Skipped, without importing DeepSpeed, when this environment built them; rebuilt when
# another environment sharing a TORCH_EXTENSIONS_DIR rebuilt them for its own paths since.
.venv/bin/python -c "from sage_grpo.core.ops_cache import prebuild_ops; prebuild_ops()"
