"""Do the preference trainers learn? DPO and a reward model on the demo's arithmetic, in this project and TRL.

    python benchmarks/preference_learning.py                    # DPO ours and TRL, reward model ours and TRL,
                                                                # then GRPO with that reward model (~15 min)
    python benchmarks/preference_learning.py --skip_trl         # ours only

1. The demo's warm start (``examples/grpo_arithmetic.py``: tiny model, SFT until 45% on validation).
2. Preference pairs from it: for each problem, chosen = the right (reversed) sum, rejected = the first of the
   start model's own samples that is wrong (a digit changed at random when all of them are right). Training pairs
   from the training problems, held-out pairs from the 500 held-out problems. The reward model also gets four
   contrast pairs per training problem (a digit changed, added or dropped; another problem's answer).
3. DPO from the start in each framework with the same settings: held-out preference accuracy (the implicit reward
   ranks chosen above rejected: ``eval_rewards/accuracies``) and held-out greedy accuracy every ``--every`` steps.
4. A reward model on those pairs in each framework, from a stronger base (the start SFT'd ``--judge_steps`` more):
   held-out ranking accuracy (``eval_accuracy``).
5. GRPO from the start with our reward model as its only reward: held-out greedy accuracy before and after.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples")]

import grpo_arithmetic as demo  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

from trainers.cli.tiny import save_tiny_model  # noqa: E402
from trainers.generation.sampling import SamplingParams, hf_generate  # noqa: E402


def wrong_digit(answer: str, draw: random.Random) -> str:
    """The answer with one digit replaced by another."""
    at = draw.randrange(len(answer))
    return answer[:at] + draw.choice([d for d in "0123456789" if d != answer[at]]) + answer[at + 1:]


def preference_pairs(model, tokenizer, rows: list[dict], samples: int, seed: int) -> tuple[list[dict], int]:
    """chosen: the right answer; rejected: the model's first wrong sample, else one wrong digit. Returns the pairs
    and how many rejected answers are the model's own."""
    torch.manual_seed(seed)
    draw = random.Random(seed)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    drawn = []
    for _ in range(samples):
        outputs = hf_generate(model.eval(), prompts, SamplingParams(max_new_tokens=5, temperature=1.0),
                              tokenizer.pad_token_id, {tokenizer.eos_token_id})
        drawn.append([t.strip() for t in tokenizer.batch_decode(outputs, skip_special_tokens=True)])
    pairs, own = [], 0
    for index, row in enumerate(rows):
        wrong = [texts[index] for texts in drawn if texts[index] and texts[index] != row["answer"]]
        pairs.append({"prompt": row["prompt"], "chosen": row["answer"],
                      "rejected": wrong[0] if wrong else wrong_digit(row["answer"], draw)})
        own += bool(wrong)
    return pairs, own


def contrast_pairs(rows: list[dict], seed: int) -> list[dict]:
    """More pairs per problem for the reward model: the right answer over one with a digit changed, one with a
    digit added, one with its last digit dropped (a one-digit answer: another digit), and another problem's
    answer. Without them the reward model learned which answers look likely whatever the question: GRPO on it
    converged on answering "001" to everything, then on appending "11" to its answers."""
    draw = random.Random(seed)
    pairs = []
    for row in rows:
        answer = row["answer"]
        other = next(r["answer"] for r in iter(lambda: draw.choice(rows), None) if r["answer"] != answer)
        shorter = answer[:-1] if len(answer) > 1 else wrong_digit(answer, draw)
        for rejected in (wrong_digit(answer, draw), answer + draw.choice("0123456789"), shorter, other):
            pairs.append({"prompt": row["prompt"], "chosen": answer, "rejected": rejected})
    return pairs


class Curve(TrainerCallback):
    """At each evaluation: the step, the given eval metric, and (given ``held_out`` problems) the model's held-out
    greedy accuracy."""

    def __init__(self, tokenizer, held_out, metric: str):
        self.tokenizer, self.held_out, self.metric, self.points = tokenizer, held_out, metric, []

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        greedy = demo.greedy_accuracy(model, self.tokenizer, self.held_out) if self.held_out is not None else None
        self.points.append((state.global_step, metrics[self.metric], greedy))


def run_fields(cli, out: str, learning_rate: float, steps: int) -> dict:
    """What the DPO and reward-model runs share (the same names in TRL's configs): 32 pairs a step, a constant
    learning rate, evaluation every ``--every`` steps and at the start."""
    return {"output_dir": out, "per_device_train_batch_size": 32, "learning_rate": learning_rate,
            "lr_scheduler_type": "constant", "max_steps": steps, "logging_steps": 10, "eval_strategy": "steps",
            "eval_steps": cli.every, "eval_on_start": True, "per_device_eval_batch_size": 64,
            "save_strategy": "no", "bf16": False, "seed": cli.seed, "report_to": "none", "disable_tqdm": True}


def dpo_fields(cli, out: str) -> dict:
    return {**run_fields(cli, out, cli.dpo_learning_rate, cli.dpo_steps), "beta": cli.beta,
            "loss_type": cli.loss_type.split(","),
            "loss_weights": [float(w) for w in cli.loss_weights.split(",")] if cli.loss_weights else None}


def reward_fields(cli, out: str) -> dict:
    return run_fields(cli, out, cli.reward_learning_rate, cli.reward_steps)


def run_dpo(framework: str, cli, start: str, pairs, held_pairs, held_out, out: str) -> list[tuple]:
    tokenizer = AutoTokenizer.from_pretrained(start)
    curve = Curve(tokenizer, held_out, "eval_rewards/accuracies")
    model = AutoModelForCausalLM.from_pretrained(start)
    if framework == "ours":
        from trainers import DPOConfig, DPOTrainer

        DPOTrainer(model=model, processing_class=tokenizer, train_dataset=pairs, eval_dataset=held_pairs,
                   callbacks=[curve], args=DPOConfig(**dpo_fields(cli, out))).train()
    else:
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        DPOTrainer(model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(pairs),
                   eval_dataset=Dataset.from_list(held_pairs), callbacks=[curve],
                   args=DPOConfig(use_cpu=True, **dpo_fields(cli, out))).train()
    return curve.points


def judge_base(start: str, train: list[dict], validation: list[dict], steps: int, out: str) -> tuple[str, float]:
    """The reward model's base: the start SFT'd ``steps`` more (a stronger model than the policy, as a reward
    model usually is: one no better than the policy ranked its own samples ~80% right and GRPO on it lost
    accuracy). Returns its folder and greedy validation accuracy."""
    from trainers import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(start)
    trainer = SFTTrainer(model=start, processing_class=tokenizer, train_dataset=[
        {"prompt": r["prompt"], "completion": r["answer"]} for r in train], args=SFTConfig(
        output_dir=out, per_device_train_batch_size=64, learning_rate=1e-3, lr_scheduler_type="constant",
        max_steps=steps, save_strategy="no", logging_steps=steps, disable_tqdm=True, bf16=False, report_to="none"))
    trainer.train()
    trainer.save_model(out)
    return out, demo.greedy_accuracy(trainer.unwrapped_model, tokenizer, validation)


def run_reward(framework: str, cli, start: str, pairs, held_pairs, out: str) -> list[tuple]:
    tokenizer = AutoTokenizer.from_pretrained(start)
    curve = Curve(tokenizer, None, "eval_accuracy")
    if framework == "ours":
        from trainers import RewardConfig, RewardTrainer

        trainer = RewardTrainer(model=start, processing_class=tokenizer, train_dataset=pairs,
                                eval_dataset=held_pairs, callbacks=[curve],
                                args=RewardConfig(**reward_fields(cli, out)))
    else:
        from datasets import Dataset
        from trl import RewardConfig, RewardTrainer

        trainer = RewardTrainer(model=start, processing_class=tokenizer, train_dataset=Dataset.from_list(pairs),
                                eval_dataset=Dataset.from_list(held_pairs), callbacks=[curve],
                                args=RewardConfig(use_cpu=True, **reward_fields(cli, out)))
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return curve.points


def run_grpo_with_reward_model(cli, start: str, reward_model: str, train, held_out, out: str) -> list[tuple]:
    """GRPO from the start, its only reward the reward model's score: held-out greedy accuracy over the run."""
    from trainers import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(start)
    points = []

    class Greedy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % cli.every == 0:
                points.append((state.global_step, demo.greedy_accuracy(model, tokenizer, held_out)))

    fields = demo.grpo_settings(out, cli.grpo_learning_rate, cli.grpo_steps, seed=cli.seed)
    GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(start), processing_class=tokenizer,
                reward_funcs=reward_model, train_dataset=train, callbacks=[Greedy()],
                args=GRPOConfig(**{**fields, "disable_tqdm": True})).train()
    return points


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="The demo's --seed: which SFT start.")
    parser.add_argument("--pairs", type=int, default=9000, help="Training pairs (from the training problems).")
    parser.add_argument("--samples", type=int, default=4, help="Samples per problem to find a wrong answer.")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss_type", default="sigmoid,sft", help="DPO loss types, comma-separated (sigmoid alone: "
                                                                  "preference accuracy rose, greedy accuracy fell).")
    parser.add_argument("--loss_weights", help="Their weights, comma-separated (default: 1 each).")
    parser.add_argument("--dpo_steps", type=int, default=400)
    parser.add_argument("--dpo_learning_rate", type=float, default=1e-4)
    parser.add_argument("--judge_steps", type=int, default=900, help="SFT steps from the start to the reward "
                                                                       "model's base.")
    parser.add_argument("--reward_steps", type=int, default=3000)
    parser.add_argument("--reward_learning_rate", type=float, default=1e-4)
    parser.add_argument("--grpo_steps", type=int, default=800)
    parser.add_argument("--grpo_learning_rate", type=float, default=2e-4)
    parser.add_argument("--every", type=int, default=100, help="Evaluate every this many steps.")
    parser.add_argument("--skip_trl", action="store_true")
    parser.add_argument("--only", choices=["dpo", "reward"], help="Run one part (reward includes its GRPO run).")
    parser.add_argument("--json", help="Also write the results here.")
    parser.add_argument("--work", help="Keep the warm start (and the runs) in this folder and reuse its start.")
    cli = parser.parse_args()

    held_out, validation, train = demo.make_splits()
    frameworks = ["ours"] if cli.skip_trl else ["ours", "trl"]
    results = {"settings": vars(cli)}
    with tempfile.TemporaryDirectory() as temporary:
        work = cli.work or temporary
        start = os.path.join(work, "start")
        if os.path.isfile(os.path.join(start, "config.json")):
            model, tokenizer = AutoModelForCausalLM.from_pretrained(start), AutoTokenizer.from_pretrained(start)
        else:
            base = save_tiny_model(os.path.join(work, "base"), **demo.MODEL_SHAPE)
            model, tokenizer = demo.warm_up(base, train, validation, os.path.join(work, "sft"), 0.45, cli.seed)
            model.save_pretrained(start)
            tokenizer.save_pretrained(start)
        before = demo.greedy_accuracy(model, tokenizer, held_out)
        began = time.perf_counter()
        pairs, own = preference_pairs(model, tokenizer, train[:cli.pairs], cli.samples, cli.seed)
        held_pairs, _ = preference_pairs(model, tokenizer, held_out, cli.samples, cli.seed + 1)
        print(f"start (seed {cli.seed}): held-out greedy {before:.1%}; {len(pairs)} training pairs ({own} rejected "
              f"answers sampled, the rest one digit changed), {len(held_pairs)} held-out pairs "
              f"({time.perf_counter() - began:.0f} s)", flush=True)
        results["start_greedy"] = before

        if cli.only in (None, "dpo"):
            for framework in frameworks:
                began = time.perf_counter()
                points = run_dpo(framework, cli, start, pairs, held_pairs, held_out,
                                 os.path.join(work, "dpo-" + framework))
                results[f"dpo_{framework}"] = {"points": points, "seconds": time.perf_counter() - began}
                print(f"DPO {framework}: " + "  ".join(f"{s}: pref {p:.1%} greedy {g:.1%}" for s, p, g in points)
                      + f"  ({time.perf_counter() - began:.0f} s)", flush=True)
        if cli.only in (None, "reward"):
            began = time.perf_counter()
            judge, judged = judge_base(start, train, validation, cli.judge_steps, os.path.join(work, "judge"))
            results["judge_greedy_validation"] = judged
            print(f"reward model base: the start SFT'd {cli.judge_steps} steps more, greedy validation {judged:.1%} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
            reward_pairs = pairs + contrast_pairs(train[:cli.pairs], cli.seed)
            for framework in frameworks:
                began = time.perf_counter()
                out = os.path.join(work, "rm-" + framework)
                points = run_reward(framework, cli, judge, reward_pairs, held_pairs, out)
                results[f"reward_{framework}"] = {"points": [p[:2] for p in points],
                                                  "seconds": time.perf_counter() - began}
                print(f"reward model {framework}: " + "  ".join(f"{s}: {a:.1%}" for s, a, _ in points)
                      + f"  ({time.perf_counter() - began:.0f} s)", flush=True)
            began = time.perf_counter()
            points = run_grpo_with_reward_model(cli, start, os.path.join(work, "rm-ours", "final"), train, held_out,
                                                os.path.join(work, "grpo-rm"))
            results["grpo_reward_model"] = {"points": points, "seconds": time.perf_counter() - began}
            print(f"GRPO with the reward model: start {before:.1%}  " + "  ".join(f"{s}: {a:.1%}" for s, a in points)
                  + f"  ({time.perf_counter() - began:.0f} s)", flush=True)
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
