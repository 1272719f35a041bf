"""A corpus of bad inputs a careless user (or a typo) produces: every one is refused when the config is read, before
any model loads, as one line naming the key, exit 2, nothing written. The corpus runs through the CLI in-process
(``sagegrpo config`` validates exactly as ``run`` does); a sample of it runs as ``sagegrpo run`` subprocesses."""

from pathlib import Path

import pytest

from tests.helpers import refused_in_one_line, sagegrpo

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")


def _json_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# (override, the key the one line must name)
CORPUS = [
    # sampler and schedule
    ("sde.steps=0", "sde.steps"),
    ("sde.steps=1", "sde"),
    ("sde.steps=-3", "sde.steps"),
    ("sde.steps=100000", "sde.steps"),
    ("sde.eta=0", "sde"),
    ("sde.eta=-0.1", "sde.eta"),
    ("sde.eta=5", "sde.eta"),
    ("sde.eta=.inf", "sde.eta"),
    ("sde.eta=.nan", "sde.eta"),
    ("sde.shift=0", "sde.shift"),
    ("sde.shift=.inf", "sde.shift"),
    ("sde.shift=-1", "sde.shift"),
    ("sde.window=[7,8]", "sde"),
    ("sde.window=[3,2]", "sde"),
    ("sde.window=[0,99]", "sde"),
    ("sde.variant=ode", "config"),
    ("sde.variant=euler", "sde.variant"),
    ("sde.variant=cps|sde.eta=1.5", "sde"),
    ("sde=5", "sde"),
    # the update and the trust region
    ("update.learning_rate=.inf", "update.learning_rate"),
    ("update.learning_rate=1e30", "update.learning_rate"),
    ("update.learning_rate=0", "update.learning_rate"),
    ("update.learning_rate=fast", "update.learning_rate"),
    ("update.micro_batch_size=0", "update.micro_batch_size"),
    ("update.micro_batch_size=3", "update.micro_batch_size"),
    ("update.max_grad_norm=.nan", "update.max_grad_norm"),
    ("update.clip_range=-1", "update.clip_range"),
    ("update.optimizer=sgd", "update.optimizer"),
    ("update.optimizer=muon|deepspeed.config=zero2", "config"),  # was a traceback once the model had loaded
    ("update.optimizer=muon|update.max_grad_norm=0.5", "update"),  # DeepSpeed would clip Muon's update by its norm
    ("update.lr_schedule=cosine", "update"),
    ("update.lr_warmup_steps=-1", "update.lr_warmup_steps"),
    ("update.seed=5", "update.seed"),  # moved to the top-level seed
    ("update.lr=1e-4", "update.lr"),
    ("trust_region.strategy=strong", "trust_region.strategy"),
    ("trust_region.preset=nope", "trust_region.preset"),
    ("trust_region.anchor_interval=0", "trust_region.anchor_interval"),
    ("trust_region.kl_target=.inf", "trust_region.kl_target"),
    # rollout, LoRA, seeds, run
    ("rollout.group_size=1", "rollout.group_size"),
    ("rollout.prompts_per_rank=0", "rollout.prompts_per_rank"),
    ("rollout.batch_size=4", "rollout.batch_size"),
    ("lora.rank=8", "lora.rank"),
    ("lora.enabled=true|lora.dropout=0.1", "lora.dropout"),
    ("lora.enabled=true|lora.rank=0", "lora.rank"),
    ("seed=-1", "seed"),
    ("seed=9223372036854775808", "seed"),
    ("seed=abc", "seed"),
    ("run.max_iterations=0", "run.max_iterations"),
    ("run.time_budget_minutes=-1", "run.time_budget_minutes"),
    ("run.preemption_grace_s=.inf", "run.preemption_grace_s"),
    ("run.colour=red", "run.colour"),
    # model and rewards: factories bound before anything loads
    ("model.name=nope", "model.name"),
    ("model.name=hunyuan15", "model.kwargs"),
    ("model.pretrained=/weights/hv15", "model.kwargs"),
    ("model.name=my_pkg.models:Big", "model.name"),
    ("model.kwargs.sed=1", "model.kwargs"),
    ("model.kwargs.dtype=float16", "model.kwargs"),
    ("model.guidance_scale=0.5", "model.guidance_scale"),
    ("model.guidance_scale=.inf", "model.guidance_scale"),
    ("model.dtype=float8", "model.dtype"),
    ("rewards=[]", "rewards"),
    ("rewards=[{name: nope}]", "rewards.0.name"),
    ("rewards=[{name: 'my_pkg.rewards:Safety'}]", "rewards.0.name"),
    ("rewards=[{name: brightness, kwargs: {targt: 0.5}}]", "rewards.0.kwargs"),
    ("rewards=[{name: brightness, weights: {brightness: .nan}}]", "rewards.0.weights.brightness"),
    ("rewards=[{name: remote}]", "rewards.0.kwargs"),
    ("scoring.timeout_s=.inf", "scoring.timeout_s"),
    ("scoring.max_failed_fraction=2", "scoring.max_failed_fraction"),
    # data, storage, tracking, registry
    ("data.eval_fraction=1.5", "data.eval_fraction"),
    ("data=5", "data"),
    ("checkpoint.uri=s3://ckpt/../evil/run2", "checkpoint.uri"),
    ("checkpoint.uri=s3://ckpt/a/./b//c", "checkpoint.uri"),
    ("checkpoint.uri=ftp://host/x", "checkpoint.uri"),
    ("checkpoint.keep_last=1", "checkpoint.keep_last"),
    ("checkpoint.every=-1", "checkpoint.every"),
    ("registry.model_name=m|tracking.enabled=false", "config"),
    ("registry.margin=-0.1", "registry.margin"),
    ("eval.every=-1", "eval.every"),
    # DeepSpeed: the JSON is loaded and checked with the config
    ("deepspeed.config=zero9", "deepspeed.config"),
    ("deepspeed.precision=fp16", "deepspeed.precision"),
    ("deepspeed.collective_timeout_minutes=0", "deepspeed.collective_timeout_minutes"),
]
DEEPSPEED_FILES = {
    "missing": None,
    "invalid": "{not json",
    "list": "[1, 2]",
    "stage9": '{"zero_optimization": {"stage": 9}}',
    "disagrees": '{"gradient_clipping": 5.0}',
    "optimizer": '{"optimizer": {"type": "Adam", "params": {"lr": 1}}}',
    "fp16": '{"fp16": {"enabled": true}}',
    "offload": '{"zero_optimization": {"stage": 3, "offload_param": {"device": "tape"}}}',
    "nvme_without_path": '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}',
    "nvme_on_stage2": '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}',
}


def test_the_corpus_is_large():
    assert len(CORPUS) + len(DEEPSPEED_FILES) >= 60


@pytest.mark.parametrize("override,key", CORPUS, ids=[case[0] for case in CORPUS])
def test_each_bad_override_is_one_line_naming_its_key(capsys, override, key):
    refused_in_one_line(capsys, ["config", DEMO, *override.split("|")], key)


@pytest.mark.parametrize("kind", sorted(DEEPSPEED_FILES))
def test_each_bad_deepspeed_config_is_one_line(capsys, tmp_path, kind):
    text = DEEPSPEED_FILES[kind]
    path = str(tmp_path / "absent.json") if text is None else _json_file(tmp_path, f"{kind}.json", text)
    refused_in_one_line(capsys, ["config", DEMO, f"deepspeed.config={path}"], "deepspeed.config")


@pytest.mark.parametrize(
    "override", ["sde.eta=5", "model.kwargs.sed=1", "rewards=[{name: nope}]", "update.learning_rate=1e30"]
)
def test_run_refuses_before_any_model_loads_and_writes_nothing(tmp_path, override):
    output = tmp_path / "run"
    result = sagegrpo("run", DEMO, f"run.output_dir={output}", override, timeout=300)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not output.exists()


def test_too_few_prompts_for_the_ranks_is_one_line_naming_the_key(tmp_path):
    # The prompt sampler's own check, run before the rewards and the model are built.
    result = sagegrpo("run", DEMO, f"run.output_dir={tmp_path / 'run'}", "rollout.prompts_per_rank=500", timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    refusal = "16 training prompts cannot fill rollout.prompts_per_rank=500 on 1 data-parallel rank(s)"
    assert result.stderr.strip().splitlines()[-1] == f"sagegrpo: error: {refusal}"
