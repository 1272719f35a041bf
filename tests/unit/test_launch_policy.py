"""sage_grpo.pipeline.launch: torchrun's outcome as a status schedulers act on (real torchrun runs:
tests/distributed)."""

import re
from pathlib import Path

import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, UserError
from sage_grpo.pipeline import launch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)


@pytest.mark.parametrize(
    "root_cause, signalled, expected",
    [
        (None, False, 0),
        (RETRYABLE_EXIT_CODE, False, 143),
        (None, True, 143),  # stopped from outside: resume from the newest committed checkpoint
        (1, True, 143),
        (UserError.exit_code, False, UserError.exit_code),
        (1, False, 1),
        (-9, False, 1),  # killed (OOM killer): restarting would loop
        (139, False, 1),
    ],
)
def test_launch_exit_status(root_cause, signalled, expected):
    assert launch.exit_status(root_cause, signalled, retry_exit_code=143) == expected
