"""test_sequence_parallel.py's K = 2 against K = 1 comparisons (velocity, rollout latents and log-probs, the first
update's gradients, weights and metrics after two updates) on two more layouts of the tiny HunyuanVideo 1.5: LoRA
adapters trained under sequence parallelism, and two data-parallel groups of two ranks (world 4 at K = 2) against
world 2 at K = 1 on the same samples. A file of their own, so the suite runs them beside that file, not after it."""

import pytest

from tests.distributed.test_sequence_parallel import (  # noqa: F401 (the comparisons, run on this file's layouts)
    Comparison,
    run_both,
    test_each_rank_holds_its_share_of_the_tokens,
    test_update_gradients_match,
    test_velocity_latents_and_log_probs_match,
    test_weights_and_metrics_after_two_updates_match,
)

# Each layout's two runs took 140-160 s here (2 cores shared with other work).
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]

LAYOUTS = {
    "lora": Comparison("hunyuan15", lora=True),
    "two-groups": Comparison("hunyuan15", whole=(2, 1), split=(4, 2)),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    return run_both(LAYOUTS[request.param], tmp_path_factory.mktemp(request.param))
