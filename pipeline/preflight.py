"""``sagegrpo preflight CONFIG``: what to run on the target node before spending GPU-hours.

It builds the real run (model, rewards, DeepSpeed) through the recipe, in a scratch folder with tracking,
checkpoints and publishing off, runs at least three iterations (more until the trust region has been measured over a
whole anchor cycle, see below) and judges what a first GPU run gets wrong:

- the noise schedule: every step's noise std is finite and >= 0 for the configured variant, steps, shift and eta;
- devices: the trainable weights and the rollout's tensors sit on the device the run expects;
- rewards: every reward returns one score per video (none failed) and the total is finite;
- on-policy: the first update recomputes the rollout's log-probs exactly (|log ratio| within 1e-5, so nothing clipped);
- one-update reward change: the first iteration's batch (each rank's first training prompts x the run's group size,
  the iteration's seed and SDE sampler, with its noise) is re-sampled and scored after that iteration's update, and
  the paired per-sample differences of the training reward (the weighted total GRPO optimises), gathered over ranks,
  give "one update changes the reward by +x +- se" (mean +- std / sqrt(n)); it fails when the mean is below -2 se:
  the update lowers, beyond noise, the reward it is given. One extra rollout and scoring of one batch;
- the trust region acts: ``update/kl_grad_ratio`` (the update-level |lambda grad KL| / |grad policy|, at the run's
  own lambda) over a whole anchor cycle: the trial runs until ``trust_region.anchor_interval`` updates (a moving
  anchor's cycle; 3 for a reference that never refreshes) have followed the first measured update (the first update
  starts at its KL references and is never measured, nor is one after an anchor refresh; the first measured one runs
  at ``kl_initial``, before the controller has seen a measurement), and judges the geometric mean of their measured
  ratios: in [0.5, 2] x ``kl_ratio_target`` for the ``calibrated`` preset, whose controller holds a cycle's mean (a
  single update inside a cycle, or during an lr warm-up, may lie outside), or, for a KL-steered lambda (``paper``),
  in the useful band 0.01-0.3 (the paper's lambda gives ~1e-6: inert). Not applicable without a KL term;
- memory: peak GPU memory against ``sagegrpo plan``'s estimate for this config (on a GPU, for HunyuanVideo 1.5);
- time: seconds per stage, and the projected wall time and GPU-hours of ``run.max_iterations``.

Exit 0 when every check passes, 1 otherwise, with one line per failed check after the table.
"""

from __future__ import annotations

import copy
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.errors import first_line
from sage_grpo.core.grpo import KLFeedback
from sage_grpo.pipeline.config import RunConfig, load_run_config

ON_POLICY_TOLERANCE = 1e-5
# Where a KL-steered lambda's gradient ratio steers without drowning the policy term; a ratio-steered lambda is
# judged against its own target, within the factor its controller is held to (docs/algorithm.md,
# "The trust region is measured and steered").
KL_GRAD_RATIO_BAND = (0.01, 0.3)
TARGET_FACTOR = 2.0
TRIAL_ITERATIONS = 3
# A one-update change of the reward below -REWARD_DROP_SE standard errors of its paired differences fails.
REWARD_DROP_SE = 2.0
REWARD_CHANGE = "one-update reward change"
# The judged window when the KL reference never refreshes (fixed anchor, velocity term only): no cycle to cover.
WINDOW_WITHOUT_CYCLE = 3


@dataclass
class Check:
    name: str
    passed: bool | None  # None: does not apply here (e.g. GPU memory on a CPU)
    detail: str

    @property
    def status(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.passed]


def preflight(config_path: str, overrides: list[str]) -> list[Check]:
    config = load_run_config(config_path, overrides)
    checks = [noise_schedule_check(config)]
    with tempfile.TemporaryDirectory(prefix="sagegrpo-preflight-") as scratch:
        trial_overrides = _trial_overrides(Path(scratch), trial_iterations(config))
        trial = load_run_config(config_path, [*overrides, *trial_overrides])
        checks += _trial_checks(trial, config)
    return checks


def _trial_overrides(scratch: Path, iterations: int) -> list[str]:
    return [
        f"run.output_dir={scratch}",
        f"run.max_iterations={iterations}",
        "tracking.enabled=false",
        f"checkpoint.uri={scratch / 'checkpoints'}",
        "eval.every=0",
        "registry.model_name=null",
    ]


def noise_schedule_check(config: RunConfig) -> Check:
    try:
        stds = config.sde.noise_stds().tolist()
    except ValueError as error:
        return Check("noise schedule", False, first_line(error))
    bad = [t for t, value in enumerate(stds) if not (math.isfinite(value) and value >= 0)]
    if bad:
        return Check("noise schedule", False, f"std not finite or negative at steps {bad[:5]} of {len(stds)}")
    return Check("noise schedule", True, f"{len(stds)} steps, std in [{min(stds):.3g}, {max(stds):.3g}]")


def _trial_checks(trial: RunConfig, planned: RunConfig) -> list[Check]:
    from sage_grpo.pipeline.recipe import SageGRPORecipe

    recipe = SageGRPORecipe(trial)
    recipe.setup()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        # The first iteration's batch is the probe's fixed batch: its prompts are the ones the sampler gives next.
        first_prompts = next(copy.deepcopy(recipe.sampler))
        steps = [_timed_step(recipe)]
        change = reward_change_check(_reward_differences(recipe, first_prompts), trial.update.updates_per_rollout)
        while not _trial_done(steps, trial):
            steps.append(_timed_step(recipe))
    except Exception as error:  # noqa: BLE001 - whatever stops the first iterations is the finding
        return [
            device_check(recipe),
            Check("first iterations", False, first_line(error, with_type=True)),
        ]
    first, last = steps[0], steps[-1]
    return [
        device_check(recipe),
        reward_check(first, len(trial.rewards)),
        on_policy_check(first),
        change,
        kl_ratio_check(steps, trial),
        memory_check(planned),
        time_check(last, planned),
    ]


def judged_window(config: RunConfig) -> int:
    """How many updates after the first measured one the trust region is judged over: one anchor cycle."""
    trust = config.trust_region
    return trust.anchor_interval if trust.anchor_moves else WINDOW_WITHOUT_CYCLE


def trial_iterations(config: RunConfig) -> int:
    """The most trial iterations: the first measured update is update 2 (update 1 starts at its references), or 3
    when the anchor refreshes after update 1; then one judged window."""
    updates = 3 + judged_window(config)
    return max(TRIAL_ITERATIONS, -(-updates // config.update.updates_per_rollout))


def _trial_done(steps: list[dict[str, float]], trial: RunConfig) -> bool:
    if len(steps) < TRIAL_ITERATIONS:
        return False
    if trial.trust_region.strategy == "none" or len(steps) >= trial_iterations(trial):
        return True
    measured = _measured(steps)
    return bool(measured) and _updates(steps[-1], len(steps)) >= measured[0][0] + judged_window(trial)


def _updates(metrics: dict[str, float], iteration: int) -> int:
    """Updates applied by the end of this iteration (one per iteration when the metrics do not say)."""
    return int(metrics.get("update/updates_done", iteration))


def _measured(steps: list[dict[str, float]]) -> list[tuple[int, dict[str, float]]]:
    """(the iteration's last update, its metrics) for each trial iteration with a measured gradient ratio."""
    return [(_updates(s, i), s) for i, s in enumerate(steps, 1) if "update/kl_grad_ratio" in s]


def _timed_step(recipe) -> dict[str, float]:
    started = time.perf_counter()
    metrics = recipe.train_step()
    metrics["time/iteration"] = time.perf_counter() - started
    return metrics


def device_check(recipe) -> Check:
    expected = distributed.device()
    module = recipe.policy.engine.module
    placed = {str(p.device) for p in module.parameters() if p.requires_grad}
    adapter = str(recipe.policy.adapter.device)
    ok = placed <= {str(expected)} and adapter == str(expected)
    return Check("devices", ok, f"expected {expected}; trainable weights on {sorted(placed)}, model on {adapter}")


def reward_check(metrics: dict[str, float], rewards: int) -> Check:
    failed, total = metrics["reward/failed_samples"], metrics["reward/mean"]
    ok = failed == 0 and math.isfinite(total)
    dimensions = sorted(
        k[len("reward/") : -len("/mean")]
        for k in metrics
        if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean"
    )
    return Check(
        "rewards",
        ok,
        f"{rewards} reward(s), dimensions {dimensions}, {failed:g} failed samples, mean total {total:.4g}",
    )


def on_policy_check(metrics: dict[str, float]) -> Check:
    if "update/logprob_mismatch" not in metrics:  # several updates per rollout: off-policy after the first, by design
        return Check("on-policy first update", None, "update.updates_per_rollout > 1: the ratio leaves 1 on purpose")
    mismatch = metrics["update/logprob_mismatch"]
    return Check(
        "on-policy first update",
        mismatch <= ON_POLICY_TOLERANCE,
        f"largest |log ratio| {mismatch:.3g} (tolerance {ON_POLICY_TOLERANCE:g}; nothing clipped below "
        "update.clip_range)",
    )


def _reward_differences(recipe, prompt_ids: list[int]) -> list[float]:
    """Right after the first iteration: its batch re-sampled, with the same noise, under the updated weights; each
    sample's total reward after minus before (a sample either scored None or not finite is left out). Every rank's
    differences, on every rank (an error on one rank is raised on all, none is left waiting in the gather): the K
    ranks of a sequence-parallel group hold the same samples and count once."""

    def here() -> list[float]:
        scored = recipe.scorer.last_scored  # what the first iteration's train_step scored, and trained on
        if scored is None:
            raise RuntimeError("the first iteration left no scores to pair with (Scorer.last_scored)")
        before = scored.total
        after = recipe.resampled_rewards(prompt_ids, 0)
        if len(after) != len(before):
            raise RuntimeError(f"{len(after)} re-sampled samples for the first iteration's {len(before)}")
        return [
            a - b
            for a, b in zip(after, before)
            if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
        ]

    by_rank = distributed.gather_or_raise(here)
    return [d for share in recipe.parallel.one_per_sequence_group(by_rank) for d in share]


def reward_change_check(differences: list[float], updates: int = 1) -> Check:
    """What one update did to the training reward, from the paired per-sample differences (after - before) of the
    same batch with the same noise: mean +- standard error (the sample std over sqrt(n), n >= 2). The rule: it fails
    when mean < -2 se, the update lowering, beyond noise, the reward it is given; a rise, or a fall within noise,
    passes. ``updates``: the optimizer steps one rollout takes (``update.updates_per_rollout``)."""
    n = len(differences)
    if n < 2:
        return Check(
            REWARD_CHANGE,
            False,
            f"{n} sample(s) scored both before and after the first update, too few to judge: did the reward fail "
            "after it?",
        )
    mean = statistics.fmean(differences)
    se = statistics.stdev(differences) / math.sqrt(n)
    what = "one update changes" if updates == 1 else f"one rollout's {updates} updates change"
    detail = (
        f"{what} the reward by {mean:+.3g} +- {se:.2g} (mean +- se over {n} samples of the first batch, re-sampled "
        f"with their noise after it; fails below -{REWARD_DROP_SE:g} se)"
    )
    if mean < -REWARD_DROP_SE * se:
        return Check(
            REWARD_CHANGE,
            False,
            f"{detail}: the update lowers the reward it is given; check the sampler's untrained steps (sde.window), "
            "update.learning_rate, update.adam_eps and the gradient scale, and the gradient's sign",
        )
    return Check(REWARD_CHANGE, True, detail)


def kl_ratio_check(steps: list[dict[str, float]], config: RunConfig) -> Check:
    """The geometric mean of the gradient ratios measured over one anchor cycle after the first measured update, at
    the lambda the run itself chose, against its band."""
    trust = config.trust_region
    if trust.strategy == "none":
        return Check("trust region acts", None, "trust_region.strategy is none")
    measured = _measured(steps)
    if not measured:
        return Check(
            "trust region acts",
            False,
            f"no update of {len(steps)} measured: each started at a just-refreshed KL reference "
            "(trust_region.anchor_interval 1?) or had no policy gradient (do the rewards differ within a group?)",
        )
    first, window = measured[0][0], judged_window(config)
    judged = [(update, s) for update, s in measured[1:] if update <= first + window]
    if not judged:
        return Check(
            "trust region acts",
            False,
            f"only update {first} of {len(steps)} trial iterations measured, at the initial lambda: none at a lambda "
            "the controller chose (trust_region.anchor_interval 2 leaves every other update unmeasured)",
        )

    def mean(suffix: str) -> float:
        values = [s.get(f"update/kl_grad_ratio{suffix}", 0.0) for _, s in judged]
        return math.exp(sum(map(math.log, values)) / len(values)) if all(v > 0 for v in values) else 0.0

    ratio, position, velocity = mean(""), mean("/position"), mean("/velocity")
    if trust.kl_feedback is KLFeedback.GRADIENT_RATIO:
        low, high = trust.kl_ratio_target / TARGET_FACTOR, trust.kl_ratio_target * TARGET_FACTOR
    else:
        low, high = KL_GRAD_RATIO_BAND
    each = ", ".join(f"{s['update/kl_grad_ratio']:.3g}" for _, s in judged)
    lambdas = ", ".join(f"{s['update/lambda_kl']:.3g}" for _, s in judged)
    return Check(
        "trust region acts",
        low <= ratio <= high,
        f"|lambda grad KL| / |grad policy| = {ratio:.3g} (geometric mean over updates {first + 1}-{first + window}: "
        f"{each}; position {position:.3g}, velocity {velocity:.3g}) at lambda {lambdas}; band {low:.3g}-{high:.3g}",
    )


def memory_check(config: RunConfig) -> Check:
    if not torch.cuda.is_available():
        return Check("peak memory", None, "no GPU: memory is planned with `sagegrpo plan` and checked on the node")
    peak_gb = torch.cuda.max_memory_allocated() / 1024**3
    total_gb = torch.cuda.get_device_properties(distributed.device()).total_memory / 1024**3
    estimate = _planned_gb(config)
    detail = f"peak {peak_gb:.1f} GB of {total_gb:.0f} GB"
    if estimate is None:
        return Check("peak memory", peak_gb < total_gb, detail + " (no plan for this model)")
    return Check("peak memory", peak_gb <= estimate, detail + f"; plan estimate {estimate:.1f} GB")


def _planned_gb(config: RunConfig) -> float | None:
    from sage_grpo.core.errors import UserError
    from sage_grpo.pipeline.memory_plan import plan_for

    total_gb = torch.cuda.get_device_properties(distributed.device()).total_memory / 1024**3
    nodes = max(1, distributed.world_size() // max(1, torch.cuda.device_count()))
    try:
        plan = plan_for(config, torch.cuda.device_count(), nodes, total_gb)
    except UserError:
        return None
    return plan.total / 1024**3


def time_check(metrics: dict[str, float], config: RunConfig) -> Check:
    seconds = metrics["time/iteration"]
    hours = seconds * config.run.max_iterations / 3600
    stages = ", ".join(f"{k[len('time/') :]} {metrics[k]:.2f}s" for k in ("time/rollout", "time/score", "time/update"))
    gpus = distributed.world_size() if torch.cuda.is_available() else 0
    projected = f"projected {hours:.2f} h for {config.run.max_iterations} iterations"
    if gpus:
        projected += f", {hours * gpus:.1f} GPU-hours on {gpus} GPU(s)"
    mfu = f"; MFU {metrics['mfu']:.1%}" if "mfu" in metrics else ""  # on a GPU of known peak
    return Check("time", True, f"{seconds:.2f}s per iteration ({stages}{mfu}); {projected}")


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    rows = [f"{c.name:<{width}}  {c.status:<4}  {c.detail}" for c in checks]
    failed = [f"preflight: {c.name} failed: {c.detail}" for c in checks if c.passed is False]
    return "\n".join(rows + failed)
