"""``sagegrpo export`` to a folder it cannot write (a read-only mount) or under a regular file is refused in one line
(exit 2) before the model loads, not with a traceback once the weights are ready to be written."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sage_grpo.core.storage import CheckpointConfig
from sage_grpo.pipeline import cli

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


def committed_step(output_dir: Path, step: int) -> None:
    staged = output_dir / "staging"
    (staged / "engine").mkdir(parents=True)
    (staged / "engine" / "states.pt").write_bytes(b"weights")
    CheckpointConfig().build(output_dir).commit(staged, step, world_size=1, config_hash="cfg")
    shutil.rmtree(staged)


@pytest.mark.parametrize("under", ["a.txt/out", "a.txt/deeper/out"])
def test_an_export_under_a_regular_file_is_refused_before_loading(tmp_path, capsys, monkeypatch, under):
    from sage_grpo.pipeline.recipe import SageGRPORecipe

    monkeypatch.setattr(SageGRPORecipe, "setup_policy", lambda *args: pytest.fail("built the policy"))
    committed_step(tmp_path / "run", 2)
    (tmp_path / "a.txt").write_text("keep me")

    code = cli.main(
        ["export", DEMO, "--checkpoint", "2", "--out", str(tmp_path / under), f"run.output_dir={tmp_path}/run"]
    )

    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error: export target") and str(tmp_path / "a.txt") in line
    assert (tmp_path / "a.txt").read_text() == "keep me"


def read_only_mounts() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "mount", "--bind", "-o", "ro", "/tmp", "/tmp"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not read_only_mounts(), reason="needs a user and mount namespace for a read-only bind mount")
def test_an_export_to_a_read_only_folder_is_refused_in_one_line(tmp_path):
    committed_step(tmp_path / "run", 2)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    export = [sys.executable, "-m", "sage_grpo.pipeline.cli", "export", DEMO, "--checkpoint", "2"]
    export += ["--out", str(read_only / "out"), f"run.output_dir={tmp_path}/run"]
    script = f'mount --bind -o ro "{read_only}" "{read_only}" && exec "$@"'
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]

    done = subprocess.run([*namespace, *export], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("sagegrpo: error: export target") and "Read-only file system" in line
    assert done.stdout == "" and list(read_only.iterdir()) == []
