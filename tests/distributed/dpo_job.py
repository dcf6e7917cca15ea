"""A short DPO (KTO, reward model) job launched by tests/distributed/test_dpo_distributed.py (or run alone); writes a
JSON report per run and rank.

argv: model_dir output_dir RUN [RUN ...]
Each RUN (a name in RUNS) trains a trainer of its own, one after the other in the same processes (one launch for all
the runs a template's tests compare), and writes output_dir/RUN/report-<rank>.json and the trained model to
output_dir/RUN/final. Every run trains 3 steps at per-device 2 with 2 accumulation steps unless RUNS says otherwise:
  dpo, dpo_one_process        DPO (sigmoid + 0.1 x sft); one_process: per-device 8, no accumulation, the global batch
                              of 8 the 2-process runs use when launched with 1 process
  dpo_precompute              DPO with precompute_ref_log_probs: the reference's log-probs computed before training,
                              each process its share
  reward, reward_one_process  the reward model (center_rewards_coefficient 0.01); one_process as above
  kto                         KTO on the pairs unpaired, per-device 4 without accumulation
"""

import json
import os
import random
import sys

import torch

from trainers import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
from trainers.parallel.distributed import gathered_parameters, unwrap, zero_stage


def digits_over_letters(n: int, seed: int) -> list[dict]:
    """Three digits preferred to three letters after a random prompt (tests/integration/test_dpo.py's)."""
    draw = random.Random(seed)
    pick = lambda chars, k: "".join(draw.choice(chars) for _ in range(k))  # noqa: E731
    return [{"prompt": pick("xyzw", draw.randint(2, 6)) + ":", "chosen": pick("0123456789", draw.randint(1, 4)),
             "rejected": pick("abcdefgh", draw.randint(1, 4))} for _ in range(n)]


RUNS = {  # name -> the trainer (method), per_device, accumulation
    "dpo": {"method": "dpo"},
    "dpo_one_process": {"method": "dpo", "per_device": 8, "accumulation": 1},
    "dpo_precompute": {"method": "dpo_precompute"},
    "reward": {"method": "reward"},
    "reward_one_process": {"method": "reward", "per_device": 8, "accumulation": 1},
    "kto": {"method": "kto", "per_device": 4, "accumulation": 1},
}


def run(model_dir: str, output_dir: str, method: str, per_device=2, accumulation=2) -> None:
    common = dict(output_dir=output_dir, per_device_train_batch_size=per_device,
                  gradient_accumulation_steps=accumulation, learning_rate=3e-3, max_steps=3, logging_steps=1,
                  save_strategy="no", disable_tqdm=True, seed=0, bf16=False, report_to="none")
    if method == "kto":  # the pairs unpaired: each process's micro-batches hold both labels
        trainer = KTOTrainer(model=model_dir, args=KTOConfig(**common), train_dataset=[
            {"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
            for row in digits_over_letters(24, 0) for side in ("chosen", "rejected")])
    elif method == "reward":
        trainer = RewardTrainer(model=model_dir, train_dataset=digits_over_letters(48, 0), args=RewardConfig(
            center_rewards_coefficient=0.01, **common))
    else:  # dpo_precompute: the reference's log-probs computed before training, each process its share
        trainer = DPOTrainer(model=model_dir, train_dataset=digits_over_letters(48, 0), args=DPOConfig(
            loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.1],
            precompute_ref_log_probs=method == "dpo_precompute", **common))
    trainer.train()
    # the reward model has no reference, nor does DPO with a precomputed one: the policy's parameters instead
    reference = getattr(trainer, "ref_model", None)
    reference = trainer.model if reference is None else unwrap(trainer.accelerator, reference)
    model = trainer.model
    with gathered_parameters(trainer.accelerator, model):
        checksum = [float(p.detach().double().sum()) for p in model.parameters()]
    trainer.save_model(os.path.join(output_dir, "final"))
    records = [r for r in trainer.state.log_history if "loss" in r]
    report = {
        "rank": trainer.accelerator.process_index,
        "zero_stage": zero_stage(trainer.accelerator),
        "history": [{k: r[k] for k in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "kl",
                                       "accuracy", "margin", "mean_reward") if k in r} for r in records],
        "reference_local_numel": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                                     for p in reference.parameters()),
        "total_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in reference.parameters()),
        "checksum": checksum,
    }
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)


def main():
    model_dir, output_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    for name in names:
        os.makedirs(os.path.join(output_dir, name), exist_ok=True)
        run(model_dir, os.path.join(output_dir, name), **RUNS[name])


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
