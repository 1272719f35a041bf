"""Memory and FLOPs of one model step, traced on fake tensors: the real modules at their real size, run without
allocating anything (torch's ``FakeTensorMode``, as torchtitan's memory estimation does), every tensor storage they
create counted while it lives and every FLOP by ``torch.utils.flop_counter``'s formulas.

What a trace measures is what one step adds to the memory that was alive when it began (the weights and the step's
inputs): activations, the tensors kept for backward, temporaries, gradients as they arise. Under ZeRO-3 a gradient
leaves the GPU as soon as it is reduced, so a training step drops each gradient once it has accumulated (the
bucket DeepSpeed reduces it in is counted with the model states). Model states, optimizer state and whatever else
lives across steps are counted by the caller.

Deep models are traced at two and at three blocks and extrapolated to their depth (``over_depth``): every block adds
the same tensors (its input kept for a checkpointed backward, or its whole activations without checkpointing), so
memory and FLOPs are affine in the number of blocks, and tracing 54 blocks would take a minute where two take a
second. ``tests/unit/test_memory_trace.py`` checks the extrapolation against a trace at full depth.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class StepTrace:
    """``peak``: the most bytes alive at once during the step beyond those alive when it began; ``flops``: the
    step's FLOPs as ``torch.utils.flop_counter`` counts them (matmuls, convolutions, attention; forward and, for a
    training step, backward)."""

    peak: int
    flops: int

    def __add__(self, other: StepTrace) -> StepTrace:
        return StepTrace(self.peak + other.peak, self.flops + other.flops)

    def __mul__(self, factor: int) -> StepTrace:
        return StepTrace(self.peak * factor, self.flops * factor)


def fake_mode():
    """A ``FakeTensorMode`` in which modules built and run allocate nothing. Tensors made outside it (Python
    scalars, small constants) are accepted and treated as fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def default_dtype(dtype):
    """Modules built inside get parameters of ``dtype``: how a fake module is built in bf16 (``module.to`` cannot
    swap fake parameters)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _Tally:
    """Bytes of the tensor storages alive, and their most at once: each storage counted when an op returns it new
    (not a view of one of its inputs) and uncounted when it is freed; and the ops' FLOPs, by
    ``torch.utils.flop_counter``'s formulas (its ``FlopCounterMode`` hooks every module to attribute FLOPs, and
    those hooks keep the activations of checkpointed blocks alive). torch's ``MemTracker`` counts storages the same
    way and attributes every byte to a module, which costs a walk over all modules per op: a minute per trace of a
    real-size model."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self.flops = 0
        self._seen: set[int] = set()

    def add(self, tensor, inputs: set[int]) -> None:
        """Count ``tensor``'s storage unless it is one of the op's ``inputs`` (storage ids) or already counted."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen or key in inputs:
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.current -= size


def _tallying(tally: _Tally):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    class Tallying(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = lambda tree: [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]  # noqa: E731
            inputs = {id(t.untyped_storage()) for t in tensors((args, kwargs))}
            out = func(*args, **kwargs)
            for tensor in tensors(out):
                tally.add(tensor, inputs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                tally.flops += formula(*args, **kwargs, out_val=out)
            return out

    return Tallying()


def trace_step(mode, module: torch.nn.Module, call: Callable[[], object], *, train: bool) -> StepTrace:
    """Run ``call()`` (which calls ``module``) once under ``mode`` (``fake_mode()``, in which ``module`` and the
    call's inputs were made) and count it. ``train``: ``call`` returns a tensor whose sum is backpropagated, and each
    parameter's gradient is dropped once it has accumulated, as ZeRO-3 reduces it away."""
    drops = [p.register_post_accumulate_grad_hook(_drop_grad) for p in module.parameters() if train and p.requires_grad]
    tally = _Tally()
    try:
        with mode, _tallying(tally):
            with contextlib.nullcontext() if train else torch.no_grad():
                out = call()
                if train:
                    out.float().sum().backward()
            del out
    finally:
        for handle in drops:
            handle.remove()
    return StepTrace(peak=tally.peak, flops=tally.flops)


def _drop_grad(param) -> None:
    param.grad = None


def over_depth(trace_at: Callable[[int], StepTrace], depth: int) -> StepTrace:
    """The trace of a ``depth``-block model from traces at two and three blocks (``trace_at(blocks)``), each further
    block adding what the third added. (The second can differ: where the peak falls moves from the first block's
    backward to a later one's.)"""
    if depth <= 3:
        return trace_at(depth)
    two, three = trace_at(2), trace_at(3)
    per_block = StepTrace(three.peak - two.peak, three.flops - two.flops)
    return two + per_block * (depth - 2)


def parameter_count(build: Callable[[], torch.nn.Module]) -> int:
    """Parameters of the module ``build()`` makes, built on the meta device: nothing is allocated or read."""
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


# HunyuanVideo 1.5's text-side inputs of the released pipeline: 1000 Qwen2.5-VL positions, 256 ByT5 positions and
# 729 SigLIP image slots (zeroed for text-to-video, but still in the sequence).
HUNYUANVIDEO15_TEXT_TOKENS = {"qwen": 1000, "byt5": 256, "image": 729}


@dataclass(frozen=True)
class TransformerCall:
    """One HunyuanVideo 1.5 transformer call as a phase makes it: ``batch`` sequences (samples x CFG branches) of
    latents [frames, height, width], a forward alone or a forward and backward (``train``), on 1/K of the tokens."""

    batch: int
    latent_grid: tuple[int, int, int]
    train: bool = False
    checkpointing: bool = False
    sequence_parallel: int = 1
    text_tokens: tuple[int, int, int] = tuple(HUNYUANVIDEO15_TEXT_TOKENS.values())


def trace_hunyuanvideo15(transformer_config: dict, call: TransformerCall, *, lora_config=None, dtype=None) -> StepTrace:
    """One call of ``HunyuanVideo15Transformer3DModel`` built from ``transformer_config`` in ``dtype`` (bf16 by
    default) with the run's attention (``core.models.hunyuan15.KeyPaddingAttnProcessor``), LoRA adapter
    (``lora_config``, a ``core.lora.LoraConfig``) and gradient checkpointing, traced at two and three blocks and
    extrapolated to the config's depth."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.core.lora import add_lora
    from sage_grpo.core.models.hunyuan15 import fake_tensor_forward, use_key_padding_attention

    dtype = torch.bfloat16 if dtype is None else dtype
    depth = {**init_defaults(HunyuanVideo15Transformer3DModel), **transformer_config}["num_layers"]

    def at(blocks: int) -> StepTrace:
        mode = fake_mode()
        with mode, default_dtype(dtype):
            model = HunyuanVideo15Transformer3DModel.from_config({**transformer_config, "num_layers": blocks})
            use_key_padding_attention(model)
            if lora_config is not None and lora_config.enabled:
                with _adapters_made_in_place():
                    add_lora(model, lora_config)
            if call.checkpointing:
                model.enable_gradient_checkpointing()
            inputs = _hunyuanvideo15_inputs(model.config, call, dtype)
        return trace_step(
            mode,
            model,
            lambda: fake_tensor_forward(model, **inputs, sequence_parallel=call.sequence_parallel),
            train=call.train,
        )

    return over_depth(at, depth)


@contextlib.contextmanager
def _adapters_made_in_place():
    """peft moves each new adapter to its base layer's device and dtype with ``Module.to``, which cannot swap fake
    parameters (``_apply`` swaps tensors of a wrapper subclass); built inside ``default_dtype`` under the fake mode,
    they are already where they belong, so ``to`` leaves the module as it is meanwhile."""
    from unittest import mock

    with mock.patch.object(torch.nn.Module, "to", lambda module, *args, **kwargs: module):
        yield


def init_defaults(cls) -> dict:
    """The keyword defaults of a diffusers model's ``__init__``: its config where a config file says nothing."""
    import inspect

    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _hunyuanvideo15_inputs(config, call: TransformerCall, dtype) -> dict:
    """Fake inputs of one call, shaped as ``HunyuanVideo15Adapter.predict_velocity`` makes them."""
    batch, (frames, height, width) = call.batch, call.latent_grid
    qwen, byt5, image = call.text_tokens
    return {
        "hidden_states": torch.empty(batch, config.in_channels, frames, height, width, dtype=dtype),
        "timestep": torch.empty(batch, dtype=dtype),
        "text": {
            "encoder_hidden_states": torch.empty(batch, qwen, config.text_embed_dim, dtype=dtype),
            "encoder_attention_mask": torch.ones(batch, qwen, dtype=torch.long),
            "encoder_hidden_states_2": torch.empty(batch, byt5, config.text_embed_2_dim, dtype=dtype),
            "encoder_attention_mask_2": torch.ones(batch, byt5, dtype=torch.long),
        },
        "image_embeds": torch.zeros(batch, image, config.image_embed_dim, dtype=dtype),
    }
