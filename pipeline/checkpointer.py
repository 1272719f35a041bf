"""Checkpoints of a run, as torchtitan's CheckpointManager keeps them: one object owns where they go (the store),
what they hold (DeepSpeed's engine checkpoint plus every registered stateful object, per rank), when they are due,
and the choreography that makes a step count only once every rank has written it.

A step is saved in three moves: all ranks write into one staging folder (a node-local disk for one node, shared
storage for several), one committer uploads it and writes the manifest last (``core.storage``), then the retention
policy prunes. ``latest`` moves only after the manifest exists, so a crash at any point leaves the previous
checkpoint or a complete new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from core import distributed
from core.errors import UserError
from core.safe_load import load_engine_checkpoint
from core.storage import load_torch
from pipeline.config import RunConfig

logger = logging.getLogger(__name__)

ENGINE_TAG = "engine"


class Stateful(Protocol):
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


def config_hash(config: RunConfig) -> str:
    """What must match for a checkpoint to continue this run: everything but how long it runs and where it logs."""
    data = config.model_dump(mode="json", exclude={"run": {"max_iterations", "time_budget_minutes"},
                                                   "tracking": True, "checkpoint": True})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class Checkpointer:
    """``save(step, force=...)`` at the end of every iteration (it knows whether one is due); ``load(resume)`` once
    after everything it restores is built. ``states`` names the objects saved per rank beside the engine."""

    def __init__(self, config: RunConfig, engine, states: dict[str, Stateful]):
        self.store = config.checkpoint.build(config.output_dir)
        self.engine = engine
        self.states = states
        self.every = config.checkpoint.every
        self.retention = config.checkpoint
        self.config_hash = config_hash(config)
        self.work_dir = config.output_dir
        self.last_step: int | None = None

    @property
    def uri(self) -> str | None:
        """The store's location once this run has a checkpoint there (saved or resumed from), else None."""
        return self.store.uri if self.last_step is not None else None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, *, force: bool = False, metrics: dict[str, float] | None = None) -> bool:
        """Write step ``step`` if it is due or ``force``d; ``metrics`` go into the manifest, where the retention
        policy (``checkpoint.best_metric``) reads them. Collective: every rank calls it with the same arguments."""
        if not (force or self.due(step)):
            return False
        staging = self.work_dir / "checkpoint-staging" / f"step-{step}"
        if distributed.is_main():
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        distributed.barrier()
        # save_latest=False: DeepSpeed's own "latest" would be written before every rank finished; our manifest commits.
        self.engine.save_checkpoint(str(staging), tag=ENGINE_TAG, save_latest=False)
        torch.save({name: state.state_dict() for name, state in self.states.items()}, self._rank_file(staging))
        distributed.barrier()
        if distributed.is_main():
            self.store.commit(staging, step, world_size=distributed.world_size(), config_hash=self.config_hash,
                              extra={**(metrics or {}), "iteration": step})
            self.store.prune(keep_last=self.retention.keep_last, best_metric=self.retention.best_metric,
                             higher_is_better=self.retention.higher_is_better)
            shutil.rmtree(staging, ignore_errors=True)
            logger.info("checkpoint step-%d committed to %s", step, self.store.uri)
        distributed.barrier()
        self.last_step = step
        return True

    def load(self, resume: str, *, same_run: bool = True, require: bool = False) -> int | None:
        """Restore the engine and every registered state from a verified checkpoint; return its step, or None when
        ``resume`` is ``auto`` and nothing is there yet. ``same_run`` (resuming) demands the config the checkpoint was
        written with; evaluating or sampling a saved policy may change the sampler."""
        step = self._resolve(resume)
        if step is None:
            if require:
                raise UserError(f"no verified checkpoint for {resume!r} in {self.store.uri}")
            logger.info("resume %s: no checkpoint found, starting a new run", resume)
            return None
        self._check_compatible(step, same_run)
        local = self.work_dir / "checkpoint-restore" / f"step-{step}"
        if distributed.is_main():
            shutil.rmtree(local, ignore_errors=True)
            self.store.download(step, local)  # verifies every file's size and sha256 before anything loads it
        distributed.barrier()
        # A checkpoint is data: DeepSpeed's files load with weights_only forced (core.safe_load), ours with
        # weights_only=True, after every file's sha256 was verified against the manifest.
        load_engine_checkpoint(self.engine, local, ENGINE_TAG, load_module_strict=True)
        saved = load_torch(self._rank_file(local))
        for name, state in self.states.items():
            state.load_state_dict(saved[name])
        distributed.barrier()
        if distributed.is_main():
            shutil.rmtree(local, ignore_errors=True)
            logger.info("loaded checkpoint step-%d of %s", step, self.store.uri)
        self.last_step = step
        return step

    def _resolve(self, resume: str) -> int | None:
        step = self.store.resolve(resume) if distributed.is_main() else None
        return distributed.broadcast_from_main(step)

    def _check_compatible(self, step: int, same_run: bool) -> None:
        manifest = self.store.read_manifest(step)
        if manifest.world_size != distributed.world_size():
            raise UserError(f"checkpoint step-{step} was written by {manifest.world_size} rank(s); resume it with "
                            f"the same number (ZeRO-3 partitions are per rank), not {distributed.world_size()}")
        if same_run and manifest.config_hash != self.config_hash:
            raise UserError(f"checkpoint step-{step} was written with a different config; only run.max_iterations, "
                            "run.time_budget_minutes, tracking and checkpoint may change on resume")

    @staticmethod
    def _rank_file(folder: Path) -> Path:
        return folder / f"pipeline_state_rank{distributed.rank()}.pt"
