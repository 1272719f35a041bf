"""Export targets: an export replaces only an earlier export of ours. Whatever else is at ``--out`` (a
folder of other models and files, a run's own output folder, a checkpoint root, an export someone added to or
changed, a file, a link) is refused in one line (exit 2) and left byte for byte as it was. What a killed export left
(its staging, a full weight copy) is removed by the next export, and only that."""

import os
import uuid
from pathlib import Path

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.export import (
    EXPORT_MANIFEST,
    LORA_WEIGHT_NAME,
    check_replaceable,
    export_lora,
    read_export_manifest,
)
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15_pipeline
from sage_grpo.core.storage import CheckpointConfig
from sage_grpo.pipeline import cli
from tests.helpers import gone_and_running_pids, make_leftover

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def adapter():
    transformer = add_lora(tiny_hunyuan15_pipeline().transformer, LoraConfig(enabled=True, rank=4, alpha=4.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in (p for p in transformer.parameters() if p.requires_grad):
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return transformer


def _others_models(out: Path, adapter) -> None:
    (out / "other-model").mkdir(parents=True)
    (out / "other-model" / "weights.safetensors").write_bytes(b"someone's weights")
    (out / "notes.txt").write_text("keep me")


def _run_output_dir(out: Path, adapter) -> None:
    (out / "checkpoints" / "step-4").mkdir(parents=True)
    (out / "checkpoints" / "step-4" / "manifest.json").write_text("{}")
    (out / "config.json").write_text("{}")
    (out / "mlflow.db").write_bytes(b"SQLite format 3\0")


def _checkpoint_root(out: Path, adapter) -> None:
    (out / "step-2").mkdir(parents=True)
    (out / "step-2" / "pipeline_state_rank0.pt").write_bytes(b"state")
    (out / "owner.json").write_text('{"run_id": "abc"}')
    (out / "latest").write_text("2\n")


def _export_with_an_extra_file(out: Path, adapter) -> None:
    export_lora(adapter, out)
    (out / "README.md").write_text("my notes on this model")


def _export_with_a_changed_file(out: Path, adapter) -> None:
    export_lora(adapter, out)
    (out / LORA_WEIGHT_NAME).write_bytes(b"fine-tuned further by hand")


def _export_with_a_subfolder(out: Path, adapter) -> None:
    export_lora(adapter, out)
    (out / "samples").mkdir()
    (out / "samples" / "video.mp4").write_bytes(b"mp4")


def _manifest_only(out: Path, adapter) -> None:
    out.mkdir()
    (out / EXPORT_MANIFEST).write_text("not json")
    (out / "data.bin").write_bytes(b"data")


def _a_file(out: Path, adapter) -> None:
    out.write_text("a file, not a folder")


def _a_link_to_an_export(out: Path, adapter) -> None:
    real = out.with_name("real-export")
    export_lora(adapter, real)
    out.symlink_to(real, target_is_directory=True)


FOREIGN = {
    "other models and files": _others_models,
    "a run's output folder": _run_output_dir,
    "a checkpoint root": _checkpoint_root,
    "an export with a file added": _export_with_an_extra_file,
    "an export with a file changed": _export_with_a_changed_file,
    "an export with a subfolder": _export_with_a_subfolder,
    "an unreadable export.json": _manifest_only,
    "a file": _a_file,
    "a link to an export": _a_link_to_an_export,
}


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``'s folder (the target and its siblings), with its bytes or link target."""
    entries = {}
    for directory, folders, files in os.walk(root.parent):
        for name in folders + files:
            path = Path(directory) / name
            relative = str(path.relative_to(root.parent))
            if path.is_symlink():
                entries[relative] = f"-> {os.readlink(path)}"
            elif path.is_file():
                entries[relative] = path.read_bytes()
            else:
                entries[relative] = "folder"
    return entries


@pytest.mark.parametrize("kind", FOREIGN)
def test_an_export_never_replaces_what_it_did_not_write(adapter, tmp_path, kind):
    out = tmp_path / "target" / "out"
    out.parent.mkdir()
    FOREIGN[kind](out, adapter)
    before = _snapshot(out)

    with pytest.raises(UserError, match="refusing to replace it") as refused:
        export_lora(adapter, out)

    assert "\n" not in str(refused.value)
    assert _snapshot(out) == before


@pytest.mark.parametrize("kind", FOREIGN)
def test_sagegrpo_export_refuses_a_foreign_out_in_one_line_before_loading_anything(
    adapter, tmp_path, capsys, monkeypatch, kind
):
    out = tmp_path / "target" / "out"
    out.parent.mkdir()
    FOREIGN[kind](out, adapter)
    before = _snapshot(out)
    monkeypatch.chdir(tmp_path)

    code = cli.main(["export", DEMO, "--checkpoint", "auto", "--out", str(out)])

    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error: export target") and str(out) in line
    assert "Traceback" not in captured.err and captured.out == ""
    assert _snapshot(out) == before
    assert not (tmp_path / "runs").exists()  # nothing was built


@pytest.mark.parametrize("kind", ["absent", "an empty folder", "an earlier export"])
def test_an_export_replaces_nothing_or_an_earlier_export_of_ours(adapter, tmp_path, kind):
    out = tmp_path / "out"
    if kind == "an empty folder":
        out.mkdir()
    elif kind == "an earlier export":
        export_lora(add_lora(tiny_hunyuan15_pipeline().transformer, LoraConfig(enabled=True, rank=4)), out)
        earlier = (out / LORA_WEIGHT_NAME).read_bytes()

    check_replaceable(out)
    export_lora(adapter, out)

    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MANIFEST, LORA_WEIGHT_NAME]
    assert read_export_manifest(out)["kind"] == "lora"
    if kind == "an earlier export":
        assert (out / LORA_WEIGHT_NAME).read_bytes() != earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or discarded folder left


def _a_committed_step(checkpoints: Path, step: int) -> None:
    staged = checkpoints.parent / "staging"
    (staged / "engine").mkdir(parents=True)
    (staged / "engine" / "states.pt").write_bytes(b"weights")
    CheckpointConfig(uri=str(checkpoints)).build().commit(staged, step, world_size=1, config_hash="cfg")


@pytest.mark.parametrize(
    ("checkpoint", "committed", "refusal"),
    [
        ("3", None, "step-3 is not a committed checkpoint"),
        ("auto", None, "no committed checkpoint in"),
        ("step-2", 2, "export target"),  # the default target, <output_dir>/exports/step-2, holds others' files
    ],
)
def test_sagegrpo_export_refuses_a_missing_checkpoint_or_an_owned_default_target_before_building_anything(
    adapter, tmp_path, capsys, monkeypatch, checkpoint, committed, refusal
):
    from sage_grpo.pipeline.recipe import SageGRPORecipe

    monkeypatch.setattr(SageGRPORecipe, "setup_policy", lambda *args: pytest.fail("built the policy"))
    output = tmp_path / "run"
    if committed is not None:
        _a_committed_step(output / "checkpoints", committed)
        _others_models(output / "exports" / f"step-{committed}", adapter)
    before = _snapshot(output)  # the whole of tmp_path

    code = cli.main(["export", DEMO, "--checkpoint", checkpoint, f"run.output_dir={output}"])

    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error:") and refusal in line
    assert captured.out == "" and _snapshot(output) == before


# --- What a killed export left --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pids():
    with gone_and_running_pids() as pids:
        yield pids


def staging(pid: int, name: str = "step-8") -> str:
    return f".{name}.{pid}-{uuid.uuid4().hex}.tmp"


# (name, kind, owner's uid or None for ours, removed?)
EXPORT_LEFTOVERS = {
    "a killed export's staging": (lambda p: staging(p["gone"]), "folder", None, True),
    "another step's, killed": (lambda p: staging(p["gone"], "step-4"), "folder", None, True),
    "this pid's (a restarted container)": (lambda p: staging(p["this"]), "folder", None, True),
    "a running export's staging": (lambda p: staging(p["running"]), "folder", None, False),
    "another user's": (lambda p: staging(p["gone"]), "folder", 12345, False),
    "a file of that name": (lambda p: staging(p["gone"]), "file", None, False),
    "a link of that name": (lambda p: staging(p["gone"]), "link", None, False),
    "a user's .tmp folder": (lambda p: ".step-8.tmp", "folder", None, False),
    "a pid-less name": (lambda p: f".step-8.{uuid.uuid4().hex}.tmp", "folder", None, False),
    "an export": (lambda p: "step-2", "folder", None, False),
}


@pytest.mark.parametrize("case", EXPORT_LEFTOVERS)
def test_an_export_removes_only_the_staging_a_killed_export_left(adapter, tmp_path, pids, case):
    name, kind, uid, removed = EXPORT_LEFTOVERS[case]
    if uid is not None and os.getuid() != 0:
        pytest.skip("making a folder another user's needs root")
    exports = tmp_path / "exports"
    exports.mkdir()
    leftover = make_leftover(exports / name(pids), kind, uid)

    export_lora(adapter, exports / "step-8")

    assert (leftover.exists() or leftover.is_symlink()) != removed
    assert (exports / "step-8" / "export.json").is_file()
    assert len([p for p in exports.iterdir() if p.name.startswith(".step-8.") and p != leftover]) == 0
