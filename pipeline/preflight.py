"""``sagegrpo preflight CONFIG``: what to run on the target node before spending GPU-hours.

It builds the real run (model, rewards, DeepSpeed) through the recipe, in a scratch folder with tracking,
checkpoints and publishing off, runs two short iterations and judges what a first GPU run gets wrong:

- the schedule: every step's noise std is finite and >= 0 for the configured variant, steps, shift and eta;
- devices: the trainable weights and the rollout's tensors sit on the device the run expects;
- rewards: every reward returns one score per video (none failed) and the total is finite;
- on-policy: the first update recomputes the rollout's log-probs exactly (|log ratio| within 1e-5, so nothing clipped);
- the trust region can act: ``update/kl_grad_ratio``, measured on the second update and projected to the KL target
  over lambda's range, reaches the band where the KL term steers without drowning the policy gradient (skipped for
  ``trust_region.strategy: none``). The second update sits one update from its KL references, well below the
  target, so its raw ratio is the run's lowest: the projection is what separates a calibrated trust region from
  an inert one (the paper's lambda, ~1e-6);
- memory: peak GPU memory against ``sagegrpo plan``'s estimate for this config (on a GPU, for HunyuanVideo 1.5);
- time: seconds per stage, and the projected wall time and GPU-hours of ``run.max_iterations``.

Exit 0 when every check passes, 1 otherwise, with one line per failed check after the table.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core import distributed, grpo
from pipeline.config import RunConfig, load_run_config
from stages.update import RATIO_ATTEMPTS

ON_POLICY_TOLERANCE = 1e-5
KL_GRAD_RATIO_BAND = (0.01, 0.3)


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
    checks = [schedule_check(config)]
    with tempfile.TemporaryDirectory(prefix="sagegrpo-preflight-") as scratch:
        trial = load_run_config(config_path, [*overrides, *_trial_overrides(Path(scratch))])
        checks += _trial_checks(trial, config)
    return checks


def _trial_overrides(scratch: Path) -> list[str]:
    return [
        f"run.output_dir={scratch}",
        "run.max_iterations=2",
        "tracking.enabled=false",
        f"checkpoint.uri={scratch / 'checkpoints'}",
        "eval.every=0",
        "registry.model_name=null",
        "trust_region.kl_grad_ratio_every=1",
    ]


def schedule_check(config: RunConfig) -> Check:
    try:
        stds = config.sde.schedule_stds().tolist()
    except ValueError as error:
        return Check("schedule", False, str(error).splitlines()[0])
    bad = [t for t, value in enumerate(stds) if not (math.isfinite(value) and value >= 0)]
    if bad:
        return Check("schedule", False, f"std not finite or negative at steps {bad[:5]} of {len(stds)}")
    return Check("schedule", True, f"{len(stds)} steps, std in [{min(stds):.3g}, {max(stds):.3g}]")


def _trial_checks(trial: RunConfig, planned: RunConfig) -> list[Check]:
    from pipeline.recipe import SageGRPORecipe

    recipe = SageGRPORecipe(trial)
    recipe.setup()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        first = _timed_step(recipe)
        second = _timed_step(recipe)
    except Exception as error:  # noqa: BLE001 - whatever stops the first iterations is the finding
        return [
            device_check(recipe),
            Check("first iterations", False, f"{type(error).__name__}: {str(error).splitlines()[0]}"),
        ]
    return [
        device_check(recipe),
        reward_check(first, len(trial.rewards)),
        on_policy_check(first),
        kl_ratio_check(second, trial),
        memory_check(planned),
        time_check(second, planned),
    ]


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


def kl_ratio_check(metrics: dict[str, float], config: RunConfig) -> Check:
    if config.trust_region.strategy == "none":
        return Check("trust region acts", None, "trust_region.strategy is none")
    if "update/kl_grad_ratio" not in metrics:
        return Check(
            "trust region acts",
            None,
            "measured only under ZeRO-3 (DeepSpeed's gradient hooks): run "
            "preflight with a ZeRO-3 config, the ratio does not depend on it",
        )
    ratio = metrics["update/kl_grad_ratio"]
    if math.isnan(ratio):  # the second update is on-policy, so nothing was clipped: no sample had an advantage
        return Check(
            "trust region acts",
            False,
            f"no policy gradient on the {RATIO_ATTEMPTS} micro-steps measured: every sample's advantage was 0 or "
            "its loss NaN (do the rewards differ within a group?)",
        )
    low, high = KL_GRAD_RATIO_BAND
    kl, weight, trust = metrics.get("update/kl", 0.0), metrics["update/lambda_kl"], config.trust_region
    measured = (
        f"|lambda grad KL| / |grad policy| = {ratio:.3g} on the second update at KL {kl:.3g}, lambda {weight:.3g}"
    )
    if not kl > 0:  # nothing to project from: judge the measurement itself
        return Check("trust region acts", low <= ratio <= high, f"{measured} (band {low:g}-{high:g})")
    reach = grpo.kl_grad_ratio_reach(
        ratio, kl, weight, target=trust.kl_target, weights=(trust.kl_initial, trust.kl_maximum)
    )
    return Check(
        "trust region acts",
        reach[0] <= high and reach[1] >= low,
        f"{measured}; at the KL target {trust.kl_target:g}, lambda in [{trust.kl_initial:g}, {trust.kl_maximum:g}] "
        f"reaches {reach[0]:.3g}-{reach[1]:.3g} (band {low:g}-{high:g})",
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
    from core.errors import UserError
    from pipeline.memory_plan import plan_for

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
