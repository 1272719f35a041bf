"""Stage 5, the KL anchor: a frozen copy of the trainable weights, held as each rank's own partitions.

Recipe: ``Anchor.snapshot(module)`` copies the trainable parameters' local shards (the adapter weights under LoRA,
every weight under full fine-tuning); ``with anchor.swapped_in(): module(...)`` evaluates the anchor by swapping those
values into the policy module in place and back; ``anchor.refresh()`` re-copies the shards from the policy.
The same class holds the velocity term's lagged policy (pi_{k-1}): ``stage()`` copies the policy's values at the
start of an update into a second buffer and ``commit()`` makes them the reference once the update was applied (a
skipped update leaves the reference where it was).

Why shards and swapping: under ZeRO-3 each rank owns 1/world of every parameter (``param.ds_tensor``) and forward
all-gathers them, so swapping the local shards makes the next forward run the anchor without ever gathering a whole
copy on one rank, and a refresh is a local copy with no communication. Under LoRA the frozen base weights are shared
and only adapter values are swapped: there is no second model to load into, so LoRA keys can never silently fail to
load (the reference code's non-strict load into a plain copy made its anchor a no-op).

Checkpoints hold each rank's shards. A run resumed on another number of ranks re-partitions them exactly
(``load_resharded_state_dict``): the old ranks' shards, concatenated in rank order, are the whole flat parameter
plus ZeRO-3's zero padding, which is cut off and re-split the way ZeRO-3 partitions (ceil(numel / world) per rank,
the last one padded). So the anchor and the lagged policy continue unchanged, with no refresh.
"""

from __future__ import annotations

from contextlib import contextmanager

from sage_grpo.core.lazy import lazy_module, no_grad

torch = lazy_module("torch", globals())


def _is_zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_tensor")


def _release_gathered(params: list[torch.nn.Parameter]) -> None:
    """Drop the gathered copies of these ZeRO-3 parameters, so the next forward gathers from the (swapped) shards.

    This includes the small parameters ZeRO-3 keeps gathered for speed ("persistent"): the coordinator re-fetches
    whatever is not available, so they come back on the next forward, with the swapped values. One call for the
    whole list: DeepSpeed's per-parameter partition() formats a debug line for each call even when it prints none.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    gathered = [p for p in params if _is_zero3(p) and p.ds_status == ZeroParamStatus.AVAILABLE]
    if gathered:
        gathered[0].partition(param_list=gathered)


def _holder(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor that holds this rank's values of ``param``: its shard under ZeRO-3, else the parameter itself."""
    return param.ds_tensor if _is_zero3(param) else param


class Anchor:
    """A snapshot of the trainable parameters' local values, optionally kept in host memory (``offload``) and in
    another precision (``dtype``: the EMA keeps float32 values of bf16 weights)."""

    def __init__(self, params: list[torch.nn.Parameter], offload: bool = False, dtype: torch.dtype | None = None):
        if not params:
            raise ValueError("the anchor needs at least one trainable parameter")
        self.params = params
        self.offload = offload
        self.dtype = dtype
        self.refreshes = 0
        self._saved = [self._store(_holder(p).data) for p in params]
        self._staged: list[torch.Tensor] | None = None

    @classmethod
    def snapshot(cls, module: torch.nn.Module, offload: bool = False, dtype: torch.dtype | None = None) -> Anchor:
        return cls([p for p in module.parameters() if p.requires_grad], offload=offload, dtype=dtype)

    def _store(self, view: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype or view.dtype
        if self.offload and view.device.type != "cpu":
            return view.detach().to("cpu", dtype=dtype, copy=True).pin_memory()
        return view.detach().to(dtype=dtype, copy=True)

    @no_grad
    def blend(self, decay: float) -> None:
        """One EMA step toward the policy's current local values: saved = decay x saved + (1 - decay) x policy."""
        self._synchronize()
        for param, saved in zip(self.params, self._saved):
            saved.lerp_(_holder(param).data.to(saved.device, saved.dtype), 1.0 - decay)

    @no_grad
    def refresh(self) -> None:
        """Copy the policy's current local values into the anchor (no communication)."""
        self._copy_policy_into(self._saved)
        self.refreshes += 1

    @no_grad
    def stage(self) -> None:
        """Copy the policy's current local values into the staging buffer (allocated once, like the saved one)."""
        if self._staged is None:
            self._staged = [self._store(_holder(p).data) for p in self.params]
        else:
            self._copy_policy_into(self._staged)

    def commit(self) -> None:
        """Make the staged values the reference (a swap of lists: no copy)."""
        if self._staged is None:
            raise RuntimeError("commit() without stage()")
        self._saved, self._staged = self._staged, self._saved
        self.refreshes += 1

    @no_grad
    def matches_policy(self) -> bool:
        """Whether the saved values are exactly the policy's current local values (this rank's shards only)."""
        self._synchronize()
        return all(
            torch.equal(saved, _holder(param).data.to(saved.device, saved.dtype))
            for param, saved in zip(self.params, self._saved)
        )

    def _copy_policy_into(self, buffers: list[torch.Tensor]) -> None:
        for param, buffer in zip(self.params, buffers):
            buffer.copy_(_holder(param).data, non_blocking=True)

    def _synchronize(self) -> None:
        """Wait for non_blocking device-to-host copies into pinned memory: until then the host values may be stale."""
        if self.offload and torch.cuda.is_available() and any(p.device.type == "cuda" for p in self.params):
            torch.cuda.synchronize()

    @no_grad
    def _swap(self) -> None:
        _release_gathered(self.params)
        for i, param in enumerate(self.params):
            holder = _holder(param)
            if self.offload:  # host copies cannot stand in for device tensors: exchange the values
                held = holder.data.clone()
                holder.data.copy_(self._saved[i])
                self._saved[i].copy_(held)
            else:  # exchange the storages, no copy; the swap back restores the optimizer's views exactly
                holder.data, self._saved[i] = self._saved[i], holder.data

    @no_grad
    def _copy_in(self) -> list[torch.Tensor]:
        """The saved values copied into the policy (cast to its precision); returns the policy's own values."""
        kept = []
        _release_gathered(self.params)
        for param, saved in zip(self.params, self._saved):
            kept.append(_holder(param).data.clone())
            _holder(param).data.copy_(saved)
        return kept

    @no_grad
    def _restore(self, kept: list[torch.Tensor]) -> None:
        _release_gathered(self.params)
        for param, values in zip(self.params, kept):
            _holder(param).data.copy_(values)

    @contextmanager
    def swapped_in(self):
        """Within the block the module computes with the anchor's weights; the policy's are restored on exit.

        Use it for no-grad forwards only: a backward outside the block would otherwise re-gather the anchor values.
        Values held in another precision than the weights' are copied in and the policy's kept aside (an exchange
        would round the held values to the weights' precision).
        """
        if self.dtype is not None and any(_holder(p).dtype != self.dtype for p in self.params):
            kept = self._copy_in()
            try:
                yield
            finally:
                self._restore(kept)
            return
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def state_dict(self) -> dict:
        """This rank's anchor values (its shards), for checkpoints: each rank saves and loads its own."""
        self._synchronize()
        return {"refreshes": self.refreshes, "values": [saved.cpu() for saved in self._saved]}

    @no_grad
    def load_state_dict(self, state: dict) -> None:
        if len(state["values"]) != len(self._saved):
            raise ValueError("anchor checkpoint does not match the trainable parameters")
        for saved, value in zip(self._saved, state["values"]):
            if saved.shape != value.shape:
                raise ValueError("anchor checkpoint shard shapes differ (was it saved with another world size?)")
            saved.copy_(value)
        self.refreshes = int(state["refreshes"])

    @no_grad
    def load_resharded_state_dict(self, states: list[dict], rank: int, world: int) -> None:
        """Load the shards every rank of a run on another number of ranks saved (``states``, in rank order) as this
        rank's shards of ``world``. Without ZeRO-3 every rank holds whole values: rank 0's are everyone's."""
        if any(len(state["values"]) != len(self._saved) for state in states):
            raise ValueError("anchor checkpoint does not match the trainable parameters")
        values = [
            self._reshard(param, [state["values"][i] for state in states], rank, world)
            for i, param in enumerate(self.params)
        ]
        self.load_state_dict({"refreshes": states[0]["refreshes"], "values": values})

    @staticmethod
    def _reshard(param: torch.nn.Parameter, shards: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
        if not _is_zero3(param):
            return shards[0]
        whole = torch.cat([shard.flatten() for shard in shards])[: param.ds_numel]
        size = _holder(param).numel()
        padded = torch.nn.functional.pad(whole, (0, max(0, size * world - whole.numel())))
        return padded.narrow(0, rank * size, size).view_as(_holder(param))
