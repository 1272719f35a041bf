"""What a run writes where, redirected to files as under a scheduler: stdout holds the summary and nothing else,
stderr one log line per iteration and no progress-bar refreshes (tqdm's conventions: bars only on a terminal, none
under ``-q``), and MLflow the learning rate of every iteration."""

from __future__ import annotations

import re
import subprocess

import pytest

from sage_grpo.core.lr_schedules import lr_multiplier
from tests.integration.pipeline_runs import REPO, environment, metric_history, only_run_id, sagegrpo_command

pytestmark = pytest.mark.integration

ITERATIONS = 3
LR, WARMUP, DECAY = 3e-3, 2, 4
BAR = re.compile(r"\r|\x1b\[")  # a bar's in-place refresh, or a cursor movement


def _run(tmp_path, *flags: str, **env: str) -> tuple[str, str]:
    out_dir = tmp_path / "run"
    command = sagegrpo_command(
        out_dir,
        f"run.max_iterations={ITERATIONS}",
        "eval.write_videos=0",
        f"update.learning_rate={LR}",
        "update.lr_schedule=linear",
        f"update.lr_warmup_steps={WARMUP}",
        f"update.lr_decay_steps={DECAY}",
    )
    command[3:3] = flags  # `python -m sage_grpo.pipeline.cli [FLAGS] run ...`
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as out, stderr.open("w") as err:
        code = subprocess.run(command, cwd=REPO, env=environment(**env), stdout=out, stderr=err, timeout=600).returncode
    assert code == 0, stderr.read_text()[-4000:]
    return stdout.read_text(), stderr.read_text()


def test_a_redirected_run_logs_one_line_per_iteration_and_prints_only_its_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    stdout, stderr = _run(tmp_path)

    assert stdout.startswith("sage-grpo: completed after 3 iteration(s)\n"), stdout[:2000]
    assert "DeepSpeed" not in stdout and "WARNING" not in stdout
    assert not BAR.search(stderr), stderr[:2000]
    assert [int(n) for n in re.findall(r"INFO sage_grpo\.pipeline\.recipe: iteration (\d+):", stderr)] == [1, 2, 3]

    tracking_uri = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    logged = metric_history(tracking_uri, only_run_id(tracking_uri), "update/learning_rate")
    # After iteration i the scheduler has stepped i times (one update per iteration): the rate of the next update.
    schedule = {"schedule": "linear", "warmup_steps": WARMUP, "decay_steps": DECAY}
    assert logged == [(i, pytest.approx(LR * lr_multiplier(i, **schedule), rel=1e-6)) for i in (1, 2, 3)]


def test_quiet_draws_no_bars_even_where_they_are_forced(tmp_path):
    # TQDM_DISABLE set but empty is tqdm's `disable=False`: bars even off a terminal (checked in tests/unit).
    stdout, stderr = _run(tmp_path, "-q", TQDM_DISABLE="")
    assert not BAR.search(stderr), stderr[:2000]
    assert " INFO " not in stderr
    assert stdout.startswith("sage-grpo: completed")
