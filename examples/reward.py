"""A reward model (a sequence classifier with one score) trained on preference pairs.

With no --model it runs an embedded default that needs no network and no GPU: a tiny Qwen2 built offline learns
to score the reversal of a 5-digit string above a copy of it. The saved model (OUTPUT_DIR/final) is a reward
model for GRPO: --reward_funcs OUTPUT_DIR/final.

    python examples/reward.py                                                # embedded default, CPU
    python examples/reward.py --model path/to/model --dataset prefs.jsonl --output_dir rm
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/reward.py --model PATH --dataset prefs.jsonl

The dataset is a local .json/.jsonl/.parquet/.csv file of preference rows (docs/reward.md): "chosen" and
"rejected" (whole sequences, or completions after a "prompt"), optionally "margin". Every RewardConfig field is
a flag (--help).
"""

import argparse
import os

from trainers import RewardConfig, RewardTrainer
from trainers.data.formats import load_dataset_file
from trainers.cli.argparsing import add_config_arguments, config_overrides
from trainers.cli.tiny import embedded_default, embedded_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Model folder or Hub id. Default: a tiny model built offline.")
    parser.add_argument("--dataset", help="Preference data file. Default: generated digit-reversal preferences.")
    parser.add_argument("--eval_dataset_file", help="Optional evaluation data file.")
    parser.add_argument("--lora_r", type=int, default=0, help="Train a LoRA adapter of this rank (0: full fine-tuning).")
    add_config_arguments(parser, RewardConfig)
    cli = parser.parse_args(argv)
    overrides = config_overrides(cli)

    if cli.model is None:  # the embedded default: a tiny model built offline
        cli.model, overrides = embedded_default("reward", overrides)
    train = load_dataset_file(cli.dataset) if cli.dataset else embedded_rows("reward")
    evaluation = load_dataset_file(cli.eval_dataset_file, "--eval_dataset_file") if cli.eval_dataset_file else None

    peft_config = None
    if cli.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.lora_r, lora_alpha=2 * cli.lora_r, target_modules="all-linear",
                                 task_type="SEQ_CLS")
    trainer = RewardTrainer(model=cli.model, args=RewardConfig(**overrides), train_dataset=train,
                            eval_dataset=evaluation, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


if __name__ == "__main__":
    main()
