"""The update stage's two ratios alone (issue 4): its wall time against a bare loop of the same transformer
forward+backward (+ the anchor's forward), side by side, and ZeRO-3 model-state memory per rank at 2 ranks / 1 rank.
`python -m benchmarks.perf` prints these among the other ratios."""

import argparse

import torch

from benchmarks.perf import report_memory, report_update
from core import distributed

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    report_update(args.repeats)
    report_memory()
