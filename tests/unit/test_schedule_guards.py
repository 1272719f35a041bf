"""The nightly schedule compares like with like and never wedges: it refuses to start without a fixed evaluation set
or on a prompt set training would refuse, a step that fails the same way every time marks its run failed instead of
being resumed forever, training uses the node's GPUs by default, and the cron wrapper finds its Python."""

import os
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
import yaml

from sage_grpo.core.errors import UserError
from sage_grpo.pipeline import scheduled_run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "configs" / "demo_prompts.txt"


def _options(tmp_path: Path, eval_source: str | None = str(PROMPTS), day: str = "2026-12-03", **changes):
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["tracking"] = {"tracking_uri": "http://mlflow.example:5000"}
    config["eval"]["source"] = eval_source
    path = tmp_path / "scheduled.yaml"
    path.write_text(yaml.safe_dump(config))
    prompts = tmp_path / "prompts"
    prompts.mkdir(exist_ok=True)
    if not any(prompts.iterdir()):
        (prompts / "2026-12-02.txt").write_text(PROMPTS.read_text())
    return scheduled_run.ScheduledRunOptions(
        str(path), str(prompts), str(tmp_path / "ckpt"), "m", date=date.fromisoformat(day), **changes
    )


@pytest.fixture
def statuses(monkeypatch):
    """Steps become tiny commands exiting with the status the test sets per step; what ran is recorded."""
    ran, chosen = [], {}

    def command(step, decision, args, root):
        ran.append((step, decision.run_name))
        return [sys.executable, "-c", f"raise SystemExit({chosen.get(step, 0)})"]

    monkeypatch.setattr(scheduled_run, "step_command", command)
    return ran, chosen


def test_no_fixed_evaluation_set_is_refused_before_anything_starts(tmp_path, statuses):
    ran, _ = statuses
    with pytest.raises(UserError, match="needs eval.source, a fixed evaluation set") as error:
        scheduled_run.run_scheduled(_options(tmp_path, eval_source=None))
    assert "\n" not in str(error.value) and ran == [] and not (tmp_path / "ckpt").exists()


def test_a_broken_newest_prompt_set_starts_no_run_and_a_later_good_one_trains(tmp_path, statuses):
    ran, _ = statuses
    options = _options(tmp_path)
    (tmp_path / "prompts" / "2026-12-03.txt").write_text("\n\n")  # uploaded empty
    with pytest.raises(UserError, match="2026-12-03.txt"):
        scheduled_run.run_scheduled(options)
    assert ran == [] and not (tmp_path / "ckpt").exists()
    (tmp_path / "prompts" / "2026-12-04.txt").write_text(PROMPTS.read_text())
    assert scheduled_run.run_scheduled(_options(tmp_path, day="2026-12-04")) == 0
    assert ran == [("train", "sage-2026-12-04"), ("promote", "sage-2026-12-04")]


@pytest.mark.parametrize("status", [UserError.exit_code, 3])
def test_a_step_that_would_fail_again_marks_its_run_failed_and_the_next_prompt_set_trains(tmp_path, statuses, status):
    ran, chosen = statuses
    chosen["train"] = status
    assert scheduled_run.run_scheduled(_options(tmp_path)) == status
    marker = tmp_path / "ckpt" / "sage-2026-12-03" / "schedule" / "train.failed"
    assert marker.read_text() == f"exited {status}"
    chosen["train"] = 0
    # Not resumed: the same prompt set is not tried again...
    skipped = scheduled_run.decide(
        date(2026, 12, 4), ["2026-12-02.txt"], scheduled_run.read_runs(scheduled_run.Store(str(tmp_path / "ckpt")))
    )
    assert skipped.action == "skip" and f"whose train exited {status}" in skipped.reason
    # ...and the next one trains.
    (tmp_path / "prompts" / "2026-12-04.txt").write_text(PROMPTS.read_text())
    assert scheduled_run.run_scheduled(_options(tmp_path, day="2026-12-04")) == 0
    assert ran[1:] == [("train", "sage-2026-12-04"), ("promote", "sage-2026-12-04")]


def test_a_crash_is_still_resumed(tmp_path, statuses):
    ran, chosen = statuses
    chosen["promote"] = 1
    assert scheduled_run.run_scheduled(_options(tmp_path)) == 1
    chosen["promote"] = 0
    assert scheduled_run.run_scheduled(_options(tmp_path, day="2026-12-04")) == 0
    assert ran[-1] == ("promote", "sage-2026-12-03")


def test_training_uses_the_nodes_gpus_by_default_and_one_process_without(tmp_path, monkeypatch):
    import torch

    options = _options(tmp_path)
    decision = scheduled_run.Decision("new", "sage-2026-12-03", "2026-12-02.txt", scheduled_run.STEPS, "")
    root = scheduled_run.Store(options.checkpoint_root)

    def processes(count: int, **changes) -> str:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        command = scheduled_run.step_command("train", decision, options.__class__(**{**vars(options), **changes}), root)
        return next(arg for arg in command if arg.startswith("--nproc-per-node="))

    assert processes(0) == "--nproc-per-node=1"
    assert processes(4) == "--nproc-per-node=4"
    assert processes(4, nproc_per_node=2) == "--nproc-per-node=2"
    with pytest.raises(UserError, match="--nproc-per-node must be >= 1"):
        scheduled_run.check_config(decision, options.__class__(**{**vars(options), "nproc_per_node": 0}), root)


def test_the_cron_wrapper_finds_the_checkouts_python_on_crons_path(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "SAGEGRPO_PYTHON"}
    env |= {"PATH": "/usr/bin:/bin", "SAGEGRPO_SCHEDULE_LOCK": str(tmp_path / "lock")}
    result = subprocess.run(
        [str(ROOT / "infra" / "scheduled_run.sh"), "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: sagegrpo schedule" in result.stdout
