"""`sagegrpo plan` on two-expert Wan 2.2: both experts counted from the checkpoint's own configs, a forward gathers
only its step's expert, and `model.train_experts` decides whose gradients and optimizer state exist. Checked on a
tiny two-expert Wan built for real (the real diffusers classes, random weights) and saved as a diffusers folder."""

import dataclasses

import pytest
import torch

from sage_grpo.core import memory_trace
from sage_grpo.core.errors import UserError
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import TINY_WAN_TRANSFORMER, tiny_wan_pipeline
from sage_grpo.pipeline import memory_plan, phase_plan
from sage_grpo.pipeline.config import load_run_config

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_a14b(tmp_path_factory):
    """A tiny Wan 2.2 A14B layout (two experts, boundary 0.875), saved as WanPipeline saves it, and the pipeline."""
    pipeline = tiny_wan_pipeline(boundary_ratio=0.875)
    folder = tmp_path_factory.mktemp("tiny-a14b")
    pipeline.save_pretrained(folder)
    return folder, pipeline


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _config(folder, tmp_path, *lines: str):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {{name: wan, pretrained: {folder}, guidance_scale: 4.0, guidance_scale_2: 3.0,\n"
        "        kwargs: {height: 64, width: 64, num_frames: 9}}\n"
        "sde: {steps: 20, shift: 12.0}\n"
        "rollout: {group_size: 2, prompts_per_rank: 1}\n"
        "data: {source: prompts.txt}\n" + "".join(f"{line}\n" for line in lines)
    )
    return path


def test_both_experts_are_counted_from_the_checkpoints_configs(tiny_a14b):
    folder, pipeline = tiny_a14b
    checkpoint = memory_plan.wan_checkpoint(str(folder))
    assert set(checkpoint.experts) == {"high", "low"} and checkpoint.boundary_ratio == 0.875
    high, low = _numel(pipeline.transformer), _numel(pipeline.transformer_2)
    shape = memory_plan.wan_shape(checkpoint)
    assert shape.param_count == high + low and shape.trainable_count == high + low
    assert shape.patch == (1, 2, 2)
    # train_experts=[low]: the high expert's parameters stay counted, but train nothing.
    assert memory_plan.wan_shape(checkpoint, train_experts=["low"]).trainable_count == low
    # LoRA on the low expert alone: peft's adapter on the real expert.
    lora = LoraConfig(enabled=True, rank=4, alpha=4)
    adapted = add_lora(tiny_wan_pipeline(boundary_ratio=0.875).transformer_2, lora)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert memory_plan.wan_shape(checkpoint, lora, ["low"]).trainable_count == trainable
    # What ZeRO-3 gathers at once is one expert's part, as for that expert alone.
    assert shape.largest_layer_params == memory_plan.largest_gathered(pipeline.transformer, "auto")


@pytest.mark.parametrize("expert", ["high", "low"])
def test_a_forward_gathers_only_its_steps_expert(tiny_a14b, expert):
    folder, pipeline = tiny_a14b
    checkpoint = memory_plan.wan_checkpoint(str(folder))
    call = memory_trace.TransformerCall(2, (3, 8, 8), train=True, checkpointing=True, text_tokens=(16,))
    traced = memory_trace.trace_wan(checkpoint.experts, call, expert=expert, dtype=torch.float32)
    running = pipeline.transformer if expert == "high" else pipeline.transformer_2
    assert traced.gathered == 4 * _numel(running)  # float32 bytes of every parameter of that expert, and no more
    assert traced.peak > 0 and traced.flops > 0


def test_training_the_low_expert_alone_drops_the_high_experts_gradients_and_optimizer_state(tiny_a14b, tmp_path):
    folder, pipeline = tiny_a14b
    both = memory_plan.plan_for(load_run_config(_config(folder, tmp_path)), 8, 1, 80)
    low = memory_plan.plan_for(load_run_config(_config(folder, tmp_path), ["model.train_experts=[low]"]), 8, 1, 80)
    # Both experts are partitioned and resident either way; only the trained one has gradients and Adam's state.
    assert low.workload.shape.param_count == both.workload.shape.param_count
    assert low.states.optimizer == pytest.approx(both.states.optimizer / 2, abs=8)
    assert low.states.gradients == pytest.approx(both.states.gradients / 2, abs=8)
    assert low.anchor == pytest.approx(both.anchor / 2, abs=8)
    # 20 steps at shift 12: 13 of the high expert (timestep >= 875), 7 of the low; every one trains.
    steps = memory_plan.schedule(load_run_config(_config(folder, tmp_path)), 0.875)
    assert steps.step_experts == ("high",) * 13 + ("low",) * 7 and steps.trained_count == 20
    only_low = memory_plan.schedule(load_run_config(_config(folder, tmp_path), ["model.train_experts=[low]"]), 0.875)
    assert only_low.trained_count == 7 and low.workload.references == both.workload.references * 7 // 20
    # An expert listed as trained with no trained step in the window is refused, as the run refuses it.
    with pytest.raises(UserError, match="'low' expert is trained"):
        memory_plan.plan_for(load_run_config(_config(folder, tmp_path), ["sde.window=[0,2]"]), 8, 1, 80)


def test_the_traced_plan_counts_each_experts_steps_and_says_what_offloading_the_idle_one_would_save(
    tiny_a14b, tmp_path, monkeypatch
):
    folder, _ = tiny_a14b
    monkeypatch.setattr(phase_plan, "wan_frozen_parameter_counts", lambda rewards: {"text encoders": 10**9})
    config = load_run_config(_config(folder, tmp_path, "update: {gradient_checkpointing: true}"))
    formula = memory_plan.plan_for(config, 8, 1, 80)
    plan = phase_plan.phase_plan(config, formula)
    assert plan.resident["text encoders"] == 4 * 10**9  # in the config's dtype, float32
    text = str(plan)
    assert "high 13 steps (13 trained), low 7 steps (7 trained)" in text
    assert "idle expert offloaded (NOT implemented" in text
    # The idle expert's bf16 parameter shard: half the parameters, over the 8 GPUs ZeRO-3 partitions them over.
    assert plan.experts.idle_shard == 2 * (formula.workload.shape.param_count // 2) // 8
    # FLOPs: both experts share a config, so every step costs one forward; trained steps add a training call and
    # the anchor's and lagged policy's reference forwards (2 samples, micro-batch 1).
    experts = memory_plan.wan_checkpoint(str(folder)).experts
    call = memory_trace.TransformerCall(2, (3, 8, 8), text_tokens=(512,))  # CFG: 2 branches; 9 x 64 x 64 latents
    forward = memory_trace.trace_wan(experts, call, expert="high").flops
    training = dataclasses.replace(call, train=True, checkpointing=True)
    step = memory_trace.trace_wan(experts, training, expert="high").flops
    references = phase_plan._reference_count(config)
    assert plan.rank_flops == 2 * (20 * forward + 20 * (step + references * forward))


def test_a_sequence_parallel_rank_traces_its_share_of_the_tokens(tiny_a14b):
    folder, _ = tiny_a14b
    experts = memory_plan.wan_checkpoint(str(folder)).experts
    call = memory_trace.TransformerCall(2, (5, 16, 16), train=True, checkpointing=True, text_tokens=(16,))
    peaks = {
        k: memory_trace.trace_wan(
            experts, dataclasses.replace(call, sequence_parallel=k), expert="low", dtype=torch.float32
        ).peak
        for k in (1, 2)
    }
    # Half the tokens through the blocks (a checkpointed block's recomputation is not split twice), the output
    # gathered whole: well under the whole sequence's peak, above half of it.
    assert 0.4 * peaks[1] < peaks[2] < 0.75 * peaks[1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_traced_peak_of_a_wan_expert_is_the_measured_one(checkpointing):
    # Wan's blocks (float32 norms, rotary embedding, cross-attention to the text) at a width where activations, not
    # the weights' gradients, make the peak: 5 x 16 x 16 tokens, CFG, forward and backward, traced as the low
    # expert of a pair and measured on that expert alone by torch's CPU profiler.
    from diffusers import WanTransformer3DModel

    from benchmarks.traced_block_check import profiled_cpu_peak

    config = TINY_WAN_TRANSFORMER | {"num_attention_heads": 4, "attention_head_dim": 16, "ffn_dim": 256}
    call = memory_trace.TransformerCall(2, (5, 32, 32), train=True, checkpointing=checkpointing, text_tokens=(32,))
    traced = memory_trace.trace_wan({"high": config, "low": config}, call, expert="low", dtype=torch.float32)
    torch.manual_seed(0)
    expert = WanTransformer3DModel.from_config(config)
    if checkpointing:
        expert.enable_gradient_checkpointing()
    generator = torch.Generator().manual_seed(1)
    shapes = memory_trace._wan_inputs(expert.config, call, torch.float32)
    inputs = {name: torch.randn(fake.shape, generator=generator) for name, fake in shapes.items()}
    inputs["timestep"] = torch.full_like(inputs["timestep"], 500.0)

    def step():
        expert(**inputs, return_dict=False)[0].float().sum().backward()

    drops = [p.register_post_accumulate_grad_hook(memory_trace._drop_grad) for p in expert.parameters()]
    try:
        measured = profiled_cpu_peak(step)
    finally:
        for handle in drops:
            handle.remove()
    assert traced.peak == pytest.approx(measured, rel=0.05)  # 44025608 both, and 24779016 vs 24789128 (2026-12-06)
