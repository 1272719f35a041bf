"""A corpus of bad inputs a careless user (or a typo) produces: every one is refused when the config is read, before
any model loads, as one line naming the key, exit 2, nothing written. The corpus runs through the CLI in-process
(``sagegrpo config`` validates exactly as ``run`` does); a sample of it runs as ``sagegrpo run`` subprocesses. Then
kwargs of a type their parameter cannot take, and output folders that cannot be folders. (DeepSpeed JSON:
test_deepspeed_json.py; config files themselves: test_config_loading.py.)"""

from pathlib import Path

import pytest

from tests.helpers import refused_in_one_line, sagegrpo

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")


# (override, the key the one line must name)
CORPUS = [
    # sampler and schedule
    ("sde.steps=0", "sde.steps"),
    ("sde.steps=1|sde.final_step=deterministic", "sde"),  # one step, and it does not train
    ("sde.final_step=sometimes", "sde.final_step"),
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
    ("sde.window=[7,8]|sde.final_step=deterministic", "sde"),
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


def test_the_corpus_is_large():
    assert len(CORPUS) >= 60


@pytest.mark.parametrize("override,key", CORPUS, ids=[case[0] for case in CORPUS])
def test_each_bad_override_is_one_line_naming_its_key(capsys, override, key):
    refused_in_one_line(capsys, ["config", DEMO, *override.split("|")], key)


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


# --- kwargs of the wrong type -----------------------------------------------------------------------------------------

# (override, the key the one line names, the parameter it names)
WRONG_TYPES = [
    ("rewards=[{name: brightness, kwargs: {target: abc}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: brightness, kwargs: {target: [1]}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: brightness, kwargs: {target: {a: 1}}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: brightness, kwargs: {target: null}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: remote, kwargs: {url: 'http://h:1/', batch_size: eight}}]", "rewards.0.kwargs", "batch_size"),
    ("rewards=[{name: remote, kwargs: {url: 'http://h:1/', concurrency: 1.5}}]", "rewards.0.kwargs", "concurrency"),
    ("rewards=[{name: remote, kwargs: {url: [1]}}]", "rewards.0.kwargs", "url"),
    ("model.kwargs.seed=[1]", "model.kwargs", "seed"),
    ("model.kwargs.height=tall", "model.kwargs", "height"),
    ("model.kwargs.transformer=5", "model.kwargs", "transformer"),
]


@pytest.mark.parametrize(("override", "key", "parameter"), WRONG_TYPES, ids=[case[0] for case in WRONG_TYPES])
def test_a_kwarg_its_parameter_type_cannot_take_is_one_line_naming_it(capsys, override, key, parameter):
    line = refused_in_one_line(capsys, ["config", str(DEMO), override], key)
    assert f"{key}: {parameter}: " in line, line


@pytest.mark.parametrize(
    "override",
    [
        "rewards=[{name: brightness, kwargs: {target: 1}}]",  # an int is a float
        "model.kwargs.transformer={num_layers: 1}",
        "rewards=[{name: 'user_rewards.credentials:AuthenticatedJudge', kwargs: {url: u, bearer: b, api_key: k}}]",
    ],
)
def test_kwargs_of_their_types_still_pass(capsys, monkeypatch, override):
    from sage_grpo.pipeline import cli

    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures"))
    assert cli.main(["config", str(DEMO), override]) == 0, capsys.readouterr().err


# --- Output folders that cannot be folders ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("run.output_dir={file}", "run.output_dir"),
        ("run.output_dir={file}/run", "run.output_dir"),
        ("run.output_dir=/proc/sagegrpo-probe", "run.output_dir"),  # cannot be created, even by root
        ("checkpoint.uri={file}", "checkpoint.uri"),
        ("checkpoint.uri=file://{file}/ckpt", "checkpoint.uri"),
        ("checkpoint.uri=/proc/sagegrpo-probe", "checkpoint.uri"),
    ],
    ids=["output-file", "output-under-file", "output-unwritable", "ckpt-file", "ckpt-under-file", "ckpt-unwritable"],
)
def test_a_folder_that_cannot_be_one_is_one_line_before_anything_is_written(tmp_path, override, key):
    a_file = tmp_path / "taken"
    a_file.write_text("someone's file\n")
    output = tmp_path / "out"
    result = sagegrpo("run", str(DEMO), f"run.output_dir={output}", override.format(file=a_file), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sagegrpo: error: {key} ") and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert a_file.read_text() == "someone's file\n"
    written = [path for path in tmp_path.rglob("*") if path.is_file() and path != a_file]
    assert written == [], written
