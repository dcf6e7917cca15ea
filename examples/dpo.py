"""Direct preference optimization of a causal LM on preference pairs.

With no --model it runs an embedded default that needs no network and no GPU: a tiny Qwen2 built offline learns
to prefer the reversal of a 5-digit string to a copy of it.

    python examples/dpo.py                                                   # embedded default, CPU
    python examples/dpo.py --model path/to/sft-model --dataset prefs.jsonl --output_dir out --beta 0.1
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/dpo.py --model PATH --dataset prefs.jsonl

The dataset is a local .json/.jsonl/.parquet/.csv file of preference rows (docs/dpo.md): "prompt", "chosen",
"rejected" (or "chosen" and "rejected" with the prompt implicit), as text or lists of messages. Every
DPOConfig field is a flag (--help).
"""

import argparse
import os

from trainers import DPOConfig, DPOTrainer
from trainers.data.formats import load_dataset_file
from trainers.cli.argparsing import add_config_arguments, config_overrides
from trainers.cli.tiny import embedded_default, embedded_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Model folder or Hub id. Default: a tiny model built offline.")
    parser.add_argument("--dataset", help="Preference data file. Default: generated digit-reversal preferences.")
    parser.add_argument("--eval_dataset_file", help="Optional evaluation data file.")
    parser.add_argument("--lora_r", type=int, default=0, help="Train a LoRA adapter of this rank (0: full fine-tuning; "
                                                               "the reference is then the model without it).")
    add_config_arguments(parser, DPOConfig)
    cli = parser.parse_args(argv)
    overrides = config_overrides(cli)

    if cli.model is None:  # the embedded default: a tiny model built offline
        cli.model, overrides = embedded_default("dpo", overrides)
    train = load_dataset_file(cli.dataset) if cli.dataset else embedded_rows("dpo")
    evaluation = load_dataset_file(cli.eval_dataset_file, "--eval_dataset_file") if cli.eval_dataset_file else None

    peft_config = None
    if cli.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.lora_r, lora_alpha=2 * cli.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=cli.model, args=DPOConfig(**overrides), train_dataset=train,
                         eval_dataset=evaluation, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


if __name__ == "__main__":
    main()
