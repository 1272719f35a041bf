"""Launcher variables with garbage values are one line and exit 2, not a traceback: the rank variables a run reads
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_PORT) and torchrun's own settings given to
``python -m sage_grpo.pipeline.launch`` (its ``PET_*`` variables or flags), each before anything starts."""

from pathlib import Path

import pytest

from sage_grpo.core import distributed
from sage_grpo.pipeline import cli, launch

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"RANK": "abc"}, "RANK='abc'"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not below WORLD_SIZE=2"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "one"}, "LOCAL_WORLD_SIZE='one'"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
    ],
)
def test_a_run_with_a_garbage_launcher_variable_stops_in_one_line(tmp_path, capsys, monkeypatch, variables, named):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "init", lambda *args, **kwargs: pytest.fail("the process group was started"))

    code = cli.main(["run", DEMO, f"run.output_dir={tmp_path / 'run'}"])

    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error: launcher environment:") and named in line


@pytest.mark.parametrize(
    ("variables", "flags", "named"),
    [
        ({"PET_NNODES": "abc"}, [], "invalid literal for int()"),
        ({"PET_NPROC_PER_NODE": "many"}, [], "nproc_per_node value: many"),
        ({"PET_MAX_RESTARTS": "x"}, [], "--max-restarts"),
        ({}, ["--nnodes", "0"], "min_nodes must be > 0"),
    ],
)
def test_the_launcher_refuses_garbage_torchrun_settings_in_one_line(capsys, monkeypatch, variables, flags, named):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)

    code = launch.main(["--standalone", *flags, "-m", "sage_grpo.pipeline.cli", "--version"])

    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"{launch.PROG}: error: ") and named in line
