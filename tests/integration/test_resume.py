"""Exact resume: a run stopped (cleanly, by SIGTERM, or by SIGKILL in the middle of a save) and resumed ends with
the same metrics, bit-identical weights and the same export as the same run done straight, on CPU, for LoRA and full
fine-tuning, each with the update options users combine with it: full fine-tuning with an EMA of the weights (what
evaluation and export use), LoRA with two PPO mini-batch updates per rollout of three transitions per forward.
A checkpoint exports to the same diffusers files as the run's own end-of-run export, and a second run pointed at a
checkpoint root another run owns is refused in one line (continuing it takes --resume auto, as above)."""

import filecmp
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE
from tests.helpers import wait_for
from tests.integration.pipeline_runs import (
    DEMO,
    REPO,
    SHORT,
    consolidated_weights,
    environment,
    metric_history,
    only_run_id,
    run_sagegrpo,
    sagegrpo,
    sagegrpo_command,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = {
    "lora": (
        "lora.enabled=true",
        "lora.rank=4",
        "lora.alpha=4",
        "update.updates_per_rollout=2",
        "update.transitions_per_micro_step=4",  # 2 chunks x 4 trained steps = 2 mini-batches of one micro-step
    ),
    "full": ("update.ema_decay=0.9",),
}
UNTIMED = ("time/", "system/", "samples_per_second")


def _compared_metrics(tracking: str) -> list[str]:
    keys = MlflowClient(tracking).get_run(only_run_id(tracking)).data.metrics
    return sorted(key for key in keys if not key.startswith(UNTIMED))


def _tracking(output_dir: Path) -> str:
    return f"sqlite:///{output_dir}/mlflow.db"


def _assert_same_run(straight: Path, resumed: Path):
    straight_run, resumed_run = only_run_id(_tracking(straight)), only_run_id(_tracking(resumed))
    compared = _compared_metrics(_tracking(straight))
    assert _compared_metrics(_tracking(resumed)) == compared
    for key in compared:
        expected = metric_history(_tracking(straight), straight_run, key)
        assert metric_history(_tracking(resumed), resumed_run, key) == expected, key
    expected_weights = consolidated_weights(straight / "checkpoints" / "step-4")
    resumed_weights = consolidated_weights(resumed / "checkpoints" / "step-4")
    assert expected_weights.keys() == resumed_weights.keys()
    for name, tensor in expected_weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name
    # The run-end export: the EMA's weights for full fine-tuning, the adapter for LoRA.
    _assert_same_export(straight / "exports" / "step-4", resumed / "exports" / "step-4")


def _assert_same_export(expected: Path, actual: Path):
    """Byte for byte: the same weights export to the same files (export.json lists their sha256)."""
    names = sorted(path.name for path in expected.iterdir())
    assert names == sorted(path.name for path in actual.iterdir())
    for name in names:
        assert filecmp.cmp(expected / name, actual / name, shallow=False), name


@pytest.fixture(scope="module", params=sorted(KINDS))
def straight_run(request, tmp_path_factory):
    output = tmp_path_factory.mktemp(f"straight-{request.param}")
    result = run_sagegrpo(output, "run.max_iterations=4", *KINDS[request.param])
    assert result.returncode == 0, result.stderr[-4000:]
    return request.param, output


def test_the_combined_update_options_act(straight_run):
    kind, straight = straight_run
    if kind == "lora":  # the second mini-batch trains a policy the first one moved: its ratio leaves 1
        ratios = metric_history(_tracking(straight), only_run_id(_tracking(straight)), "update/ratio_max")
        assert len(ratios) == 4 and all(ratio != 1.0 for _, ratio in ratios)
    else:  # the run exports the EMA, which lags every weight training still moves
        before, policy = (consolidated_weights(straight / "checkpoints" / f"step-{step}") for step in (2, 4))
        exported = load_file(straight / "exports" / "step-4" / "diffusion_pytorch_model.safetensors")
        assert exported.keys() == policy.keys()
        moving = [name for name in policy if not policy[name].equal(before[name])]
        assert moving and not any(exported[name].equal(policy[name]) for name in moving)


def test_stop_and_resume_equals_the_straight_run(straight_run, tmp_path):
    kind, straight = straight_run
    first = run_sagegrpo(tmp_path, "run.max_iterations=2", *KINDS[kind])
    assert first.returncode == 0, first.stderr[-4000:]
    second = run_sagegrpo(tmp_path, "run.max_iterations=4", *KINDS[kind], flags=("--resume", "auto"))
    assert second.returncode == 0, second.stderr[-4000:]
    assert "loaded checkpoint step-2" in second.stderr
    _assert_same_run(straight, tmp_path)


def _start(output: Path, kind: str) -> subprocess.Popen:
    return subprocess.Popen(
        sagegrpo_command(output, "run.max_iterations=4", *KINDS[kind]),
        cwd=REPO,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("straight_run", ["full"], indirect=True)  # one kind is enough for signals
def test_sigterm_checkpoints_exits_retryable_and_resumes(straight_run, tmp_path):
    kind, straight = straight_run
    process = _start(tmp_path, kind)
    mlflow_db = tmp_path / "mlflow.db"
    # The embedding cache is written during the first rollout: the run is mid-iteration 1.
    wait_for(lambda: (tmp_path / "embedding-cache").exists() and mlflow_db.exists(), process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate()
    assert process.returncode == RETRYABLE_EXIT_CODE, output[-4000:]
    committed = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert committed and "resume with" in output
    resumed = run_sagegrpo(tmp_path, "run.max_iterations=4", *KINDS[kind], flags=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_same_run(straight, tmp_path)


@pytest.mark.parametrize("straight_run", ["full"], indirect=True)  # one kind is enough for signals
def test_sigkill_in_the_middle_of_a_save_loses_nothing(straight_run, tmp_path):
    kind, straight = straight_run
    process = _start(tmp_path, kind)
    staging = tmp_path / "checkpoint-staging" / "step-2"
    wait_for(lambda: staging.exists() and any(staging.rglob("*.pt")), process)
    process.kill()
    process.wait()
    assert not (tmp_path / "checkpoints" / "step-2" / "manifest.json").exists()
    resumed = run_sagegrpo(tmp_path, "run.max_iterations=4", *KINDS[kind], flags=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # The restart reattaches to the killed job's MLflow run (no second run left RUNNING), does not log the
    # re-executed iterations twice, and its audit holds each iteration once.
    _assert_same_run(straight, tmp_path)
    client = MlflowClient(_tracking(tmp_path))
    assert client.get_run(only_run_id(_tracking(tmp_path))).info.status == "FINISHED"
    audit = [json.loads(line) for line in (tmp_path / "audit" / "rank-0.jsonl").read_text().splitlines()]
    assert [record["iteration"] for record in audit if "prompt_ids" in record] == [1, 2, 3, 4]


def test_a_checkpoint_exports_as_the_run_end_did_and_another_run_is_refused_the_root(straight_run, tmp_path):
    kind, straight = straight_run
    out = tmp_path / "exported"
    exported = sagegrpo(
        "export",
        str(DEMO),
        f"run.output_dir={straight}",
        *SHORT,
        *KINDS[kind],
        "--checkpoint",
        "auto",
        "--out",
        str(out),
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.strip() == str(out.resolve())  # the only stdout line
    _assert_same_export(straight / "exports" / "step-4", out)

    # Refused before it starts an MLflow run or writes a step: the straight run's record stays its own.
    second = run_sagegrpo(straight, "run.max_iterations=6")
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1].startswith("sagegrpo: error: checkpoint root")
    assert "belongs to run" in second.stderr
    only_run_id(_tracking(straight))
    assert sorted(p.name for p in (straight / "checkpoints").glob("step-*")) == ["step-2", "step-4"]
