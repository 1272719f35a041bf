"""sage_grpo.core.safe_load: a planted pickle in a DeepSpeed checkpoint is refused with one line and runs nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.safe_load import FORCE_WEIGHTS_ONLY, UnsafeCheckpointError, check_data_only, data_only_torch_load

pytestmark = pytest.mark.unit


class Planted:
    """Unpickling this creates ``marker``: the stand-in for an attacker's command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def plant(path: Path, marker: Path, zip_format: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"module": {"w": torch.ones(2)}, "payload": Planted(marker)}, path, _use_new_zipfile_serialization=zip_format
    )
    return path


def deepspeed_load(path: Path):
    """How DeepSpeed reads every engine file: its checkpoint engine, with weights_only=False."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return TorchCheckpointEngine().load(str(path), map_location="cpu")


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_deepspeed_loads_inside_the_context_refuse_a_planted_pickle(tmp_path, zip_format):
    marker = tmp_path / "marker"
    planted = plant(tmp_path / "engine" / "zero_pp_rank_0_mp_rank_00_model_states.pt", marker, zip_format)

    with pytest.raises(UnsafeCheckpointError) as refused, data_only_torch_load():
        deepspeed_load(planted)
    assert isinstance(refused.value, UserError) and "\n" not in str(refused.value)
    assert "io.open" in str(refused.value)
    assert not marker.exists()

    deepspeed_load(planted)  # the control: DeepSpeed on its own runs the planted code
    assert marker.exists()


def test_the_scan_names_the_file_and_the_global_without_unpickling(tmp_path):
    marker = tmp_path / "marker"
    planted = plant(tmp_path / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    torch.save({"w": torch.ones(2)}, tmp_path / "engine" / "mp_rank_00_model_states.pt")  # a clean neighbour

    with pytest.raises(UnsafeCheckpointError) as refused:
        check_data_only(tmp_path / "engine")
    message = str(refused.value)
    assert str(planted) in message and "io.open" in message and "\n" not in message
    assert not marker.exists()


def test_the_scan_refuses_a_file_that_is_not_a_torch_save_zip(tmp_path):
    marker = tmp_path / "marker"
    plant(tmp_path / "model_states.pt", marker, zip_format=False)
    with pytest.raises(UnsafeCheckpointError, match="not a torch.save checkpoint"):
        check_data_only(tmp_path)
    assert not marker.exists()


def test_plain_data_and_deepspeed_types_still_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = {"loss_scaler": LossScaler(scale=4.0), "zero_stage": ZeroStageEnum.weights, "w": torch.arange(3.0)}
    torch.save(state, tmp_path / "optim_states.pt")
    check_data_only(tmp_path)
    with data_only_torch_load():
        loaded = deepspeed_load(tmp_path / "optim_states.pt")
    assert loaded["loss_scaler"].cur_scale == 4.0 and loaded["zero_stage"] is ZeroStageEnum.weights
    assert torch.equal(loaded["w"], torch.arange(3.0))


@pytest.mark.parametrize("before", [None, "0"])
def test_the_process_settings_are_restored(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(FORCE_WEIGHTS_ONLY, raising=False)
    else:
        monkeypatch.setenv(FORCE_WEIGHTS_ONLY, before)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # a user opt-out must not defeat the context
    allowed_before = torch.serialization.get_safe_globals()
    with data_only_torch_load():
        assert os.environ[FORCE_WEIGHTS_ONLY] == "1" and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ
    assert os.environ.get(FORCE_WEIGHTS_ONLY) == before
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    # torch keeps the allow-list in a set: its order after the context is torch's, the members must be ours.
    assert set(torch.serialization.get_safe_globals()) == set(allowed_before)


def test_the_universal_conversion_refuses_a_planted_pickle_before_reading_it(tmp_path):
    from sage_grpo.core.safe_load import convert_to_universal

    marker = tmp_path / "marker"
    plant(tmp_path / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="io.open"):
        convert_to_universal(tmp_path / "engine", tmp_path / "universal")
    assert not marker.exists() and not (tmp_path / "universal").exists()
