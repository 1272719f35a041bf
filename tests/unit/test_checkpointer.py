"""The Checkpointer in-process, with what the recipe registers with it: a real DeepSpeed engine (ZeRO-3, a world of
one) over the one-layer model, its Updater, the prompt sampler, the progress and the RNG. A save followed by a load
into freshly built objects must continue the run exactly as the saved one went on; saves happen when due, pruning
keeps the last ``keep_last``, ``latest`` follows the commits, and a root belongs to one run and one config."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from sage_grpo.core import distributed
from sage_grpo.core.errors import UserError
from sage_grpo.core.storage import RootClaimedError
from sage_grpo.pipeline.checkpointer import RNGState, for_run
from sage_grpo.pipeline.config import RunConfig, load_run_config
from sage_grpo.pipeline.recipe import Progress, build_policy
from sage_grpo.stages.ingest import PromptSampler
from sage_grpo.stages.rollout import generate
from sage_grpo.stages.update import compute_advantages
from tests.helpers import world_of_one

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
PROMPTS = [f"prompt {i}" for i in range(5)]  # 2 per iteration: the sampler crosses an epoch within 3 iterations
TINY = [
    "model.name=tests.helpers:linear_adapter",
    "model.kwargs={}",
    "sde.steps=3",
    "rollout.group_size=2",
    "rollout.prompts_per_rank=2",
    "update.micro_batch_size=2",
    "trust_region.anchor_interval=2",
    "checkpoint.every=2",
    "checkpoint.keep_last=2",
]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with world_of_one():
        yield


@pytest.fixture
def config(tmp_path) -> RunConfig:
    return load_run_config(DEMO, [*TINY, f"run.output_dir={tmp_path / 'run'}"])


class Training:
    """The recipe's training state around the one-layer model, registered with a Checkpointer under the recipe's
    names. Each iteration draws its rollout seed from torch's RNG, so a resume that lost the RNG, the sampler's
    position, the optimizer or the updater's controller would go on differently."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.policy = build_policy(config)
        self.sampler = PromptSampler(len(PROMPTS), config.rollout.prompts_per_rank, 0, 1, config.seed)
        self.progress = Progress()
        self.states = {
            "updater": self.policy.updater,
            "sampler": self.sampler,
            "progress": self.progress,
            "rng": RNGState(),
        }
        self.checkpointer = for_run(config, self.policy.engine, self.states)

    def iteration(self) -> dict[str, float]:
        config = self.config
        prompt_ids = next(self.sampler)
        rollout = generate(
            self.policy.adapter,
            [PROMPTS[i] for i in prompt_ids],
            config.rollout.group_size,
            config.sde,
            int(torch.randint(2**62, ())),
            prompt_ids=prompt_ids,
            batch_size=config.update.micro_batch_size,
            decode=False,
            progress=False,
        )
        rewards = rollout.latents[:, -1].mean(dim=(1, 2, 3, 4)).tolist()
        metrics = self.policy.updater.update(rollout, compute_advantages(rewards, rollout.group_ids, config.update))
        self.progress.iteration += 1
        self.progress.history.append(metrics)
        return metrics

    def train(self, iterations: int, *, save: bool = True) -> list[dict[str, float]]:
        """``iterations`` iterations, each followed by the recipe's ``save`` (which writes only the due ones)."""
        history = []
        for _ in range(iterations):
            history.append(self.iteration())
            if save:
                self.checkpointer.save(self.progress.iteration)
        return history

    def weights(self) -> str:
        return distributed.weights_fingerprint(self.policy.engine.module)


def committed(config: RunConfig) -> list[int]:
    return config.checkpoint.build(config.output_dir).list_steps()


def latest(config: RunConfig) -> str:
    return (config.output_dir / "checkpoints" / "latest").read_text().strip()


def test_a_resumed_run_continues_exactly_as_the_saved_one_went_on(config):
    straight = Training(config)
    straight.checkpointer.claim()
    straight.train(2)  # step 2 is due: saved
    at_save = copy.deepcopy({name: state.state_dict() for name, state in straight.states.items()})
    weights_at_save = straight.weights()
    went_on = straight.train(2, save=False)

    resumed = Training(config)
    assert resumed.weights() != weights_at_save  # a fresh build: everything below comes from the checkpoint
    assert resumed.checkpointer.load("auto") == 2

    assert resumed.weights() == weights_at_save
    assert resumed.progress.state_dict() == at_save["progress"]
    assert resumed.sampler.state_dict() == at_save["sampler"]
    assert torch.equal(torch.get_rng_state(), at_save["rng"]["torch"])
    # Bit for bit: the same prompts, noise, rewards, KL controller, anchor and Adam moments, so the same metrics.
    assert resumed.train(2, save=False) == went_on
    assert resumed.weights() == straight.weights()


def test_without_the_checkpoint_the_same_iterations_go_differently(config):
    """The control for the test above: its continuation depends on what was restored."""
    straight = Training(config)
    straight.train(2, save=False)
    went_on = straight.train(1, save=False)

    assert Training(config).train(1, save=False) != went_on


def test_only_due_or_forced_steps_are_saved_and_the_last_two_are_kept(config):
    training = Training(config)
    assert training.checkpointer.uri is None  # nothing saved or resumed yet
    training.checkpointer.claim()

    training.train(3)  # every 2: step 2 only
    assert committed(config) == [2] and latest(config) == "2"
    assert not training.checkpointer.save(3)  # not due
    assert training.checkpointer.save(3, force=True)  # the end of a run, or a stop
    training.train(3)  # steps 4 and 6 are due; keep_last=2 prunes 2 and 3

    assert committed(config) == [4, 6] and latest(config) == "6"
    assert training.checkpointer.uri == str(config.output_dir / "checkpoints")
    # DeepSpeed's own "latest" would name the engine tag before every rank wrote it: the manifest commits instead.
    assert not (config.output_dir / "checkpoints" / "step-6" / "latest").exists()


def test_latest_is_resumed_by_auto_and_any_kept_step_by_name(config):
    training = Training(config)
    training.checkpointer.claim()
    weights = {}
    for step in (2, 4):
        training.train(2)
        weights[step] = training.weights()

    for resume, step in (("auto", 4), ("2", 2), ("step-4", 4), (f"{config.output_dir}/checkpoints/step-2", 2)):
        loader = Training(config)
        assert loader.checkpointer.load(resume) == step
        assert loader.progress.iteration == step and loader.weights() == weights[step]


def test_a_step_that_is_not_there_is_refused_by_name_and_auto_starts_fresh(config):
    training = Training(config)
    training.checkpointer.claim()
    training.train(2)

    with pytest.raises(UserError, match="step-3"):
        Training(config).checkpointer.load("3")
    empty = load_run_config(DEMO, [*TINY, f"run.output_dir={config.output_dir.parent / 'other'}"])
    fresh = Training(empty)
    assert fresh.checkpointer.load("auto") is None and fresh.progress.iteration == 0
    with pytest.raises(UserError, match="no verified checkpoint"):
        fresh.checkpointer.load("auto", require=True)


def test_a_root_belongs_to_one_run_until_a_fresh_start_takes_it_over(config):
    first = Training(config)
    first.checkpointer.claim()
    first.train(4)  # steps 2 and 4

    with pytest.raises(RootClaimedError):  # a second run pointed at the same root, without --resume
        Training(config).checkpointer.claim()
    resumed = Training(config)
    resumed.checkpointer.load("auto")
    resumed.checkpointer.claim()  # the resumed run is the first one: its identity came with the checkpoint
    assert resumed.checkpointer.run_id == first.checkpointer.run_id

    taking_over = Training(config)
    taking_over.checkpointer.claim(fresh_start=True)
    taking_over.train(6)  # its steps 2, 4 and 6 replace the first run's 2 and 4 (moved aside, never deleted)
    assert committed(config) == [4, 6]
    set_aside = sorted(path.name.rsplit("-", 2)[0] for path in (config.output_dir / "checkpoints").glob("set-aside-*"))
    assert set_aside == ["set-aside-step-2", "set-aside-step-4"]


def test_a_run_resumes_only_under_its_config_and_a_saved_policy_loads_under_any(config, tmp_path):
    training = Training(config)
    training.checkpointer.claim()
    training.train(2)
    policy = training.weights()

    def changed(*overrides: str) -> Training:
        return Training(load_run_config(DEMO, [*TINY, f"run.output_dir={config.output_dir}", *overrides]))

    with pytest.raises(UserError, match="different config") as refused:
        changed("update.learning_rate=0.1").checkpointer.load("auto")
    assert "\n" not in str(refused.value)
    assert changed("run.max_iterations=20", "checkpoint.keep_last=3").checkpointer.load("auto") == 2

    # eval and sample: the policy alone, under another sampler config; the run's other states are not theirs to load.
    evaluator = changed("update.learning_rate=0.1")
    loader = for_run(evaluator.config, evaluator.policy.engine, {"updater": evaluator.policy.updater})
    assert loader.load("auto", same_run=False, require=True) == 2
    assert evaluator.weights() == policy and evaluator.progress.iteration == 0
