"""RLOO (REINFORCE leave-one-out) on your model, your prompts and your reward functions: examples/grpo.py's
script (the same data, rewards, LoRA and launch) with RLOOConfig and RLOOTrainer (docs/rloo.md).

    python examples/rloo.py                                        # embedded default: tiny model, digit reversal
    python examples/rloo.py --model path/to/model --dataset prompts.jsonl --reward_funcs accuracy format
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/rloo.py --model PATH --dataset prompts.jsonl

Every RLOOConfig field is a flag (--help).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo  # noqa: E402  (examples/grpo.py)


def main(argv=None):
    grpo.main(argv, method="rloo", description=__doc__)


if __name__ == "__main__":
    main()
