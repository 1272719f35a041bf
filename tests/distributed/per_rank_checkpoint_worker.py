"""Checkpoint a 2-rank DeepSpeed job whose ranks share no folder: each rank saves into its own directory and uploads
its own files (``upload_rank_files``), rank 0 writes the manifest after gathering what every rank reported
(``commit_manifest``); then every rank downloads the step into its own directory and loads it into a fresh engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sage_grpo.core import distributed
from sage_grpo.core.safe_load import load_engine_checkpoint
from sage_grpo.core.storage import CheckpointConfig, FileEntry

sys.path.insert(0, str(Path(__file__).parent))
from safe_load_worker import TAG, engine_for, trainable_weights  # noqa: E402

STEP = 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    store = CheckpointConfig(uri=args.root).build()
    node = args.out / f"rank{rank}"  # this rank's own disk

    engine = engine_for(args.stage, "full", seed=0)
    for _ in range(2):
        engine.backward(engine(torch.randn(3, 6)))
        engine.step()
    expected = trainable_weights(engine)

    if distributed.is_main():
        store.begin_step(STEP, run_id="run-a")
    distributed.barrier()
    engine.save_checkpoint(str(node / "staging"), tag=TAG, save_latest=False)
    entries = store.upload_rank_files(STEP, rank, node / "staging")
    reported = [None] * world
    dist.all_gather_object(reported, [entry.model_dump() for entry in entries])
    if distributed.is_main():
        store.commit_manifest(
            STEP,
            {r: [FileEntry(**entry) for entry in files] for r, files in enumerate(reported)},
            world_size=world,
            config_hash="c",
            run_id="run-a",
        )
    distributed.barrier()

    store.download(STEP, node / "restore")
    fresh = engine_for(args.stage, "full", seed=1)
    load_engine_checkpoint(fresh, node / "restore", TAG, load_module_strict=True)
    loaded = trainable_weights(fresh)
    report = {
        "loaded_equal": all(torch.equal(expected[name], loaded[name]) for name in expected),
        "uploaded": sorted(entry.path for entry in entries),
    }
    (args.out / f"report_rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
