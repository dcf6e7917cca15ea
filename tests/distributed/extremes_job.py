"""trainers.stats.reduce_extremes over 2 processes (no model): each rank reports what it got back.

argv: output_dir
"""

import json
import os
import sys

import torch

from trainers import distributed as dist
from trainers.stats import Extreme, reduce_extremes


def main():
    accelerator = dist.build_accelerator(1)
    rank = accelerator.process_index
    # per micro-batch:       rank 0          rank 1
    low = [(0.2, 0.1), (float("nan"), 0.4), (0.3, float("nan")), (float("nan"), float("nan"))]
    high = [(0.5, 0.7), (0.0, 0.1), (0.6, float("nan")), (0.2, 0.2)]
    extremes = {"low_min": [Extreme(torch.tensor(pair[rank]), "min") for pair in low],
                "high_max": [Extreme(torch.tensor(pair[rank]), "max") for pair in high]}
    with open(os.path.join(sys.argv[1], f"report-{rank}.json"), "w") as f:
        json.dump(reduce_extremes(accelerator, extremes), f)


if __name__ == "__main__":
    main()
