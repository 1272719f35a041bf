"""core.environment: the accelerator stack and the DeepSpeed ops a bug report needs (``sagegrpo env``)."""

import sys

import pytest

from sage_grpo.core.environment import accelerator_lines, deepspeed_op_lines
from sage_grpo.core.ops_cache import CPU_OPS

pytestmark = pytest.mark.unit


def test_each_op_this_project_loads_is_reported_built_only_when_its_library_is_in_the_extensions_folder(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    (tmp_path / "deepspeed_shm_comm").mkdir()  # a folder left by a killed build holds no library

    lines = deepspeed_op_lines()

    assert lines[0].endswith(str(tmp_path))
    by_op = {line.split()[1]: line for line in lines[1:]}
    assert set(by_op) == set(CPU_OPS)
    assert "; built" in by_op["cpu_adam"]
    assert "not built" in by_op["deepspeed_shm_comm"]
    assert all("compatible" in line for line in by_op.values())


def test_without_a_gpu_the_accelerator_lines_say_why_nccl_and_the_driver_are_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the `gpu` extra not installed

    cuda, nccl, driver = accelerator_lines()

    assert cuda.startswith("cuda") and "none (CPU)" in cuda
    assert nccl.split(maxsplit=1)[1] == "none (no CUDA device)"
    assert "nvidia-ml-py not installed" in driver


def test_the_driver_version_comes_from_nvml_when_the_gpu_extra_is_installed(monkeypatch):
    class FakeNvml:
        NVMLError = RuntimeError
        calls: list[str] = []

        @classmethod
        def nvmlInit(cls):
            cls.calls.append("init")

        @classmethod
        def nvmlSystemGetDriverVersion(cls):
            return b"575.51.03"

        @classmethod
        def nvmlShutdown(cls):
            cls.calls.append("shutdown")

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)

    assert accelerator_lines()[2].split(maxsplit=1)[1] == "575.51.03"
    assert FakeNvml.calls == ["init", "shutdown"]
