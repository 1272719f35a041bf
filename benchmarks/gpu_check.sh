#!/usr/bin/env bash
# What a first real run needs, on one GPU in bf16, in under 8 minutes (the step limits add to 470 s):
#   1. sagegrpo env;
#   2. block-check: a slice of real-width HunyuanVideo 1.5 blocks at the 480p token count with CFG, trained one step
#      as the run trains it; the attention kernel that ran, its peak memory against `sagegrpo plan`'s trace of the
#      same slice (within 10%), its MFU from the traced model FLOPs (benchmarks/traced_block_check.py);
#   3. preflight of the demo config (tiny model): devices, rewards, on-policy first update, KL gradient band;
#   4. the demo run itself (8 iterations, evaluation, checkpoints, export);
#   5. with 2 GPUs, sequence parallelism K = 2 against K = 1 in bf16 (benchmarks/sequence_parallel_memory.py): memory
#      and time per rank, and the velocity, rollout and gradient norm equal within bf16 rounding (its verdict line);
#      with one, a line saying it was skipped.
# The block check's lines are appended to benchmarks/RESULTS.md with the card named.
# Every step has its own time limit and log (OUT_DIR); the runs' outputs go to a scratch folder; a table of the
# numbers is printed last.
#
#   benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT where set, else runs/gpu-check)
#
# Where the repo root holds .whl/ (wheels for a machine with no package registry), they are installed first into
# /tmp/site; otherwise the current environment must have the project's dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${OUT:-runs/gpu-check}}")
runs=$(mktemp -d -t sagegrpo-gpu-check-XXXXXX)
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
sagegrpo=(python3 -m sage_grpo.pipeline.cli)  # the checkout itself, installed or not (timeout runs programs, not functions)

step() {  # step NAME SECONDS COMMAND...: its output to NAME.log, the last lines shown, its status and time kept
    local name=$1 limit=$2 started=$SECONDS status
    shift 2
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    status=$?
    grep -v "Guiders are\|should be kept in float32" "$out/$name.log" | tail -n 18
    echo "$name: exit $status in $((SECONDS - started)) s" | tee -a "$out/steps.txt"
}

step env 20 "${sagegrpo[@]}" env
step block-check 180 python3 -m benchmarks.traced_block_check --results benchmarks/RESULTS.md
step preflight-tiny 90 "${sagegrpo[@]}" preflight configs/demo.yaml
step demo 90 "${sagegrpo[@]}" run configs/demo.yaml "run.output_dir=$runs/demo" --fresh-start
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step sequence-parallel 90 python3 -m benchmarks.sequence_parallel_memory
else
    echo "sequence-parallel: skipped, K = 2 against K = 1 needs 2 GPUs" | tee -a "$out/steps.txt"
fi

echo "=== summary"
cat "$out/steps.txt"
grep -h "^\(slice\|attention kernel\|peak\|MFU\|traced-vs-measured\):" "$out/block-check.log"
grep -h "^\(schedule\|devices\|first iterations\|rewards\|on-policy\|trust region\|time\|preflight:\) " \
    "$out/preflight-tiny.log"
[ -f "$out/sequence-parallel.log" ] && grep -h "^\(activations per rank\|peak CUDA memory per rank\|update time\):" \
    "$out/sequence-parallel.log" | sed "s/^/sequence parallel K=1 vs K=2 /"
[ -f "$out/sequence-parallel.log" ] && grep -h "^\(bfloat16 K=2 vs K=1\|equivalence:\)" "$out/sequence-parallel.log"
python3 - "$runs/demo/mlflow.db" <<'EOF'
import sys

import mlflow

client = mlflow.MlflowClient(f"sqlite:///{sys.argv[1]}")
run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
for key in ("reward/mean", "samples_per_second", "time/rollout", "time/update", "mfu", "update/kl_grad_ratio"):
    values = [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
    print(f"demo {key}: " + " ".join(f"{v:.4g}" for v in values))
EOF
