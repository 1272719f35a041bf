"""A job requeued on another number of ranks continues: 2 ranks -> 1 rank -> 2 ranks, each leg resuming the last
leg's checkpoint through DeepSpeed's universal checkpoint (torchrun, gloo on CPU, the shortened demo).

Why the final weights are not compared with a straight 2-rank run's: an iteration takes ``rollout.prompts_per_rank``
x world size prompts, so the 1-rank leg trains on half the prompts per iteration, and no run that changes size can
end at the weights of one that did not. What must carry over exactly is compared instead:
- the state every rank restores: ``update/lambda_kl`` of the first iteration after each resume is the KL
  controller's value in the checkpoint it resumed; the update counters and the anchor's refreshes continue;
- the prompt stream: the legs together take the seeded stream's prompts in order, each once, at 4, 4, 2, 2, 4
  prompts per iteration (a sampler restarted, or kept per rank, would repeat some);
- MLflow: one run, every iteration logged once.
That weights, Adam moments and step counts survive the conversion exactly (the next step lands where the saving job's
own did) is tested on real engines in tests/distributed/test_universal_checkpoint.py, and the anchor's re-partitioned
shards in tests/unit/test_anchor_reshard.py.
"""

import json
import subprocess
from pathlib import Path

import pytest

from sage_grpo.core.storage import load_torch
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.stages.ingest import PromptSampler, ingest
from tests.helpers import torchrun
from tests.integration.pipeline_runs import DEMO, SHORT, metric_history, only_run_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OVERRIDES = [*SHORT, "eval.every=0", "checkpoint.keep_last=3"]


def _run(output: Path, ranks: int, iterations: int, resume: bool) -> subprocess.CompletedProcess:
    return torchrun(
        ranks,
        "-m",
        "sage_grpo.pipeline.cli",
        "run",
        str(DEMO),
        f"run.output_dir={output}",
        *OVERRIDES,
        f"run.max_iterations={iterations}",
        f"tracking.tracking_uri=sqlite:///{output}/mlflow.db",
        *(["--resume", "auto"] if resume else []),
    )


def _prompts(output: Path, rank: int) -> dict[int, list[int]]:
    lines = (output / "audit" / f"rank-{rank}.jsonl").read_text().splitlines()
    return {entry["iteration"]: entry["prompt_ids"] for entry in map(json.loads, lines) if "prompt_ids" in entry}


def _saved_lambda(output: Path, step: int) -> float:
    return load_torch(output / "checkpoints" / f"step-{step}" / "pipeline_state_rank0.pt")["updater"]["controller"][
        "value"
    ]


def test_two_ranks_then_one_then_two_continue_one_run(tmp_path):
    _run(tmp_path, ranks=2, iterations=2, resume=False)
    shrunk = _run(tmp_path, ranks=1, iterations=4, resume=True)
    assert "written by 2 rank(s); continuing it on 1" in shrunk.stderr and "loaded checkpoint step-2" in shrunk.stderr
    grown = _run(tmp_path, ranks=2, iterations=6, resume=True)
    assert "written by 1 rank(s); continuing it on 2" in grown.stderr and "loaded checkpoint step-4" in grown.stderr

    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = only_run_id(tracking)
    history = {
        key: metric_history(tracking, run_id, key)
        for key in ("reward/mean", "update/lambda_kl", "update/updates_done", "update/anchor_refreshes")
    }
    assert [step for step, _ in history["reward/mean"]] == [1, 2, 3, 4, 5, 6]
    lambdas = dict(history["update/lambda_kl"])
    assert lambdas[3] == _saved_lambda(tmp_path, 2) and lambdas[5] == _saved_lambda(tmp_path, 4)
    assert [value for _, value in history["update/updates_done"]] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in history["update/anchor_refreshes"]] == [0, 1, 1, 2, 2, 3]

    config = load_run_config(DEMO, OVERRIDES)
    train_prompts = len(ingest(config.data).train)
    stream = PromptSampler(train_prompts, 1, 0, 1, config.seed)
    expected = [next(stream)[0] for _ in range(train_prompts)]  # one epoch of the seeded stream, in order
    audits = [_prompts(tmp_path, rank) for rank in (0, 1)]
    taken = [i for iteration in range(1, 6) for audit in audits for i in audit.get(iteration, [])]
    assert len(audits[0][3]) == len(audits[0][4]) == 2 and 3 not in audits[1] and 4 not in audits[1]
    assert taken == expected[: len(taken)] and len(taken) == 16 <= train_prompts
