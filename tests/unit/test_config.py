"""The run config: every shipped YAML validates, and bad input is one line naming the key, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.pipeline.config import load_run_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = load_run_config(path)
    assert config.rollout.group_size >= 2


def test_paper_configs_hold_the_papers_settings():
    config = load_run_config(REPO / "configs" / "hunyuanvideo15_sage_lora.yaml")
    assert (config.sde.steps, config.sde.shift, config.sde.eta, config.model.guidance_scale) == (20, 5.0, 0.5, 6.0)
    assert config.rewards[0].explicit_weights() == {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}
    assert config.trust_region.strategy.value == "dual" and config.update.learning_rate == 1e-5
    assert config.trust_region.preset == "calibrated"


def test_baselines_differ_from_sage_only_in_the_sampler_and_say_which_keys_differ():
    sage = load_run_config(REPO / "configs" / "hunyuanvideo15_sage_lora.yaml")
    arms = {
        p.stem.removeprefix("hunyuanvideo15_").removesuffix("_lora"): (p, load_run_config(p))
        for p in CONFIGS
        if p.stem.endswith("_lora") and "_sage_" not in p.stem
    }
    assert set(arms) == {"dance", "flow", "cps", "dance_eta05", "flow_eta05"}
    for name, (path, other) in arms.items():
        variant = name.split("_")[0]
        assert other.sde.variant == variant
        assert other.model_dump(exclude={"sde", "run", "checkpoint"}) == sage.model_dump(
            exclude={"sde", "run", "checkpoint"}
        )
        assert other.sde.steps == sage.sde.steps and other.sde.shift == sage.sde.shift
        header = path.read_text().split("seed:")[0]
        if other.sde.eta == sage.sde.eta:
            assert "only sde.variant differs" in header, path.name
        else:  # the variant's own eta: the header must not claim one difference
            assert "sde.variant and sde.eta" in header, path.name
            assert (REPO / "configs" / f"hunyuanvideo15_{variant}_eta05_lora.yaml").exists()


def test_overrides_are_typed():
    config = load_run_config(
        REPO / "configs" / "demo.yaml", ["sde.eta=0.3", "lora.enabled=true", "lora.rank=8", "eval.every=0"]
    )
    assert config.sde.eta == 0.3 and config.lora.rank == 8 and config.eval.every == 0


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.group_size=1", "rollout.group_size"),
        ("sde.variant=ddim", "sde.variant"),
        ("update.learning_rate=fast", "update.learning_rate"),
        ("update.lr=1e-4", "update.lr"),
        ("lora.rank=8", "lora.rank"),
        ("update.micro_batch_size=3", "update.micro_batch_size"),
        ("sde=5", "sde"),
        ("nonsense", "nonsense"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(UserError) as error:
        load_run_config(REPO / "configs" / "demo.yaml", [override])
    assert key in str(error.value) and "\n" not in str(error.value)


def test_cli_rejects_before_loading_any_model():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sage_grpo.pipeline.cli",
            "run",
            str(REPO / "configs" / "demo.yaml"),
            "trust_region.strategy=sometimes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "trust_region.strategy" in result.stderr


def test_missing_config_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")


def test_the_saved_config_masks_secrets_but_keeps_the_rest():
    from sage_grpo.core.secrets import masked_config

    config = load_run_config(
        REPO / "configs" / "demo.yaml",
        [
            "rewards=[{name: 'tests.fixtures.user_rewards.safety:HostedJudge', "
            "kwargs: {url: 'http://user:hunter2@rewards:8000', api_token: s3cr3t}}]",
            "checkpoint.uri=s3://bucket/ckpt",
        ],
    )
    saved = masked_config(config)
    text = str(saved)
    assert "hunter2" not in text and "s3cr3t" not in text
    assert saved["rewards"][0]["kwargs"]["api_token"] == "***"
    assert saved["checkpoint"]["uri"] == "s3://bucket/ckpt" and saved["sde"]["eta"] == config.sde.eta


@pytest.mark.parametrize(
    "override,replacement",
    [
        ("checkpoint.endpoint_url=http://minio:9000", "s3.endpoint_url"),
        ("checkpoint.addressing_style=path", "s3.addressing_style"),
        ("checkpoint.read_timeout_s=5.5", "s3.read_timeout_s"),
        ("data.s3_endpoint_url=http://minio:9000", "s3.endpoint_url"),
        ("update.seed=3", "seed"),
    ],
)
def test_a_moved_key_is_refused_with_where_it_went(override, replacement):
    old, value = override.split("=")
    with pytest.raises(UserError) as error:
        load_run_config(REPO / "configs" / "demo.yaml", [override])
    assert str(error.value).endswith(f"{old} moved to {replacement}") and "\n" not in str(error.value)
    section, _, key = replacement.rpartition(".")
    config = load_run_config(REPO / "configs" / "demo.yaml", [f"{replacement}={value}"])  # its new place takes it
    assert str(getattr(getattr(config, section) if section else config, key)) == value


def test_the_checkpoint_store_and_the_scheduler_reach_s3_through_the_one_s3_section(tmp_path):
    from sage_grpo.pipeline.scheduled_run import ScheduledRunOptions, stores

    overrides = ("s3.endpoint_url=http://minio:9000", "s3.addressing_style=path", "s3.region_name=eu-west-1")
    config = load_run_config(REPO / "configs" / "demo.yaml", list(overrides))
    checkpoints = config.checkpoint.model_copy(update={"uri": "s3://bucket/run"}).build(s3=config.s3)
    options = ScheduledRunOptions(
        str(REPO / "configs" / "demo.yaml"), "s3://bucket/prompts", "s3://bucket/runs", "m", overrides=overrides
    )
    clients = [checkpoints.backend._client, *(store._s3 for store in stores(options))]
    for client in clients:
        assert client.meta.endpoint_url == "http://minio:9000" and client.meta.region_name == "eu-west-1"
        assert client.meta.config.s3["addressing_style"] == "path"
