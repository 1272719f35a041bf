"""KL from the start: how far a sweep run's policy has moved from the pretrained model, per evaluation.

The x-axis of gold against drift (issue 39): a trust region is worth having if it buys more gold per unit of drift
than a smaller learning rate does. Measured after a run, from the checkpoints it committed at its evaluations
(``checkpoint.every`` = ``eval.every``), on one fixed reference process for every arm: the base config's SDE
(``configs/toyworld.yaml``: sampler, eta, steps, shift, window) on the held-out captions, 16 samples each with the
same noise at every checkpoint. Per sample it is the path KL of the stochastic steps,

    KL(policy || start) = sum_t ||mean_policy(x_t) - mean_start(x_t)||^2 / (2 std_t^2),

with x_t drawn from the policy (both transitions are Gaussians of one std, so each step's KL is closed-form). The
number is the mean over samples, in nats. Arms with another sampler or window are measured on the same reference
process, so their drifts compare.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from sage_grpo.core.safe_load import data_only_torch_load
from sage_grpo.stages.rollout import SDEConfig, generate, score_transition

SAMPLES_PER_CAPTION = 16
SEED = 0  # the same noise for every checkpoint of every arm: drift differences are the weights', not the noise's
STEP = re.compile(r"step-(\d+)$")


def kl_from_start(adapter, start: torch.nn.Module, prompts: list[str], sde_config: SDEConfig) -> float:
    """Mean path KL (nats per sample) of the adapter's transformer from ``start`` over ``sde_config``'s stochastic
    steps, on ``SAMPLES_PER_CAPTION`` samples of each prompt drawn from the adapter's transformer."""
    with torch.no_grad():
        rollout = generate(
            adapter, prompts, SAMPLES_PER_CAPTION, sde_config, SEED, decode=False, progress=False, record_means=True
        )
        stochastic = [t for t in range(sde_config.steps) if float(rollout.stds[t]) > 0]
        total = torch.zeros(rollout.num_samples, dtype=torch.float64)
        for batch in rollout.batches:
            for t in stochastic:
                start_mean = score_transition(adapter, rollout, batch, t, module=start).mean
                squared = (rollout.means[batch, t] - start_mean).double().pow(2).flatten(1).sum(dim=1)
                total[batch] += squared / (2 * float(rollout.stds[t]) ** 2)
    return float(total.mean())


def checkpoint_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The transformer's weights in a committed ZeRO-2 checkpoint (the engine's module states, data only)."""
    with data_only_torch_load():
        states = torch.load(step_dir / "engine" / "mp_rank_00_model_states.pt", weights_only=True)
    return states["module"]


def drift_by_iteration(run_dir: Path, base_config: Path) -> dict[int, float]:
    """KL from the start at every checkpoint ``run_dir`` holds (iteration -> nats), and 0 at iteration 0: the run's
    own pretrained weights (its ``config.json``) on ``base_config``'s SDE."""
    import copy
    import json

    from sage_grpo.pipeline.config import load_run_config

    from .model import toyworld_adapter
    from .world import HELD_OUT_CAPTIONS

    config = load_run_config(base_config, [])
    adapter = toyworld_adapter(**json.loads((run_dir / "config.json").read_text())["model"]["kwargs"])
    policy = adapter.transformer  # the engine's module: its checkpoint holds every weight, the unused ones too
    start = copy.deepcopy(policy).requires_grad_(False)
    drift = {0: 0.0}
    steps = sorted(
        (int(m.group(1)), path)
        for path in (run_dir / "checkpoints").glob("step-*")
        if (m := STEP.search(path.name)) and (path / "manifest.json").exists()
    )
    for iteration, step_dir in steps:
        policy.load_state_dict(checkpoint_weights(step_dir), strict=True)
        drift[iteration] = kl_from_start(adapter, start, list(HELD_OUT_CAPTIONS), config.sde)
    return drift
