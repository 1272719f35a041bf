"""Reading a run config imports no heavy library (issue 31): ``sagegrpo config`` and the refusals of every command
come before torch, MLflow, diffusers or DeepSpeed would load. Each check runs in a fresh interpreter, since this one
has imported them all already.

Two exceptions, both while validating. torch: the ``sde`` section's check of which steps inject noise (and so how
many micro-steps an update accumulates) is ``core.sde``'s own maths, written in torch; a copy in plain Python could
drift from the rule the sampler and the update use. diffusers (and torch, transformers, peft... through it): a
hunyuan15 config with sequence parallelism and weights not on disk, whose split is checked against the transformer's
defaults in diffusers (``core.models.sequence_layout``); hence the LoRA config here rather than the 720p one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import worker_environment

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "mlflow", "pandas", "diffusers", "transformers", "deepspeed", "boto3", "botocore", "peft")

# Loads a config through the function ``sagegrpo config`` uses, noting who imports torch first (a finder asked before
# the real ones, only while a module is not yet imported), then prints the heavy modules loaded and that importer.
_LOAD_PROBE = """
import json, sys

class FirstTorchImport:
    stack = None  # the importing modules' names, outermost first

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and FirstTorchImport.stack is None:
            frame, FirstTorchImport.stack = sys._getframe(), []
            while frame:
                FirstTorchImport.stack.insert(0, frame.f_globals.get("__name__"))
                frame = frame.f_back
        return None

sys.meta_path.insert(0, FirstTorchImport())
from sage_grpo.pipeline.commands import _load_config

_load_config(sys.argv[1], [])
heavy = sorted(name for name in sys.modules if name.split(".")[0] in sys.argv[2].split(","))
print(json.dumps({"heavy": sorted({name.split(".")[0] for name in heavy}), "torch_importer": FirstTorchImport.stack}))
"""


def _environment_without_mlflow_variables() -> dict[str, str]:
    """The worker environment without ``MLFLOW_*``: a config read where one is set imports MLflow to check its value
    (``core.tracking_config.check_mlflow_environment``), and earlier tests in the same worker may leave one set."""
    return {key: value for key, value in worker_environment().items() if not key.startswith("MLFLOW_")}


def _run_python(code: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=_environment_without_mlflow_variables(),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout


def test_importing_the_config_schema_and_the_commands_imports_no_heavy_library():
    code = (
        "import sys; import sage_grpo.pipeline.commands, sage_grpo.pipeline.config, sage_grpo.pipeline.cli; "
        f"print(sorted({{name.split('.')[0] for name in sys.modules}} & {set(HEAVY)!r}))"
    )
    assert _run_python(code).strip() == "[]"


@pytest.mark.parametrize("config", ["configs/demo.yaml", "configs/hunyuanvideo15_sage_lora.yaml"])
def test_validating_a_config_imports_only_torch_and_only_for_the_noise_schedule(config):
    found = json.loads(_run_python(_LOAD_PROBE, config, ",".join(HEAVY)))
    assert set(found["heavy"]) <= {"torch"}, found["heavy"]
    ours = [name for name in found["torch_importer"] or [] if str(name).startswith("sage_grpo.")]
    importer = [name for name in ours if name != "sage_grpo.core.lazy"]
    assert importer and importer[-1] == "sage_grpo.core.sde", importer


def test_config_command_prints_json_without_importing_a_heavy_library():
    # The command line as ``python -m sage_grpo.pipeline.cli`` runs it, with the modules loaded reported at exit.
    code = (
        "import atexit, runpy, sys; "
        "atexit.register(lambda: print('loaded:', *sorted({n.split('.')[0] for n in sys.modules}), file=sys.stderr)); "
        "sys.argv = ['sagegrpo', 'config', 'configs/demo.yaml', '--json']; "
        "runpy.run_module('sage_grpo.pipeline.cli', run_name='__main__', alter_sys=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_environment_without_mlflow_variables(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    resolved = json.loads(done.stdout)
    assert resolved["model"]["name"] == "tiny-hunyuan15" and resolved["run"]["name"] == "demo"
    loaded = next(line.split()[1:] for line in done.stderr.splitlines() if line.startswith("loaded:"))
    assert "sage_grpo" in loaded  # the report is there to read
    assert sorted(set(loaded) & set(HEAVY) - {"torch"}) == []
