"""The scheduled run: decisions, markers, commands and the lock (pipeline/scheduled_run.py, infra/scheduled_run.sh)."""

import dataclasses
import fcntl
import os
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
import yaml

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, UserError
from sage_grpo.pipeline import scheduled_run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
PROMPTS = ROOT / "configs" / "demo_prompts.txt"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)


TODAY = date(2026, 12, 3)
PROMPT_SETS = ["2026-11-20", "2026-12-01.jsonl", "_SUCCESS", ".2026-12-09.uploading"]


def _run(name, prompt_set="2026-11-20", completed=()):
    return scheduled_run.RunState(name, prompt_set, frozenset(completed))


def test_first_start_of_the_day_trains_a_new_run_on_the_newest_prompt_set():
    decision = scheduled_run.decide(TODAY, PROMPT_SETS, [_run("sage-2026-12-02", completed=scheduled_run.STEPS)])
    assert decision.action == "new"
    assert decision.run_name == "sage-2026-12-03"
    assert decision.prompt_set == "2026-12-01.jsonl"  # hidden and marker entries are not prompt sets
    assert decision.steps == scheduled_run.STEPS


def test_a_complete_run_today_means_nothing_to_do():
    decision = scheduled_run.decide(TODAY, PROMPT_SETS, [_run("sage-2026-12-03", completed=scheduled_run.STEPS)])
    assert (decision.action, decision.steps) == ("skip", ())


def test_a_prompt_set_already_trained_is_not_trained_again():
    done = _run("sage-2026-12-02", prompt_set="2026-12-01.jsonl", completed=scheduled_run.STEPS)
    decision = scheduled_run.decide(TODAY, PROMPT_SETS, [done])
    assert (decision.action, decision.steps) == ("skip", ())
    assert "already trained by sage-2026-12-02" in decision.reason


def test_an_unfinished_run_is_resumed_from_its_first_unfinished_step_on_its_own_prompts():
    runs = [
        _run("sage-2026-11-30", completed=scheduled_run.STEPS),
        _run("sage-2026-12-01", completed={"train"}),
        _run("manual-experiment"),
    ]
    decision = scheduled_run.decide(TODAY, PROMPT_SETS, runs)
    assert decision.action == "resume"
    assert decision.run_name == "sage-2026-12-01"
    assert decision.prompt_set == "2026-11-20"
    assert decision.steps == ("promote",)


def test_markers_of_runs_from_before_the_evaluate_step_was_dropped_still_read(tmp_path):
    root = scheduled_run.Store(str(tmp_path))
    old_layout = {"sage-2026-12-01": ("train", "evaluate", "promote"), "sage-2026-12-02": ("train", "evaluate")}
    for name, steps in old_layout.items():
        root.write("2026-12-01\n", name, "schedule", "prompt_set")
        for step in steps:
            root.write("", name, "schedule", f"{step}.done")
    complete, unfinished = scheduled_run.read_runs(root)
    assert complete.done and not unfinished.done
    assert scheduled_run.decide(TODAY, PROMPT_SETS, [complete, unfinished]).steps == ("promote",)


def test_unscheduled_runs_are_ignored_and_missing_prompts_are_a_user_error():
    with pytest.raises(UserError, match="no prompt set"):
        scheduled_run.decide(TODAY, ["_SUCCESS"], [_run("manual-experiment")])
    with pytest.raises(UserError, match="prompt_set"):
        scheduled_run.decide(TODAY, PROMPT_SETS, [_run("sage-2026-12-01", prompt_set=None)])


def _config(tmp_path: Path, tracking_uri: str | None = "http://mlflow.example:5000") -> Path:
    """The demo config on a shared tracking server with a fixed evaluation set, as the scheduled run needs."""
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["tracking"] = {"tracking_uri": tracking_uri}
    config["eval"]["source"] = str(PROMPTS)
    path = tmp_path / "scheduled.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _args(
    tmp_path: Path, day: str = "2026-12-03", dry_run: bool = False, config: Path | None = None
) -> scheduled_run.ScheduledRunOptions:
    prompts = tmp_path / "prompts"
    prompts.mkdir(exist_ok=True)
    for name in ("2026-12-01.txt", "2026-12-02.txt"):
        (prompts / name).write_text(PROMPTS.read_text())
    return scheduled_run.ScheduledRunOptions(
        str(config or _config(tmp_path)),
        str(prompts),
        str(tmp_path / "ckpt"),
        "m",
        date=date.fromisoformat(day),
        dry_run=dry_run,
    )


@pytest.fixture
def steps(monkeypatch):
    """Steps become tiny Python commands whose statuses the test chooses; what ran is recorded."""
    ran, statuses = [], {}

    def command(step, decision, args, root):
        ran.append((step, decision.run_name, decision.prompt_set))
        return [sys.executable, "-c", f"raise SystemExit({statuses.get(step, 0)})"]

    monkeypatch.setattr(scheduled_run, "step_command", command)
    return ran, statuses


def test_starting_twice_the_same_day_does_not_train_twice(tmp_path, steps):
    ran, _ = steps
    assert scheduled_run.run_scheduled(_args(tmp_path)) == 0
    assert ran == [(step, "sage-2026-12-03", "2026-12-02.txt") for step in scheduled_run.STEPS]
    assert (tmp_path / "ckpt" / "sage-2026-12-03" / "schedule" / "prompt_set").read_text().strip() == "2026-12-02.txt"
    assert scheduled_run.run_scheduled(_args(tmp_path)) == 0
    assert len(ran) == len(scheduled_run.STEPS)  # the second start ran nothing


def test_a_checkpointed_stop_is_passed_on_and_resumed_at_the_next_start(tmp_path, steps):
    ran, statuses = steps
    statuses["train"] = RETRYABLE_EXIT_CODE
    assert scheduled_run.run_scheduled(_args(tmp_path)) == RETRYABLE_EXIT_CODE
    assert not (tmp_path / "ckpt" / "sage-2026-12-03" / "schedule" / "train.done").exists()
    statuses["train"] = 0
    (tmp_path / "prompts" / "2026-12-04.txt").write_text(PROMPTS.read_text())  # new data for the second day
    # The next day's start finishes yesterday's run before starting a new one.
    assert scheduled_run.run_scheduled(_args(tmp_path, day="2026-12-04")) == 0
    assert ran[1:] == [(step, "sage-2026-12-03", "2026-12-02.txt") for step in scheduled_run.STEPS]  # its own prompts
    assert scheduled_run.run_scheduled(_args(tmp_path, day="2026-12-04")) == 0
    assert ran[-1] == ("promote", "sage-2026-12-04", "2026-12-04.txt")


def test_dry_run_writes_nothing(tmp_path, steps, capsys):
    ran, _ = steps
    assert scheduled_run.run_scheduled(_args(tmp_path, dry_run=True)) == 0
    assert not (tmp_path / "ckpt").exists() and len(ran) == len(scheduled_run.STEPS)
    assert "schedule: new: new run sage-2026-12-03" in capsys.readouterr().out


def test_train_step_runs_under_the_launcher_with_resume_auto(tmp_path):
    args = _args(tmp_path)
    decision = scheduled_run.Decision("new", "sage-2026-12-03", "2026-12-02", scheduled_run.STEPS, "")
    command = scheduled_run.step_command("train", decision, args, scheduled_run.Store(args.checkpoint_root))
    assert command[:3] == [sys.executable, "-m", "sage_grpo.pipeline.launch"]
    # Each worker is this interpreter running the CLI module: nothing is looked up on PATH.
    assert command[command.index("--module") + 1 : command.index("--module") + 3] == ["sage_grpo.pipeline.cli", "run"]
    assert "sagegrpo" not in command and "--no-python" not in command
    assert command[command.index("--resume") + 1] == "auto"
    assert f"data.source={tmp_path}/prompts/2026-12-02" in command
    assert f"checkpoint.uri={tmp_path}/ckpt/sage-2026-12-03/checkpoints" in command
    assert "run.output_dir=/cache/runs/sage-2026-12-03" in command
    # The run registers its result as the challenger; the gate is the separate promote step.
    assert {"registry.model_name=m", "registry.promote=false"} <= set(command)


def test_promote_step_gates_with_the_configs_registry_settings_and_the_runs_overrides(tmp_path):
    args = dataclasses.replace(_args(tmp_path), overrides=("tracking.tracking_uri=http://mlflow.team:5000",))
    decision = scheduled_run.Decision("new", "sage-2026-12-03", "2026-12-02", scheduled_run.STEPS, "")
    root = scheduled_run.Store(args.checkpoint_root)
    command = scheduled_run.step_command("promote", decision, args, root)
    assert command[:4] == [sys.executable, "-m", "sage_grpo.pipeline.cli", "promote"]
    assert command[command.index("--config") + 1] == args.config
    assert command[command.index("--model") + 1] == "m"
    # The same overrides as training (the user's tracking URI among them), so the same tracking server.
    assert command[command.index("m") + 1 :] == scheduled_run.run_overrides(decision, args, root)
    assert "tracking.tracking_uri=http://mlflow.team:5000" in command


@pytest.mark.parametrize(
    "problem, tracking_uri, message",
    [
        ("no shared tracking server", None, "needs tracking.tracking_uri"),
        ("an invalid config", "http://mlflow:5000", "update.learning_rate"),
    ],
)
def test_a_config_the_scheduled_run_cannot_use_is_refused_before_any_step(
    tmp_path, steps, problem, tracking_uri, message
):
    ran, _ = steps
    config = _config(tmp_path, tracking_uri)
    if problem == "an invalid config":
        config.write_text(config.read_text().replace("learning_rate: 0.003", "learning_rate: -1"))
    with pytest.raises(UserError, match=message):
        scheduled_run.run_scheduled(_args(tmp_path, config=config))
    assert ran == [] and not (tmp_path / "ckpt").exists()


def test_scheduled_run_script_exits_quietly_while_another_holds_the_lock(tmp_path):
    lock = tmp_path / "lock"
    env = {**os.environ, "SAGEGRPO_SCHEDULE_LOCK": str(lock), "SAGEGRPO_PYTHON": "/bin/false"}
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = subprocess.run(
            [str(ROOT / "infra" / "scheduled_run.sh"), "--dry-run"], env=env, capture_output=True, text=True, timeout=10
        )
    assert result.returncode == 0 and "another scheduled run" in result.stdout
    result = subprocess.run([str(ROOT / "infra" / "scheduled_run.sh")], env=env, capture_output=True, timeout=10)
    assert result.returncode == 1  # unlocked: it went on to run $SAGEGRPO_PYTHON (here /bin/false)
