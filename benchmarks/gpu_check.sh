#!/usr/bin/env bash
# The pipeline's first run on one GPU, in bf16 (DeepSpeed's precision "auto" on CUDA), in one call of a few minutes:
#   1. sagegrpo env;
#   2. preflight of the demo config (tiny model): devices, rewards, on-policy first update, KL gradient band, memory;
#   3. preflight of the demo config with a transformer an H200 notices (16 x 128 heads, 8 layers, 128x128x9 video,
#      5120 tokens): peak memory against `sagegrpo plan`, seconds per stage and the MFU the recipe estimates;
#   4. sequence parallelism: one update at K = 1 and at K = 2 (two processes, sharing the GPU if there is one),
#      per-rank activation and peak CUDA memory and update time (benchmarks/sequence_parallel_memory.py);
#   5. the demo run itself (8 iterations, evaluation, checkpoints, export): the reward curve and samples/s;
#   6. the demo with LoRA for 2 iterations;
#   7. the unit tier with CUDA visible (tests written on CPU machines that may assume no GPU).
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

SIZED=(
    model.kwargs.height=128 model.kwargs.width=128 model.kwargs.num_frames=9
    model.kwargs.transformer.num_attention_heads=16 model.kwargs.transformer.attention_head_dim=128
    model.kwargs.transformer.num_layers=8 model.kwargs.transformer.mlp_ratio=4.0
    "model.kwargs.transformer.rope_axes_dim=[16,56,56]"
)

step env 45 "${sagegrpo[@]}" env
step preflight-tiny 100 "${sagegrpo[@]}" preflight configs/demo.yaml
step preflight-sized 120 "${sagegrpo[@]}" preflight configs/demo.yaml "${SIZED[@]}"
step sequence-parallel 240 python3 -m benchmarks.sequence_parallel_memory
step demo 120 "${sagegrpo[@]}" run configs/demo.yaml "run.output_dir=$runs/demo" --fresh-start
step demo-lora 75 "${sagegrpo[@]}" run configs/demo.yaml lora.enabled=true run.max_iterations=2 eval.every=0 \
    "run.output_dir=$runs/demo-lora" --fresh-start
step unit 75 python3 -m pytest tests/unit -m unit -q -p no:cacheprovider -n 14 --timeout 60

echo "=== summary"
cat "$out/steps.txt"
grep -h "^\(schedule\|devices\|first iterations\|rewards\|on-policy\|trust region\|peak memory\|time\|preflight:\) " \
    "$out/preflight-tiny.log" "$out/preflight-sized.log"
grep -h "^\(activations per rank\|peak CUDA memory per rank\|update time\):" "$out/sequence-parallel.log" |
    sed "s/^/sequence parallel K=1 vs K=2 /"
python3 - "$runs/demo/mlflow.db" <<'EOF'
import sys

import mlflow

client = mlflow.MlflowClient(f"sqlite:///{sys.argv[1]}")
run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
for key in ("reward/mean", "samples_per_second", "time/rollout", "time/update", "mfu", "update/kl_grad_ratio"):
    values = [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
    print(f"demo {key}: " + " ".join(f"{v:.4g}" for v in values))
EOF
