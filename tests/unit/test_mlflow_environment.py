"""An MLflow environment variable MLflow cannot parse (``MLFLOW_HTTP_REQUEST_TIMEOUT=abc``) is one line and exit 2
when the config is read, or when ``promote`` starts, not a traceback at MLflow's first request deep in a run."""

from pathlib import Path

import pytest

from sage_grpo.core import distributed
from sage_grpo.pipeline import cli

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
BAD = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": ("abc", "invalid literal for int()"),
    "MLFLOW_ENABLE_ASYNC_LOGGING": ("maybe", "must be one of"),
}


def one_error_line(capsys, variable: str) -> str:
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error: MLflow environment:") and variable in line
    return line


@pytest.mark.parametrize("variable", BAD)
def test_a_run_refuses_an_unparseable_mlflow_variable_before_deepspeed_starts(tmp_path, capsys, monkeypatch, variable):
    value, words = BAD[variable]
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(distributed, "init", lambda *args, **kwargs: pytest.fail("DeepSpeed was started"))

    code = cli.main(["run", DEMO, f"run.output_dir={tmp_path / 'run'}"])

    assert code == 2
    assert words in one_error_line(capsys, variable)
    assert not (tmp_path / "run").exists()


def test_promote_refuses_an_unparseable_mlflow_variable(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "abc")

    code = cli.main(["promote", "--model", "m", "--tracking-uri", "http://127.0.0.1:9", "--dry-run"])

    assert code == 2
    one_error_line(capsys, "MLFLOW_HTTP_REQUEST_TIMEOUT")


def test_a_run_without_tracking_ignores_mlflow_variables(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "abc")

    assert cli.main(["config", DEMO, "tracking.enabled=false", "registry.model_name=null"]) == 0


def test_parseable_mlflow_variables_pass(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "true")

    assert cli.main(["config", DEMO]) == 0
