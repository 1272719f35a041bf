"""The package as a user installs it: a wheel built from the source, installed into a fresh venv, run from another
folder, finds its shipped DeepSpeed configs (deepspeed_configs/ is package data). Nothing is downloaded: the wheel
is installed without dependencies and the fresh venv reuses this environment's installed packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.integration.pipeline_runs import REPO

pytestmark = pytest.mark.integration

SOURCE = ("pyproject.toml", "README.md", "sage_grpo", "core", "stages", "pipeline", "deepspeed_configs")


def _run(*command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_an_installed_wheel_resolves_the_shipped_deepspeed_configs_from_another_folder(tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ and egg-info there
    source.mkdir()
    for name in SOURCE:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source)
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source)
    [wheel] = dist.glob("sage_grpo-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site_packages = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    # This environment's packages after the venv's own, as plain paths: its .pth files (the checkout's editable
    # install among them) are not processed, so `core`, `stages` and `pipeline` can only come from the wheel.
    (site_packages / "reused.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "run.yaml").write_text(yaml.safe_dump({"data": {"source": "prompts.txt"}}))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = _run(venv / "bin" / "sagegrpo", "config", "run.yaml", cwd=elsewhere, env=env)
    assert yaml.safe_load(result.stdout)["deepspeed"]["config"] == "zero3"

    where = _run(
        python, "-c", "import sage_grpo.stages.engine as e; print(e.DEEPSPEED_CONFIGS)", cwd=elsewhere, env=env
    )
    assert Path(where.stdout.strip()).is_relative_to(site_packages)
    assert sorted(path.name for path in Path(where.stdout.strip()).glob("*.json")) == [
        "zero2.json",
        "zero3.json",
        "zero3_offload.json",
    ]
