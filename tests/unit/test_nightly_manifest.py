"""The shipped nightly CronJob scores every day on one fixed evaluation set: its command line gives the run config an
``eval.source`` from the overlay's settings, which the schedule requires before it starts anything."""

import pytest

from sage_grpo.pipeline.config import load_run_config
from tests.unit.test_k8s_manifests import _expand, overlay  # noqa: F401 (overlay: the rendered dev and prod fixture)

pytestmark = pytest.mark.unit


def test_the_nightly_job_carries_a_fixed_evaluation_set(overlay, tmp_path):  # noqa: F811
    settings = overlay[("ConfigMap", "sage-grpo-settings")]["data"]
    (tmp_path / "run.yaml").write_text(overlay[("ConfigMap", "sage-grpo-run")]["data"]["run.yaml"])
    cron = overlay[("CronJob", "sage-grpo-scheduled")]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    args = [_expand(arg, settings) for arg in cron["containers"][0]["args"]]
    overrides = [arg for arg in args[1:] if "=" in arg and not arg.startswith("--")]
    day = f"data.source={settings['PROMPTS_URI']}/2026-01-01.jsonl"
    config = load_run_config(tmp_path / "run.yaml", [*overrides, day])
    assert config.eval.source == settings["EVAL_PROMPTS_URI"]
    assert config.eval.source.startswith("s3://") and config.eval.source.endswith(".jsonl")
