"""On-policy distillation on your student, your teacher and your prompts (docs/distillation.md).

    python examples/distillation.py                              # embedded default: tiny student and teacher
    python examples/distillation.py --model path/to/student --teacher_model_name_or_path path/to/teacher \\
        --dataset prompts.jsonl --beta 0.0
    python examples/distillation.py --model path/to/student --teacher_model_server_url http://localhost:8001 \\
        --loss_top_k 20 --dataset prompts.jsonl                  # a teacher served by `trainers vllm-serve`

    # several GPUs / ZeRO-3 (the teacher is partitioned with the student):
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/distillation.py --model PATH \\
        --teacher_model_name_or_path TEACHER --dataset prompts.jsonl

The dataset is a local .json/.jsonl/.parquet file with a "prompt" column (a string, or a list of {"role",
"content"} messages), and a "completion" column when --lmbda < 1 (some rounds train on it). The teacher needs the
student's vocabulary. Every DistillationConfig field is a flag (--help).
"""

import argparse
import os

from trainers import DistillationConfig, DistillationTrainer
from trainers.cli.argparsing import add_config_arguments, config_overrides
from trainers.cli.tiny import embedded_default, embedded_rows
from trainers.data.formats import load_dataset_file


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="The student: a folder or Hub id. Default: a tiny model built offline.")
    parser.add_argument("--dataset", help="Prompt file. Default: generated digit-reversal prompts.")
    parser.add_argument("--eval_dataset_file", help="Optional evaluation prompt file.")
    parser.add_argument("--lora_r", type=int, default=0, help="A LoRA adapter of this rank (0: full fine-tuning).")
    add_config_arguments(parser, DistillationConfig)
    cli = parser.parse_args(argv)
    overrides = config_overrides(cli)
    if cli.model is None:  # the embedded default: a random tiny student and a random, wider teacher
        cli.model, overrides = embedded_default("distill", overrides)
    train = load_dataset_file(cli.dataset) if cli.dataset else embedded_rows("distill")
    evaluation = load_dataset_file(cli.eval_dataset_file, "--eval_dataset_file") if cli.eval_dataset_file else None
    peft_config = None
    if cli.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.lora_r, lora_alpha=2 * cli.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    args = DistillationConfig(**overrides)
    trainer = DistillationTrainer(model=cli.model, teacher_model=args.teacher_model_name_or_path, args=args,
                                  train_dataset=train, eval_dataset=evaluation, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


if __name__ == "__main__":
    main()
