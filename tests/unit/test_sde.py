"""Closed-form checks of the four SDE variants and the temporal gradient equalizer (spec sections 1-2)."""

import math

import pytest
import torch

from sage_grpo.core import sde

pytestmark = pytest.mark.unit

ETA = 0.5


def _inputs(batch=3, shape=(2, 4, 5), seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, *shape, generator=generator, dtype=torch.float64)
    return x, v


def _hand_mean_std(variant, x, v, sigma, sigma_next, eta):
    """The spec's table, written out with Python floats independently of core.sde."""
    dt = sigma_next - sigma
    score = -(x - (1 - sigma) * (x - sigma * v)) / sigma**2
    if variant == "dance":
        return x + dt * v - 0.5 * eta**2 * score * dt, eta * math.sqrt(-dt)
    if variant == "flow":
        s = eta * math.sqrt(sigma / (1 - sigma))
        mean = x * (1 + s**2 * dt / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, s * math.sqrt(-dt)
    if variant == "cps":
        std = sigma_next * math.sin(eta * math.pi / 2)
        return (x - sigma * v) * (1 - sigma_next) + (x + (1 - sigma) * v) * math.sqrt(sigma_next**2 - std**2), std
    variance = eta**2 * (-(sigma - sigma_next) + math.log((1 - sigma_next) / (1 - min(sigma, 1 - 3e-3))))
    return x + dt * v + 0.5 * variance * score, math.sqrt(variance)


@pytest.mark.parametrize("variant", sde.VARIANTS)
@pytest.mark.parametrize("sigma,sigma_next", [(0.9, 0.8), (0.5, 0.45), (0.2, 0.05)])
def test_mean_and_std_match_the_spec_formulas(variant, sigma, sigma_next):
    x, v = _inputs()
    out = sde.sde_step(variant, v, x, sigma, sigma_next, ETA, generator=torch.Generator().manual_seed(1))
    mean, std = _hand_mean_std(variant, x, v, sigma, sigma_next, ETA)
    torch.testing.assert_close(out.mean, mean, rtol=1e-12, atol=1e-12)
    assert float(out.std) == pytest.approx(std, rel=1e-12)


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_log_prob_matches_torch_normal(variant):
    x, v = _inputs(seed=3)
    out = sde.sde_step(variant, v, x, 0.7, 0.6, ETA, generator=torch.Generator().manual_seed(2))
    expected = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-10, atol=1e-10)
    assert out.log_prob.shape == (x.shape[0],)


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_scoring_a_drawn_sample_reproduces_its_log_prob_exactly(variant):
    x, v = _inputs(seed=4)
    x, v = x.float(), v.float()
    drawn = sde.sde_step(variant, v, x, 0.8, 0.7, ETA, generator=torch.Generator().manual_seed(5))
    scored = sde.sde_step(variant, v, x, 0.8, 0.7, ETA, prev_sample=drawn.prev_sample)
    assert torch.equal(scored.log_prob, drawn.log_prob)
    assert torch.equal(scored.prev_sample, drawn.prev_sample)


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_per_sample_sigmas_equal_scalar_steps(variant):
    x, v = _inputs(batch=2, seed=6)
    sigmas, sigma_nexts = torch.tensor([0.9, 0.4]), torch.tensor([0.85, 0.3])
    batched = sde.sde_step(variant, v, x, sigmas, sigma_nexts, ETA, prev_sample=x)
    for i in range(2):
        single = sde.sde_step(
            variant, v[i : i + 1], x[i : i + 1], float(sigmas[i]), float(sigma_nexts[i]), ETA, prev_sample=x[i : i + 1]
        )
        torch.testing.assert_close(batched.mean[i : i + 1], single.mean)
        torch.testing.assert_close(batched.log_prob[i : i + 1], single.log_prob)


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_eta_zero_is_the_deterministic_euler_step(variant):
    x, v = _inputs(seed=7)
    out = sde.sde_step(variant, v, x, 0.6, 0.5, 0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.prev_sample, x - 0.1 * v)
    assert float(out.std) == 0.0
    assert torch.all(out.log_prob == 0)


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_deterministic_final_step_to_sigma_zero_is_the_euler_step(variant):
    x, v = _inputs(seed=8)
    out = sde.sde_step(variant, v, x, 0.2, 0.0, ETA, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.prev_sample, x - 0.2 * v)
    assert torch.isfinite(out.log_prob).all()


def _hand_final_step(variant, x, v, sigma, eta):
    """The last step (sigma_next = 0) with noise: each variant's own formula there; CPS (no noise left to share)
    takes SAGE's integrated variance around its x0 prediction."""
    sage_variance = eta**2 * (-sigma + math.log(1 / (1 - sigma)))
    if variant == "cps":
        return x - sigma * v, math.sqrt(sage_variance)
    return _hand_mean_std(variant, x, v, sigma, 0.0, eta)


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_noisy_final_step_follows_each_variants_formula_and_carries_a_log_prob(variant):
    x, v = _inputs(seed=8)
    mean, std = _hand_final_step(variant, x, v, 0.2, ETA)
    out = sde.sde_step(variant, v, x, 0.2, 0.0, ETA, noisy_final_step=True, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, mean)
    assert float(out.std) == pytest.approx(std, rel=1e-12) and std > 0.05
    expected = torch.distributions.Normal(mean, std).log_prob(out.prev_sample).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob, expected)
    assert not torch.allclose(out.prev_sample, mean)  # its noise stays in the video


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_noisy_final_steps_log_prob_has_a_gradient_through_the_velocity(variant):
    """What makes the last step train: its recorded transition's log-prob depends on the network's prediction."""
    x, v = _inputs(seed=10)
    v.requires_grad_(True)
    drawn = sde.sde_step(variant, v.detach(), x, 0.2, 0.0, ETA, noisy_final_step=True).prev_sample
    for noisy, trains in ((True, True), (False, False)):
        out = sde.sde_step(variant, v, x, 0.2, 0.0, ETA, prev_sample=drawn, noisy_final_step=noisy)
        (grad,) = torch.autograd.grad(out.log_prob.sum(), v, allow_unused=True, materialize_grads=True)
        assert bool(grad.abs().sum() > 0) == trains


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_first_step_at_sigma_one_is_finite(variant):
    x, v = _inputs(seed=9)
    out = sde.sde_step(variant, v, x, 1.0, 0.99, ETA, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all()
    assert float(out.std) > 0


def test_flow_first_step_replaces_sigma_one_by_the_schedules_second_sigma():
    x, v = _inputs(seed=10)
    sigmas = sde.flow_match_sigmas(20, 5.0)
    out = sde.sde_step("flow", v, x, float(sigmas[0]), float(sigmas[1]), ETA, prev_sample=x)
    s = ETA * math.sqrt(1.0 / (1.0 - float(sigmas[1])))
    assert float(out.std) == pytest.approx(s * math.sqrt(1.0 - float(sigmas[1])), rel=1e-9)


def test_clamped_flow_first_step_std_exceeds_sage_by_the_formula_ratio():
    sigmas = sde.flow_match_sigmas(20, 5.0)
    s1 = float(sigmas[1])
    clamp = sde.SAGE_SIGMA_CLAMP
    flow_std = float(sde.noise_stds("flow", sigmas, ETA, flow_sigma_max=clamp)[0])
    sage_std = float(sde.noise_stds("sage", sigmas, ETA)[0])
    expected_flow = ETA * math.sqrt(1.0 / (1.0 - clamp)) * math.sqrt(1.0 - s1)
    expected_sage = ETA * math.sqrt(-(clamp - s1) + math.log((1.0 - s1) / (1.0 - clamp)))
    assert flow_std == pytest.approx(expected_flow, rel=1e-9)
    assert sage_std == pytest.approx(expected_sage, rel=1e-9)
    assert flow_std / sage_std == pytest.approx(expected_flow / expected_sage, rel=1e-9)
    assert flow_std / sage_std > 1.5


@pytest.mark.parametrize("variant", sde.VARIANTS)
@pytest.mark.parametrize("noisy_final_step", [True, False])
def test_mean_jacobian_matches_autograd(variant, noisy_final_step):
    """N_t's numerator is d mean / d v; check each variant's analytic derivative against autograd, every step."""
    sigmas = sde.flow_match_sigmas(6, 3.0)
    _, jacobian = sde._noise_terms(variant, sigmas, ETA, None, noisy_final_step)
    for t in range(6):
        x = torch.randn(1, 3, dtype=torch.float64)
        v = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
        sigma, sigma_next = float(sigmas[t]), float(sigmas[t + 1])
        out = sde.sde_step(variant, v, x, sigma, sigma_next, ETA, prev_sample=x, noisy_final_step=noisy_final_step)
        (grad,) = torch.autograd.grad(out.mean.sum(), v)
        torch.testing.assert_close(grad, torch.full_like(grad, float(jacobian[t])))


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_equalized_gradient_scale_equals_the_median_on_every_trained_step(variant):
    sigmas = sde.flow_match_sigmas(20, 5.0)
    scales = sde.gradient_scales(variant, sigmas, ETA)
    factors = sde.balance_factors(variant, sigmas, ETA)
    trained = ~torch.isnan(scales)
    assert trained.sum() == 19 and not trained[-1]
    median = scales[trained].median()
    torch.testing.assert_close(scales[trained] * factors[trained], median.expand(int(trained.sum())), rtol=1e-6, atol=0)
    assert factors[-1] == 0


@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_a_noisy_final_step_is_equalized_like_every_other(variant):
    sigmas = sde.flow_match_sigmas(20, 5.0)
    scales = sde.gradient_scales(variant, sigmas, ETA, noisy_final_step=True)
    factors = sde.balance_factors(variant, sigmas, ETA, noisy_final_step=True)
    assert not torch.isnan(scales).any()
    torch.testing.assert_close(scales * factors, scales.median().expand(20), rtol=1e-6, atol=0)
    assert sde.noise_stds(variant, sigmas, ETA, noisy_final_step=True)[-1] > 0


def test_unequalized_sage_gradient_scale_spans_more_than_tenfold():
    scales = sde.gradient_scales("sage", sde.flow_match_sigmas(20, 5.0), ETA)
    trained = scales[~torch.isnan(scales)]
    assert trained.max() / trained.min() > 10


def test_shifted_schedule_matches_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, 21)[:-1].numpy())
    torch.testing.assert_close(sde.flow_match_sigmas(20, 5.0).float(), scheduler.sigmas.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("steps", [20, 67, 68, 200, 1000])
@pytest.mark.parametrize("shift", [1.0, 5.0, 12.0])
@pytest.mark.parametrize("variant", sde.VARIANTS)
def test_every_step_std_is_finite_and_nonnegative_up_to_a_thousand_steps(variant, steps, shift):
    sigmas = sde.flow_match_sigmas(steps, shift)
    stds = sde.noise_stds(variant, sigmas, 1.0)
    assert torch.isfinite(stds).all() and (stds >= 0).all()
    assert stds[-1] == 0 and (stds[steps // 2 : -1] > 0).all()
    scales = sde.gradient_scales(variant, sigmas, 1.0)
    assert torch.isfinite(scales[stds > 0]).all()


def test_sage_clamping_both_ends_changes_only_the_first_step_by_at_most_3e_3_eta_squared():
    sigmas = sde.flow_match_sigmas(20, 5.0)
    sigma, sigma_next = sigmas[:-2], sigmas[1:-1]
    clamped = sde.sage_integrated_variance(sigma, sigma_next, ETA)
    papers = ETA**2 * (
        -(sigma - sigma_next) + torch.log((1 - sigma_next) / (1 - sigma.clamp(max=sde.SAGE_SIGMA_CLAMP)))
    )
    difference = (papers - clamped).abs()
    assert 0 < difference[0] <= 3e-3 * ETA**2 + 1e-12
    torch.testing.assert_close(clamped[1:], papers[1:], rtol=1e-9, atol=1e-12)


def test_sage_step_entirely_above_the_clamp_injects_no_noise_and_never_goes_negative():
    variance = sde.sage_integrated_variance(torch.tensor([1.0, 0.999]), torch.tensor([0.999, 0.998]), 1.0)
    assert variance.tolist() == [0.0, 0.0]
    # The paper's formula (sigma alone clamped) is negative on both of these steps.
    assert (-(1.0 - 0.999) + math.log((1 - 0.999) / (1 - sde.SAGE_SIGMA_CLAMP))) < 0


def test_a_non_finite_std_is_an_error_not_a_deterministic_step():
    sigmas = sde.flow_match_sigmas(20, 5.0)
    with pytest.raises(ValueError, match="step 0 of 20"):
        sde.noise_stds("flow", sigmas, ETA, flow_sigma_max=1.0)


@pytest.mark.parametrize(
    "bad",
    [
        dict(variant="ddim"),
        dict(eta=-0.1),
        dict(sigma=0.5, sigma_next=0.6),
        dict(variant="cps", eta=1.2),
        dict(eta=float("nan")),
    ],
)
def test_invalid_arguments_are_rejected(bad):
    args = dict(variant="sage", sigma=0.5, sigma_next=0.4, eta=ETA) | bad
    x, v = _inputs()
    with pytest.raises(ValueError):
        sde.sde_step(args["variant"], v, x, args["sigma"], args["sigma_next"], args["eta"])
