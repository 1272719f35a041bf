"""``--resume auto`` accepts a change of how the run reaches its stores (the ``s3`` section: endpoint, region,
addressing, retries, timeouts) and refuses only a change that names another store (``data.source``). The states are
the recipe's own over a real ZeRO-3 engine (tests/unit/test_checkpointer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.pipeline.config import RunConfig, load_run_config
from tests.unit.test_checkpointer import DEMO, TINY, Training, process_group  # noqa: F401 (a fixture)

pytestmark = pytest.mark.unit

TRANSPORT = [
    "s3.endpoint_url=https://minio.internal:9000",
    "s3.region_name=eu-west-1",
    "s3.addressing_style=path",
    "s3.retry_mode=adaptive",
    "s3.max_attempts=3",
    "s3.connect_timeout_s=2",
    "s3.read_timeout_s=30",
]


def run_config(output_dir: Path, *overrides: str) -> RunConfig:
    return load_run_config(DEMO, [*TINY, f"run.output_dir={output_dir}", *overrides])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """Step 1 of a run that reached S3 through AWS's endpoint with the default retries and timeouts."""
    output_dir = tmp_path_factory.mktemp("transport") / "run"
    saver = Training(run_config(output_dir))
    saver.checkpointer.claim()
    saver.progress.iteration = 1
    saver.checkpointer.save(1, force=True)
    return output_dir


def test_resume_accepts_another_way_to_reach_the_same_stores(saved_run):
    resumed = Training(run_config(saved_run, *TRANSPORT))

    assert resumed.checkpointer.load("auto") == 1
    assert resumed.progress.iteration == 1


def test_resume_refuses_a_prompt_source_in_another_store(saved_run):
    moved = Training(run_config(saved_run, *TRANSPORT, "data.source=s3://another-bucket/prompts.txt"))

    with pytest.raises(UserError, match="different config"):
        moved.checkpointer.load("auto")
