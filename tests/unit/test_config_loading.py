"""YAML reading refuses what would blow up later: alias bombs, self-referring aliases, absurd nesting."""

import time

import pytest

from sage_grpo.core.config_loading import MAX_EXPANDED_SIZE, parse_override, read_yaml
from sage_grpo.core.errors import UserError

pytestmark = pytest.mark.unit


def alias_bomb(levels: int = 9) -> str:
    """The billion-laughs document: each level aliases the previous one 9 times (9^levels nodes, ~60 bytes/level)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_in_one_line_without_expanding_it(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert path.stat().st_size < 1024 and MAX_EXPANDED_SIZE < 9**9
    started = time.monotonic()
    with pytest.raises(UserError, match="alias bomb") as refused:
        read_yaml(path)
    assert time.monotonic() - started < 1.0  # measured, not expanded
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_an_alias_bomb_in_an_override_is_refused():
    bomb = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x, x, x]"] + ["*a"] * 9) + "]"  # small: loads fine
    assert parse_override(f"run.tags={bomb}")[1][1] == ["x"] * 10
    nested = "{" + alias_bomb().replace("\n", ", ").rstrip(", ") + "}"  # flow style, one line
    with pytest.raises(UserError, match="override run.tags: YAML aliases expand"):
        parse_override(f"run.tags={nested}")


def test_an_alias_that_contains_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: &x [1, *x]\n")
    with pytest.raises(UserError, match="alias refers to a node that contains it"):
        read_yaml(path)


def test_nesting_too_deep_to_load_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError, match="nested too deeply"):
        read_yaml(path)


def test_ordinary_anchors_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {lr: 0.001, eta: 0.5}\nrun_a: *b\nruns: [*b, *b]\n")
    assert read_yaml(path) == {
        "base": {"lr": 0.001, "eta": 0.5},
        "run_a": {"lr": 0.001, "eta": 0.5},
        "runs": [{"lr": 0.001, "eta": 0.5}] * 2,
    }
