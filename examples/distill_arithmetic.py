"""The distillation demo: a tiny student learns the GRPO demo's addition from a teacher that solves it, on its own
completions, in seconds on a laptop CPU.

    python examples/distill_arithmetic.py                    # about 2 minutes on 2 CPU cores, no network, no GPU
    python examples/distill_arithmetic.py --compare_grpo     # then GRPO from the same start, to the same mark
    python examples/distill_arithmetic.py --serve_teacher    # the teacher behind `trainers vllm-serve` (vLLM)
    python examples/distill_arithmetic.py --warm_start outputs/grpo-arithmetic/warm-start   # the GRPO demo's start

1. The GRPO demo's start (examples/grpo_arithmetic.py): a tiny Qwen2 (width 128, 4 layers) SFT'd until it is
   about half right on two-digit additions written least-significant digit first.
2. The teacher: the same start SFT'd further (--teacher_sft_steps), until it solves almost every held-out
   problem. With --teacher PATH an existing teacher is used instead.
3. On-policy distillation (DistillationTrainer): the student samples an answer to each prompt, the teacher
   scores every token of it, and the student minimizes the divergence between the two next-token
   distributions. No reward, no answers: only the teacher's distribution. Held-out greedy accuracy is measured
   every --eval_every steps; the run stops once the student reaches --mark x the teacher's accuracy.
4. With --compare_grpo: GRPO (the GRPO demo's settings, its exact-answer reward) from the same start, measured
   the same way, until the same mark. The times exclude the evaluations.

With --serve_teacher the teacher runs in a vLLM server this script starts (`trainers vllm-serve`), which returns
its top --loss_top_k log-probs at each position (the divergence is then over those tokens and the rest of the
vocabulary as one more outcome: docs/distillation.md). docs/distillation.md has the numbers.
"""

import argparse
import os
import sys
import time

import torch
from transformers import TrainerCallback

from trainers import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.cli.tiny import save_tiny_model
from trainers.generation.local_server import start_local_server

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_arithmetic as demo  # noqa: E402  (examples/grpo_arithmetic.py)


class Race(TrainerCallback):
    """Held-out greedy accuracy every ``every`` steps, against the training time without the evaluations; stops
    the run at ``mark``."""

    def __init__(self, held_out: list[dict], mark: float, every: int):
        self.held_out, self.mark, self.every = held_out, mark, every
        self.trainer, self.started, self.evaluating = None, 0.0, 0.0
        self.curve: list[tuple[int, float, float]] = []  # (step, seconds of training, accuracy)
        self.reached: tuple[int, float] | None = None  # (step, seconds) when the mark was first reached

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        began = time.perf_counter()
        accuracy = demo.greedy_accuracy(self.trainer.unwrapped_model, self.trainer.processing_class, self.held_out)
        self.evaluating += time.perf_counter() - began
        seconds = time.perf_counter() - self.started - self.evaluating
        self.curve.append((state.global_step, seconds, accuracy))
        print(f"   step {state.global_step:4d}: held-out accuracy {accuracy:.1%}  ({seconds:.1f} s of training)",
              flush=True)
        if accuracy >= self.mark and self.reached is None:
            self.reached = (state.global_step, seconds)
            control.should_training_stop = True


def race(trainer, held_out: list[dict], mark: float, every: int) -> Race:
    clock = Race(held_out, mark, every)
    clock.trainer = trainer
    trainer.add_callback(clock)
    trainer.train()
    return clock


def build_teacher(start: str, train: list[dict], output_dir: str, steps: int, seed: int) -> str:
    """The start SFT'd ``steps`` more steps (lr 1e-3, as the warm-up), saved to ``output_dir``."""
    rows = [{"prompt": r["prompt"], "completion": r["answer"]} for r in train]
    trainer = SFTTrainer(model=start, train_dataset=rows, args=SFTConfig(
        output_dir=output_dir, per_device_train_batch_size=64, learning_rate=1e-3, max_steps=steps,
        lr_scheduler_type="constant", save_strategy="no", logging_steps=steps, disable_tqdm=True, seed=seed,
        bf16=False, report_to="none"))
    trainer.train()
    trainer.save_model(output_dir)
    trainer.processing_class.save_pretrained(output_dir)
    return output_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/distill-arithmetic")
    parser.add_argument("--warm_start", help="The start, saved before (the GRPO demo's OUTPUT_DIR/warm-start, or this "
                                             "demo's OUTPUT_DIR/start): no SFT warm-up.")
    parser.add_argument("--teacher", help="An existing teacher (a folder); default: built from the start.")
    parser.add_argument("--teacher_sft_steps", type=int, default=1500, help="SFT steps that make the teacher.")
    parser.add_argument("--mark", type=float, default=0.8, help="Stop at this fraction of the teacher's accuracy.")
    parser.add_argument("--max_steps", type=int, default=400)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--beta", type=float, default=1.0, help="DistillationConfig.beta (1: reverse KL, TRL's).")
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--compare_grpo", action="store_true", help="Then GRPO from the same start, to the mark.")
    parser.add_argument("--serve_teacher", action="store_true", help="The teacher behind a vLLM server.")
    parser.add_argument("--loss_top_k", type=int, default=20, help="With --serve_teacher: the teacher's top-k.")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args(argv)
    started = time.time()
    held_out, validation, train = demo.make_splits()
    os.makedirs(cli.output_dir, exist_ok=True)

    if cli.warm_start:
        print(f"1. the GRPO demo's start, from {cli.warm_start}", flush=True)
        start = cli.warm_start
        model, tokenizer = demo.load_warm_start(start)
    else:
        print("1. the GRPO demo's start: a tiny model, SFT warm-up", flush=True)
        base = save_tiny_model(os.path.join(cli.output_dir, "base-model"), **demo.MODEL_SHAPE)
        model, tokenizer = demo.warm_up(base, train, validation, os.path.join(cli.output_dir, "sft"), 0.45, cli.seed)
        start = demo.save_warm_start(model, tokenizer, os.path.join(cli.output_dir, "start"))
    before = demo.greedy_accuracy(model, tokenizer, held_out)
    print(f"   student's held-out accuracy: {before:.1%}  ({time.time() - started:.0f} s)", flush=True)

    teacher = cli.teacher
    if teacher is None:
        print(f"2. the teacher: the start SFT'd {cli.teacher_sft_steps} more steps", flush=True)
        teacher = build_teacher(start, train, os.path.join(cli.output_dir, "teacher"), cli.teacher_sft_steps,
                                cli.seed)
    from transformers import AutoModelForCausalLM

    teacher_accuracy = demo.greedy_accuracy(AutoModelForCausalLM.from_pretrained(teacher), tokenizer, held_out)
    mark = cli.mark * teacher_accuracy
    print(f"   teacher's held-out accuracy: {teacher_accuracy:.1%}; the mark: {mark:.1%}  "
          f"({time.time() - started:.0f} s)", flush=True)

    server, served, threads = None, {}, torch.get_num_threads()
    if cli.serve_teacher:
        # the server takes a core of its own: with 2 cores, a trainer on both stalls it (docs/distillation.md);
        # it gets token ids only, so it needs no tokenizer
        server = start_local_server(teacher, os.path.join(cli.output_dir, "teacher-server.log"), max_model_len=64,
                                   extra=("--skip-tokenizer-init",))
        print(f"   teacher served at {server.url} (started in {server.startup_seconds:.0f} s)", flush=True)
        served = {"teacher_model_server_url": server.url, "loss_top_k": cli.loss_top_k}
        torch.set_num_threads(max(1, threads - 1))
    try:
        print("3. on-policy distillation" + (f" (the teacher served, top-{cli.loss_top_k})" if server else ""),
              flush=True)
        args = DistillationConfig(
            output_dir=os.path.join(cli.output_dir, "distill"), per_device_train_batch_size=64,
            max_completion_length=5, learning_rate=cli.learning_rate, lr_scheduler_type="cosine",
            max_steps=cli.max_steps, beta=cli.beta, logging_steps=cli.eval_every, save_strategy="no",
            disable_tqdm=True, bf16=False, seed=cli.seed, report_to="none", **served)
        trainer = DistillationTrainer(model=start, teacher_model=None if server else teacher, args=args,
                                      train_dataset=train)
        distilled = race(trainer, held_out, mark, cli.eval_every)
        trainer.save_model(os.path.join(cli.output_dir, "final"))
    finally:
        if server is not None:
            server.stop()
            torch.set_num_threads(threads)
    results = {"before": before, "teacher": teacher_accuracy, "mark": mark, "distillation": distilled.reached,
               "distillation_curve": distilled.curve}
    if cli.compare_grpo:
        print("4. GRPO from the same start (the GRPO demo's settings), to the same mark", flush=True)
        settings = demo.grpo_settings(os.path.join(cli.output_dir, "grpo"), seed=cli.seed)
        trainer = GRPOTrainer(model=start, reward_funcs=demo.exact_answer, train_dataset=train,
                              args=GRPOConfig(**{**settings, "disable_tqdm": True}))
        grpo = race(trainer, held_out, mark, cli.eval_every)
        results.update(grpo=grpo.reached, grpo_curve=grpo.curve)

    def reached(run):
        return f"step {run[0]}, {run[1]:.1f} s of training" if run else "not reached"

    print(f"\nheld-out greedy accuracy: student {before:.1%}, teacher {teacher_accuracy:.1%}; mark {mark:.1%}")
    print(f"distillation reached it at {reached(distilled.reached)} (best {max(a for *_, a in distilled.curve):.1%})")
    if cli.compare_grpo:
        print(f"GRPO reached it at {reached(results['grpo'])}")
    print(f"total time {time.time() - started:.0f} s")
    return results


if __name__ == "__main__":
    main()
