"""Learning-rate schedules against their closed forms."""

import math

import pytest

from sage_grpo.core.lr_schedules import lr_multiplier

pytestmark = pytest.mark.unit


def test_warmup_is_linear_then_constant():
    assert [lr_multiplier(step, warmup_steps=3) for step in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("step,expected", [(2, 1.0), (4, 0.5), (6, 0.0), (10, 0.0)])
def test_linear_decay_after_warmup(step, expected):
    assert lr_multiplier(step, schedule="linear", warmup_steps=2, decay_steps=4) == pytest.approx(expected)


def test_cosine_decay_reaches_the_floor():
    values = [lr_multiplier(step, schedule="cosine", decay_steps=8, min_ratio=0.1) for step in range(10)]
    assert values[0] == 1.0 and values[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert values[8] == pytest.approx(0.1) and values[9] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values, values[1:]))
