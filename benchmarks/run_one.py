"""One benchmark run in its own process, for ``benchmarks/compare_trl.py``: this project or TRL, SFT, GRPO, RLOO, DPO,
a reward model or KTO.

Prints one JSON line: per-step wall times (the first ``--warmup`` steps excluded by the caller), trained
non-padding tokens, the final loss, the seconds the trainer took to build (model loading; with vLLM colocate, the
engine's start-up), the process's peak RSS and, on a GPU, its name and PyTorch's peak
allocated GPU memory. Both frameworks use the GPU when one is visible.
"""

import argparse
import json
import random
import sys
import time

import torch

WORDS = ["alpha", "beta", "gamma", "delta", "tensor", "matrix", "reward", "policy", "token", "gradient", "the",
         "a", "of", "and", "model", "learns", "fast", "slow", "cat", "sat", "on", "mat", "step", "batch"]


def sentences(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def sft_rows(max_length: int, n: int = 512) -> list[dict]:
    """Texts of varied length (from ~max_length/8 to ~max_length tokens), so padding matters."""
    return [{"text": t} for t in sentences(n, max(2, max_length // 32), max(4, max_length // 5), seed=1)]


def grpo_rows(n: int = 64) -> list[dict]:
    return [{"prompt": t} for t in sentences(n, 4, 10, seed=2)]


def dpo_rows(max_length: int, n: int = 256) -> list[dict]:
    """Preference pairs: a prompt of 4-12 words, two completions of varied length (up to ~max_length/6 words)."""
    prompts = sentences(n, 4, 12, seed=3)
    chosen = sentences(n, 2, max(4, max_length // 6), seed=4)
    rejected = sentences(n, 2, max(4, max_length // 6), seed=5)
    return [{"prompt": p, "chosen": " " + c, "rejected": " " + r} for p, c, r in zip(prompts, chosen, rejected)]


def kto_rows(max_length: int, n: int = 256) -> list[dict]:
    """dpo_rows unpaired: each pair's chosen completion desirable, its rejected one not (alternating)."""
    return [{"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
            for row in dpo_rows(max_length, n // 2) for side in ("chosen", "rejected")]


def reward_len(completions, **kwargs):
    return [float(len(c)) / 100 for c in completions]


def reward_rare(completions, **kwargs):
    """1 when the completion contains "cil": about 1 in 8 completions of 64 tokens from the benchmark models do,
    so ~40% of groups of 8 score all 0 (zero std, advantage 0), as on a hard task where most attempts fail."""
    return [float("cil" in c) for c in completions]


REWARDS = {"len": reward_len, "rare": reward_rare}
SETUP = {}  # "started": before the trainer is built; "built": once it is (a colocated vLLM engine starts in between)


class StepClock:
    """Wall time of each optimizer step."""

    def __init__(self):
        self.times: list[float] = []
        self._last = None

    def tick(self):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def common_args(cli) -> dict:
    """Config fields both frameworks get; ``--extra`` overrides any of them."""
    return dict(output_dir=cli.out, max_steps=cli.steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                bf16=cli.bf16, report_to="none", gradient_checkpointing=False, seed=0)


def sft_args(cli) -> dict:
    return {**common_args(cli), "per_device_train_batch_size": cli.batch, "max_length": cli.max_length,
            "packing": cli.packing, "learning_rate": 1e-4, **cli.extra}


def grpo_args(cli) -> dict:
    """GRPO and RLOO (RLOO with its KL penalty at TRL's default, beta 0.05: a reference model in both)."""
    return {**common_args(cli), "per_device_train_batch_size": cli.batch, "num_generations": cli.num_generations,
            "max_completion_length": cli.completion_length, "learning_rate": 1e-6,
            "beta": 0.05 if cli.method == "rloo" else 0.0,
            "generation_kwargs": {"min_new_tokens": cli.completion_length}, **cli.extra}


PREFERENCE = {"dpo": ("DPOConfig", "DPOTrainer"), "reward": ("RewardConfig", "RewardTrainer"),
              "kto": ("KTOConfig", "KTOTrainer")}  # method -> the config and trainer names, in both frameworks


def preference_args(cli) -> dict:
    """DPO, a reward model and KTO: the batch of pairs (KTO: rows), max_length, learning rate 1e-5, and beta 0.1
    where the method has one."""
    beta = {} if cli.method == "reward" else {"beta": 0.1}
    return {**common_args(cli), "per_device_train_batch_size": cli.batch, "max_length": cli.max_length,
            "learning_rate": 1e-5, **beta, **cli.extra}


def lora_config(cli):
    """``--lora R``: the same LoRA adapters for both (rank R on every linear layer, alpha 2R), else None."""
    if not cli.lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=cli.lora, lora_alpha=2 * cli.lora, target_modules="all-linear", task_type="CAUSAL_LM")


def distill_args(cli) -> dict:
    """Distillation: a batch of prompts, one completion each forced to full length, TRL's beta (reverse KL); the
    teacher is the model itself (the time and memory of a teacher of the student's size)."""
    return {**common_args(cli), "per_device_train_batch_size": cli.batch,
            "max_completion_length": cli.completion_length, "learning_rate": 1e-6,
            "generation_kwargs": {"min_new_tokens": cli.completion_length}, **cli.extra}


def ours_grpo_args(cli) -> dict:
    """grpo_args with --ours_extra over it. With use_vllm, generation_kwargs are vLLM SamplingParams arguments
    (as in TRL): the full-length forcing is vLLM's min_tokens."""
    args = {**grpo_args(cli), **cli.ours_extra}
    if args.get("use_vllm") and "generation_kwargs" not in cli.ours_extra:
        args["generation_kwargs"] = {"min_tokens": cli.completion_length}
    return args


def run_ours(cli, rows):
    import trainers
    from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    if cli.method == "sft":
        trainer = SFTTrainer(model=cli.model, train_dataset=rows, peft_config=lora_config(cli),
                             args=SFTConfig(**sft_args(cli)))
    elif cli.method in PREFERENCE:
        config, trainer_class = (getattr(trainers, name) for name in PREFERENCE[cli.method])
        trainer = trainer_class(model=cli.model, train_dataset=rows, peft_config=lora_config(cli),
                                args=config(**preference_args(cli)))
    elif cli.method == "distill":
        trainer = trainers.DistillationTrainer(model=cli.model, teacher_model=cli.model, train_dataset=rows,
                                               peft_config=lora_config(cli),
                                               args=trainers.DistillationConfig(**{**distill_args(cli),
                                                                                   **cli.ours_extra}))
    else:
        config, trainer_class = (trainers.RLOOConfig, trainers.RLOOTrainer) if cli.method == "rloo" else \
            (GRPOConfig, GRPOTrainer)
        trainer = trainer_class(model=cli.model, reward_funcs=REWARDS[cli.reward], train_dataset=rows,
                                peft_config=lora_config(cli), args=config(**ours_grpo_args(cli)))
    SETUP["built"] = time.perf_counter()
    clock = StepClock()
    original = trainer.after_optimizer_step  # called once per step, right after the optimizer step
    trainer.after_optimizer_step = lambda metrics: (clock.tick(), original(metrics))[1]
    clock.tick()
    trainer.train()
    trainer.end()  # a vLLM engine (colocate) is shut down here, not left to the interpreter's exit
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return clock.times, logs[-1]["num_tokens"], logs[-1]["loss"], zero_std_share(logs)


def run_trl(cli, rows):
    from datasets import Dataset
    from transformers import TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            clock.tick()

        def on_step_end(self, *args, **kwargs):
            clock.tick()

    cpu = {"use_cpu": not torch.cuda.is_available()}
    if cli.method == "sft":
        trainer = SFTTrainer(model=cli.model, train_dataset=Dataset.from_list(rows), callbacks=[Clock()],
                             peft_config=lora_config(cli), args=SFTConfig(**sft_args(cli), **cpu))
    elif cli.method in PREFERENCE:
        config, trainer_class = (getattr(trl, name) for name in PREFERENCE[cli.method])
        trainer = trainer_class(model=cli.model, train_dataset=Dataset.from_list(rows), callbacks=[Clock()],
                                peft_config=lora_config(cli), args=config(**preference_args(cli), **cpu))
    elif cli.method == "distill":
        trainer = trl.DistillationTrainer(model=cli.model, teacher_model=cli.model,
                                          train_dataset=Dataset.from_list(rows), callbacks=[Clock()],
                                          peft_config=lora_config(cli),
                                          args=trl.DistillationConfig(**distill_args(cli), **cpu))
    else:
        config, trainer_class = (trl.RLOOConfig, trl.RLOOTrainer) if cli.method == "rloo" else (GRPOConfig, GRPOTrainer)
        trainer = trainer_class(model=cli.model, reward_funcs=REWARDS[cli.reward],
                                train_dataset=Dataset.from_list(rows), callbacks=[Clock()],
                                peft_config=lora_config(cli), args=config(**grpo_args(cli), **cpu))
    SETUP["built"] = time.perf_counter()
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return clock.times, logs[-1].get("num_tokens", float("nan")), logs[-1]["loss"], zero_std_share(logs)


def zero_std_share(logs: list[dict]) -> float | None:
    """GRPO: the mean over steps of frac_reward_zero_std (the share of groups whose advantages are all 0)."""
    shares = [r["frac_reward_zero_std"] for r in logs if "frac_reward_zero_std" in r]
    return sum(shares) / len(shares) if shares else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["ours", "trl"])
    parser.add_argument("method", choices=["sft", "grpo", "rloo", "distill", "dpo", "reward", "kto"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision for both frameworks.")
    parser.add_argument("--extra", type=json.loads, default={}, help="Extra config fields (JSON), for both.")
    parser.add_argument("--ours_extra", type=json.loads, default={}, help="Extra config fields (JSON), ours only.")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear layer, for both (0: none).")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="len", help="GRPO's reward function.")
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    rows = {"sft": lambda: sft_rows(cli.max_length), "dpo": lambda: dpo_rows(cli.max_length),
            "reward": lambda: dpo_rows(cli.max_length), "kto": lambda: kto_rows(cli.max_length)}.get(
        cli.method, grpo_rows)()
    SETUP["started"] = time.perf_counter()
    times, tokens, loss, zero_std = (run_ours if cli.framework == "ours" else run_trl)(cli, rows)
    from memory_probe import peak_rss_bytes

    result = {"step_times": times, "num_tokens": tokens, "loss": loss, "peak_mb": peak_rss_bytes() / 2**20,
              "frac_reward_zero_std": zero_std, "build_s": SETUP["built"] - SETUP["started"]}
    if torch.cuda.is_available():
        result.update(device=torch.cuda.get_device_name(0), peak_gpu_mb=torch.cuda.max_memory_allocated() / 2**20)
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
