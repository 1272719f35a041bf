"""A committed step whose manifest is structurally wrong for the engine that loads it is set aside like any bad step
under ``--resume auto`` (one warning, the previous verified step loaded) and refused in one line by name: a manifest
that omits the ZeRO optimizer states (DeepSpeed stopped the resume with a FileNotFoundError traceback). A real
ZeRO-3 engine, a world of one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sage_grpo.core.storage import CheckpointError
from sage_grpo.pipeline.checkpointer import Checkpointer, RNGState, for_run
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.pipeline.recipe import Progress, build_policy
from tests.helpers import world_of_one

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
TINY = ["model.name=tests.helpers:linear_adapter", "model.kwargs={}", "sde.steps=3", "rollout.group_size=2"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with world_of_one():
        yield


def checkpointer(config) -> Checkpointer:
    policy = build_policy(config)
    states = {"updater": policy.updater, "progress": Progress(), "rng": RNGState()}
    return for_run(config, policy.engine, states)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return load_run_config(DEMO, [*TINY, f"run.output_dir={tmp_path_factory.mktemp('manifests') / 'run'}"])


@pytest.fixture(scope="module")
def pristine(config) -> dict:
    """Steps 2 and 4 committed by a ZeRO-3 engine; step 4's manifest as written."""
    saver = checkpointer(config)
    saver.claim()
    for step in (2, 4):
        saver.states["progress"].iteration = step
        saver.save(step, force=True)
    return json.loads(manifest_path(config, 4).read_text())


def manifest_path(config, step: int) -> Path:
    return config.output_dir / "checkpoints" / f"step-{step}" / "manifest.json"


def without_optimizer_states(manifest: dict) -> None:
    manifest["files"] = [entry for entry in manifest["files"] if "optim_states" not in entry["path"]]


CASES = {
    "the optimizer states omitted": (without_optimizer_states, "optimizer states for rank(s) [0]"),
}


@pytest.fixture(scope="module")
def resumed(config, pristine) -> Checkpointer:
    """One fresh engine for every load here: a refused step loads nothing, and step 2 loads whole over anything."""
    return checkpointer(config)


@pytest.fixture(params=CASES)
def damaged(request, config, pristine):
    change, words = CASES[request.param]
    manifest = json.loads(json.dumps(pristine))
    change(manifest)
    manifest_path(config, 4).write_text(json.dumps(manifest))
    try:
        yield words
    finally:
        manifest_path(config, 4).write_text(json.dumps(pristine))


def test_resume_auto_sets_the_step_aside_and_loads_the_one_before(resumed, damaged, caplog):
    with caplog.at_level(logging.WARNING, logger="sage_grpo"):
        assert resumed.load("auto") == 2
    [warning] = [record.getMessage() for record in caplog.records if "skipping checkpoint" in record.getMessage()]
    assert "step-4" in warning and damaged in warning


def test_the_step_asked_for_by_name_is_refused_in_one_line(resumed, damaged):
    with pytest.raises(CheckpointError) as refused:
        resumed.load("4")
    assert damaged in str(refused.value) and "\n" not in str(refused.value)
