"""A checkpoint whose values are out of range is set aside like any other bad step, never loaded: lambda NaN (every
update then skipped, the run "completing" untrained), inf, 1e308 or negative (trained away from the anchor); a
controller history with NaN or inf; counters below 0; a sampler position past the prompt set; a non-finite anchor
shard. The states are the recipe's own (a real ZeRO-3 engine over the one-layer model, its Updater, the sampler, the
progress, the RNG), saved by a real run of 3 iterations; each case edits step 3 and rewrites its manifest to match,
as whoever can write to the store can."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from sage_grpo.core.checkpoint_values import ControllerValues, values_problem
from sage_grpo.core.errors import UserError
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.pipeline.checkpointer import Checkpointer, RNGState, Stateful, for_run
from sage_grpo.pipeline.config import RunConfig, load_run_config
from sage_grpo.pipeline.recipe import Policy, Progress, build_policy
from sage_grpo.stages.ingest import PromptSampler
from sage_grpo.stages.update import Updater
from tests.unit.test_checkpointer import DEMO, PROMPTS, TINY, Training, process_group  # noqa: F401 (a fixture)

pytestmark = pytest.mark.unit

STATE = "pipeline_state_rank0.pt"


def run_config(output_dir: Path, *overrides: str) -> RunConfig:
    return load_run_config(
        DEMO, [*TINY, "checkpoint.every=1", "checkpoint.keep_last=3", f"run.output_dir={output_dir}", *overrides]
    )


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """Steps 1-3 of a real run over 5 prompts, 2 an iteration: step 3 carries one prompt over into epoch 1."""
    output_dir = tmp_path_factory.mktemp("saved") / "run"
    training = Training(run_config(output_dir))
    training.checkpointer.claim()
    training.train(3)
    return output_dir


@pytest.fixture(scope="module")
def policy(saved_run) -> Policy:
    """The engine a resume loads into, built once: each load replaces its whole state."""
    return build_policy(run_config(saved_run))


@pytest.fixture
def states(saved_run, policy) -> dict[str, Stateful]:
    """Fresh objects for each resume to load into, under the recipe's names."""
    config = run_config(saved_run)
    return {
        "updater": Updater(policy.engine, policy.adapter, config.update, config.trust_region, seed=config.seed),
        "sampler": PromptSampler(len(PROMPTS), config.rollout.prompts_per_rank, 0, 1, config.seed),
        "progress": Progress(),
        "rng": RNGState(),
    }


@pytest.fixture
def root(saved_run, tmp_path) -> Path:
    """A copy of the run's checkpoint root, for one case to change."""
    shutil.copytree(saved_run / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def checkpointer(saved_run: Path, policy: Policy, states: dict[str, Stateful], root: Path) -> Checkpointer:
    """``states`` resuming the saved run (its config) from the copy of its root."""
    return for_run(run_config(saved_run, f"checkpoint.uri={root}"), policy.engine, states)


def edit_step(root: Path, step: int, change) -> None:
    step_dir = root / f"step-{step}"
    state = torch.load(step_dir / STATE, weights_only=True)
    change(state)
    torch.save(state, step_dir / STATE)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (step_dir / entry["path"]).read_bytes()
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def setter(*keys, value):
    def change(state):
        *parents, last = keys
        for key in parents:
            state = state[key]
        state[last] = value(state[last]) if callable(value) else value

    return change


def poisoned(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = value
    return tensor


OUT_OF_RANGE = {
    "lambda NaN": (setter("updater", "controller", "value", value=math.nan), "controller.value"),
    "lambda inf": (setter("updater", "controller", "value", value=math.inf), "controller.value"),
    "lambda 1e308": (setter("updater", "controller", "value", value=1e308), "lambda 1e+308"),
    "lambda negative": (setter("updater", "controller", "value", value=-1.0), "lambda -1.0"),
    "controller history NaN": (
        setter("updater", "controller", "measurements", value=lambda old: [*old, math.nan]),
        "controller.measurements",
    ),
    "controller history inf": (
        setter("updater", "controller", "measurements", value=lambda old: [*old, -math.inf]),
        "controller.measurements",
    ),
    "updates below 0": (setter("updater", "updates_done", value=-1), "updater.updates_done"),
    "skipped updates below 0": (setter("updater", "skipped_updates", value=-3), "updater.skipped_updates"),
    "controller steps below 0": (setter("updater", "controller", "steps", value=-1), "controller.steps"),
    "anchor refreshes below 0": (setter("updater", "anchor", "refreshes", value=-1), "anchor.refreshes"),
    "sampler position past the prompt set": (setter("sampler", "position", value=6), "position 6"),
    "sampler epoch below 0": (setter("sampler", "epoch", value=-1), "sampler.epoch"),
    "sampler carrying a prompt that is not there": (setter("sampler", "carried_over", value=[5]), "carried-over"),
    "anchor shard NaN": (
        setter("updater", "anchor", "values", 0, value=lambda shard: poisoned(shard, math.nan)),
        "anchor.values.0",
    ),
    "anchor shard inf": (
        setter("updater", "anchor", "values", 0, value=lambda shard: poisoned(shard, math.inf)),
        "anchor.values.0",
    ),
}


@pytest.mark.parametrize("case", OUT_OF_RANGE)
def test_auto_sets_a_step_out_of_range_aside_with_one_warning_and_loads_the_one_before(
    saved_run, policy, states, root, caplog, case
):
    change, named = OUT_OF_RANGE[case]
    edit_step(root, 3, change)

    with caplog.at_level(logging.WARNING):
        assert checkpointer(saved_run, policy, states, root).load("auto") == 2

    [warning] = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert "step-3" in warning and named in warning and "\n" not in warning
    assert states["progress"].iteration == 2
    controller = states["updater"].controller
    assert math.isfinite(controller.value) and controller.value > 0
    assert (root / "step-3" / STATE).exists()  # kept (moved aside by the next save), never loaded
    assert not (saved_run / "checkpoint-restore").exists()


@pytest.mark.parametrize("case", ["lambda NaN", "sampler position past the prompt set", "anchor shard inf"])
def test_a_step_out_of_range_asked_for_by_name_is_refused_in_one_line(saved_run, policy, states, root, case):
    change, named = OUT_OF_RANGE[case]
    edit_step(root, 3, change)

    with pytest.raises(UserError) as refused:  # exit 2
        checkpointer(saved_run, policy, states, root).load("3")

    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_the_values_a_run_saves_load(saved_run, policy, states, root):
    assert checkpointer(saved_run, policy, states, root).load("3") == 3
    assert states["sampler"].carried_over  # step 3 crossed into the next epoch


def test_a_sampler_at_the_exact_end_of_its_epoch_is_in_range():
    sampler = PromptSampler(4, 2, 0, 1, seed=0)
    next(sampler), next(sampler)
    assert sampler.position == sampler.num_prompts
    assert sampler.state_problem(sampler.state_dict(), 2) is None


@pytest.mark.parametrize("preset", ["paper", "calibrated"])
def test_every_lambda_a_controller_produces_is_in_its_range(preset):
    """Through the paper preset's whole warm-up (interpolated up to its maximum) and beyond, and the calibrated
    controller's clipping at both bounds: each state it would checkpoint passes."""
    trust = TrustRegionConfig(preset=preset)
    controller = trust.controller()
    lambda_range = (trust.kl_minimum or trust.kl_initial, trust.kl_maximum)
    for step in range(150):
        controller.update(10.0 ** (step % 7 - 6), 10.0 ** (step % 9 - 4))
        state = controller.state_dict()
        assert values_problem(ControllerValues, state, "controller", lambda_range=lambda_range) is None
