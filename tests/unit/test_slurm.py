"""The Slurm batch script: requeue, the pre-timeout signal relayed, exit 75 requeued (fake srun/scancel/scontrol)."""

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE
from tests.helpers import wait_for

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)


SBATCH = ROOT / "infra" / "slurm" / "train.sbatch"


def test_sbatch_requests_requeue_and_a_pre_timeout_signal():
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--requeue" in directives
    assert "--signal=B:USR1@300" in directives
    assert re.search(r"^trap \w+ USR1$", SBATCH.read_text(), re.MULTILINE)


def _fake_slurm(tmp_path: Path, step_status: str) -> dict:
    """srun, scancel and scontrol stand-ins: the "step" exits 75 on SIGUSR1 (as a checkpointing run does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": f'echo "$@" > {tmp_path}/srun.args\n'
        f'[ "{step_status}" = wait ] || exit {step_status}\n'
        f'trap "exit {RETRYABLE_EXIT_CODE}" USR1\necho $$ > {tmp_path}/step.pid\n'
        "while :; do sleep 0.05; done",
        "scancel": f'echo "$@" >> {tmp_path}/scancel.log\nkill -USR1 "$(cat {tmp_path}/step.pid)"',
        "scontrol": f'if [ "$1" = show ]; then echo node1; else echo "$@" >> {tmp_path}/scontrol.log; fi',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
    }


def test_sbatch_relays_usr1_and_requeues_on_exit_75(tmp_path):
    env = _fake_slurm(tmp_path, "wait")
    job = subprocess.Popen(
        ["bash", str(SBATCH), "configs/x.yaml", "seed=3"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for((tmp_path / "step.pid").exists, job)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does
    assert job.wait() == RETRYABLE_EXIT_CODE, job.communicate()[0]
    assert (tmp_path / "scancel.log").read_text().split() == ["--signal=USR1", "42"]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "42"]
    srun_args = (tmp_path / "srun.args").read_text().split()
    assert srun_args[srun_args.index("--resume") + 1] == "auto"
    assert "--rdzv-endpoint=node1:29500" in srun_args and "seed=3" in srun_args


def test_sbatch_does_not_requeue_a_finished_or_failed_run(tmp_path):
    for status in ("0", "1"):
        work = tmp_path / status
        work.mkdir()
        result = subprocess.run(
            ["bash", str(SBATCH), "configs/x.yaml"],
            env=_fake_slurm(work, status),
            cwd=work,
            capture_output=True,
            text=True,
        )
        assert result.returncode == int(status)
        assert not (work / "scontrol.log").exists()
