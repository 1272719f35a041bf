"""Two "nodes" on this machine: two separate torchrun invocations with --nnodes 2 (one process each) meeting at a
rendezvous on loopback, running the demo config for two iterations. Both ranks must train on different prompts and
end with identical weights."""

import json
import subprocess
import sys

import pytest

from tests.helpers import free_port
from tests.integration.pipeline_runs import DEMO, REPO, SHORT, environment

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_torchrun_nodes_train_on_different_prompts_and_agree_on_weights(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                "--rdzv-id=two-nodes",
                "-m",
                "sage_grpo.pipeline.cli",
                "run",
                str(DEMO),
                f"run.output_dir={tmp_path}",
                *SHORT,
                "run.max_iterations=2",
                "eval.every=0",
            ],
            cwd=REPO,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    audits = [
        [json.loads(line) for line in (tmp_path / "audit" / f"rank-{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]
    for iteration in (1, 2):
        trained = [
            next(r["prompt_ids"] for r in audit if r.get("iteration") == iteration and "prompt_ids" in r)
            for audit in audits
        ]
        assert trained[0] and trained[1] and not set(trained[0]) & set(trained[1])
    fingerprints = [audit[-1]["weights_sha256"] for audit in audits]
    assert fingerprints[0] == fingerprints[1]
    assert '"world_size": 2' in (tmp_path / "checkpoints" / "step-2" / "manifest.json").read_text()
