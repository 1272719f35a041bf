"""Reading a config file: YAML refuses what would blow up later (alias bombs, self-referring aliases, absurd
nesting); a file in another encoding, unreadable, or with line breaks in a key is one line; a byte order mark reads
as the UTF-8 file."""

import time
from pathlib import Path

import pytest

from sage_grpo.core.config_loading import MAX_EXPANDED_SIZE, parse_override, read_yaml
from sage_grpo.core.errors import UserError
from tests.helpers import refused_in_one_line

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


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


# --- Config files in other encodings, unreadable, or with line breaks in a key -------------------------------------


def _config_bytes(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "run.yaml"
    path.write_bytes(data)
    return str(path)


def _demo_text() -> str:
    # data.source made absolute, so the copy reads the same prompts from anywhere
    return DEMO.read_text().replace("configs/demo_prompts.txt", str(REPO / "configs" / "demo_prompts.txt"))


# (how the file is written, what the one line must say)
CONFIG_FILES = {
    "latin-1": (lambda text: ("# café\n" + text).encode("latin-1"), "is not UTF-8 text"),
    "utf-16-without-mark": (lambda text: text.encode("utf-16-le"), "NUL bytes"),
    "utf-32-without-mark": (lambda text: text.encode("utf-32-be"), "NUL bytes"),
    "utf-16-broken": (lambda text: text.encode("utf-16")[:-1], "is not UTF-16 text"),
    "key-with-newline": (lambda text: (text + '"run\\nname": x\n').encode(), "run\\nname: unknown key"),
    "key-with-line-separator": (lambda text: (text + '"a\\u2028b": 1\n').encode(), "a\\u2028b: unknown key"),
    "key-with-carriage-return": (lambda text: (text + '"a\\rb": 1\n').encode(), "a\\rb: unknown key"),
    "nested-key-with-newline": (
        lambda text: text.replace("  max_iterations: 8", '  "max_\\niterations": 8').encode(),
        "run.max_\\niterations: unknown key",
    ),
}


@pytest.mark.parametrize("kind", sorted(CONFIG_FILES))
def test_a_config_file_that_cannot_be_read_as_text_or_has_line_breaks_in_a_key_is_one_line(capsys, tmp_path, kind):
    write, message = CONFIG_FILES[kind]
    path = _config_bytes(tmp_path, write(_demo_text()))
    assert message in refused_in_one_line(capsys, ["config", path], path)


def test_an_unreadable_config_file_is_one_line(capsys, tmp_path, monkeypatch):
    path = _config_bytes(tmp_path, _demo_text().encode())

    def unreadable(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", unreadable)  # root reads through any mode bits
    assert "Permission denied" in refused_in_one_line(capsys, ["config", path], path)


@pytest.mark.parametrize("codec", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
def test_a_config_with_a_byte_order_mark_reads_as_the_utf8_one(capsys, tmp_path, codec):
    from sage_grpo.pipeline import cli

    text = _demo_text()
    if codec == "utf-16-be":  # Python's utf-16-be writes no mark: add it, as editors do
        data = "\ufeff".encode(codec) + text.encode(codec)
    else:
        data = text.encode(codec)
    assert cli.main(["config", _config_bytes(tmp_path, text.encode())]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["config", _config_bytes(tmp_path, data)]) == 0
    assert capsys.readouterr().out == expected
