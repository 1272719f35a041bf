#!/usr/bin/env bash
# Regenerates constraints/production.txt from the venv scripts/setup.sh built (after the suite passed there): the
# exact versions the scheduled production image installs (Dockerfile: pip install -c constraints/production.txt),
# then the file's hand-pinned section (the image's extras this venv does not install), kept as it was.
set -euo pipefail
cd "$(dirname "$0")/.."
by_hand=$(sed -n '/^# Pinned by hand/,$p' constraints/production.txt)
{
  echo "# Exact versions the test suite ran with (pip freeze of scripts/setup.sh's venv, local version tags dropped)."
  echo "# The production image installs with: pip install -c constraints/production.txt ."
  echo "# Regenerate: scripts/freeze_constraints.sh"
  .venv/bin/python -m pip freeze --exclude-editable | grep -v -e "^-e " -e "@ file" | sed -E 's/\+[a-z0-9.]+$//'
  if [ -n "$by_hand" ]; then echo "$by_hand"; fi
} > constraints/production.txt
