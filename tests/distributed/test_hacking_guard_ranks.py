"""The hacking guard on 2 ranks (``sagegrpo run`` under ``sage_grpo.pipeline.launch``, gloo on CPU, the shortened
demo made to hack): the 4 evaluation prompts are sampled and judged in two batches, one per rank, and their scores
gathered to rank 0 and broadcast before the guard reads them, so every rank reaches the same decision. Tighten
doubles the KL weight on both ranks and both go on; stop ends both (neither is left waiting in a collective) with
exit 3."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sage_grpo.core.storage import load_torch
from sage_grpo.stages.evaluate import HACKING_STOP_EXIT_CODE
from tests.helpers import REPO, free_port, worker_environment
from tests.integration.pipeline_runs import CONTRAST_JUDGE, DEMO, HACKING, SHORT, metric_history, only_run_id

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _two_ranks(output: Path, *overrides: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "sage_grpo.pipeline.launch", "--nproc-per-node=2", "--nnodes=1"]
    command = [
        *launcher,
        f"--master-port={free_port()}",
        *("-m", "sage_grpo.pipeline.cli", "run", str(DEMO)),
        f"run.output_dir={output}",
        *SHORT,
        *HACKING,
        CONTRAST_JUDGE,
        "eval.num_prompts=4",  # two batches of update.micro_batch_size=2: one on each rank
        "run.max_iterations=10",
        *overrides,
    ]
    return subprocess.run(command, env=worker_environment(), capture_output=True, text=True, timeout=900, cwd=REPO)


def _controllers(output: Path, step: int) -> list[dict]:
    folder = output / "checkpoints" / f"step-{step}"
    return [load_torch(folder / f"pipeline_state_rank{rank}.pt")["updater"]["controller"] for rank in (0, 1)]


def test_tighten_acts_on_both_ranks_and_both_go_on(tmp_path):
    result = _two_ranks(tmp_path, "eval.guard.action=tighten")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = only_run_id(uri)
    fired = [step for step, _ in metric_history(uri, run_id, "guard/fired")]
    assert fired and max(fired) < 10, fired  # it fired, and training went on past it
    assert MlflowClient(uri).get_run(run_id).data.tags["hacking_guard"].startswith("tighten at iteration ")
    # Each rank doubled its own controller's strength once per firing: a rank that had not decided alike would hold
    # strength 1.
    ranks = _controllers(tmp_path, 10)
    assert [controller["strength"] for controller in ranks] == [2.0 ** len(fired)] * 2
    assert ranks[0]["value"] == ranks[1]["value"]
    # The weight it set doubled with it: the next update's lambda jumps by about 2x, more than the controller moves
    # it between other updates.
    weight = dict(metric_history(uri, run_id, "update/lambda_kl"))
    jumps = {step: weight[step + 1] / weight[step] for step in range(2, 10)}
    for step in fired:
        assert jumps[step] > 1.5, jumps
    assert all(jump < 1.5 for step, jump in jumps.items() if step not in fired), jumps


def test_stop_ends_both_ranks(tmp_path):
    result = _two_ranks(tmp_path, "eval.guard.action=stop", "checkpoint.best_metric=eval/judge/contrast")
    assert result.returncode == HACKING_STOP_EXIT_CODE, result.stdout[-2000:] + result.stderr[-4000:]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    [(fired_at, _)] = metric_history(uri, only_run_id(uri), "guard/fired")
    assert fired_at < 10
    # Exactly the export, finished: rank 1 exiting 3 first must not have the launcher kill rank 0 while it writes.
    [export] = [path.name for path in (tmp_path / "exports").iterdir()]
    assert export.startswith("best-by-judge-step-"), export
