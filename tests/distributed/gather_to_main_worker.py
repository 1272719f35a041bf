"""Two ranks gather to rank 0 alone (``core.distributed.gather_to_main_or_raise``): each writes what it received,
and whether a failure on rank 1 was raised on every rank."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sage_grpo.core import distributed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distributed.init()
    rank = distributed.rank()
    received = distributed.gather_to_main_or_raise(lambda: {"rank": rank, "video": [rank] * 4})

    def fail_on_rank_1():
        if rank == 1:
            raise ValueError("rank 1 could not score")
        return rank

    try:
        distributed.gather_to_main_or_raise(fail_on_rank_1)
        raised = None
    except ValueError as error:
        raised = str(error)
    report = {"received": received, "raised": raised}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
