"""Checkpoints of a run, as torchtitan's CheckpointManager keeps them: one object owns where they go (the store),
what they hold (DeepSpeed's engine checkpoint plus every registered stateful object, per rank), when they are due,
and the choreography that makes a step count only once every rank has written it.

A step is saved in three moves: every rank stages its own files on its own disk and uploads them, one committer
writes the manifest once every rank's upload is confirmed (``core.storage``), then the retention policy prunes.
``latest`` moves only after the manifest exists, so a crash at any point leaves the previous checkpoint or a complete
new one.

A step written by another number of ranks (a job requeued on fewer or more nodes) is resumed through DeepSpeed's
universal checkpoint: each host converts the downloaded engine tag (``core.safe_load.convert_to_universal``) and every
rank loads its new ZeRO partitions from it, weights, Adam moments and step counts included. The per-rank states are
mapped onto the new ranks (``_load_resharded``): what is the same on every rank (the updater's counters and KL
controller, the prompt sampler's global position in its stream, the progress, the RNG) comes from rank 0's file;
the anchor, lagged-policy and EMA shards are re-partitioned exactly from every old rank's file. The run continues
where it stopped, its metrics continuous; it is not bit-identical to a run that never changed size, because each
iteration then takes ``prompts_per_rank`` x the new world size prompts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from sage_grpo.core import distributed
from sage_grpo.core.errors import UserError
from sage_grpo.core.files import remove_abandoned
from sage_grpo.core.s3 import S3Config
from sage_grpo.core.safe_load import UnsafeCheckpointError, convert_to_universal, load_engine_checkpoint
from sage_grpo.core.storage import CheckpointConfig, CheckpointError, FileEntry, Manifest, load_torch
from sage_grpo.pipeline.config import RunConfig

logger = logging.getLogger(__name__)

ENGINE_TAG = "engine"
UNIVERSAL_TAG = "universal"  # the engine tag converted for another world size, beside it in the restore folder
# Under the output folder: one folder per restoring job and host (a run, an export, an eval), removed once loaded.
RESTORE_DIR = "checkpoint-restore"
_RANK_FILE = re.compile(r"pipeline_state_rank(0|[1-9][0-9]*)\.pt")
# DeepSpeed's name for a ZeRO rank's optimizer-state shard (bf16_ with ZeRO-1/2's bf16 optimizer).
_OPTIMIZER_SHARD = re.compile(rf"{ENGINE_TAG}/(?:bf16_)?zero_pp_rank_(0|[1-9][0-9]*)_mp_rank_[0-9]+_optim_states\.pt")
_PLAIN = (str, int, float, bool, type(None))


class Stateful(Protocol):
    """Saved per rank. An object whose state differs between ranks also has
    ``load_resharded_state_dict(states, rank, world)``: every old rank's state, for this rank of a new world size;
    the others are given rank 0's state when the world size changed. One whose values must agree with the step it
    was saved at has ``state_problem(state, step)``: what is wrong with ``state`` for that step, or None.

    A saved state is data from outside: before anything is loaded it must have the structure of the live object's
    ``state_dict()`` (:func:`schema_problem`)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGState:
    """The process's torch and Python random states, so a resumed run draws the same numbers."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]  # weights_only loading turns the inner tuple into a list
        random.setstate((version, tuple(internal), gauss))


def for_run(config: RunConfig, engine, states: dict[str, Stateful]) -> Checkpointer:
    """The Checkpointer of ``config``'s run: its ``checkpoint`` section, output folder, ``s3`` section and hash."""
    return Checkpointer(
        config.checkpoint, engine, states, output_dir=config.output_dir, s3=config.s3, config_hash=config_hash(config)
    )


def config_hash(config: RunConfig) -> str:
    """What must match for a checkpoint to continue this run: everything but how long it runs, where it logs and
    where it publishes, and how it reaches its stores. Every ``s3`` key is transport (endpoint, region, addressing,
    retries, timeouts: a store behind a new proxy is the same store); what names a store, ``data.source`` and
    ``eval.source``, must match, and the checkpoint store is the one the step was read from."""
    data = config.model_dump(
        mode="json",
        exclude={
            "run": {"max_iterations", "time_budget_minutes"},
            "tracking": True,
            "checkpoint": True,
            "registry": True,
            "parallel": True,  # how ranks share the work, as the world size (which a resume may change too)
            "s3": True,
        },
    )
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class Checkpointer:
    """``save(step, force=...)`` at the end of every iteration (it knows whether one is due); ``load(resume)`` once
    after everything it restores is built. ``states`` names the objects saved per rank beside the engine.

    A checkpoint root belongs to one run (``run_id``, claimed in the store): a second run pointed at the same root is
    refused, and pruning never touches another run's steps. Every rank stages into its own folder and uploads its own
    files, and the committer writes the manifest once every rank's upload is confirmed, so ranks on different nodes
    need no shared filesystem. A store outage past its retry bound is ``StoreUnavailable`` on every rank (exit 75):
    the staging is kept and the committed steps are intact."""

    def __init__(
        self,
        settings: CheckpointConfig,
        engine,
        states: dict[str, Stateful],
        *,
        output_dir: Path,
        s3: S3Config,
        config_hash: str,
    ):
        """``settings`` is the run's ``checkpoint`` section; ``output_dir`` holds the staging and restore folders (and
        the store, unless ``checkpoint.uri`` names one); ``s3`` is how an S3 store is reached; ``config_hash``
        (:func:`config_hash`) is written into every manifest and must match for a resume to continue the run."""
        self.store = settings.build(output_dir, s3)
        self.engine = engine
        self.states = states
        self.every = settings.every
        self.retention = settings
        self.config_hash = config_hash
        self.work_dir = output_dir
        self.last_step: int | None = None
        self.run_id: str | None = None

    @property
    def uri(self) -> str | None:
        """The store's location once this run has a checkpoint there (saved or resumed from), else None."""
        return self.store.uri if self.last_step is not None else None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def claim(self, *, fresh_start: bool = False) -> None:
        """Make the root this run's before it trains (a new identity unless :meth:`load` resumed one); a root that
        another run owns is a one-line refusal unless ``fresh_start`` takes it over (its steps stay untouched)."""
        if self.run_id is None:
            self.run_id = distributed.broadcast_from_main(uuid.uuid4().hex)
        distributed.on_main(lambda: self.store.claim(self.run_id, take_over=fresh_start))

    def save(self, step: int, *, force: bool = False, metrics: dict[str, float] | None = None) -> bool:
        """Write step ``step`` if it is due or ``force``d; ``metrics`` go into the manifest, where the retention
        policy (``checkpoint.best_metric``) reads them. Collective: every rank calls it with the same arguments."""
        if not (force or self.due(step)):
            return False
        staging = self.work_dir / "checkpoint-staging" / f"step-{step}" / f"rank-{distributed.rank()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        distributed.on_main(lambda: self.store.begin_step(step, run_id=self.run_id))
        # save_latest=False: DeepSpeed's own "latest" would be written before every rank finished; our manifest commits.
        self.engine.save_checkpoint(str(staging), tag=ENGINE_TAG, save_latest=False)
        torch.save({name: state.state_dict() for name, state in self.states.items()}, self._rank_file(staging))
        reported = distributed.gather_or_raise(
            lambda: [entry.model_dump() for entry in self.store.upload_rank_files(step, distributed.rank(), staging)]
        )
        distributed.on_main(lambda: self._commit(step, reported, metrics))
        shutil.rmtree(staging, ignore_errors=True)
        distributed.barrier()
        if distributed.is_main():
            shutil.rmtree(staging.parent, ignore_errors=True)
        self.last_step = step
        return True

    def _commit(self, step: int, reported: list[list[dict]], metrics: dict[str, float] | None) -> None:
        rank_files = {rank: [FileEntry(**entry) for entry in entries] for rank, entries in enumerate(reported)}
        self.store.commit_manifest(
            step,
            rank_files,
            world_size=distributed.world_size(),
            config_hash=self.config_hash,
            extra={**(metrics or {}), "iteration": step},
            run_id=self.run_id,
        )
        self.store.prune(self.retention, run_id=self.run_id)
        logger.info("checkpoint step-%d committed to %s", step, self.store.uri)

    def load(
        self, resume: str, *, same_run: bool = True, require: bool = False, fresh_start: bool = False
    ) -> int | None:
        """Restore the engine and every registered state from a verified checkpoint; return its step, or None when
        ``resume`` is ``auto`` and nothing is there yet. ``same_run`` (resuming) demands the config the checkpoint was
        written with and continues its run identity; evaluating or sampling a saved policy may change the sampler.
        When checkpoints exist but none verifies, ``auto`` refuses unless ``fresh_start``. Under ``auto``, a step
        whose manifest or states are wrong (a file missing for a rank, a state of another structure, a pickle) is
        set aside with one warning and the previous verified step is loaded; a step asked for by name is refused."""
        step = distributed.on_main(lambda: self.store.resolve(resume, fresh_start=fresh_start))
        while step is not None:
            try:
                return self._load_step(step, same_run)
            except (CheckpointError, UnsafeCheckpointError) as error:
                if resume != "auto":
                    raise
                if distributed.is_main():
                    logger.warning("skipping checkpoint %s/step-%d: %s", self.store.uri, step, error)
                step = distributed.on_main(functools.partial(self.store.resolve_without, step, fresh_start=fresh_start))
        if require:
            raise UserError(f"no verified checkpoint for {resume!r} in {self.store.uri}")
        logger.info("resume %s: no checkpoint found, starting from the beginning", resume)
        if same_run:  # a job restarted before its first commit keeps the identity it claimed the root with
            self.run_id = distributed.on_main(self.store.owner)
        return None

    def _load_step(self, step: int, same_run: bool) -> int:
        manifest = distributed.on_main(lambda: self._checked_manifest(step))
        self._check_compatible(step, manifest, same_run)
        resharded = manifest.world_size != distributed.world_size()
        if resharded:
            logger.warning(
                "checkpoint step-%d was written by %d rank(s); continuing it on %d through DeepSpeed's "
                "universal checkpoint",
                step,
                manifest.world_size,
                distributed.world_size(),
            )
        restore, leader = self._restore_folder()  # one download (and conversion) per host; its ranks read it
        local = restore / f"step-{step}"
        try:
            distributed.gather_or_raise(lambda: self._fetch(step, local, resharded) if leader else None)
            # A checkpoint is data: DeepSpeed's files load with weights_only forced (core.safe_load), ours with
            # weights_only=True, after every file's sha256 was verified against the manifest. Ours are checked
            # against their schema before anything is loaded, so a wrong state never leaves the run half-restored.
            saved: list[dict[str, Any]] = []
            distributed.gather_or_raise(
                lambda: saved.extend(self._checked_states(local, step, manifest, resharded, same_run))
            )
            load_engine_checkpoint(
                self.engine,
                local,
                UNIVERSAL_TAG if resharded else ENGINE_TAG,
                universal=resharded,
                load_module_strict=True,
            )
            if resharded:
                self._load_resharded(saved)
            else:
                for name, state in self.states.items():
                    state.load_state_dict(saved[0][name])
            distributed.barrier()
        finally:
            if leader:
                shutil.rmtree(restore, ignore_errors=True)
                with contextlib.suppress(OSError):  # another reader's folder is still in it
                    restore.parent.rmdir()
        logger.info("loaded checkpoint step-%d of %s", step, self.store.uri)
        self.last_step = step
        if same_run:
            self.run_id = distributed.on_main(lambda: manifest.run_id or self.store.owner())
        return step

    def _restore_folder(self) -> tuple[Path, bool]:
        """This job's restore folder on this host, and whether this rank fetches into it (the host's lowest rank).

        Private to the job: two readers of one output folder (two exports, an eval beside a resuming run) each restore
        into their own, so neither removes or overwrites the files the other is loading. It is named by the host and
        the fetching process's id (:func:`_abandoned_restores`), so a later restore removes it once that process is
        gone (killed mid-restore), and never while it runs."""
        ranks = distributed.gather_or_raise(lambda: (socket.gethostname(), os.getpid()))
        host = ranks[distributed.rank()][0]
        leader = next(rank for rank, (name, _) in enumerate(ranks) if name == host)
        token = distributed.broadcast_from_main(uuid.uuid4().hex)
        return self.work_dir / RESTORE_DIR / f"{host}-{ranks[leader][1]}-{token}", leader == distributed.rank()

    def _fetch(self, step: int, local: Path, resharded: bool) -> None:
        restores = self.work_dir / RESTORE_DIR
        remove_abandoned(restores, _abandoned_restores(socket.gethostname()))
        for earlier in restores.glob("step-*"):  # a killed restore of the shared layout before private folders
            shutil.rmtree(earlier, ignore_errors=True)
        self.store.download(step, local)  # verifies every file's size and sha256 before anything loads it
        if resharded:
            convert_to_universal(local / ENGINE_TAG, local / UNIVERSAL_TAG)

    def _checked_manifest(self, step: int) -> Manifest:
        """The step's manifest, if it lists a pipeline state for exactly each of its ranks and an engine state (with
        each rank's optimizer-state shard, for a ZeRO engine)."""
        manifest = self.store.read_manifest(step)
        paths = {entry.path for entry in manifest.files}
        if manifest.world_size > len(paths):  # each rank has a file of its own: bounds the ranks counted below
            raise CheckpointError(f"its manifest says {manifest.world_size} rank(s) but lists {len(paths)} file(s)")
        expected = {self._rank_file(Path(), rank).name for rank in range(manifest.world_size)}
        listed = {path for path in paths if _RANK_FILE.fullmatch(path)}
        if listed != expected:
            raise CheckpointError(
                f"its manifest says {manifest.world_size} rank(s) but lists the pipeline states of "
                f"{len(listed)}: missing {sorted(expected - listed)[:3]}, unexpected {sorted(listed - expected)[:3]}"
            )
        if not any(path.startswith(f"{ENGINE_TAG}/") for path in paths):
            raise CheckpointError(f"its manifest lists no {ENGINE_TAG}/ files")
        if getattr(self.engine, "zero_optimization", lambda: False)():
            # DeepSpeed would load each rank's shard and stop with a traceback on the first one not downloaded.
            sharded = {int(match[1]) for path in paths if (match := _OPTIMIZER_SHARD.fullmatch(path))}
            missing = [rank for rank in range(manifest.world_size) if rank not in sharded]
            if missing:
                raise CheckpointError(f"its manifest lists no optimizer states for rank(s) {missing[:3]}")
        return manifest

    def _checked_states(
        self, local: Path, step: int, manifest, resharded: bool, same_run: bool
    ) -> list[dict[str, Any]]:
        """This rank's saved states (every old rank's when ``resharded``), each checked against its live object. A
        loader of another run (eval, sample, export: the policy alone) checks only the states it loads; the run's
        others (progress, sampler, RNG) are there and not its to judge."""
        ranks = range(manifest.world_size) if resharded else [distributed.rank()]
        saved = [load_torch(self._rank_file(local, rank)) for rank in ranks]
        live = {name: state.state_dict() for name, state in self.states.items()}
        for rank, states in zip(ranks, saved):
            # Shards of another world size have other shapes; load_resharded_state_dict checks them as it maps them.
            where = self._rank_file(Path(), rank).name
            if not same_run and isinstance(states, Mapping):
                states = {name: value for name, value in states.items() if name in live}
            problem = schema_problem(states, live, where, shapes=not resharded)
            for name, state in self.states.items():
                if problem is None and states[name] is None:  # only parts inside a state are optional
                    problem = f"{where}.{name} is None"
                if problem is None and hasattr(state, "state_problem"):
                    problem = state.state_problem(states[name], step)
            if problem is not None:
                raise CheckpointError(problem)
        return saved

    def _load_resharded(self, saved: list[dict[str, Any]]) -> None:
        """Every old rank's states, mapped onto this rank of the new world size (see the module's docstring)."""
        rank, world = distributed.rank(), distributed.world_size()
        for name, state in self.states.items():
            if hasattr(state, "load_resharded_state_dict"):
                state.load_resharded_state_dict([states[name] for states in saved], rank, world)
            else:
                state.load_state_dict(saved[0][name])

    def _check_compatible(self, step: int, manifest, same_run: bool) -> None:
        if same_run and manifest.config_hash != self.config_hash:
            raise UserError(
                f"checkpoint step-{step} was written with a different config; only run.max_iterations, "
                "run.time_budget_minutes, tracking, checkpoint, registry, parallel and s3 may change on resume"
            )

    @staticmethod
    def _rank_file(folder: Path, rank: int | None = None) -> Path:
        return folder / f"pipeline_state_rank{distributed.rank() if rank is None else rank}.pt"


def _abandoned_restores(host: str) -> re.Pattern[str]:
    """The restore folders of this host (``Checkpointer._restore_folder``): those of another host sharing the output
    folder carry process ids this host cannot check."""
    return re.compile(rf"{re.escape(host)}-(?P<pid>[1-9][0-9]*)-[0-9a-f]{{32}}")


def schema_problem(saved: Any, live: Any, where: str, *, shapes: bool = True) -> str | None:
    """Why ``saved`` (a state read from a checkpoint) cannot be what ``live`` (the object's own ``state_dict()``)
    saved, or None: mappings with the same keys, tensors of the same dtype (and shape, with ``shapes``), scalars of
    the same type; a mapping or sequence like a non-empty live one, entry by entry, or plain data where the live one
    is empty (a history that grows). None on either side is an optional part its owner handles (a run without EMA)."""
    if saved is None or live is None:
        return None
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return f"{where} is a {type(saved).__name__}, not a mapping"
        if not live:
            return None if _is_plain(saved) else f"{where} holds something other than plain data"
        if saved.keys() != live.keys():
            missing, unexpected = sorted(map(str, live.keys() - saved.keys())), sorted(map(str, saved.keys() - live))
            return f"{where}: missing entries {missing[:5]}, unexpected entries {unexpected[:5]}"
        children = [(saved[key], live[key], f"{where}.{key}") for key in live]
    elif isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.dtype != live.dtype or (shapes and saved.shape != live.shape):
            found = f"{saved.dtype} {list(saved.shape)}" if isinstance(saved, torch.Tensor) else type(saved).__name__
            return f"{where} is {found}, expected a {live.dtype} tensor {list(live.shape) if shapes else ''}".rstrip()
        return None
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            return f"{where} is a {type(saved).__name__}, not a sequence"
        if not live:
            return None if _is_plain(saved) else f"{where} holds something other than plain data"
        if len(saved) != len(live):
            return f"{where} has {len(saved)} entries, expected {len(live)}"
        children = [(s, v, f"{where}.{i}") for i, (s, v) in enumerate(zip(saved, live))]
    elif type(saved) is not type(live):
        return f"{where} is {type(saved).__name__}, expected {type(live).__name__}"
    else:
        return None
    return next((p for p in (schema_problem(*child, shapes=shapes) for child in children) if p), None)


def _is_plain(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(isinstance(key, str) and _is_plain(child) for key, child in value.items())
    if isinstance(value, (list, tuple)):
        return all(_is_plain(child) for child in value)
    return isinstance(value, _PLAIN)
