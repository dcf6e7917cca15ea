"""Supervised fine-tuning of a causal LM.

With no --model it runs an embedded default that needs no network and no GPU: a tiny Qwen2 built offline
learns to reverse 5-digit strings.

    python examples/sft.py                                                   # embedded default, CPU, ~20 s
    python examples/sft.py --model path/to/model --dataset chat.jsonl --output_dir out
    accelerate launch --config_file accelerate_configs/single_gpu.yaml examples/sft.py --model PATH --dataset chat.jsonl
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/sft.py --model PATH --dataset chat.jsonl
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/sft.py --model PATH --dataset chat.jsonl

The dataset is a local .json/.jsonl/.parquet/.csv file in any SFT format (docs/sft.md): a "text" column,
a "messages" column, "prompt" + "completion", or "input_ids". Every SFTConfig field is a flag (--help).
"""

import argparse
import os

from trainers import SFTConfig, SFTTrainer
from trainers.argparsing import add_config_arguments, config_overrides
from trainers.data import load_dataset_file
from trainers.tiny import as_sft_rows, reverse_digits_rows, save_tiny_model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Model folder or Hub id. Default: a tiny model built offline.")
    parser.add_argument("--dataset", help="Training data file. Default: generated digit-reversal pairs.")
    parser.add_argument("--eval_dataset_file", help="Optional evaluation data file.")
    parser.add_argument("--lora_r", type=int, default=0, help="Train a LoRA adapter of this rank (0: full fine-tuning).")
    parser.add_argument("--resume_from_checkpoint", default=None,
                        help="'true' resumes from the newest complete checkpoint in output_dir; a path, from that one.")
    add_config_arguments(parser, SFTConfig)
    cli = parser.parse_args(argv)
    overrides = config_overrides(cli)

    if cli.model is None:  # the embedded default
        overrides = {"output_dir": "outputs/sft-tiny", "per_device_train_batch_size": 32, "learning_rate": 3e-3,
                     "max_steps": 150, "logging_steps": 25, "save_strategy": "no", "lr_scheduler_type": "cosine",
                     "warmup_steps": 10, **overrides}
        cli.model = save_tiny_model(os.path.join(overrides["output_dir"], "tiny-model"), hidden_size=128,
                                    num_layers=4)
    train = load_dataset_file(cli.dataset) if cli.dataset else as_sft_rows(reverse_digits_rows(2000, seed=1))
    evaluation = load_dataset_file(cli.eval_dataset_file, "--eval_dataset_file") if cli.eval_dataset_file else None

    peft_config = None
    if cli.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.lora_r, lora_alpha=2 * cli.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=cli.model, args=SFTConfig(**overrides), train_dataset=train,
                         eval_dataset=evaluation, peft_config=peft_config)
    resume = {"true": True, "false": None}.get(str(cli.resume_from_checkpoint).lower(), cli.resume_from_checkpoint)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


if __name__ == "__main__":
    main()
