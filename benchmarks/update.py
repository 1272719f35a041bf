"""The update stage's ratios alone (issue 4, issue 17): its wall time against a bare loop of the same model work
(anchor and lagged forwards, policy forward+backward), side by side on ZeRO-3 and ZeRO-2, at the tiny and the
compute-bound size; and ZeRO-3 model-state memory per rank at 2 ranks / 1 rank.
`python -m benchmarks.perf` prints these among the other ratios."""

import argparse

import torch

from benchmarks.perf import SIZES, report_memory, report_update
from sage_grpo.core import distributed

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "compute"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    for key in args.sizes:
        report_update(args.repeats, SIZES[key])
    report_memory()
