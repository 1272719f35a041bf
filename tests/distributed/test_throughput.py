"""Several updates per rollout, several transitions per forward and the EMA, on a real 1-process DeepSpeed engine
(ZeRO-3 and ZeRO-2, gloo on CPU)."""

import json
from pathlib import Path

import pytest

from sage_grpo.stages.update import RATIO_TOLERANCE
from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("throughput_worker.py")


@pytest.fixture(scope="module", params=["zero3", "zero2"])
def report(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    torchrun(1, str(WORKER), "--out", str(out), "--deepspeed-config", request.param)
    return json.loads((out / f"report_{request.param}.json").read_text())


def test_one_update_per_rollout_is_exactly_on_policy(report):
    one = report["one"]
    assert one["logprob_mismatch"] == 0.0 and "clip_fraction" not in one  # constant 0 here: not logged
    assert one["updates_done"] == 1 and one["micro_steps_per_update"] == 12


def test_the_second_update_on_a_rollout_moves_the_ratio_and_the_clip_and_velocity_kl_act(report):
    two = report["two_updates"]
    assert two["updates_done"] == 2 and two["micro_steps_per_update"] == 6
    # Only the second update can leave 1 (the first is on-policy, above): it did, past the clip range.
    assert max(two["ratio_max"] - 1, 1 - two["ratio_min"]) > 1e-4
    assert two["clip_fraction"] > 0
    assert two["velocity_kl"] > 0  # the lagged policy is the first update's start, the policy moved since


def test_batched_transitions_stay_on_policy_within_the_tolerance_and_give_the_same_loss(report):
    batched, one = report["three_per_forward"], report["one"]
    assert batched["micro_steps_per_update"] == 4
    # |log ratio| <= 1e-5 < log(1 + clip_range): nothing is clipped.
    assert 0 <= batched["logprob_mismatch"] <= RATIO_TOLERANCE
    # Each micro-step's loss is the mean over its 3 transitions: the same objective, so the same gradient (its norm
    # before clipping, which DeepSpeed reports) to float precision.
    assert batched["grad_norm"] > 0
    assert batched["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


def test_the_ema_follows_its_formula_swaps_in_and_out_and_resumes_bit_identically(report):
    ema = report["ema"]
    assert ema["ema_formula_error"] < 1e-6
    assert ema["ema_moved"] > 1e-4  # it is not the policy
    assert ema["policy_restored_after_swap"]
    assert ema["resume_weights_identical"] and ema["resume_ema_identical"]


@pytest.mark.parametrize(
    "case", ["dual", "kl_grad_ratio_each_update", "unmeasured", "no_trust_region", "lora", "checkpointed"]
)
def test_zero3_gathers_each_transformer_block_whole_and_trains_the_same_weights(report, request, case):
    run = report["leaf"][case]
    assert run["weights_moved"] > 1e-4
    if case == "kl_grad_ratio_each_update":  # measured on every ZeRO stage (update 2: the references have moved)
        assert run["kl_grad_ratio"] > 0
    if "zero2" in request.node.callspec.id:  # ZeRO-2 holds every parameter whole: there is nothing to gather
        assert run["leaves"] == []
        return
    # "auto" is the model's _no_split_modules (its blocks, patch embedding and token refiner) and the largest
    # parts of the rest that hold layers: the image and ByT5 projections, the time embedding, the output norm.
    assert run["leaves"] == [
        "AdaLayerNormContinuous",
        "HunyuanVideo15ByT5TextProjection",
        "HunyuanVideo15ImageProjection",
        "HunyuanVideo15PatchEmbed",
        "HunyuanVideo15TimeEmbedding",
        "HunyuanVideo15TokenRefiner",
        "HunyuanVideo15TransformerBlock",
    ]
    # Gathering a block at once changes when parameters are fetched, not the arithmetic: bit for bit the same
    # weights and metrics as with a fetch per submodule.
    assert run["weights_difference"] == 0.0 and run["metrics_differing"] == []


def test_measuring_the_kl_gradient_ratio_leaves_training_unchanged(report):
    # Its torch.autograd.grad passes stop at the model's output (a view of its own): they never reach the network,
    # its DeepSpeed hooks or the optimizer.
    assert report["leaf"]["kl_grad_ratio_each_update"]["measurement_difference"] == 0.0


def test_gradient_checkpointing_recomputes_the_blocks_to_the_same_weights(report):
    # The shipped HunyuanVideo configs train with it: the blocks' recompute in the backward fetches their
    # parameters again (ZeRO-3) and must give the gradients of the stored forward.
    run = report["leaf"]["checkpointed"]
    assert run["checkpointing"] and not report["leaf"]["dual"]["checkpointing"]
    assert run["checkpointing_difference"] == 0.0


def test_muon_steps_each_matrix_by_an_orthogonalized_update_and_resumes_bit_identically(report):
    if "muon" not in report:
        pytest.skip("update.optimizer=muon is wired for ZeRO-3 only")
    muon = report["muon"]
    # Most matrices Muon trains (the blocks': DeepSpeed leaves layers named *embed* to the AdamW) moved, each checked.
    assert len(muon["top_singular_values"]) > muon["muon_matrices"] / 2
    # Newton-Schulz leaves singular values of about 1: each matrix moves by about the learning rate in spectral
    # norm. With DeepSpeed's clip at the default 1.0 they were ~0.1, divided by the norm of all the
    # orthogonalized updates (~11 on this model).
    assert all(0.5 <= value <= 1.5 for value in muon["top_singular_values"].values()), muon["top_singular_values"]
    assert muon["adam_moved"] > 1e-4
    assert muon["resume_difference"] == 0.0
    # torch's AdamW, as with optimizer=adamw. DeepSpeed's fused CPU Adam drifts by float rounding after a resume
    # (below, with the offload config): a `sagegrpo run` with it stopped and resumed ended 1.2e-7 off.
    assert muon["adam"] == "torch.optim.adamw"


def test_the_offload_config_trains_and_resumes_within_the_cpu_adams_rounding(report):
    if "offload" not in report:
        pytest.skip("zero3_offload is a ZeRO-3 config")
    offload = report["offload"]
    assert offload["weights_moved"] > 1e-4
    # Not bit for bit: DeepSpeedCPUAdam's bias correction is beta^t multiplied up step by step, and restarted from
    # pow(beta, t) after a load, which differs in the last bit of a float (beta2^3: 0.9970031 against 0.997003).
    assert offload["resume_difference"] <= 1e-6
