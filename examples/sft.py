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
from trainers.data.formats import load_dataset_file
from trainers.cli.argparsing import add_config_arguments, config_overrides
from trainers.cli.tiny import embedded_default, embedded_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Model folder or Hub id. Default: a tiny model built offline.")
    parser.add_argument("--dataset", help="Training data file. Default: generated digit-reversal pairs.")
    parser.add_argument("--eval_dataset_file", help="Optional evaluation data file.")
    parser.add_argument("--lora_r", type=int, default=0, help="Train a LoRA adapter of this rank (0: full fine-tuning).")
    add_config_arguments(parser, SFTConfig)
    cli = parser.parse_args(argv)
    overrides = config_overrides(cli)

    if cli.model is None:  # the embedded default: a tiny model built offline learns to reverse digits
        cli.model, overrides = embedded_default("sft", overrides)
    train = load_dataset_file(cli.dataset) if cli.dataset else embedded_rows("sft")
    evaluation = load_dataset_file(cli.eval_dataset_file, "--eval_dataset_file") if cli.eval_dataset_file else None

    peft_config = None
    if cli.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.lora_r, lora_alpha=2 * cli.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=cli.model, args=SFTConfig(**overrides), train_dataset=train,
                         eval_dataset=evaluation, peft_config=peft_config)
    # --resume_from_checkpoint is a config field: 'true' (the newest checkpoint in output_dir) or a folder
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


if __name__ == "__main__":
    main()
