"""The container image: pins, prebuilt DeepSpeed ops, non-root, caches, what it copies, its provenance."""

import json
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from sage_grpo.core.tracking import IMAGE_ENV

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _instructions() -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    lines = [line for line in _dockerfile().splitlines() if not line.lstrip().startswith("#")]
    return [
        " ".join(part.strip() for part in chunk.split("\\\n"))
        for chunk in re.split(r"(?<!\\)\n", "\n".join(lines))
        if chunk.strip()
    ]


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=\"?([^\"\n]+)\"?$", _dockerfile(), re.MULTILINE)
    assert match, f"Dockerfile has no ARG {name}=..."
    return match.group(1)


def _final_stage() -> list[str]:
    lines = _instructions()
    return lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")) :]


def _pyproject_requirement(name: str) -> Requirement:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, dependencies) if r.name == name)


def test_image_pins_torch_and_deepspeed_inside_pyprojects_ranges():
    assert _pyproject_requirement("torch").specifier.contains(_arg("TORCH_VERSION"))
    assert _pyproject_requirement("deepspeed").specifier.contains(_arg("DEEPSPEED_VERSION"))
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url', _dockerfile())


def test_torch_wheels_match_the_base_images_cuda():
    major, minor, _ = _arg("CUDA_VERSION").split(".")
    assert _arg("TORCH_INDEX").endswith(f"/cu{major}{minor}")
    assert "FROM nvidia/cuda:${CUDA_VERSION}-" in _dockerfile()


def test_deepspeed_ops_are_prebuilt_for_ampere_and_hopper():
    build = next(run for run in _instructions() if run.startswith("RUN ") and 'pip install "deepspeed==' in run)
    assert "DS_BUILD_FUSED_ADAM=1" in build and "DS_BUILD_CPU_ADAM=1" in build
    architectures = _arg("TORCH_CUDA_ARCH_LIST").split(";")
    assert {"8.0", "9.0"} <= set(architectures)


def test_image_runs_sagegrpo_as_a_non_root_user():
    lines = _instructions()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    entrypoint = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert json.loads(entrypoint[-1][len("ENTRYPOINT ") :]) == ["sagegrpo"]


def test_image_environment_puts_caches_on_the_volume_and_fails_fast_on_nccl_errors():
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(run for run in _instructions() if run.startswith("ENV "))))
    assert env["HF_HOME"].startswith("/cache/") and env["TORCH_EXTENSIONS_DIR"].startswith("/cache/")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert 'VOLUME ["/cache"]' in _dockerfile()


def test_everything_the_image_copies_exists_and_is_not_dockerignored():
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv"} <= ignored
    sources = re.findall(r"^COPY (?!--from)(\S+)", _dockerfile(), re.MULTILINE)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source not in ignored, source


def test_image_records_its_commit_and_version_as_labels_and_for_mlflow():
    stage = _final_stage()
    assert {"ARG GIT_COMMIT", "ARG VERSION"} <= set(stage)
    # Built without them, the image fails at once instead of carrying no provenance.
    check = next(line for line in stage if line.startswith("RUN test -n"))
    assert '"${GIT_COMMIT}"' in check and '"${VERSION}"' in check and stage.index(check) < 4
    labels = " ".join(line for line in stage if line.startswith("LABEL "))
    assert "org.opencontainers.image.revision=${GIT_COMMIT}" in labels
    assert "org.opencontainers.image.version=${VERSION}" in labels
    env = " ".join(line for line in stage if line.startswith("ENV "))
    assert f"{IMAGE_ENV}=sage-grpo:${{VERSION}}" in env
    # MLflow turns MLFLOW_RUN_CONTEXT's JSON into run tags: the commit, where the image has no .git to read it from.
    context = re.search(r'MLFLOW_RUN_CONTEXT="((?:[^"\\]|\\.)*)"', env).group(1)
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert json.loads(context.replace("\\", "").replace("${GIT_COMMIT}", commit)) == {
        "mlflow.source.git.commit": commit
    }


def test_image_installs_the_package_with_its_deepspeed_configs_and_gpu_metrics():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(Requirement(r).name == "nvidia-ml-py" for r in extras["gpu"])
    installs = [line for line in _instructions() if line.startswith("RUN ") and "pip install" in line]
    assert any(re.search(r'"\.\[[\w,]*\bgpu\b[\w,]*\]"', line) for line in installs)
    # A regular install (not editable): deepspeed_configs/ travels as package data, and no source tree is needed.
    assert any(line.endswith("pip install --no-deps .") for line in installs)
    assert not any(" -e " in line for line in installs)
    assert "COPY deepspeed_configs ./deepspeed_configs" in _instructions()
    assert not any(line.startswith(("COPY core", "COPY pipeline")) for line in _final_stage())
