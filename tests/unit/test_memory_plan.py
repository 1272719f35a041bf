"""The memory planner: HunyuanVideo 1.5's size from diffusers, numbers that move the way ZeRO, LoRA, checkpointing
and sequence parallelism say they must, and advice that adds nodes only where nodes help."""

import dataclasses
import itertools
from pathlib import Path

import pytest

from sage_grpo.core import memory_trace
from sage_grpo.core.errors import UserError
from sage_grpo.core.lora import LoraConfig
from sage_grpo.pipeline import memory_plan, phase_plan
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


def _workload(shape, *, lora=False, frames=81, height=480, width=848, batch=2, **kw):
    return memory_plan.Workload(shape=shape, lora=lora, frames=frames, height=height, width=width, batch=batch, **kw)


def _layout(*, gpus_per_node=8, nodes=8, gpu_mem_gb=80.0, k=1, zero_stage=3, offload=False, checkpointing=True):
    return memory_plan.Layout(
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_mem_gb=gpu_mem_gb,
        sequence_parallel=k,
        zero_stage=zero_stage,
        offload_optimizer=offload,
        offload_param=offload,
        grad_checkpointing=checkpointing,
    )


def _plan(shape, *, lora=False, **layout):
    return memory_plan.plan(_workload(shape, lora=lora), _layout(**layout))


def _at(workload, layout, **change):
    return memory_plan.budget(workload, dataclasses.replace(layout, **change))


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


def _per_token(shape, batch, checkpointing=True):
    """Stored activation bytes per token of one rank, from activation_bytes' formula: each block's bf16 input plus one
    block's full set (34 bytes per unit of hidden size) with checkpointing, every block's full set without."""
    per_hidden = 2 * shape.num_layers + 34 if checkpointing else 34 * shape.num_layers
    return batch * shape.hidden_size * per_hidden


def _tokens_per_rank(workload, k):
    """1/K of the video tokens, and of the text padded to a multiple of K."""
    return workload.video_tokens // k + -(-workload.context_tokens // k)


VIDEO_720P = {"frames": 121, "height": 720, "width": 1280}


def _workload_720p(shape):
    """The 720p run of configs/hunyuanvideo15_sage_720p.yaml: CFG, 2 prompts x 4 videos a rank, 20 steps (19
    trained), the anchor's and the lagged policy's references."""
    latents = shape.latent_channels * memory_plan.video_tokens(121, 720, 1280)
    return _workload(
        shape,
        **VIDEO_720P,
        rollout=memory_plan.rollout_bytes(8, 20, latents),
        references=memory_plan.reference_bytes(8 * 19, latents, 2),
    )


def test_activations_per_rank_scale_as_one_over_k(full):
    workload = _workload_720p(full)
    plans = {k: memory_plan.plan(workload, _layout(k=k)) for k in (1, 2, 4, 8)}
    for k, plan in plans.items():
        per_rank = _tokens_per_rank(workload, k)
        assert plan.activations == _per_token(full, 2) * per_rank
        assert plan.activations_without_checkpointing == _per_token(full, 2, checkpointing=False) * per_rank
        assert plans[1].activations / plan.activations == pytest.approx(k, rel=1e-3)
        # ZeRO-3 partitions over all 64 GPUs whatever K; the K ranks of a group hold the same rollout.
        assert (plan.states, plan.anchor, plan.per_gpu - plan.activations) == (
            plans[1].states,
            plans[1].anchor,
            plans[1].per_gpu - plans[1].activations,
        )


def test_more_nodes_shrink_the_partitioned_states_and_nothing_else(full):
    workload = _workload(full, **VIDEO_720P, rollout=GIB, references=2 * GIB)
    plans = [memory_plan.budget(workload, _layout(nodes=n, k=2)) for n in (1, 2, 8, 64)]
    assert len({(p.activations, p.per_gpu) for p in plans}) == 1
    for fewer, more in zip(plans, plans[1:]):
        assert more.states.optimizer < fewer.states.optimizer and more.anchor < fewer.anchor
        assert more.total < fewer.total


def test_the_issues_720p_plan_gets_the_smallest_k_not_more_nodes(full):
    # 8 nodes x 8 GPUs at K=1 does not fit; the old planner answered "12 nodes", which shrinks only the ZeRO states.
    workload = _workload_720p(full)
    for gpu_mem_gb in (80.0, 40.0):
        plan = memory_plan.plan(workload, _layout(gpu_mem_gb=gpu_mem_gb))
        assert not plan.fits
        sizes = [k for k in range(1, 17) if not 16 % k and not workload.video_tokens % k and not 8 % k]
        assert memory_plan.sequence_parallel_sizes(workload, 8) == sizes == [1, 2, 4, 8]
        # total(K) = total(1) minus the activations of the tokens a rank no longer carries.
        saved = {
            k: _per_token(full, 2) * (_tokens_per_rank(workload, 1) - _tokens_per_rank(workload, k)) for k in sizes
        }
        total = {k: plan.total - saved[k] for k in sizes}
        smallest = next(k for k in sizes if total[k] <= gpu_mem_gb * GIB)
        assert smallest == (2 if gpu_mem_gb == 80 else 4)
        (suggestion,) = plan.suggestions
        assert suggestion.change == f"--sequence-parallel {smallest}" and suggestion.plan.fits
        assert suggestion.plan.layout == dataclasses.replace(plan.layout, sequence_parallel=smallest)
        assert suggestion.plan.total == total[smallest]
        assert "--nodes" not in str(plan)


def test_nodes_are_never_suggested_for_an_activation_bound_plan(full):
    # One GPU per node leaves K = 1: at 720p the activations alone exceed 40 GB, and no node count changes them.
    workload = _workload(full, **VIDEO_720P)
    plan = memory_plan.plan(workload, _layout(gpus_per_node=1, nodes=1, gpu_mem_gb=40.0))
    assert plan.activations > 40 * GIB and plan.suggestions == ()
    assert str(plan).splitlines()[-1].startswith("nothing fits: even at K=1")
    # Without gradient checkpointing, turning it on is the remedy on the same GPUs, not nodes.
    plan = memory_plan.plan(_workload(full), _layout(checkpointing=False))
    assert plan.activations > 80 * GIB
    assert [s.change for s in plan.suggestions] == ["update.gradient_checkpointing=true"]
    # Across setups: where what nodes do not shrink exceeds the GPU at every K, no suggestion adds nodes; where one
    # does, it is the fewest nodes at which some K fits.
    bound, added = 0, 0
    for gpus_per_node, gpu_mem_gb, video in itertools.product((1, 8), (24.0, 40.0, 80.0), ({}, VIDEO_720P)):
        workload = _workload(full, **video)
        asked = _layout(gpus_per_node=gpus_per_node, nodes=1, gpu_mem_gb=gpu_mem_gb)
        sizes = memory_plan.sequence_parallel_sizes(workload, gpus_per_node)
        suggestions = memory_plan.plan(workload, asked).suggestions
        if _at(workload, asked, sequence_parallel=sizes[-1]).per_gpu > gpu_mem_gb * GIB:
            bound += 1
            assert all(s.plan.layout.nodes == asked.nodes for s in suggestions)
        for suggestion in suggestions:
            found = suggestion.plan.layout
            if found.nodes != asked.nodes:
                added += 1
                assert suggestion.plan.fits and suggestion.plan.per_gpu <= gpu_mem_gb * GIB
                assert not any(_at(workload, found, nodes=found.nodes - 1, sequence_parallel=k).fits for k in sizes)
    assert bound >= 2 and added >= 3  # both kinds of setup were seen


def test_offload_is_suggested_for_full_fine_tuning_on_one_24gb_gpu(full):
    workload = _workload(full, batch=1)  # 480p without CFG
    plan = memory_plan.plan(workload, _layout(gpus_per_node=1, nodes=1, gpu_mem_gb=24.0))
    # Adam's fp32 master weights and moments alone (12 bytes a parameter) are 4x the GPU.
    assert plan.states.optimizer == 12 * full.param_count and not plan.fits
    offloaded = [s for s in plan.suggestions if s.change == "deepspeed.config=zero3_offload"]
    assert len(offloaded) == 1 and offloaded[0].plan.fits
    layout = offloaded[0].plan.layout
    assert (layout.zero_stage, layout.offload_optimizer, layout.offload_param, layout.nodes) == (3, True, True, 1)
    assert "host memory per node" in offloaded[0].why


def test_a_size_ulysses_cannot_split_is_refused_in_one_line(full):
    refusals = [
        (_workload(full), _layout(k=3), "16 attention heads"),
        (_workload(full), _layout(k=4), "33390 video tokens"),  # 480p: 21 x 30 x 53 latent tokens
        (_workload(full, **VIDEO_720P), _layout(gpus_per_node=2, nodes=1, k=4), "the 2 GPUs"),
    ]
    for workload, layout, reason in refusals:
        with pytest.raises(UserError, match=reason) as refused:
            memory_plan.plan(workload, layout)
        assert "\n" not in str(refused.value)


def test_a_plan_that_fits_names_a_smaller_k_and_fewer_nodes_that_also_fit(full):
    plan = memory_plan.plan(_workload_720p(full), _layout(k=8))
    assert plan.fits
    smaller, fewer = plan.suggestions
    assert smaller.change == "--sequence-parallel 2" and smaller.plan.fits
    assert fewer.change == "--nodes 1" and fewer.plan.fits
    assert [line.startswith("also fits") for line in str(plan).splitlines()[-2:]] == [True, True]


def test_settings_the_estimators_do_not_model_are_refused(full):
    with pytest.raises(UserError, match="stages 2 and 3"):
        _plan(full, zero_stage=1)
    with pytest.raises(UserError, match="stage 3"):
        memory_plan.model_states(full.param_count, full.param_count, full.largest_layer_params, 2, True, True, 8, 1)


# What the traced plan's stand-ins below report: a transformer call adding 1 GiB and 1e15 FLOPs, the frozen models'
# parameter counts. The real traces are tested in tests/unit/test_memory_trace.py and, for the shipped configs,
# tests/integration/test_shipped_plans.py.
STUB_TRACE = memory_trace.StepTrace(peak=GIB, flops=10**15)
STUB_DECODE = memory_trace.StepTrace(peak=GIB // 2, flops=10**14)  # the VAE decode of a micro-batch
STUB_FROZEN = {"text encoders": 7 * 10**9, "VAE": 10**9}


@pytest.fixture
def traced(monkeypatch):
    """Stand in for the traces and the frozen models' counts; record each traced call."""
    calls = []

    def trace(transformer_config, call, lora_config=None, dtype=None):
        calls.append(call)
        return STUB_TRACE

    monkeypatch.setattr(memory_trace, "trace_hunyuanvideo15", trace)
    monkeypatch.setattr(memory_trace, "trace_hunyuanvideo15_decode", lambda vae_config, call, dtype=None: STUB_DECODE)
    monkeypatch.setattr(phase_plan, "frozen_parameter_counts", lambda rewards: dict(STUB_FROZEN))
    return calls


@pytest.fixture
def counted(monkeypatch, lora, traced):
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
    layout, workload = plan.layout, plan.workload
    assert workload.lora and layout.offload_optimizer and layout.offload_param and layout.zero_stage == 3
    assert workload.batch == 2  # CFG doubles the batch
    assert (workload.frames, workload.height, workload.width) == (33, 480, 848)
    assert plan.tokens_per_rank == memory_plan.video_tokens(33, 480, 848) + memory_plan.HUNYUANVIDEO15_CONTEXT_TOKENS
    text = str(plan)
    assert "LoRA" in text and "fits" in text and "sequence parallel: K=1" in text
    # 2 samples x 21 float32 latents (20 steps), counted in the total.
    assert workload.rollout == 4 * 32 * memory_plan.video_tokens(33, 480, 848) * 2 * 21
    assert plan.total - workload.rollout - workload.references == _without_rollout(plan) and "rollout" in text
    bigger = memory_plan.plan_from_config(config, gpus_per_node=8, nodes=1, gpu_mem_gb=80, overrides=["sde.steps=40"])
    assert bigger.workload.rollout == workload.rollout * 41 // 21
    # The dual trust region's two references (anchor, lagged policy): a float32 mean per trained transition of an
    # update, 2 samples x the trained steps of the schedule; none without a trust region, one with the rollout
    # log-ratio velocity estimator, half per update with two updates per rollout.
    trained = SDEConfig().trained_step_count
    assert workload.references == 4 * 32 * memory_plan.video_tokens(33, 480, 848) * 2 * trained * 2
    assert "KL references" in text

    def references(*overrides):
        return memory_plan.plan_from_config(config, 8, 1, 80, overrides=list(overrides)).workload.references

    assert references("trust_region.strategy=none") == 0
    assert references("trust_region.velocity_estimator=rollout_logratio") == workload.references // 2
    assert references("trust_region.strategy=moving") == workload.references // 2  # the default: the anchor alone
    assert references("update.updates_per_rollout=2") == workload.references // 2

    # K from parallel.sequence_parallel_size, which --sequence-parallel replaces.
    split = memory_plan.plan_from_config(config, 8, 1, 80, overrides=["parallel.sequence_parallel_size=2"])
    assert split.layout.sequence_parallel == 2 and split.tokens_per_rank == memory_plan.tokens_per_rank(workload, 2)
    whole = memory_plan.plan_from_config(config, 8, 1, 80, ["parallel.sequence_parallel_size=2"], sequence_parallel=1)
    assert whole.layout.sequence_parallel == 1

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


@pytest.fixture
def small_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {name: hunyuan15, pretrained: org/model}\nlora: {enabled: true}\n"
        "update: {gradient_checkpointing: true}\ndata: {source: prompts.txt}\n"
    )
    return ["plan", str(config), "--gpus-per-node", "8", "--nodes", "1"]


def test_plan_command_is_registered_with_the_documented_flags(capsys, counted, small_config):
    from sage_grpo.pipeline.cli import main, parse_args

    args = parse_args([*small_config, "update.micro_batch_size=2", "--sequence-parallel", "2"])
    assert args.gpu_mem == 80.0 and args.overrides == ["update.micro_batch_size=2"] and args.sequence_parallel == 2
    assert main(small_config) == 0
    out = capsys.readouterr().out
    assert "per GPU:" in out and ": fits" in out


def test_plan_command_exits_1_when_the_plan_does_not_fit(capsys, counted, small_config):
    from sage_grpo.pipeline.cli import main

    assert main([*small_config, "--gpu-mem", "12"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*small_config, "--sequence-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "16 attention heads" in err


def test_the_shipped_720p_config_fits_8_nodes_of_8_gpus_at_the_smallest_k(monkeypatch, capsys, full, traced):
    from sage_grpo.pipeline.cli import main
    from sage_grpo.pipeline.config import load_run_config

    path = Path(__file__).resolve().parents[2] / "configs" / "hunyuanvideo15_sage_720p.yaml"
    config = load_run_config(path)
    assert not config.lora.enabled and config.model.kwargs == {"height": 720, "width": 1280, "num_frames": 121}
    monkeypatch.setattr(memory_plan, "hunyuanvideo15_shape", lambda *args: full)  # the 8.3B count, tested above
    plan = memory_plan.plan_for(config, gpus_per_node=8, nodes=8, gpu_mem_gb=80)
    k = config.parallel.sequence_parallel_size
    assert plan.fits and plan.layout.sequence_parallel == k > 1
    sizes = memory_plan.sequence_parallel_sizes(plan.workload, 8)
    smaller = [dataclasses.replace(plan.layout, sequence_parallel=size) for size in sizes if size < k]
    assert not any(memory_plan.budget(plan.workload, layout).fits for layout in smaller)
    assert main(["plan", str(path), "--gpus-per-node", "8", "--nodes", "8"]) == 0
    assert f"K={k}" in capsys.readouterr().out


def _phase_plan(config_path, *overrides, k=None, mfu=0.4):
    from sage_grpo.pipeline.config import load_run_config

    config = load_run_config(config_path, ["model.dtype=bfloat16", *overrides])
    formula = memory_plan.plan_for(config, 8, 1, 80, sequence_parallel=k)
    return phase_plan.phase_plan(config, formula, mfu=mfu, gpu_name="H100")


def test_the_traced_plan_adds_each_phase_to_what_lives_throughout(monkeypatch, traced, counted, small_config):
    decodes = []
    monkeypatch.setattr(
        memory_trace, "trace_hunyuanvideo15_decode", lambda config, call: decodes.append(call) or STUB_DECODE
    )
    config = small_config[1]
    plan = _phase_plan(config)
    # 1 GiB a call (STUB_TRACE) on top of what lives throughout; the frozen models in bf16 where they live.
    resident = sum(plan.resident.values())
    assert plan.resident["text encoders"] == 2 * STUB_FROZEN["text encoders"]
    assert plan.phases["evaluation"] == resident + GIB
    work = plan.formula.workload
    assert plan.phases["rollout step"] == resident + work.rollout + GIB
    assert plan.phases["update micro-step"] == resident + work.rollout + work.references + GIB
    assert plan.peak == plan.phases["update micro-step"]
    # The update traces training with the run's checkpointing; the rollout and the references do not.
    assert {(c.train, c.checkpointing) for c in traced} == {(False, False), (True, True)}
    # The decode of a micro-batch's latents (STUB_DECODE) beside the rollout, tiled as HunyuanVideo15Adapter decodes.
    assert plan.phases["VAE decode"] == resident + work.rollout + STUB_DECODE.peak
    latents = ((work.frames - 1) // 4 + 1, work.height // 16, work.width // 16)
    assert decodes == [memory_trace.DecodeCall(1, latents, tiling=True)]
    offloaded = _phase_plan(config, "model.kwargs.offload_text_encoder=true")
    assert "text encoders" not in offloaded.resident
    assert {name: plan.phases[name] - offloaded.phases[name] for name in plan.phases} == dict.fromkeys(
        plan.phases, 2 * STUB_FROZEN["text encoders"]
    )


def test_videoalign_is_traced_beside_the_next_micro_batchs_rollout_and_decode(monkeypatch, traced, counted, tmp_path):
    scored = memory_trace.StepTrace(peak=GIB // 4, flops=10**13)
    calls = []
    monkeypatch.setattr(phase_plan, "QWEN2_VL_2B", {"released": "config"})
    monkeypatch.setattr(memory_trace, "trace_videoalign", lambda config, call: calls.append((config, call)) or scored)
    config = tmp_path / "run.yaml"
    reward = "{name: videoalign, kwargs: {base_model: /m, checkpoint: /c, max_pixels: 50176}, batch_size: 4}"
    config.write_text(
        "model: {name: hunyuan15, pretrained: org/model}\nlora: {enabled: true}\n"
        f"rewards: [{reward}, {{name: brightness}}]\n"
        "update: {gradient_checkpointing: true, micro_batch_size: 2}\ndata: {source: prompts.txt}\n"
    )
    plan = _phase_plan(config)
    work = plan.formula.workload
    # A micro-batch of 2 videos (under the reward's batch_size), 24 fps, sampled and resized by the reward's kwargs.
    video = (work.frames, work.height, work.width)
    assert calls == [({"released": "config"}, memory_trace.videoalign_call(2, video, 24, {"max_pixels": 50176}))]
    resident = sum(plan.resident.values()) + work.rollout
    assert plan.phases["scoring"] == resident + scored.peak
    assert plan.phases["rollout step"] == resident + GIB + scored.peak
    assert plan.phases["VAE decode"] == resident + STUB_DECODE.peak + scored.peak
    assert "not traced: reward brightness (a plugin: neither its weights nor its activations)" in str(plan)


def test_gpu_hours_follow_from_the_flops_and_a_rank_does_1_over_k_of_its_groups(traced, counted, small_config):
    whole = _phase_plan(small_config[1])
    del traced[:]
    split = _phase_plan(small_config[1], k=2)
    # Memory is traced on a rank's share of the tokens, FLOPs on whole sequences (Ulysses attends over all tokens of
    # 1/K of the heads), then divided by K.
    assert sorted(call.sequence_parallel for call in traced) == [1, 1, 2, 2]
    assert split.rank_flops == whole.rank_flops / 2
    seconds = whole.rank_flops / (0.4 * 989e12)
    assert whole.seconds_per_iteration == pytest.approx(seconds)
    assert whole.gpu_hours_per_iteration == pytest.approx(seconds * 8 / 3600)
    assert "GPU-hours per iteration" in str(whole)


def test_the_plan_says_when_the_hand_formula_and_the_trace_disagree(traced, counted, small_config):
    plan = _phase_plan(small_config[1])
    agree = dataclasses.replace(plan, update_transient=plan.formula.activations)
    assert "they agree (0%)" in str(agree)
    assert "they disagree" in str(dataclasses.replace(plan, update_transient=plan.formula.activations * 2))


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--mfu", "3"], "--mfu"),
        (["--gpu", "abacus"], "--gpu abacus"),
        (["--nodes", "0"], "--nodes"),
        (["--nodes", "1000000000"], "--nodes"),
        (["--gpus-per-node", "-1"], "--gpus-per-node"),
        (["--gpu-mem", "nan"], "--gpu-mem"),
        (["--sequence-parallel", "0"], "sequence_parallel_size"),
    ],
)
def test_plan_with_absurd_inputs_says_so_in_one_line(capsys, counted, small_config, flags, reason):
    from sage_grpo.pipeline.cli import main

    assert main([*small_config, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err
