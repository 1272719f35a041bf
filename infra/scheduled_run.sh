#!/usr/bin/env bash
# The scheduled fine-tuning run (pipeline/scheduled_run.py): newest prompt set, train (resume or new; a completed run
# registers itself as the challenger), promote (the config's registry gate on its tracking server).
# For cron on a host, or as the CronJob's command (infra/k8s/base/cronjob.yaml); arguments go to `sagegrpo schedule`:
#
#   infra/scheduled_run.sh configs/hunyuanvideo15_sage_lora.yaml --prompts s3://BUCKET/prompts \
#       --checkpoint-root s3://BUCKET/scheduled --model NAME [--nproc-per-node 8] [--dry-run]
#
# A second start while one is running exits 0 at once: it holds a lock ($SAGEGRPO_SCHEDULE_LOCK) for its lifetime.
# Starting again after it finished is safe too: the schedule skips a complete day and resumes an unfinished run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${SAGEGRPO_PYTHON:-python}
exec 9>"${SAGEGRPO_SCHEDULE_LOCK:-/tmp/sagegrpo-schedule.lock}"
if ! flock --nonblock 9; then
  echo "scheduled_run: another scheduled run holds the lock; nothing to do"
  exit 0
fi
# exec keeps fd 9, and with it the lock, and makes Python the process that receives SIGTERM (it relays it to the
# running step, which checkpoints and exits 75).
exec "$PYTHON" -m sage_grpo.pipeline.cli schedule "$@"
