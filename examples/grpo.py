"""GRPO on your model, your prompts and your reward functions.

    python examples/grpo.py                                        # embedded default: tiny model, digit reversal
    python examples/grpo.py --model path/to/model --dataset prompts.jsonl --reward_funcs accuracy format

    # one GPU / several GPUs (DDP) / ZeRO-3 for a model that does not fit on one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml examples/grpo.py --model PATH --dataset prompts.jsonl
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/grpo.py --model PATH --dataset prompts.jsonl
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/grpo.py --model PATH --dataset prompts.jsonl

The dataset is a local .json/.jsonl/.parquet file with a "prompt" column (a string, or a list of
{"role", "content"} messages); every other column reaches the reward functions as a keyword argument.
--reward_funcs takes built-in names (accuracy, format, overlong), module:function, or reward-model folders.
Every GRPOConfig field is a flag (--help).
"""

import argparse
import os

from trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trainers.data.formats import load_dataset_file
from trainers.cli.argparsing import add_config_arguments, config_overrides
from trainers.cli.tiny import embedded_default, embedded_rows


ALGORITHMS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}  # examples/rloo.py runs "rloo"


def main(argv=None, method="grpo", description=__doc__):
    config_class, trainer_class = ALGORITHMS[method]
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Model folder or Hub id. Default: a tiny model built offline.")
    parser.add_argument("--dataset", help="Prompt file. Default: generated digit-reversal prompts.")
    parser.add_argument("--eval_dataset_file", help="Optional evaluation prompt file.")
    parser.add_argument("--reward_funcs", nargs="+", default=["accuracy"],
                        help="Built-in names, module:function, or reward-model folders (default: accuracy).")
    parser.add_argument("--lora_r", type=int, default=0, help="Train a LoRA adapter of this rank (0: full fine-tuning).")
    add_config_arguments(parser, config_class)
    cli = parser.parse_args(argv)
    overrides = config_overrides(cli)

    if cli.model is None:  # the embedded default: a random tiny model, so expect a low (but working) reward
        cli.model, overrides = embedded_default(method, overrides)
    train = load_dataset_file(cli.dataset) if cli.dataset else embedded_rows(method)
    evaluation = load_dataset_file(cli.eval_dataset_file, "--eval_dataset_file") if cli.eval_dataset_file else None

    peft_config = None
    if cli.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.lora_r, lora_alpha=2 * cli.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = trainer_class(model=cli.model, reward_funcs=cli.reward_funcs, args=config_class(**overrides),
                            train_dataset=train, eval_dataset=evaluation, peft_config=peft_config)
    # --resume_from_checkpoint is a config field: 'true' (the newest checkpoint in output_dir) or a folder
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


if __name__ == "__main__":
    main()
