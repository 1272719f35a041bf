#!/usr/bin/env bash
# The scheduled fine-tuning run (pipeline/scheduled_run.py): newest prompt set, train (resume or new; a completed run
# registers itself as the challenger), promote (the config's registry gate on its tracking server).
# For cron on a host, or as the CronJob's command (infra/k8s/base/cronjob.yaml); arguments go to `sagegrpo schedule`:
#
#   infra/scheduled_run.sh configs/hunyuanvideo15_sage_lora.yaml --prompts s3://BUCKET/prompts \
#       --checkpoint-root s3://BUCKET/scheduled --model NAME [--nproc-per-node N] [--dry-run]
#
# The Python it runs, first found: $SAGEGRPO_PYTHON; the checkout's .venv/bin/python (what scripts/setup.sh builds);
# /opt/venv/bin/python (the Docker image's); python3, then python, on PATH. Cron's PATH is /usr/bin:/bin, which holds
# no venv: without one of the first three it finds a system Python that lacks sage_grpo, and the run says so.
# A second start while one is running exits 0 at once: it holds a lock ($SAGEGRPO_SCHEDULE_LOCK) for its lifetime.
# Starting again after it finished is safe too: the schedule skips a complete day and resumes an unfinished run.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  local candidate
  for candidate in "${SAGEGRPO_PYTHON:-}" "$PWD/.venv/bin/python" /opt/venv/bin/python; do
    if [[ -n "$candidate" && -x "$candidate" ]]; then
      echo "$candidate"
      return
    fi
  done
  command -v python3 || command -v python || {
    echo "scheduled_run: no Python found: set SAGEGRPO_PYTHON to the environment's python" >&2
    exit 2
  }
}
PYTHON=$(find_python)
exec 9>"${SAGEGRPO_SCHEDULE_LOCK:-/tmp/sagegrpo-schedule.lock}"
if ! flock --nonblock 9; then
  echo "scheduled_run: another scheduled run holds the lock; nothing to do"
  exit 0
fi
# exec keeps fd 9, and with it the lock, and makes Python the process that receives SIGTERM (it relays it to the
# running step, which checkpoints and exits 75).
exec "$PYTHON" -m sage_grpo.pipeline.cli schedule "$@"
