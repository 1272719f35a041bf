"""The run's report: the PNG plots written under ``<output_dir>/plots`` when a run ends (plain data in, a file out).

The reward curves, S_t per denoising step of the configured schedule, the KL against lambda over iterations, and of
the last iteration the reward spread of each group and a grid of training samples with their reward and advantage.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sage_grpo.core import plotting, sde
from sage_grpo.stages.evaluate import finite_or_none, score_text
from sage_grpo.stages.rollout import SDEConfig


def plot_step_weights(sde_config: SDEConfig, path: Path, sigmas: torch.Tensor | None = None) -> Path:
    """S_t, the temporal gradient equalizer's weight, per denoising step of the configured schedule (``sigmas``: the
    model's own schedule, default the flow-matching one with the configured shift); 0 on untrained steps."""
    sigmas = sde.flow_match_sigmas(sde_config.steps, sde_config.shift) if sigmas is None else sigmas
    weights, trained = sde_config.step_weights(sigmas), sde_config.trained_steps_mask(sigmas)
    fig, ax = plotting.pyplot().subplots(figsize=(7, 3.5))
    steps = range(len(weights))
    ax.bar(steps, weights.tolist(), color=["tab:blue" if t else "lightgray" for t in trained.tolist()])
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")  # the median trained step's weight
    ax.set_xticks(list(steps)[:: max(1, len(weights) // 20)])
    ax.set(
        xlabel="denoising step (0 = pure noise)",
        ylabel="S_t",
        title=f"equalizer weight per step ({sde_config.variant}, eta {sde_config.eta:g}, shift {sde_config.shift:g})",
    )
    ax.grid(alpha=0.3, axis="y")
    return plotting.save_figure(fig, path)


def plot_kl_and_lambda(history: list[dict[str, float]], path: Path, kl_target: float | None = None) -> Path:
    """``update/kl`` (left axis, log scale) and the adaptive weight ``update/lambda_kl`` (right axis) per
    iteration: whether the controller holds the KL near its target."""
    fig, kl_axis = plotting.pyplot().subplots(figsize=(7, 4))
    lambda_axis = kl_axis.twinx()
    for axis, key, color in ((kl_axis, "update/kl", "tab:blue"), (lambda_axis, "update/lambda_kl", "tab:orange")):
        points = _series(history, key)
        if points:
            axis.plot(*zip(*points), marker="o", markersize=3, color=color, label=key)
        axis.set_ylabel(key, color=color)
        if points and all(value > 0 for _, value in points):
            axis.set_yscale("log")
    if kl_target is not None:
        kl_axis.axhline(kl_target, color="tab:blue", linestyle="--", linewidth=0.8, label="kl target")
    kl_axis.set(xlabel="iteration", title="KL to the anchor and its weight lambda")
    kl_axis.xaxis.set_major_locator(_integer_ticks())
    kl_axis.legend(loc="upper left", fontsize=8)
    kl_axis.grid(alpha=0.3)
    return plotting.save_figure(fig, path)


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)  # iterations: no 1.2, 1.4


def _series(history: list[dict[str, float]], key: str) -> list[tuple[float, float]]:
    return [(h["iteration"], h[key]) for h in history if key in h and math.isfinite(h[key])]


def rewards_by_group(rewards: list[float | None], group_ids: list[int]) -> dict[int, list[float]]:
    """Each group's scored rewards (None and nan left out), groups in order of first appearance."""
    groups: dict[int, list[float]] = {}
    for reward, group in zip(rewards, group_ids):
        members = groups.setdefault(int(group), [])
        if finite_or_none(reward) is not None:
            members.append(float(reward))
    return groups


def plot_group_rewards(rewards: list[float | None], group_ids: list[int], path: Path, iteration: int) -> Path:
    """One box per group (one prompt's G samples): the spread GRPO's advantages come from. A flat box means that
    prompt taught nothing this iteration. Unscored samples (None/nan) are left out."""
    groups = rewards_by_group(rewards, group_ids)
    fig, ax = plotting.pyplot().subplots(figsize=(max(4, 0.6 * len(groups) + 2), 4))
    ids = sorted(groups)
    ax.boxplot([groups[i] for i in ids], showmeans=True)
    ax.set_xticks(range(1, len(ids) + 1), [str(i) for i in ids])
    ax.set(xlabel="group (prompt id)", ylabel="reward", title=f"reward spread per group, iteration {iteration}")
    ax.grid(alpha=0.3, axis="y")
    return plotting.save_figure(fig, path)


def plot_sample_grid(
    videos: torch.Tensor,
    group_ids: list[int],
    rewards: list[float | None],
    advantages: list[float],
    path: Path,
    max_groups: int = 4,
) -> Path:
    """The middle frame of each training sample, a row per group (the first ``max_groups``), titled with its reward
    and advantage: what the update pushed towards (A > 0) and away from (A < 0)."""
    rows: dict[int, list[int]] = {}
    for index, group in enumerate(group_ids):
        rows.setdefault(int(group), []).append(index)
    shown = list(rows.items())[:max_groups]
    columns = max(len(members) for _, members in shown)
    plt = plotting.pyplot()
    fig, axes = plt.subplots(len(shown), columns, figsize=(2.2 * columns, 2.4 * len(shown)), squeeze=False)
    middle = videos.shape[1] // 2
    for row, (group, members) in enumerate(shown):
        for column in range(columns):
            ax = axes[row, column]
            ax.set_axis_off()
            if column < len(members):
                i = members[column]
                ax.imshow(videos[i, middle].cpu().numpy())
                ax.set_title(f"group {group}  r {score_text(rewards[i])}  A {advantages[i]:+.2f}", fontsize=7)
    return plotting.save_figure(fig, path)


def plot_reward_curves(history: list[dict[str, float]], path: Path) -> Path:
    """Training reward (mean per iteration) and every eval/* metric against the iteration."""
    fig, ax = plotting.pyplot().subplots(figsize=(7, 4))
    keys = ["reward/mean"] + sorted({k for h in history for k in h if k.startswith("eval/")})
    for key in keys:
        points = _series(history, key)
        if points:
            ax.plot(*zip(*points), marker="o", label=key)
    ax.set(xlabel="iteration", ylabel="reward", title="reward over training")
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return plotting.save_figure(fig, path)
