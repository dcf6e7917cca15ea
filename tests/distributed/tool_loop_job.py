"""GRPO with tools, launched by tests/distributed/test_tool_loop_distributed.py with 2 processes; writes a JSON
report per rank.

argv: model_dir output_dir mode
  train: 3 steps; each process's first turns are scripted (an untrained tiny model never writes a tool call), and
         differ by process: process 0 makes 3 calls (1 fails), process 1 makes 2 calls (1 fails) and 1 malformed
         block, so each process alone would log other tools/* values than the two together. The real sampler
         writes every turn after the first (under ZeRO-3 every process samples together, gathering the weights),
         except that process 0's first rollout calls multiply once more on its second turn: its third turn is
         then sampled while process 1, with nothing left, samples its dummy row.
  fail_reset: an environment_factory whose reset raises on process 1 only, in the first round.
"""

import dataclasses
import json
import os
import sys

import torch
from transformers import TrainerCallback

from trainers import GRPOConfig, GRPOTrainer
from trainers.parallel.distributed import gathered_parameters, zero_stage
from trainers.generation.backend import PolicyBackend, register_backend
from trainers.generation.sampling import Samples
from trainers.cli.tiny import build_tokenizer

END = "<|im_end|>"


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def explode() -> str:
    """A tool that always fails."""
    raise ValueError("boom")


FIRST_TURNS = {  # per process, per row of its 4
    0: [call("multiply", a=3, b=7), call("multiply", a=11, b=7), call("divide", a=1, b=2), "no call"],
    1: [call("multiply", a=5, b=7), '<tool_call>\n{"name": multiply}\n</tool_call>', call("explode"), "no call"],
}
SECOND_TURN = call("multiply", a=21, b=2)  # process 0, row 0


class Scripted(PolicyBackend):
    """A backend (registered, chosen with generation_backend): the first turn of each round from FIRST_TURNS, every
    later turn from the policy (which every process samples together), but for SECOND_TURN on process 0. The turn
    is counted per round (reset when an episode ends: ``start_round``), not read from the ids: a process with
    nothing left to sample still calls the backend with a dummy row (its first prompt), and must then take the
    same path as the others."""

    def __init__(self, inputs):
        super().__init__(inputs)
        self.tokenizer, self.rank, self.turn = inputs.tokenizer, inputs.context.accelerator.process_index, 0

    def start_round(self):
        self.turn = 0

    def sample(self, prompts, prompt_ids, params):
        self.turn += 1
        if self.turn > 1:
            samples = super().sample(prompts, prompt_ids, params)
            if self.turn == 2 and self.rank == 0:  # the first of the rollouts that called a tool: row 0
                completions = [self.encode(SECOND_TURN, params)] + samples.completion_ids[1:]
                samples = dataclasses.replace(samples, completion_ids=completions)
            return samples
        return Samples(prompt_ids, [self.encode(FIRST_TURNS[self.rank][j % 4], params) for j in range(len(prompt_ids))])

    def encode(self, text: str, params) -> list[int]:
        return self.tokenizer(text + END, add_special_tokens=False)["input_ids"][:params.max_new_tokens]


def reward(completions, **kwargs):
    """Deterministic: characters of the tool results and of the last turn (the real sampler's), scaled."""
    return [sum(len(m["content"]) for m in c if m["role"] == "tool") / 10 + len(c[-1]["content"]) / 100
            for c in completions]


class FailingReset:
    """An environment whose reset fails on process 1 (the user's bug in one process's tool code)."""

    def reset(self, **row) -> str:
        if int(os.environ.get("RANK", "0")) == 1:
            raise RuntimeError("the environment failed on purpose (rank 1)")
        return " Go."

    def noop(self) -> str:
        """Does nothing."""
        return "ok"


def main():
    model_dir, output_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} times 7?"}]} for i in range(4)]
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=320, learning_rate=1e-2, max_steps=3, logging_steps=1,
                      save_strategy="no", disable_tqdm=True, seed=0, bf16=False, report_to="none")
    tools = {"tools": [multiply, explode]} if mode == "train" else {"environment_factory": FailingReset}
    # the tiny model's byte-level vocabulary, with the chat template that renders tools
    counts = []

    class Episodes(TrainerCallback):
        def on_episode_end(self, args, state, control, episode=None, **kwargs):
            counts.append(dataclasses.asdict(episode.counts))
            trainer.backend.start_round()

    register_backend("scripted", Scripted)
    args.generation_backend = "scripted"
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=rows,
                          processing_class=build_tokenizer(tools=True), callbacks=[Episodes()], **tools)
    acc = trainer.accelerator
    with gathered_parameters(acc, trainer.model):
        initial = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    trainer.train()
    with gathered_parameters(acc, trainer.model):
        checksum = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    report = {"rank": acc.process_index, "num_processes": acc.num_processes, "zero_stage": zero_stage(acc),
              "counts": counts, "initial": initial, "checksum": checksum,
              "history": [r for r in trainer.state.log_history if "train_runtime" not in r]}
    with open(os.path.join(output_dir, f"report-{acc.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
