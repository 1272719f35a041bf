"""ToyWorld benchmark: the generator is deterministic with known motion, the analytic rewards prefer valid videos to
noise, the x0-predicting model's velocity lands on the clean video, the report replaces its section in place. The
report's statistics and the sweep's bookkeeping: ``test_toyworld_evidence.py``; learning: ``test_toyworld_learning.py``
(slow)."""

import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.toyworld import world  # noqa: E402
from benchmarks.toyworld.rewards import ToyWorldReward, manifold_drift  # noqa: E402
from sage_grpo.core.models.base import frames_to_uint8  # noqa: E402
from sage_grpo.core.rewards.base import VideoBatch  # noqa: E402

pytestmark = pytest.mark.unit


def _as_batch(videos: torch.Tensor) -> VideoBatch:
    return VideoBatch.from_tensor(frames_to_uint8(videos), fps=8)


def test_generator_is_deterministic_by_seed():
    first, captions = world.batch([3, 4, 5])
    again, captions_again = world.batch([3, 4, 5])
    other, _ = world.batch([6, 7, 8])
    assert torch.equal(first, again) and captions == captions_again
    assert not torch.equal(first, other)


@pytest.mark.parametrize("caption", world.CAPTIONS)
def test_square_moves_at_the_captioned_constant_velocity(caption):
    video = world.render(world.random_scene(11, caption))
    mask = video.amax(dim=1) > 0  # [F, H, W]
    assert all(int(m.sum()) == world.SQUARE**2 for m in mask)
    corners = torch.stack([torch.nonzero(m).min(dim=0).values for m in mask])
    steps = corners[1:] - corners[:-1]
    _, direction = world.parse_caption(caption)
    assert (steps == torch.tensor(world.DIRECTIONS[direction])).all()


def test_latent_map_is_exactly_invertible():
    videos, _ = world.batch([1, 2])
    latents = world.encode(videos)
    assert latents.shape[1:] == world.LATENT_SHAPE
    torch.testing.assert_close(world.decode(latents), videos, atol=1e-5, rtol=0)


def test_rewards_score_valid_videos_above_noise_and_wrong_captions():
    videos, captions = world.batch(list(range(8)))
    valid = ToyWorldReward()(_as_batch(videos), captions)
    noise = ToyWorldReward()(_as_batch(torch.rand_like(videos)), captions)
    for dimension in ("TA", "VQ", "MQ"):
        assert min(valid[dimension]) > 0.99 > 0.3 > max(noise[dimension]), dimension
    colours = list(world.COLOURS)
    recoloured = []
    for caption in captions:
        colour, direction = world.parse_caption(caption)
        recoloured.append(f"a {colours[(colours.index(colour) + 1) % len(colours)]} square moving {direction}")
    assert max(ToyWorldReward()(_as_batch(videos), recoloured)["TA"]) <= 0.5  # the colour half scores 0


def test_drift_is_zero_on_the_manifold_and_large_for_noise():
    videos, _ = world.batch(list(range(4)))
    assert max(manifold_drift(_as_batch(videos))) == 0.0
    assert min(manifold_drift(_as_batch(torch.rand_like(videos)))) > 0.3


def test_x0_prediction_converts_to_the_velocity_that_lands_on_the_clean_video():
    """With a perfect x0 predictor, the ODE sampler through predict_velocity = (x - x0_hat) / sigma must end exactly
    on the clean latents, whatever the noise: the conversion is what every stage sees."""
    from benchmarks.toyworld.model import ToyWorldAdapter, build_transformer
    from sage_grpo.stages.rollout import SDEConfig, generate

    videos, captions = world.batch([21, 22], ["a red square moving left", "a blue square moving up"])
    target = world.encode(videos)

    class Oracle(ToyWorldAdapter):
        def predict_clean(self, latents, sigma, embeddings, *, module=None):
            return target[: len(latents)]

    rollout = generate(
        Oracle(build_transformer()),
        captions,
        1,
        SDEConfig(variant="ode", steps=8, shift=3.0),
        seed=5,
        batch_size=2,
        progress=False,
    )
    assert max(manifold_drift(VideoBatch.from_tensor(rollout.videos, 8))) < 0.01


def test_report_section_is_replaced_and_the_rest_kept():
    from benchmarks.toyworld.report import BEGIN, END, replace_section

    text = f"# Results\n\n{BEGIN}\nold table\n{END}\n\n## Pipeline overhead ratios\n\nperf numbers\n"
    new = replace_section(text, f"{BEGIN}\nnew table\n{END}")
    assert "new table" in new and "old table" not in new
    assert new.endswith("## Pipeline overhead ratios\n\nperf numbers\n")
    assert replace_section("# Results\n\n## Perf\n", f"{BEGIN}\nx\n{END}").startswith(f"# Results\n\n{BEGIN}\nx\n{END}")
