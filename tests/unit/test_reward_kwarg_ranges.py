"""A reward kwarg out of its range is refused when the config is read, in one line naming the key, before DeepSpeed
starts (it used to pass validation and fail when the reward was built, after DeepSpeed's start-up lines)."""

from pathlib import Path

import pytest

from sage_grpo.core import distributed
from sage_grpo.core.rewards.simple import Brightness
from sage_grpo.pipeline import cli

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


@pytest.mark.parametrize("target", ["5", "-0.1", ".nan", "bright"])
def test_an_out_of_range_brightness_target_is_refused_before_deepspeed_starts(tmp_path, capsys, monkeypatch, target):
    monkeypatch.setattr(distributed, "init", lambda *args, **kwargs: pytest.fail("DeepSpeed was started"))
    output = tmp_path / "run"

    code = cli.main(
        ["run", DEMO, f"rewards=[{{name: brightness, kwargs: {{target: {target}}}}}]", f"run.output_dir={output}"]
    )

    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith("sagegrpo: error:") and "rewards.0.kwargs" in line and "target" in line
    assert not output.exists()


def test_a_brightness_target_in_range_is_kept():
    assert Brightness(target=0.25).target == 0.25


def test_building_brightness_directly_holds_the_same_range():
    with pytest.raises(ValueError, match="less than or equal to 1"):
        Brightness(target=5)
