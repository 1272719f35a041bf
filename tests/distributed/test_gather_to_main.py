"""What only rank 0 reads reaches rank 0 alone; a failure on any rank is raised on every rank."""

import json
from pathlib import Path

import pytest

from tests.helpers import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("gather_to_main_worker.py")


def test_results_reach_rank_0_alone_and_errors_every_rank(tmp_path):
    torchrun(2, str(WORKER), "--out", str(tmp_path))
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert main["received"] == [{"rank": 0, "video": [0] * 4}, {"rank": 1, "video": [1] * 4}]
    assert other["received"] is None
    assert main["raised"] == other["raised"] == "rank 1 could not score"
