"""An override's value is never silently cut: YAML would end it at `` #`` (a comment) and fold or split it at a line
break, so ``run.name=exp #3`` is taken literally and a value holding a line break is refused in one line."""

import json
from pathlib import Path

import pytest

from sage_grpo.core.config_loading import parse_override
from sage_grpo.pipeline import cli

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("run.name=exp #3", "exp #3"),
        ("run.name=exp\t#3", "exp\t#3"),
        ("run.name=#3", "#3"),
        ("rollout.group_size=8 # more", "8 # more"),  # then refused by the schema, never read as 8
        ("run.name=exp#3", "exp#3"),  # no comment: YAML keeps it too
        ('run.name="exp #3"', "exp #3"),  # quoted: YAML's own string
        ('run.tags=[a, "#b"]', ["a", "#b"]),
        ("rollout.group_size=8", 8),
    ],
)
def test_a_value_yaml_would_cut_at_a_comment_is_taken_whole(override, value):
    assert parse_override(override)[1] == value


def test_sagegrpo_config_keeps_a_run_name_with_a_hash(capsys):
    assert cli.main(["config", DEMO, "run.name=nightly #42", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["name"] == "nightly #42"


def test_a_number_followed_by_a_comment_is_refused_not_cut(capsys):
    assert cli.main(["config", DEMO, "rollout.group_size=8 # more"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "rollout.group_size" in line


@pytest.mark.parametrize("value", ["a\nb", "demo\nseed: 7", "x\r", "x\u2028y"])
def test_a_value_with_a_line_break_is_refused_in_one_line(capsys, value):
    assert cli.main(["config", DEMO, f"run.name={value}"]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error: override run.name") and "line break" in line
    assert captured.out == ""
