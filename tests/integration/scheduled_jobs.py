"""The scheduled job (``sagegrpo schedule``) as cron runs it, on the demo shortened to minutes, day after day against
one tracking server: what the nightly-promotion tests share."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.integration.pipeline_runs import DEMO, REPO, cli_command, environment

DAYS = ("2026-12-01", "2026-12-02")
PROMPTS = (REPO / "configs" / "demo_prompts.txt").read_text().splitlines()


@dataclass
class ScheduledJob:
    """A job's config, its prompts folder (one prompt file a day), checkpoint root, work folder and the folder cron
    starts it in; ``exam`` is the fixed evaluation set every day is scored on."""

    config: Path
    prompts: Path
    exam: Path
    root: Path
    work: Path
    cwd: Path
    tracking_uri: str
    model: str

    def add_day(self, day: str, prompts: list[str]) -> None:
        (self.prompts / f"{day}.txt").write_text("\n".join(prompts) + "\n")

    def start(self, day: str, *overrides: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """The day's job to its end (a hang is the per-test limit's to stop), with the tracking server given as an
        override (train and promote alike must use it) and a PATH without the venv, as under cron."""
        command = cli_command(
            "schedule",
            str(self.config),
            f"tracking.tracking_uri={self.tracking_uri}",
            *overrides,
            "--prompts",
            str(self.prompts),
            "--checkpoint-root",
            str(self.root),
            "--model",
            self.model,
            "--work-dir",
            str(self.work),
            "--date",
            day,
            *flags,
        )
        env = environment(PATH="/usr/bin:/bin")
        return subprocess.run(command, cwd=self.cwd, env=env, capture_output=True, text=True)


def scheduled_job(tmp_path: Path, tracking_uri: str, model: str, *, exam_size: int, **sections) -> ScheduledJob:
    """The demo at 4 SDE steps, 2 prompts x 2 videos, evaluated on the last ``exam_size`` demo prompts and
    checkpointed every 2 iterations; ``sections`` are merged into the config's (``eval``, ``registry``, ``run``).
    Day one's prompt file is the first 12 demo prompts; a test adds later days."""
    exam = tmp_path / "eval-v1.txt"
    exam.write_text("\n".join(PROMPTS[-exam_size:]) + "\n")
    config = yaml.safe_load(DEMO.read_text())
    config["sde"]["steps"] = 4
    config["rollout"] = {"group_size": 2, "prompts_per_rank": 2}
    config["update"]["micro_batch_size"] = 2
    config["eval"] = {"every": 2, "write_videos": 0, "source": str(exam)}
    config["checkpoint"] = {"every": 2, "keep_last": 2}
    config["trust_region"]["anchor_interval"] = 2
    config["registry"] = {"min_eval_prompts": exam_size}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    job = ScheduledJob(
        config=tmp_path / "scheduled.yaml",
        prompts=tmp_path / "prompts",
        exam=exam,
        root=tmp_path / "scheduled",
        work=tmp_path / "work",
        cwd=tmp_path / "cwd",
        tracking_uri=tracking_uri,
        model=model,
    )
    job.config.write_text(yaml.safe_dump(config))
    job.prompts.mkdir()
    job.cwd.mkdir()
    job.add_day(DAYS[0], PROMPTS[:12])
    return job


def succeeded(result: subprocess.CompletedProcess) -> str:
    """The job's stdout, once it exited 0 (else its output's tail)."""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result.stdout
