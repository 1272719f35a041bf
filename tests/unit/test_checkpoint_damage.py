"""Damaged and hostile checkpoints: a ``latest`` that names no committed step, steps whose manifest
verifies but is wrong, state files of another structure, planted pickles, links and special files inside a step.

``--resume auto`` never starts over when a verified step exists: it sets the bad step aside with one warning line
and loads the previous one. A step asked for by name is refused in one line. Each case is applied to the newest of
three committed steps, its manifest rewritten to match (what whoever can write to the bucket can do)."""

import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.storage import CheckpointError
from sage_grpo.pipeline.checkpointer import Checkpointer, RNGState, for_run
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.pipeline.recipe import Progress

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
STATE = "pipeline_state_rank0.pt"
ENGINE_FILE = "engine/mp_rank_00_model_states.pt"


class Payload:
    """Stands in for an object an attacker pickled into a checkpoint."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Engine:
    """The two calls the Checkpointer makes on a DeepSpeed engine, with one tensor of state."""

    def __init__(self):
        self.weight = torch.zeros(3)
        self._config = SimpleNamespace(load_universal_checkpoint=False)

    def save_checkpoint(self, directory, tag, save_latest):
        (Path(directory) / tag).mkdir(parents=True)
        torch.save({"weight": self.weight}, Path(directory) / ENGINE_FILE)

    def load_checkpoint(self, directory, tag, **options):
        self.weight = torch.load(Path(directory) / ENGINE_FILE)["weight"]
        return directory, {}


class Shards:
    """A state holding tensors of a fixed shape, as the anchor's shards are."""

    def __init__(self):
        self.values = [torch.zeros(4, 2), torch.zeros(3)]

    def state_dict(self):
        return {"refreshes": 1, "values": [value.clone() for value in self.values]}

    def load_state_dict(self, state):
        self.values = [value.clone() for value in state["values"]]


def checkpointer(config) -> tuple[Checkpointer, Progress]:
    progress = Progress()
    states = {"progress": progress, "rng": RNGState(), "shards": Shards()}
    return for_run(config, Engine(), states), progress


@pytest.fixture
def config(tmp_path):
    return load_run_config(DEMO, [f"run.output_dir={tmp_path / 'run'}"])


@pytest.fixture
def root(config) -> Path:
    saver, progress = checkpointer(config)
    saver.claim()
    for step in (1, 2, 3):
        progress.iteration = step
        progress.history.append({"iteration": step, "reward/mean": 0.1 * step})
        saver.engine.weight = torch.full((3,), float(step))
        saver.save(step, force=True)
    return config.output_dir / "checkpoints"


def rewrite_manifest(step_dir: Path, change=lambda manifest: None) -> None:
    """The manifest made to verify against the files as they are now (through links), then ``change``d."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["files"]:
        data = (step_dir / entry["path"]).read_bytes()
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    change(manifest)
    path.write_text(json.dumps(manifest))


def edit_state(step_dir: Path, change) -> None:
    state = torch.load(step_dir / STATE, weights_only=True)
    change(state)
    torch.save(state, step_dir / STATE)
    rewrite_manifest(step_dir)


def plant_pickle(step_dir: Path) -> None:
    edit_state(step_dir, lambda state: state["progress"].update(last_eval=Payload()))


def plant_pickle_in_the_engine(step_dir: Path) -> None:
    torch.save({"weight": Payload()}, step_dir / ENGINE_FILE)
    rewrite_manifest(step_dir)


def link_state_to(target: str):
    def link(step_dir: Path) -> None:
        (step_dir / STATE).unlink()
        (step_dir / STATE).symlink_to(target if target.startswith("/") else step_dir.parent / target)
        rewrite_manifest(step_dir)

    return link


def fifo_beside_the_files(step_dir: Path) -> None:
    os.mkfifo(step_dir / "extra")


def step_folder_is_a_link(step_dir: Path) -> None:
    real = step_dir.with_name("elsewhere")
    step_dir.rename(real)
    step_dir.symlink_to(real, target_is_directory=True)


def world_size(n: int):
    return lambda step_dir: rewrite_manifest(step_dir, lambda manifest: manifest.update(world_size=n))


def without_entry(path: str):
    def drop(manifest):
        manifest["files"] = [entry for entry in manifest["files"] if entry["path"] != path]

    return lambda step_dir: rewrite_manifest(step_dir, drop)


def no_files(step_dir: Path) -> None:
    rewrite_manifest(step_dir, lambda manifest: manifest.update(files=[]))


def set_in_state(*keys, value):
    def change(state):
        *parents, last = keys
        for key in parents:
            state = state[key]
        state[last] = value

    return lambda step_dir: edit_state(step_dir, change)


def drop_from_state(name: str):
    return lambda step_dir: edit_state(step_dir, lambda state: state.pop(name))


def add_to_state(name: str):
    return lambda step_dir: edit_state(step_dir, lambda state: state.update({name: {"x": 1}}))


def not_a_mapping(step_dir: Path) -> None:
    torch.save([1, 2, 3], step_dir / STATE)
    rewrite_manifest(step_dir)


HOSTILE = {
    "pickle in the pipeline state": plant_pickle,
    "pickle in the engine state": plant_pickle_in_the_engine,
    "state linked to another step's": link_state_to("step-2/" + STATE),
    "state linked outside the store": link_state_to("/etc/passwd"),
    "a fifo inside the step": fifo_beside_the_files,
    "the step folder a link": step_folder_is_a_link,
    "world size 2, one rank's files": world_size(2),
    "world size 1000": world_size(1000),
    "rank state missing from the manifest": without_entry(STATE),
    "engine state missing from the manifest": without_entry(ENGINE_FILE),
    "empty file list": no_files,
    "iteration 1e9 as a float": set_in_state("progress", "iteration", value=1e9),
    "iteration 10**9": set_in_state("progress", "iteration", value=10**9),
    "iteration of another step": set_in_state("progress", "iteration", value=2),
    "iteration a string": set_in_state("progress", "iteration", value="3"),
    "a state missing": drop_from_state("rng"),
    "an unexpected state": add_to_state("payload"),
    "a state None": set_in_state("progress", value=None),
    "a shard of the wrong shape": set_in_state("shards", "values", 0, value=torch.zeros(2, 4)),
    "a shard of the wrong dtype": set_in_state("shards", "values", 1, value=torch.zeros(3, dtype=torch.float64)),
    "a shard missing": set_in_state("shards", "values", value=[torch.zeros(4, 2)]),
    "a shard not a tensor": set_in_state("shards", "values", 1, value=[0.0, 0.0, 0.0]),
    "the rng state truncated": set_in_state("rng", "torch", value=torch.zeros(10, dtype=torch.uint8)),
    "the state not a mapping": not_a_mapping,
}


def warnings_in(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


@pytest.mark.parametrize("case", HOSTILE)
def test_auto_sets_a_bad_step_aside_with_one_warning_and_loads_the_previous_one(config, root, caplog, case):
    HOSTILE[case](root / "step-3")
    loader, progress = checkpointer(config)

    with caplog.at_level(logging.INFO):
        assert loader.load("auto") == 2

    assert progress.iteration == 2 and len(progress.history) == 2
    assert torch.equal(loader.engine.weight, torch.full((3,), 2.0))
    [warning] = warnings_in(caplog)
    assert "step-3" in warning and "\n" not in warning and "weights_only=False" not in warning
    assert not (config.output_dir / "checkpoint-restore").exists()


@pytest.mark.parametrize("case", HOSTILE)
def test_a_bad_step_asked_for_by_name_is_refused_in_one_line(config, root, case):
    HOSTILE[case](root / "step-3")
    loader, progress = checkpointer(config)

    with pytest.raises(UserError) as refused:  # exit 2
        loader.load("3")

    message = str(refused.value)
    assert "\n" not in message and "weights_only=False" not in message and "pwned" not in message
    assert progress.iteration == 0


def test_the_bad_step_is_kept_and_never_pruned(config, root):
    HOSTILE["iteration 10**9"](root / "step-3")
    loader, progress = checkpointer(config)
    assert loader.load("auto") == 2

    for step in (3, 4, 5, 6):  # step 3 again: the bad one is moved aside, not replaced or deleted
        progress.iteration = step
        progress.history.append({"iteration": step})
        loader.save(step, force=True)

    [aside] = root.glob("set-aside-step-3-*")
    assert torch.load(aside / STATE, weights_only=True)["progress"]["iteration"] == 10**9


LATEST = {
    "zero": b"0\n",
    "negative": b"-1\n",
    "very negative": b"-999999999\n",
    "garbage": b"garbage",
    "empty": b"",
    "binary": b"\xff\xfe\x00\x01",
    "a float": b"2.5\n",
    "exponent": b"1e9\n",
    "a step never committed": b"99\n",
    "non-ascii digits": "\u0663".encode(),
    "signed": b"+3\n",
}


@pytest.mark.parametrize("content", LATEST.values(), ids=LATEST)
def test_a_damaged_latest_resumes_the_newest_verified_step_with_one_warning(config, root, caplog, content):
    (root / "latest").write_bytes(content)
    loader, progress = checkpointer(config)

    with caplog.at_level(logging.INFO):
        assert loader.load("auto") == 3

    assert progress.iteration == 3
    [warning] = warnings_in(caplog)
    assert "step-3" in warning and "latest" in warning


@pytest.mark.parametrize("content", [b"0\n", b"-1\n", b"garbage"])
def test_a_damaged_latest_and_a_bad_newest_step_resume_the_one_before(config, root, content):
    (root / "latest").write_bytes(content)
    HOSTILE["a shard of the wrong shape"](root / "step-3")
    loader, _ = checkpointer(config)

    assert loader.load("auto") == 2
    assert loader.store.resolve("auto") == 2  # the store remembers what its reader set aside


def test_a_damaged_latest_never_becomes_a_fresh_start_when_nothing_verifies(config, root):
    (root / "latest").write_bytes(b"0\n")
    for step_dir in root.glob("step-*"):
        (step_dir / STATE).write_bytes(b"corrupt")
    loader, _ = checkpointer(config)

    with pytest.raises(CheckpointError, match="--fresh-start"):
        loader.load("auto")


def test_a_restore_a_killed_process_left_is_removed_by_the_next_resume(config, root):
    killed = config.output_dir / "checkpoint-restore" / "step-1" / "engine"
    killed.mkdir(parents=True)
    (killed / "mp_rank_00_model_states.pt").write_bytes(b"half a download")
    loader, _ = checkpointer(config)

    assert loader.load("auto") == 3
    assert not (config.output_dir / "checkpoint-restore").exists()


def test_a_failed_restore_leaves_no_restore_folder(config, root):
    HOSTILE["a shard of the wrong shape"](root / "step-3")
    loader, _ = checkpointer(config)

    with pytest.raises(CheckpointError):
        loader.load("3")
    assert not (config.output_dir / "checkpoint-restore").exists()
