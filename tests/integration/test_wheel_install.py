"""The package as a user installs it: a wheel built from the source, installed into a fresh venv beside other
distributions' top-level packages named ``core`` and ``pipeline``, run from another folder. It finds its shipped
DeepSpeed configs (deepspeed_configs/ is package data), and the demo trains, checkpoints and exports through the
``sagegrpo`` console script without importing either stranger: the wheel installs one name, ``sage_grpo``. Nothing is
downloaded: the wheel is installed without dependencies and the fresh venv reuses this environment's packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.integration.pipeline_runs import DEMO, REPO, SHORT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOURCE = ("pyproject.toml", "README.md", "sage_grpo", "core", "stages", "pipeline", "deepspeed_configs")
STRANGERS = ("core", "pipeline")  # names the wheel installed at the top level before it installed sage_grpo alone


@dataclass
class Installed:
    venv: Path
    site_packages: Path
    elsewhere: Path  # a folder outside the checkout, where the commands run
    env: dict[str, str]  # without PYTHONPATH: nothing of the checkout is importable
    imported: Path  # a planted stranger that is imported writes its name here

    def run(self, *command, timeout: int = 300) -> subprocess.CompletedProcess:
        return _run(*command, cwd=self.elsewhere, env=self.env, timeout=timeout)


def _run(*command, timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _plant_strangers(site_packages: Path, imported: Path) -> None:
    """A ``core`` and a ``pipeline`` package of someone else's, first on the venv's path: importing one records its
    name and fails, as a wrong module in its place would."""
    for name in STRANGERS:
        (site_packages / name).mkdir()
        (site_packages / name / "__init__.py").write_text(
            f"with open({str(imported)!r}, 'a') as record:\n"
            f"    record.write({name!r} + '\\n')\n"
            f"raise ImportError('the planted {name} package was imported, not sage_grpo.{name}')\n"
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp_path = tmp_path_factory.mktemp("wheel")
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
    # install among them) are not processed, so sage_grpo can only come from the wheel.
    (site_packages / "reused.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    imported = tmp_path / "strangers-imported.txt"
    _plant_strangers(site_packages, imported)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return Installed(venv, site_packages, elsewhere, env, imported)


def test_the_wheel_installs_one_top_level_name_and_the_strangers_stay_importable(installed):
    tops = installed.run(installed.venv / "bin" / "python", "-c", _TOP_LEVEL_NAMES).stdout.split()
    assert tops == ["sage_grpo"]
    installed.run(installed.venv / "bin" / "python", "-c", "import sage_grpo.core, sage_grpo.pipeline")
    assert not installed.imported.exists()
    # The control: the planted packages are the ones a bare import finds, and they are caught.
    refused = subprocess.run(
        [installed.venv / "bin" / "python", "-c", "import core"], cwd=installed.elsewhere, env=installed.env
    )
    assert refused.returncode != 0 and installed.imported.read_text() == "core\n"
    installed.imported.unlink()


_TOP_LEVEL_NAMES = (
    "from importlib.metadata import distribution\n"
    "print(*sorted({f.parts[0] for f in distribution('sage-grpo').files\n"
    "       if f.suffix == '.py' and '.dist-info' not in f.parts[0] and len(f.parts) > 1}))"
)


def test_an_installed_wheel_resolves_the_shipped_deepspeed_configs_from_another_folder(installed):
    (installed.elsewhere / "run.yaml").write_text(yaml.safe_dump({"data": {"source": "prompts.txt"}}))
    result = installed.run(installed.venv / "bin" / "sagegrpo", "config", "run.yaml")
    assert yaml.safe_load(result.stdout)["deepspeed"]["config"] == "zero3"

    where = installed.run(
        installed.venv / "bin" / "python", "-c", "import sage_grpo.stages.engine as e; print(e.DEEPSPEED_CONFIGS)"
    )
    assert Path(where.stdout.strip()).is_relative_to(installed.site_packages)
    assert sorted(path.name for path in Path(where.stdout.strip()).glob("*.json")) == [
        "zero2.json",
        "zero3.json",
        "zero3_offload.json",
    ]
    assert not installed.imported.exists()


def test_the_installed_demo_trains_checkpoints_and_exports_beside_the_strangers(installed):
    demo = yaml.safe_load(DEMO.read_text())
    demo["data"]["source"] = str(REPO / demo["data"]["source"])  # the checkout's prompts, by absolute path
    (installed.elsewhere / "demo.yaml").write_text(yaml.safe_dump(demo))
    out = installed.elsewhere / "runs" / "demo"

    # One iteration: a rollout, its scores, an update, an evaluation, the final checkpoint and the export.
    result = installed.run(
        installed.venv / "bin" / "sagegrpo",
        "run",
        "demo.yaml",
        f"run.output_dir={out}",
        *SHORT,
        "run.max_iterations=1",
        "eval.every=1",
        "tracking.system_metrics=false",
        timeout=600,
    )

    assert "sage-grpo: completed after 1 iteration(s)" in result.stdout
    assert not installed.imported.exists(), installed.imported.read_text()
    assert (out / "checkpoints" / "step-1" / "manifest.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "1"
    assert any((out / "exports" / "step-1").iterdir())
