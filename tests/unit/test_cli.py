"""The command line's basics: version, fast help, options and overrides in any order, the resolved config, env."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from sage_grpo.core.errors import UserError
from sage_grpo.pipeline import cli, commands

pytestmark = pytest.mark.unit

DEMO = "configs/demo.yaml"


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.strip() == f"sagegrpo {commands.package_version()}"


def test_help_imports_neither_torch_nor_mlflow():
    probe = (
        "import sys; from sage_grpo.pipeline import cli; cli.build_parser(); print(sorted({'torch', 'mlflow', "
        "'deepspeed'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "argv",
    [
        ["run", DEMO, "--max-iterations", "4", "seed=3"],
        ["run", DEMO, "seed=3", "--max-iterations", "4"],
        ["run", "--max-iterations", "4", DEMO, "seed=3"],
    ],
)
def test_options_and_overrides_in_any_order(argv):
    args = cli.parse_args(argv)
    assert (args.config, args.max_iterations, args.overrides) == (DEMO, 4, ["seed=3"])


def test_unknown_flags_and_overrides_on_commands_without_them_are_refused():
    with pytest.raises(UserError, match="unrecognized arguments: --nope"):
        cli.parse_args(["run", DEMO, "--nope"])
    with pytest.raises(UserError, match="unrecognized arguments: seed=3"):
        cli.parse_args(["inspect-sde", "seed=3"])  # promote takes overrides: they apply to its --config


def test_config_prints_the_validated_config_with_defaults_and_masked_secrets(capsys):
    uri = "http://alice:hunter2@mlflow.internal:5000"
    assert cli.main(["config", DEMO, "run.max_iterations=3", f"tracking.tracking_uri={uri}"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["run"]["max_iterations"] == 3
    assert resolved["update"]["micro_batch_size"] == 4  # from the YAML
    assert "clip_range" in resolved["update"]  # a default the YAML never names
    assert "hunter2" not in out and "mlflow.internal" in out


def test_config_json_is_the_same_resolved_config(capsys):
    overrides = ["run.max_iterations=3", "tracking.tracking_uri=http://alice:hunter2@mlflow.internal:5000"]
    assert cli.main(["config", DEMO, *overrides]) == 0
    as_yaml = yaml.safe_load(capsys.readouterr().out)
    assert cli.main(["config", DEMO, *overrides, "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == as_yaml and as_yaml["run"]["max_iterations"] == 3
    assert "hunter2" not in out


def test_config_errors_are_one_line_exit_2(capsys):
    assert cli.main(["config", DEMO, "sde.steps=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sde.steps" in err


def test_env_reports_versions_and_devices(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    import torch

    assert f"torch         {torch.__version__}" in out and "devices:" in out
    assert "nccl" in out and "op cpu_adam" in out  # the accelerator stack and the ops a bug report needs


def test_list_index_overrides_reach_into_lists(capsys):
    assert (
        cli.main(
            [
                "config",
                DEMO,
                "rewards.0.weights={brightness: 1.0}",
                "rewards.0.weights.brightness=2",
                "rewards.1={name: colorfulness}",
            ]
        )
        == 0
    )
    rewards = yaml.safe_load(capsys.readouterr().out)["rewards"]
    assert rewards[0]["weights"] == {"brightness": 2.0} and rewards[1]["name"] == "colorfulness"
    assert cli.main(["config", DEMO, "rewards.5.name=brightness"]) == 2
    assert "not an index of a list of 1 item(s)" in capsys.readouterr().err


def test_the_summary_never_prints_a_tracking_password(tmp_path):
    from sage_grpo.pipeline.commands import _summary_text
    from sage_grpo.pipeline.config import load_run_config
    from sage_grpo.pipeline.recipe import RunSummary

    config = load_run_config(DEMO)
    summary = RunSummary(
        "completed",
        1,
        tmp_path,
        None,
        "https://bob:pa55word@mlflow.example:443",
        "abc",
        [{"reward/mean": float("nan"), "iteration": 1}],
    )
    text = _summary_text(config, summary)
    assert "pa55word" not in text and "mlflow.example" in text
    assert "no sample was scored in iteration(s) [1]" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["schedule", DEMO, "seed=3", "--prompts", "p", "--checkpoint-root", "r", "--model", "m"],
        ["schedule", "--config", DEMO, "--prompts", "p", "--checkpoint-root", "r", "--model", "m", "seed=3"],
    ],
)
def test_schedule_takes_the_config_like_the_other_commands(monkeypatch, argv):
    from sage_grpo.pipeline import scheduled_run

    seen = []
    monkeypatch.setattr(scheduled_run, "run_scheduled", lambda options: seen.append(options) or 0)
    assert cli.main(argv) == 0
    assert (seen[0].config, seen[0].overrides, seen[0].model) == (DEMO, ("seed=3",), "m")


def test_the_program_returns_the_commands_status_in_a_single_process():
    # No process group (config never starts one): a normal return, every atexit hook to come. Its own process: a
    # pytest worker may hold a process group an earlier test started, and there the program would end the worker.
    probe = (
        "import atexit, sys; from sage_grpo.pipeline import cli; atexit.register(print, 'atexit hook ran'); "
        f"sys.argv = ['sagegrpo', 'config', {DEMO!r}, 'sde.steps=0']; sys.exit(cli.program())"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "sde.steps" in result.stderr
    assert result.stdout.strip().endswith("atexit hook ran")


@pytest.mark.parametrize("command", sorted(cli.EXAMPLES))
def test_every_subcommand_help_says_what_it_does_with_an_example_and_the_exit_codes(command, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.parse_args([command, "--help"])
    assert exited.value.code == 0
    usage, description, *sections = capsys.readouterr().out.split("\n\n")
    assert usage.startswith(f"usage: sagegrpo {command}")
    assert description and not description.startswith(("positional arguments:", "options:"))  # a sentence first
    rest = "\n\n".join(sections)
    assert f"example:\n  sagegrpo {command}" in rest
    assert "exit codes:" in rest and "75  retryable" in rest


def test_every_subcommand_has_an_example(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    listed = re.search(r"\{([a-z,-]+)\}", capsys.readouterr().out).group(1).split(",")
    assert sorted(listed) == sorted(cli.EXAMPLES)
