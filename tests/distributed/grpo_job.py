"""A short GRPO job launched by tests/distributed with 2 processes; writes a JSON report per run and rank.

argv: model_dir output_dir RUN [RUN ...]
Each RUN (a name in RUNS) trains a trainer of its own, one after the other in the same processes (one launch for
all the variants a test file compares), and writes output_dir/RUN/report-<rank>.json.
Layout: per-device 2 completions, num_generations 4, 2 processes, 1 step per generation: each round has one
prompt whose group of 4 is split 2 + 2 across the processes.
"""

import json
import os
import random
import sys

import torch

from trainers import GRPOConfig, GRPOTrainer
from trainers.parallel.distributed import gathered_parameters, zero_stage
from trainers.sampling.rewards import RewardLogs
from trainers.sampling.rollout import decode
from trainers.sampling.scoring import LogProbScorer
from trainers.generation.sampling import Samples
from trainers.data.samplers import group_slots

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest
from tests.conftest import MicroBatches, Rounds  # noqa: E402
from tests.conftest import digits_varied as digits  # noqa: E402


def logs_per_rank(completions, log_metric, **kwargs):
    """Scores 0 and logs what only its own process knows: 'rank' (0 or 1), and on rank 1 alone 'only_rank_1' = 7
    (a name one process never logs must not leave the other waiting)."""
    rank = int(os.environ.get("RANK", "0"))
    log_metric("rank", float(rank))
    if rank == 1:
        log_metric("only_rank_1", 7.0)
    return [0.0] * len(completions)


def idle_on_rank_0(prompts, completions, **kwargs):
    """GRPO_JOB_SKIP: every completion of "abc" scores 0.5 (the whole group has advantage 0); otherwise rank 0's
    two score 0.5 and rank 1's 0 and 1, so rank 0's rows have advantage 0 (their group's mean) and rank 1's not."""
    if prompts[0] == "abc" or os.environ.get("RANK", "0") == "0":
        return [0.5] * len(completions)
    return [float(i % 2) for i in range(len(completions))]


def ragged_by_rank(prompts, trainer):
    """GRPO_JOB_TOKEN_BUDGET's rollout function: on rank 0 each completion is the EOS alone, on rank 1 six random
    digits or letters, so rank 1's rows need more micro-batches of a token budget than rank 0's."""
    tokenizer, rank = trainer.processing_class, trainer.accelerator.process_index
    draw = random.Random(rank * 100 + trainer.state.global_step)
    completions = [[tokenizer.eos_token_id] if rank == 0 else
                   tokenizer("".join(draw.choice("0123456789abcdef") for _ in range(6)))["input_ids"] for _ in prompts]
    return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": completions,
            "logprobs": None}


RUNS = {  # name -> what it changes from the plain run
    "plain": {},
    "rollout_func": {"rollout_func": True},  # sampling through a rollout function (made-up sampler log-probs)
    "one_forward": {"one_forward_per_row": True},  # the straightforward path, for comparison
    "checkpointing": {"checkpointing": True},
    "checkpointing_one_forward": {"checkpointing": True, "one_forward_per_row": True},
    "skip": {"skip": True},  # skip_zero_gradient_rows, with rewards that leave rank 0's rows at advantage 0
    "every": {"skip": False},  # the same rewards, every row trained
    "entropy": {"top_entropy_quantile": 0.25},
    "sync_ref": {"sync_ref": True},  # the reference moves halfway to the policy after the last step
    "budget": {"token_budget": 11},  # padding-free, 4 rows per step and process, ragged completions
    "rows": {"token_budget": "none"},  # the same, in micro-batches of rows
}


def run(model_dir: str, output_dir: str, one_forward_per_row=False, checkpointing=False, top_entropy_quantile=None,
        sync_ref=False, skip=None, rollout_func=False, token_budget=None) -> None:
    rows = [{"prompt": p} for p in ["abc", "hello", "xyz", "12"]]
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=2, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, max_steps=3, logging_steps=1, save_strategy="no",
                      disable_tqdm=True, seed=0, bf16=False, beta=0.05, gradient_checkpointing=checkpointing)
    shared_forwards = []  # whether each shared prompt forward did share (None: it declined)
    masks = []  # top_entropy_quantile: each micro-batch's loss-token entropies and which were kept
    forwards = []  # skip (True or False: skip_zero_gradient_rows): (rows, with gradient) of each forward

    class Scorer(LogProbScorer):  # the trainer's scorer, recording what it forwards (scorer_class)
        def shared_forward(self, *call_args, **kwargs):
            out = super().shared_forward(*call_args, **kwargs)
            shared_forwards.append(out is not None)
            return out

        def policy_logprobs(self, model, rows, **options):
            if skip is not None:
                forwards.append([rows.completion_ids.shape[0], torch.is_grad_enabled()])
            return super().policy_logprobs(model, rows, **options)

    if one_forward_per_row:
        Scorer.shares_prompt_forward = False

    class Trainer(GRPOTrainer):
        scorer_class = Scorer

        def high_entropy_tokens(self, entropy, mask):
            kept = super().high_entropy_tokens(entropy, mask)
            masks.append({"entropy": entropy[mask.bool()].tolist(), "kept": kept[mask.bool()].tolist()})
            return kept

    if top_entropy_quantile is not None:
        args.top_entropy_quantile = top_entropy_quantile
    if sync_ref:
        args.sync_ref_model, args.ref_model_sync_steps, args.ref_model_mixup_alpha = True, args.max_steps, 0.5
    reward = digits
    if skip is not None:
        args.beta, args.skip_zero_gradient_rows, reward = 0.0, skip, idle_on_rank_0
    rollout_prompts = []  # rollout_func: what each call of the rollout function was given

    def rollout(prompts, trainer):
        """The trainer's own sampling (under ZeRO-3, generate gathers the weights: every process calls it), with
        made-up sampler log-probs on process 1 and none on process 0, so the trainer's comparison and sampler
        correction run their collectives with one process that has nothing to count."""
        rollout_prompts.append(prompts)
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        completions = trainer.generate(prompt_ids)
        logprobs = [[0.0] * len(c) for c in completions] if trainer.accelerator.process_index == 1 else None
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}

    sampler = rollout if rollout_func else None
    micro_batches = MicroBatches()
    if token_budget is not None:  # "none" or a budget; padding-free, 4 rows per step and process
        args.padding_free, args.gradient_accumulation_steps = True, 2
        args.token_budget = None if token_budget == "none" else int(token_budget)
        sampler = ragged_by_rank
    trainer = Trainer(model=model_dir, reward_funcs=[reward, logs_per_rank], args=args, train_dataset=rows,
                      rollout_func=sampler, callbacks=[micro_batches])
    report = train_and_report(trainer, args, token_budget is not None)
    report.update(masks=masks, rollout_prompts=rollout_prompts, forwards=forwards, shared_forwards=shared_forwards,
                  micro_batches=micro_batches.per_step)
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)


def train_and_report(trainer, args, ragged: bool) -> dict:
    forward_tokens = []  # token_budget: the tokens of each forward with gradients (one packed row)

    def record(module, call_args, kwargs):
        if torch.is_grad_enabled():
            forward_tokens.append(kwargs["input_ids"].numel())

    hook = trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    acc = trainer.accelerator
    reference = getattr(trainer.ref_model, "module", trainer.ref_model)

    def reference_checksum():
        with gathered_parameters(acc, reference):
            return [float(p.detach().double().sum()) for p in reference.parameters()]

    reference_before = reference_checksum() if reference is not None else None  # beta > 0 only
    with gathered_parameters(acc, trainer.model):
        initial = [float(p.detach().double().sum()) for p in trainer.model.parameters()]

    rounds = Rounds()  # what each process holds of round 0 (the first on_rollout_end), recorded as it trains
    trainer.add_callback(rounds)
    trainer.train()
    hook.remove()
    round_report = None
    if not ragged:
        slots = group_slots(trainer.prompt_sampler.batch(0), args.num_generations, acc.num_processes,
                            acc.process_index)
        batch = rounds.rollouts[0].micro_batch(0, args.per_device_train_batch_size)
        rows_of_round = [trainer.train_rows[i] for i in slots]
        completion_ids = [ids[m.bool()].tolist()
                          for ids, m in zip(batch.completion_ids, batch.completion_attention)]
        prompts, completions = decode(trainer.processing_class, rows_of_round, completion_ids)
        local_rewards = trainer.stage.score_completions(
            rows_of_round, prompts, completions, Samples(prompt_ids=[], completion_ids=completion_ids), RewardLogs(),
            trainer.state)
        round_report = {"slots": slots, "completions": batch.completion_ids.tolist(),
                        "rewards": local_rewards[:, 0].tolist(), "advantages": batch.advantages.tolist()}
    with gathered_parameters(acc, trainer.model):
        checksum = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    return {"rank": acc.process_index, "num_processes": acc.num_processes, "zero_stage": zero_stage(acc),
            "shares_prompt_forward": trainer.shares_prompt_forward,
            "skips_zero_gradient_rows": trainer.skips_zero_gradient_rows,
            "broadcast_buffers": getattr(trainer.model_wrapped, "broadcast_buffers", None),
            "round": round_report, "checksum": checksum,
            "history": [r for r in trainer.state.log_history if "train_runtime" not in r],  # not train()'s summary
            "reference_before": reference_before,
            "reference_after": reference_checksum() if reference is not None else None, "initial": initial,
            "forward_tokens": forward_tokens}


def main():
    model_dir, output_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    for name in names:
        os.makedirs(os.path.join(output_dir, name), exist_ok=True)
        run(model_dir, os.path.join(output_dir, name), **RUNS[name])


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
