"""Process-group set-up, the run's parallel layout and small collectives. Rank, world size and local rank come from
the environment only (torchrun, the deepspeed launcher and Slurm's srun via torchrun all set RANK / WORLD_SIZE /
LOCAL_RANK)."""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sage_grpo.core.errors import UserError
from sage_grpo.core.files import remove_abandoned
from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())
dist = lazy_module("torch.distributed", globals())

# The folder of a single process's rendezvous file (see ``init``), removed by ``shutdown``.
_rendezvous: str | None = None
_RENDEZVOUS_FOLDER = re.compile(r"sagegrpo-pg-(?P<pid>[1-9][0-9]*)-\w+")


class ParallelConfig(BaseModel):
    """The ``parallel`` section: how ranks share the work beyond plain data parallelism.

    ``sequence_parallel_size`` K (Ulysses): groups of K consecutive ranks each hold one sample's video tokens split K
    ways through every transformer forward and backward (rollout, update, anchor and lagged-policy forwards), so the
    activations of a sequence are spread over K GPUs. The world then holds world/K data-parallel groups; ZeRO-3 still
    partitions the weights over every rank. K must divide the world size, the attention heads and the video tokens.
    """

    model_config = ConfigDict(extra="forbid")

    sequence_parallel_size: int = Field(1, ge=1, le=1024)


@dataclass(frozen=True)
class ParallelLayout:
    """How the run's ranks share the work, built once (``build``), checked once, and passed to whatever depends on it.

    The world is world/K data-parallel groups of K consecutive ranks (consecutive: on one node, where Ulysses'
    all-to-alls are fast). The K ranks of a group hold the same samples, each with a K-th of their video tokens
    (``ParallelConfig``). The default is one process alone; ``build`` reads this process's rank and world.
    """

    world_size: int = 1
    sequence_parallel_size: int = 1  # K
    rank: int = 0
    # The (data, ring, ulysses) device mesh diffusers' context parallelism takes; None at K = 1.
    mesh: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.sequence_parallel_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"no such layout: {self}")
        if self.world_size % self.sequence_parallel_size:
            raise UserError(
                f"parallel.sequence_parallel_size={self.sequence_parallel_size} does not divide the world size "
                f"{self.world_size}"
            )

    @classmethod
    def build(cls, sequence_parallel_size: int = 1) -> ParallelLayout:
        """This process's layout in the world of ``init``, with its device mesh when K > 1 (a ``ring`` dim of size 1
        beside ``ulysses``, as diffusers asks). With K > 1 every rank calls it once, after ``init``: the mesh's groups
        are made by all ranks together. At K = 1 it makes nothing: plain data parallelism, free to build anywhere."""
        layout = cls(world_size(), sequence_parallel_size, rank())
        if sequence_parallel_size == 1:
            return layout
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device().type,
            (layout.data_parallel_size, 1, sequence_parallel_size),
            mesh_dim_names=("data", "ring", "ulysses"),
        )
        return replace(layout, mesh=mesh)

    @property
    def data_parallel_size(self) -> int:
        """Groups holding distinct samples: world size / K."""
        return self.world_size // self.sequence_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's group: what shards prompts and seeds."""
        return self.rank // self.sequence_parallel_size

    @property
    def sequence_parallel_rank(self) -> int:
        """This rank's place in its group: which K-th of each sample's tokens it holds."""
        return self.rank % self.sequence_parallel_size

    @property
    def sequence_share(self) -> slice:
        """This rank's share of work its group's K ranks would otherwise repeat (decoding and scoring the same
        videos): every K-th item from its place in the group."""
        return slice(self.sequence_parallel_rank, None, self.sequence_parallel_size)

    def across_sequence_group(self, call) -> list:
        """``call()`` on every rank of this rank's group, the list of the group's results (in group order) on each of
        them: the K ranks share what each did on its ``sequence_share``. An exception any of them raises is raised
        on all."""
        if self.sequence_parallel_size == 1:
            return [call()]
        if self.mesh is None:
            raise RuntimeError(f"{self} has no device mesh to gather over: ParallelLayout.build makes it")
        return gather_or_raise(call, group=self.mesh["ulysses"].get_group())

    def one_per_sequence_group(self, values_by_rank: list) -> list:
        """The entries of a list indexed by global rank that belong to distinct groups (the first rank of each): a
        gather over all ranks holds every group's values K times."""
        return values_by_rank[:: self.sequence_parallel_size]


class LauncherEnvironment(BaseModel):
    """What a launcher (torchrun, the deepspeed launcher, srun wrappers) tells each process in its environment,
    checked where it is read, so a garbage value is one line naming the variable, not a traceback from ``int()``."""

    model_config = ConfigDict(alias_generator=str.upper, frozen=True)

    rank: int = Field(0, ge=0)
    world_size: int = Field(1, ge=1)
    local_rank: int = Field(0, ge=0)
    local_world_size: int = Field(1, ge=1)
    master_port: int = Field(29500, ge=1, le=65535)

    @model_validator(mode="after")
    def _ranks_inside_their_worlds(self):
        if self.rank >= self.world_size:
            raise ValueError(f"RANK={self.rank} is not below WORLD_SIZE={self.world_size}")
        if "local_world_size" in self.model_fields_set and self.local_rank >= self.local_world_size:
            raise ValueError(f"LOCAL_RANK={self.local_rank} is not below LOCAL_WORLD_SIZE={self.local_world_size}")
        return self


def launcher_environment() -> LauncherEnvironment:
    """The launcher's variables as set now (defaults for those unset); a bad one is a one-line UserError."""
    given = {
        field.alias: os.environ[field.alias]
        for field in LauncherEnvironment.model_fields.values()
        if field.alias in os.environ
    }
    try:
        return LauncherEnvironment.model_validate(given)
    except ValidationError as error:
        problem = error.errors()[0]
        named = "".join(f"{name}={given[name]!r}: " for name in problem["loc"] if name in given)
        raise UserError(f"launcher environment: {named}{problem['msg'].removeprefix('Value error, ')}") from None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else launcher_environment().rank


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else launcher_environment().world_size


def local_rank() -> int:
    return launcher_environment().local_rank


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def _ranks_share_a_gpu() -> bool:
    """More ranks on this node than GPUs (a check of the multi-rank path on a one-GPU machine): NCCL refuses two ranks
    on one device ("Duplicate GPU detected"), gloo does not."""
    return launcher_environment().local_world_size > torch.cuda.device_count()


def init(timeout_minutes: float = 30.0) -> None:
    """Start the process group DeepSpeed uses (NCCL on GPUs, gloo on CPU), with a collective timeout so a hung
    rank fails the job in bounded time instead of hanging it. Single-process runs get a world of one as well,
    so every code path is the same."""
    if dist.is_initialized():
        return
    launcher_environment()  # a garbage RANK or MASTER_PORT is one line here, not a traceback inside torch
    import deepspeed

    from sage_grpo.core.ops_cache import (
        clear_stale_locks,
        use_this_environments_extensions_dir,
        use_this_environments_ninja,
    )

    # DeepSpeed loads (or JIT-builds) its ops here, in this environment's own folder; a lock left by a process killed
    # mid-build would hang every rank, and another environment's ninja would rebuild them.
    use_this_environments_extensions_dir()
    use_this_environments_ninja()
    clear_stale_locks()
    launched = "WORLD_SIZE" in os.environ  # torchrun, the deepspeed launcher, Slurm's srun wrappers set it
    # A single process rendezvouses through a file, not a TCP port: a free port found now can be taken by any other
    # process (an outgoing connection's ephemeral port) before the store listens on it.
    global _rendezvous
    if not launched:
        # A killed process never ran shutdown: its folder is removed here, at the next start (the pid says whose).
        remove_abandoned(tempfile.gettempdir(), _RENDEZVOUS_FOLDER)
    _rendezvous = None if launched else tempfile.mkdtemp(prefix=f"sagegrpo-pg-{os.getpid()}-")
    init_method = None if launched else f"file://{_rendezvous}/store"
    for name, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
    ):
        os.environ.setdefault(name, value)
    backend = "nccl" if torch.cuda.is_available() and not _ranks_share_a_gpu() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    deepspeed.init_distributed(
        dist_backend=backend,
        timeout=timedelta(minutes=timeout_minutes),
        init_method=init_method,
        rank=rank(),
        world_size=world_size(),
    )
    atexit.register(shutdown)  # every entry point: the CLI, the test workers, the benchmarks


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over ranks (one collective for the whole dict)."""
    return _all_reduce(values, "mean")


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """Sum scalars over ranks (one collective for the whole dict): counts, and squared norms of partitioned tensors."""
    return _all_reduce(values, "sum")


def all_reduce_max(values: dict[str, float]) -> dict[str, float]:
    """The largest value of each scalar over ranks (one collective for the whole dict)."""
    return _all_reduce(values, "max")


def _all_reduce(values: dict[str, float], how: Literal["mean", "sum", "max"]) -> dict[str, float]:
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device())
    dist.all_reduce(packed, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
    if how == "mean":
        packed /= dist.get_world_size()
    return dict(zip(keys, packed.tolist()))


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one: how ranks agree on skip and stop decisions."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    packed = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device())
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return bool(packed.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group before the interpreter exits, as torch asks (``init`` registers it to run at exit).
    Not enough on its own to end a launched rank cleanly: gloo's threads outlive it (``exit_launched``)."""
    global _rendezvous
    if dist.is_initialized():
        dist.destroy_process_group()
    if _rendezvous is not None:  # a scheduled job's runs would leave one folder each in /tmp
        shutil.rmtree(_rendezvous, ignore_errors=True)
        _rendezvous = None


def exit_launched(code: int) -> int:
    """End a process that holds a process group (any world size: ZeRO-3 gathers through gloo on one rank too) with
    ``code`` once its output is flushed, skipping the interpreter's teardown; without one, ``code`` comes back.

    Deliberately by hand. gloo's worker threads outlive ``destroy_process_group`` and can still be finishing an async
    all-gather (ZeRO-3's) when the interpreter finalizes: freeing that work's tensor needs the GIL, and Python 3.11
    answers a thread that asks for the GIL during finalization with ``pthread_exit``, whose forced unwind through
    gloo's run loop calls ``std::terminate``. The rank, its run complete, aborts ("terminate called without an
    active exception", exit -6; core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
    ``THPVariable_dealloc`` -> ``take_gil`` -> ``PyThread_exit_thread``), torchrun fails the job and its agents
    wait out their exit barrier. ``os._exit`` never finalizes. Everything a run writes is closed by then
    (checkpoints committed, the MLflow run ended)."""
    if not dist.is_initialized():
        return code
    shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def weights_fingerprint(module: torch.nn.Module) -> str:
    """sha256 over every parameter's full value, gathered one parameter at a time under ZeRO-3 (so never a whole
    model on one rank). Equal on every rank that holds the same weights; names exactly the weights a run produced."""
    import hashlib
    from contextlib import nullcontext

    import deepspeed

    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        gathered = deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") else nullcontext()
        with gathered:
            digest.update(name.encode())
            digest.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def broadcast_from_main(value):
    """Rank 0's ``value`` on every rank (any picklable object; our own values only, never data from outside)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(call):
    """``call()`` on rank 0, its result on every rank; an exception it raises is raised on every rank (instead of
    rank 0 failing while the others wait in the next collective until the timeout)."""
    outcome = None
    if is_main():
        try:
            outcome = ("ok", call())
        except Exception as error:  # noqa: BLE001 - re-raised below, on every rank
            outcome = ("error", error)
    kind, value = broadcast_from_main(outcome)
    if kind == "error":
        raise value
    return value


def gather_or_raise(call, group=None) -> list:
    """``call()`` on every rank, the list of all ranks' results on every rank; if any rank raised, every rank raises
    the first such error (by rank). ``group``: a process group to gather over instead of the world."""
    try:
        outcome = ("ok", call())
    except Exception as error:  # noqa: BLE001 - re-raised below, on every rank
        outcome = ("error", error)
    outcomes = [outcome]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        outcomes = [None] * dist.get_world_size(group)
        dist.all_gather_object(outcomes, outcome, group=group)
    for kind, value in outcomes:
        if kind == "error":
            raise value
    return [value for _, value in outcomes]


def gather_to_main_or_raise(call) -> list | None:
    """``call()`` on every rank, the list of all ranks' results on rank 0 and None on the others: what only rank 0
    reads (evaluation videos) travels to rank 0 alone, not to every rank. If any rank raised, every rank raises the
    first such error (by rank)."""
    try:
        outcome = ("ok", call())
    except Exception as error:  # noqa: BLE001 - re-raised below, on every rank
        outcome = ("error", error)
    gather_or_raise(lambda: _raised(outcome))  # the outcomes' kinds, small, on every rank
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [outcome[1]]
    gathered = [None] * dist.get_world_size() if is_main() else None
    dist.gather_object(outcome[1], gathered, dst=0)
    return gathered


def _raised(outcome: tuple) -> None:
    kind, value = outcome
    if kind == "error":
        raise value


def node_leader() -> bool:
    """True on the lowest rank of each host: the one that fetches files every rank of its host reads."""
    import socket

    hosts = gather_or_raise(socket.gethostname)
    return hosts.index(hosts[rank()]) == rank()
