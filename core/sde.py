"""ODE-to-SDE denoising steps for rectified-flow models, and the temporal gradient equalizer.

Pure tensor math: no I/O, no global state. Every formula is in ``shared/spec/sage-grpo.md`` sections 1 and 2.

Conventions (the spec's): the model predicts velocity ``v`` at noise level ``sigma``;
``x0_hat = x - sigma * v``, ``x1_hat = x + (1 - sigma) * v``, a step goes from ``sigma`` to ``sigma_next < sigma``
with ``dt = sigma_next - sigma``. Log-densities are computed in float32 (float64 when the inputs are float64)
whatever dtype the model runs in, because bf16 cannot resolve the tiny policy ratios GRPO clips at 1 +- 1e-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())

VARIANTS = ("dance", "flow", "cps", "sage")

# SAGE's reference code clamps sigma below 1 before the log, so the first step's variance stays finite. We clamp both
# ends of the step (see ``sage_integrated_variance``).
SAGE_SIGMA_CLAMP = 1.0 - 3e-3

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SDEStepOutput:
    """One transition. ``log_prob`` has one value per batch element; ``std`` broadcasts against ``mean``."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    # The network's prediction the step was computed from: the update differentiates each loss term with respect to
    # it to compare the terms' pushes on the model's output (``stages.update.OutputGradients``).
    velocity: torch.Tensor | None = None


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown SDE variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    return variant


def check_eta(variant: str, eta: float) -> float:
    """eta >= 0 for every variant; CPS also needs eta <= 1 (its std is sigma_next * sin(eta pi / 2): above 1 the noise
    shrinks again and the mean's Jacobian changes sign, so the equalizer would be wrong)."""
    if not eta >= 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if variant == "cps" and eta > 1:
        raise ValueError(f"eta must be <= 1 for the cps variant, got {eta}")
    return eta


def _math_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_sample(value: float | torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scalar or per-sample [B] sigma as a tensor broadcastable against ``like`` ([B, ...])."""
    value = torch.as_tensor(value, dtype=dtype, device=like.device)
    if value.ndim == 0:
        return value
    if value.ndim != 1 or value.shape[0] != like.shape[0]:
        raise ValueError(f"per-sample sigma must have shape [{like.shape[0]}], got {list(value.shape)}")
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def sage_integrated_variance(sigma: torch.Tensor, sigma_next: torch.Tensor, eta: float) -> torch.Tensor:
    """Sigma_t: the exact integral of eta^2 * s / (1 - s) over [min(sigma_next, c), min(sigma, c)], c = 1 - 3e-3.

    The reference clamps only sigma; then a step with sigma_next > c integrates over a reversed interval and
    Sigma_t < 0 (NaN std: the first step of every schedule of 68+ steps at shift 5). Clamping both ends keeps the
    integrand's domain, so Sigma_t >= 0 always; it differs from the paper's formula only on steps that start above c,
    by at most 0.003 * eta^2. A step entirely above c injects no noise. Written with log1p(d / (1 - s_hi)) - d
    (d = s_hi - s_lo) so that short steps (T = 1000) do not lose the O(d^2) result to cancellation.
    """
    high = torch.clamp(sigma, max=SAGE_SIGMA_CLAMP)
    width = high - torch.clamp(sigma_next, max=SAGE_SIGMA_CLAMP)
    # log1p(x) >= x / (1 + x) makes the exact value >= 0; the clamp only removes a rounding of -1 ulp.
    return eta**2 * torch.clamp(torch.log1p(width / (1.0 - high)) - width, min=0.0)


def _flow_noise_scale(sigma, sigma_next, eta, flow_sigma_max):
    # Flow-GRPO's s = eta * sqrt(sigma / (1 - sigma)) is infinite at sigma = 1; like the reference it substitutes a
    # smaller sigma in the denominator there: the schedule's second sigma (this step's sigma_next) by default.
    substitute = sigma_next if flow_sigma_max is None else torch.as_tensor(flow_sigma_max, dtype=sigma.dtype)
    denominator_sigma = torch.where(sigma >= 1.0, substitute, sigma)
    return eta * torch.sqrt(sigma / (1.0 - denominator_sigma))


def _final_cps_std(sigma, eta):
    # CPS keeps the noise level sigma_next * sin(eta pi / 2): none is left to share at sigma_next = 0. Its noisy last
    # step takes SAGE's integrated variance over [0, sigma] (the same reverse SDE's marginal-preserving noise).
    return torch.sqrt(sage_integrated_variance(sigma, torch.zeros_like(sigma), eta))


def _mean_and_std(variant, v, x, sigma, sigma_next, eta, flow_sigma_max):
    dt = sigma_next - sigma
    if variant == "dance":
        score = -(x + (1.0 - sigma) * v) / sigma
        std = eta * torch.sqrt(-dt)
        mean = x + dt * v - 0.5 * eta**2 * score * dt
    elif variant == "flow":
        s = _flow_noise_scale(sigma, sigma_next, eta, flow_sigma_max)
        std = s * torch.sqrt(-dt)
        mean = x * (1.0 + s**2 * dt / (2.0 * sigma)) + v * (1.0 + s**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
    elif variant == "cps":
        std = sigma_next * math.sin(eta * math.pi / 2.0)
        x0_hat = x - sigma * v
        x1_hat = x + (1.0 - sigma) * v
        mean = x0_hat * (1.0 - sigma_next) + x1_hat * torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0))
    else:
        score = -(x + (1.0 - sigma) * v) / sigma
        variance = sage_integrated_variance(sigma, sigma_next, eta)
        std = torch.sqrt(variance)
        mean = x + dt * v + 0.5 * variance * score
    return mean, std


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(sample; mean, std^2 I) averaged over non-batch elements; 0 where std == 0 (a deterministic step)."""
    deterministic = std == 0
    safe_std = torch.where(deterministic, torch.ones_like(std), std)
    elementwise = -((sample - mean) ** 2) / (2.0 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    elementwise = torch.where(deterministic, torch.zeros_like(elementwise), elementwise)
    return elementwise.flatten(1).mean(dim=1)


def sde_step(
    variant: str,
    velocity: torch.Tensor,
    latents: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    eta: float,
    *,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    flow_sigma_max: float | None = None,
    noisy_final_step: bool = False,
) -> SDEStepOutput:
    """One stochastic denoising step from ``sigma`` to ``sigma_next``.

    Draws ``prev_sample = mean + std * eps`` or, when ``prev_sample`` is given, scores that sample instead (this is how
    training recomputes log-probs of recorded transitions). The last step (``sigma_next == 0``) is stochastic with
    ``noisy_final_step``: each variant's own formula at sigma_next = 0 (CPS, which has no noise left to share there,
    takes SAGE's integrated variance around its x0 prediction), so it carries a log-prob and trains like every other
    step; its noise stays in the video, as in Flow-GRPO's sampler. Without it the last step is the deterministic
    Euler step ``x + dt * v``. ``eta = 0`` makes every variant the deterministic Euler step. Deterministic steps have
    ``std = 0`` and ``log_prob = 0``.
    """
    check_eta(check_variant(variant), eta)
    dtype = _math_dtype(velocity, latents)
    v = velocity.to(dtype)
    x = latents.to(dtype)
    sigma_t = _per_sample(sigma, x, dtype)
    sigma_next_t = _per_sample(sigma_next, x, dtype)
    # Checked where the values are on the host: reading a device tensor would synchronise every step (the
    # rollout's schedule is validated once, on the CPU, before its first step).
    if sigma_t.device.type == "cpu" and (
        torch.any(sigma_next_t >= sigma_t) or torch.any(sigma_t > 1.0) or torch.any(sigma_next_t < 0.0)
    ):
        raise ValueError("a denoising step needs 1 >= sigma > sigma_next >= 0")

    euler = x + (sigma_next_t - sigma_t) * v
    final = sigma_next_t == 0
    if eta == 0:
        mean, std = euler, torch.zeros_like(sigma_t)
    elif noisy_final_step:
        mean, std = _mean_and_std(variant, v, x, sigma_t, sigma_next_t, eta, flow_sigma_max)
        std = torch.as_tensor(std, dtype=dtype, device=x.device)
        if variant == "cps":
            std = torch.where(final, _final_cps_std(sigma_t, eta), std)
    else:
        # Evaluate the variant where sigma_next > 0 only; a stand-in sigma_next keeps the discarded branch finite.
        stand_in = torch.where(final, sigma_t * 0.5, sigma_next_t)
        mean, std = _mean_and_std(variant, v, x, sigma_t, stand_in, eta, flow_sigma_max)
        mean = torch.where(final, euler, mean)
        std = torch.where(final, torch.zeros_like(std), torch.as_tensor(std, dtype=dtype, device=x.device))

    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, dtype=dtype, device=x.device)
        sample = mean + std * noise
    else:
        sample = prev_sample.to(dtype)
    log_prob = gaussian_log_prob(sample, mean, std)
    return SDEStepOutput(prev_sample=sample, log_prob=log_prob, mean=mean, std=std, velocity=velocity)


# ----------------------------------------------------------------------------------------------------------------
# Temporal gradient equalizer
# ----------------------------------------------------------------------------------------------------------------


def _std_and_mean_jacobian(variant, sigma, sigma_next, eta, flow_sigma_max):
    """Noise std and d mean / d v, each variant derived from its mean formula (CPS's for sigma_next > 0 only)."""
    dt = sigma_next - sigma
    if variant == "dance":
        # d score / d v = -(1 - sigma) / sigma
        return eta * torch.sqrt(-dt), dt * (1.0 + 0.5 * eta**2 * (1.0 - sigma) / sigma)
    if variant == "flow":
        s = _flow_noise_scale(sigma, sigma_next, eta, flow_sigma_max)
        return s * torch.sqrt(-dt), dt * (1.0 + s**2 * (1.0 - sigma) / (2.0 * sigma))
    if variant == "cps":
        std = sigma_next * math.sin(eta * math.pi / 2.0)
        return std, -sigma * (1.0 - sigma_next) + (1.0 - sigma) * sigma_next * math.cos(eta * math.pi / 2.0)
    variance = sage_integrated_variance(sigma, sigma_next, eta)
    return torch.sqrt(variance), dt - 0.5 * variance * (1.0 - sigma) / sigma


def noise_stds(
    variant: str,
    sigmas: torch.Tensor,
    eta: float,
    *,
    flow_sigma_max: float | None = None,
    noisy_final_step: bool = False,
) -> torch.Tensor:
    """The noise std of every step of a schedule (``sigmas`` has T+1 entries ending at 0); 0 on deterministic steps
    (the last one unless ``noisy_final_step``, see ``sde_step``).

    Raises ValueError when a step's std is not
    finite or negative: such a step must never pass for a deterministic one (it would silently stop training).
    """
    std, _ = _noise_terms(variant, sigmas, eta, flow_sigma_max, noisy_final_step)
    bad = ~torch.isfinite(std) | (std < 0)
    if torch.any(bad):
        t = int(torch.nonzero(bad).flatten()[0])
        raise ValueError(
            f"the {variant} noise std of step {t} of {len(std)} is {float(std[t])} "
            f"(sigma {float(sigmas[t]):.6g} -> {float(sigmas[t + 1]):.6g})"
        )
    return std


def gradient_scales(
    variant: str,
    sigmas: torch.Tensor,
    eta: float,
    *,
    flow_sigma_max: float | None = None,
    noisy_final_step: bool = False,
):
    """N_t = |d mean / d v| / std per step: how strongly a step's log-prob gradient scales. NaN on deterministic
    steps."""
    std, jacobian = _noise_terms(variant, sigmas, eta, flow_sigma_max, noisy_final_step)
    stochastic = std > 0
    return torch.where(stochastic, jacobian.abs() / torch.where(stochastic, std, 1.0), torch.nan)


def _noise_terms(variant, sigmas, eta, flow_sigma_max, noisy_final_step):
    check_variant(variant)
    sigmas = torch.as_tensor(sigmas, dtype=torch.float64).cpu()
    sigma, sigma_next = sigmas[:-1], sigmas[1:]
    check_eta(variant, eta)
    final = sigma_next == 0
    stochastic = (~final | noisy_final_step) & (eta > 0)
    stand_in = torch.where(final, sigma * 0.5, sigma_next)
    std, jacobian = _std_and_mean_jacobian(variant, sigma, stand_in, eta, flow_sigma_max)
    std = torch.as_tensor(std, dtype=torch.float64).expand_as(sigma)
    if noisy_final_step:
        final_std, final_jacobian = _std_and_mean_jacobian(variant, sigma, torch.zeros_like(sigma), eta, flow_sigma_max)
        if variant == "cps":
            final_std = _final_cps_std(sigma, eta)
        std = torch.where(final, torch.as_tensor(final_std, dtype=torch.float64), std)
        jacobian = torch.where(final, final_jacobian, jacobian)
    return torch.where(stochastic, std, 0.0), torch.where(stochastic, jacobian, sigma_next - sigma)


def balance_factors(
    variant: str,
    sigmas: torch.Tensor,
    eta: float,
    *,
    trained: torch.Tensor | None = None,
    flow_sigma_max: float | None = None,
    noisy_final_step: bool = False,
):
    """S_t = median(N) / (N_t + 1e-8) for every step; 0 on deterministic steps, which carry no gradient.

    ``trained`` ([T] bool) restricts the median and the factors to the steps that are trained (an SDE window).
    """
    scales = gradient_scales(variant, sigmas, eta, flow_sigma_max=flow_sigma_max, noisy_final_step=noisy_final_step)
    stochastic = ~torch.isnan(scales)
    if trained is not None:
        stochastic &= torch.as_tensor(trained, dtype=torch.bool, device=stochastic.device)
    if not torch.any(stochastic):
        return torch.zeros_like(scales)
    median = scales[stochastic].median()
    return torch.where(stochastic, median / (torch.nan_to_num(scales) + 1e-8), 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------------------------


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching time shift diffusers' FlowMatchEulerDiscreteScheduler applies: s' = k s / (1 + (k-1) s)."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def flow_match_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """T+1 sigmas from 1 to 0, linear in unshifted time then shifted (HunyuanVideo 1.5 samples with shift 5)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


def sliding_window(window: tuple[int, int], steps: int, iteration: int, every: int) -> tuple[int, int]:
    """The stochastic window of ``iteration`` when it slides along the schedule (MixGRPO's progressive window).

    ``window`` = (start, end) is its position at iteration 0; it keeps its size and moves one step towards low noise
    every ``every`` iterations. Starts range over 0 .. steps - size - 1, so the window never covers the last step (to
    sigma 0: stochastic only with ``noisy_final_step``, and MixGRPO's windows never reach it); past the last start it
    returns to 0, like MixGRPO's restart, so a long run keeps cycling over the whole schedule. A function of the
    iteration alone: a resumed run slides exactly as an uninterrupted one.
    """
    start, end = window
    if not 0 <= start < end <= steps:
        raise ValueError(f"window must satisfy 0 <= start < end <= steps={steps}, got {window}")
    if every < 1:
        raise ValueError(f"the window must stay at least 1 iteration at each position, got every={every}")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    size = end - start
    positions = steps - size  # starts 0 .. steps - size - 1
    if positions < 2:
        raise ValueError(
            f"a window of {size} of {steps} steps has nowhere to slide: size <= {steps - 2}, since the "
            "last step never trains"
        )
    if start >= positions:
        raise ValueError(
            f"a window of {size} steps starting at {start} covers the last step, which never trains: "
            f"start <= {positions - 1}"
        )
    moved = (start + iteration // every) % positions
    return moved, moved + size
