"""The memory planner: HunyuanVideo 1.5's size from diffusers, and numbers that move the way ZeRO, LoRA and
checkpointing say they must."""

import dataclasses

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.core.lora import LoraConfig
from sage_grpo.pipeline import memory_plan
from sage_grpo.stages.rollout import SDEConfig

pytestmark = pytest.mark.unit

GIB = memory_plan.GIB


@pytest.fixture(scope="module")
def lora():
    return memory_plan.hunyuanvideo15_shape(lora_config=LoraConfig(enabled=True, rank=32))


@pytest.fixture(scope="module")
def full(lora):
    # The same count without the adapter: building the 8.3B model twice, even on meta, costs seconds.
    return dataclasses.replace(lora, trainable_count=lora.param_count)


def _plan(shape, *, lora=False, gpus_per_node=8, nodes=8, zero_stage=3, offload=False, checkpointing=True, **kw):
    return memory_plan.plan(
        shape.param_count,
        shape.trainable_count,
        zero_stage,
        offload,
        offload,
        lora,
        gpus_per_node,
        nodes,
        kw.pop("gpu_mem_gb", 80.0),
        81,
        480,
        848,
        checkpointing,
        largest_layer_params=shape.largest_layer_params,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        batch=2,
        **kw,
    )


def test_the_default_diffusers_config_is_the_8_3b_release(full):
    assert 8.0e9 <= full.param_count <= 8.6e9
    assert (full.hidden_size, full.num_layers, full.latent_channels) == (2048, 54, 32)


def test_zero3_gathers_one_transformer_block_at_a_time(full):
    # The 54 dual-stream blocks hold ~98% of the weights; ZeRO-3 gathers each whole (deepspeed.zero3_leaf_modules).
    assert 54 * full.largest_layer_params <= full.param_count < 1.05 * 54 * full.largest_layer_params
    per_module = memory_plan.hunyuanvideo15_shape(zero3_leaf_modules=[])
    assert 0 < per_module.largest_layer_params < full.param_count / 100


def test_lora_trains_a_small_adapter(lora):
    # rank 32 on to_q/to_k/to_v/to_out.0 of 54 blocks alone: 54 * 4 * 32 * (2048 + 2048)
    assert 54 * 4 * 32 * 4096 <= lora.trainable_count < lora.param_count / 100


def test_video_tokens_follow_the_vae_compression():
    assert memory_plan.video_tokens(81, 480, 848) == 21 * 30 * 53
    assert memory_plan.video_tokens(1, 16, 16) == 1
    with pytest.raises(UserError):
        memory_plan.video_tokens(80, 480, 848)
    with pytest.raises(UserError):
        memory_plan.video_tokens(81, 481, 848)


def test_zero3_model_states_shrink_as_one_over_the_gpu_count(full):
    small, large = _plan(full, nodes=1), _plan(full, nodes=8)
    for field in ("gradients", "optimizer"):
        assert getattr(small.states, field) / getattr(large.states, field) == pytest.approx(8, rel=1e-6)
    # Parameters carry the gathered largest layer, which does not shrink, on top of the 1/N shard.
    gathered = 4 * full.largest_layer_params
    assert (small.states.params - gathered) / (large.states.params - gathered) == pytest.approx(8, rel=1e-6)
    assert small.anchor / large.anchor == pytest.approx(8, rel=1e-6)


def test_the_split_adds_up_to_deepspeeds_own_estimate(full):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    states = _plan(full, nodes=2).states
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        full.param_count, full.largest_layer_params, 8, 2, cpu_offload=False, cpu_offload_params=False
    )
    assert states.params + states.gradients + states.optimizer == gpu
    states = _plan(full, nodes=2, zero_stage=2).states
    _, gpu = estimate_zero2_model_states_mem_needs(full.param_count, 8, 2, cpu_offload=False)
    assert states.params + states.gradients + states.optimizer == gpu


def test_offload_moves_optimizer_state_to_the_host(full):
    on_gpu, offloaded = _plan(full, nodes=1), _plan(full, nodes=1, offload=True)
    assert offloaded.states.optimizer == offloaded.states.gradients == 0
    assert offloaded.states.params < on_gpu.states.params
    assert offloaded.states.cpu_per_node > on_gpu.states.cpu_per_node


def test_lora_needs_far_less_optimizer_and_gradient_memory(full, lora):
    full_plan, lora_plan = _plan(full, nodes=1), _plan(lora, lora=True, nodes=1)
    assert lora_plan.states.optimizer < full_plan.states.optimizer / 100
    assert lora_plan.states.gradients < full_plan.states.gradients / 100
    assert lora_plan.anchor < full_plan.anchor / 100
    # The frozen base is still held, sharded like any ZeRO-3 parameter.
    assert lora_plan.states.params >= 2 * (lora.param_count - lora.trainable_count) // 8


def test_gradient_checkpointing_cuts_activations_by_an_order_of_magnitude(full):
    on, off = _plan(full), _plan(full, checkpointing=False)
    assert on.activations_with_checkpointing == off.activations_with_checkpointing
    assert on.activations < off.activations / 10
    assert on.total < off.total


def test_smallest_node_count_is_consistent_with_fits(full):
    # Tight enough on 40 GB that one node of 8 does not fit full fine-tuning but some larger count does.
    plans = [_plan(full, nodes=n, gpu_mem_gb=40.0) for n in (1, 2, 4, 8)]
    minimum = plans[0].min_nodes
    assert minimum is not None and minimum > 1
    assert all(p.min_nodes == minimum for p in plans)  # a property of the setup, not of the node count asked
    assert all(p.fits == (p.nodes >= minimum) for p in plans)
    assert _plan(full, nodes=minimum, gpu_mem_gb=40.0).fits
    assert not _plan(full, nodes=minimum - 1, gpu_mem_gb=40.0).fits
    # Totals never grow with more nodes, so "fits" is monotone in the node count.
    totals = [p.total for p in plans]
    assert totals == sorted(totals, reverse=True)


def test_no_node_count_fits_when_activations_alone_exceed_the_gpu(full):
    plan = _plan(full, checkpointing=False)
    assert plan.activations > 80 * GIB
    assert not plan.fits and plan.min_nodes is None
    assert "none" in str(plan)


def test_settings_the_estimators_do_not_model_are_refused(full):
    with pytest.raises(UserError, match="stages 2 and 3"):
        _plan(full, zero_stage=1)
    with pytest.raises(UserError, match="stage 3"):
        memory_plan.model_states(full.param_count, full.param_count, full.largest_layer_params, 2, True, True, 8, 1)


@pytest.fixture
def counted(monkeypatch, lora):
    """Stand in for the meta-device count (tested above) and record what the config asked it for."""
    calls = []

    def shape(transformer_config=None, lora_config=None, zero3_leaf_modules="auto"):
        calls.append((transformer_config, lora_config, zero3_leaf_modules))
        return lora

    monkeypatch.setattr(memory_plan, "hunyuanvideo15_shape", shape)
    return calls


def test_plan_from_a_config_reads_the_run_schema(tmp_path, counted):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {name: hunyuan15, pretrained: org/hunyuanvideo-1.5, guidance_scale: 6.0,\n"
        "        kwargs: {num_frames: 33, height: 480, width: 848}}\n"
        "lora: {enabled: true, rank: 16}\n"
        "deepspeed: {config: zero3_offload, zero3_leaf_modules: [HunyuanVideo15TransformerBlock]}\n"
        "update: {micro_batch_size: 1, gradient_checkpointing: true}\n"
        "rollout: {group_size: 2, prompts_per_rank: 1}\n"
        "trust_region: {strategy: dual}\n"
        "data: {source: prompts.txt}\n"
    )
    plan = memory_plan.plan_from_config(config, gpus_per_node=8, nodes=1, gpu_mem_gb=80)
    assert counted == [(None, LoraConfig(enabled=True, rank=16), ["HunyuanVideo15TransformerBlock"])]
    assert plan.lora and plan.offload_optimizer and plan.offload_param and plan.zero_stage == 3
    assert plan.batch == 2  # CFG doubles the batch
    assert plan.tokens == memory_plan.video_tokens(33, 480, 848) + memory_plan.HUNYUANVIDEO15_CONTEXT_TOKENS
    text = str(plan)
    assert "LoRA" in text and "fits" in text and "smallest node count" in text
    # 2 samples x 21 float32 latents (20 steps), counted in the total.
    assert plan.rollout == 4 * 32 * memory_plan.video_tokens(33, 480, 848) * 2 * 21
    assert plan.total - plan.rollout - plan.references == _without_rollout(plan) and "rollout" in text
    bigger = memory_plan.plan_from_config(config, gpus_per_node=8, nodes=1, gpu_mem_gb=80, overrides=["sde.steps=40"])
    assert bigger.rollout == plan.rollout * 41 // 21
    # The dual trust region's two references (anchor, lagged policy): a float32 mean per trained transition of an
    # update, 2 samples x the trained steps of the schedule; none without a trust region, one with the rollout
    # log-ratio velocity estimator, half per update with two updates per rollout.
    trained = SDEConfig().trained_step_count
    assert plan.references == 4 * 32 * memory_plan.video_tokens(33, 480, 848) * 2 * trained * 2
    assert "KL references" in text

    def references(*overrides):
        return memory_plan.plan_from_config(config, 8, 1, 80, overrides=list(overrides)).references

    assert references("trust_region.strategy=none") == 0
    assert references("trust_region.velocity_estimator=rollout_logratio") == plan.references // 2
    assert references("trust_region.strategy=moving") == plan.references // 2  # the default: the anchor alone
    assert references("update.updates_per_rollout=2") == plan.references // 2

    with pytest.raises(UserError, match="only models"):
        memory_plan.plan_from_config(
            config,
            gpus_per_node=8,
            nodes=1,
            gpu_mem_gb=80,
            overrides=["model.name=tiny-hunyuan15", "model.pretrained=null"],
        )
    with pytest.raises(UserError, match="lora.rank"):
        memory_plan.plan_from_config(config, gpus_per_node=8, nodes=1, gpu_mem_gb=80, overrides=["lora.rank=0"])
    config.write_text("model: {name: tiny-hunyuan15}\ndata: {source: prompts.txt}\n")
    with pytest.raises(UserError, match="only models"):
        memory_plan.plan_from_config(config, gpus_per_node=8, nodes=1, gpu_mem_gb=80)


def _without_rollout(plan) -> int:
    s = plan.states
    return s.params + s.gradients + s.optimizer + plan.anchor + plan.activations + plan.reserve


def test_plan_command_is_registered_with_the_documented_flags(capsys, tmp_path, counted):
    from sage_grpo.pipeline.cli import parse_args

    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {name: hunyuan15, pretrained: org/model}\nlora: {enabled: true}\ndata: {source: prompts.txt}\n"
    )
    args = parse_args(["plan", str(config), "--gpus-per-node", "8", "--nodes", "1", "update.micro_batch_size=2"])
    assert args.gpu_mem == 80.0 and args.overrides == ["update.micro_batch_size=2"]
    assert args.handler(args) == 0
    assert "per GPU:" in capsys.readouterr().out
