"""The generation backend interface without a model: a scripted backend registered by name and built from
explicit arguments, its lifetime (sample, sync_weights, close), the tool loop (trainers/agents/tool_loop.py) and
the sampling base's rollout stage (trainers/sampling/rollout.py) driven by it. Nothing here loads or runs a model."""

import json

import pytest
import torch
from accelerate import Accelerator

from trainers.agents.tool_loop import ToolCounts, ToolLoop, ToolOptions
from trainers.cli.tiny import build_tokenizer
from trainers.errors import ConfigError
from trainers.generation.backend import BACKENDS, BackendInputs, build_backend, register_backend
from trainers.generation.sampling import GenerationContext, Samples, SamplingParams
from trainers.sampling.advantages import ADVANTAGE_ESTIMATORS
from trainers.grpo.config import GRPOConfig
from trainers.sampling.rewards import Reward
from trainers.sampling.rollout import RolloutStage, RoundNeeds

END = "<|im_end|>"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedBackend:
    """A backend that needs no model: turn ``t`` of every row answers ``turns[t]`` (ended by the EOS, cut at the
    budget); it records its lifetime (``events``) and what it was asked (``asked``: each call's prompt ids)."""

    turns: list[str] = ["hello"]

    def __init__(self, inputs: BackendInputs):
        self.tokenizer, self.events, self.asked = inputs.tokenizer, [], []

    def sample(self, prompts, prompt_ids, params):
        turn = len(self.asked)
        self.asked.append([list(ids) for ids in prompt_ids])
        text = self.turns[min(turn, len(self.turns) - 1)] + END
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:params.max_new_tokens]
        self.events.append("sample")
        return Samples([list(p) for p in prompt_ids], [list(ids) for _ in prompt_ids])

    def sync_weights(self, step=None):
        self.events.append(f"sync {step}")

    def close(self):
        self.events.append("close")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tools=True)


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def inputs_for(tokenizer, accelerator, config=None) -> BackendInputs:
    context = GenerationContext(accelerator, tokenizer.pad_token_id, frozenset({tokenizer.eos_token_id}))
    return BackendInputs(context, policy=None, wrapped=None, tokenizer=tokenizer, config=config,
                         completions_per_round=4)


def test_a_backend_is_one_class_and_one_registration(tokenizer, accelerator):
    register_backend("scripted-unit", ScriptedBackend)
    backend = build_backend("scripted-unit", inputs_for(tokenizer, accelerator))
    assert isinstance(backend, ScriptedBackend) and "scripted-unit" in BACKENDS
    backend.sync_weights(0)
    out = backend.sample(["a"], [[1, 2]], SamplingParams(max_new_tokens=3))
    backend.close()
    assert out.completion_ids == [tokenizer("hel", add_special_tokens=False)["input_ids"]]  # cut at the budget
    assert backend.events == ["sync 0", "sample", "close"]


def test_an_unknown_backend_names_the_registered_ones(tokenizer, accelerator):
    with pytest.raises(ConfigError, match=r"generation_backend='nope' is not a registered backend.*'policy'"):
        build_backend("nope", inputs_for(tokenizer, accelerator))
    with pytest.raises(ValueError, match="non-empty string"):
        register_backend("", ScriptedBackend)


def test_the_tool_loop_over_a_scripted_backend(tokenizer, accelerator):
    """Turn 1 calls multiply; the loop runs it, appends the tool turn's tokens (masked out, NaN log-probs
    absent: the backend gives none) and samples turn 2 from prompt + turn 1 + tool turn, token in, token out."""
    class TwoTurns(ScriptedBackend):
        turns = [call("multiply", a=6, b=7), "It is 42."]

    loop = ToolLoop([multiply], None, ToolOptions(), tokenizer, reward_count=1)
    backend = TwoTurns(inputs_for(tokenizer, accelerator))
    rows = [{"prompt": [{"role": "user", "content": "What is 6 times 7?"}]}] * 2
    prompt_ids = [tokenizer.apply_chat_template(rows[0]["prompt"], tools=loop.schemas[None], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)] * 2
    try:
        episode = loop.run(backend, rows, prompt_ids, SamplingParams(max_new_tokens=200),
                           eos_ids={tokenizer.eos_token_id}, accelerator=accelerator)
    finally:
        loop.close()
    assert episode.counts == ToolCounts(rollouts=2, calls=2)
    assert backend.asked[0] == prompt_ids  # the dataset's prompt ids, not rendered again
    samples = episode.samples
    first = tokenizer(TwoTurns.turns[0] + END, add_special_tokens=False)["input_ids"]
    second = tokenizer(TwoTurns.turns[1] + END, add_special_tokens=False)["input_ids"]
    for row, (completion, mask) in enumerate(zip(samples.completion_ids, samples.model_mask)):
        tool_turn = completion[len(first):len(completion) - len(second)]
        assert completion[:len(first)] == first and completion[-len(second):] == second
        assert "42" in tokenizer.decode(tool_turn) and len(tool_turn) > 0
        assert mask == [1] * len(first) + [0] * len(tool_turn) + [1] * len(second)  # the tool's tokens: no loss
        assert backend.asked[1][row] == prompt_ids[row] + completion[:len(completion) - len(second)]
    assert samples.logprobs is None and samples.finished == [True, True]
    assert [m["role"] for m in episode.messages[0]] == ["assistant", "tool", "assistant"]
    assert episode.messages[0][1]["content"] == "42"

    # a budget that cuts the first turn: no call is run, and the rollouts did not finish (truncated)
    loop = ToolLoop([multiply], None, ToolOptions(), tokenizer, reward_count=1)
    try:
        cut = loop.run(TwoTurns(inputs_for(tokenizer, accelerator)), rows, prompt_ids,
                       SamplingParams(max_new_tokens=10), eos_ids={tokenizer.eos_token_id}, accelerator=accelerator)
    finally:
        loop.close()
    assert cut.counts == ToolCounts(rollouts=2) and cut.samples.finished == [False, False]
    assert [len(c) for c in cut.samples.completion_ids] == [10, 10]


def test_the_rollout_stage_over_a_scripted_backend(tokenizer, accelerator):
    """One round, rows to Rollout, without a model: with beta=0 and a round per optimizer step neither old nor
    reference log-probs are needed. The rewards differ within the group, so the advantages are group-relative."""
    args = GRPOConfig(output_dir="unused", num_generations=4, per_device_train_batch_size=4, max_completion_length=8)
    backend = ScriptedBackend(inputs_for(tokenizer, accelerator, args))
    counter = iter(range(100))
    rewards = [Reward("counter", lambda completions, **kw: [float(next(counter)) for _ in completions])]
    stage = RolloutStage(backend, None, rewards, torch.tensor([1.0]), scorer=None, args=args,
                         accelerator=accelerator, tokenizer=tokenizer, eos_ids={tokenizer.eos_token_id},
                         sampling=SamplingParams(max_new_tokens=8), needs=RoundNeeds(),
                         estimator=ADVANTAGE_ESTIMATORS["grpo"])
    rows = [{"prompt": "hi"}] * 4
    built = stage.build(rows, [[104, 105]] * 4, trainer_state=None)
    rollout = built.rollout
    assert built.sampled.samples.completion_ids[0] == tokenizer("hello" + END, add_special_tokens=False)["input_ids"]
    assert rollout.completion_ids.shape == (4, 6) and bool(rollout.loss_mask.all())
    assert rollout.advantages.tolist() == pytest.approx([-1.1619, -0.3873, 0.3873, 1.1619], abs=1e-4)
    assert rollout.old_logps is None and rollout.ref_logps is None
    assert built.metrics["reward"] == pytest.approx(1.5) and built.metrics["completions/clipped_ratio"] == 0.0


def test_a_stage_without_estimator_or_scorer_logs_rewards_and_leaves_advantages_at_zero(tokenizer, accelerator):
    """Distillation's stage: no advantage estimator, no log-prob scorer. The rewards (an environment's) are still
    scored and logged; the advantages stay 0 and no log-probs are computed."""
    args = GRPOConfig(output_dir="unused", num_generations=4, per_device_train_batch_size=4, max_completion_length=8)
    backend = ScriptedBackend(inputs_for(tokenizer, accelerator, args))
    rewards = [Reward("length", lambda completions, **kw: [float(i) for i in range(len(completions))])]
    stage = RolloutStage(backend, None, rewards, torch.tensor([2.0]), scorer=None, args=args,
                         accelerator=accelerator, tokenizer=tokenizer, eos_ids={tokenizer.eos_token_id},
                         sampling=SamplingParams(max_new_tokens=8), needs=RoundNeeds(), estimator=None)
    built = stage.build([{"prompt": "hi"}] * 4, [[104, 105]] * 4, trainer_state=None)
    assert built.rollout.advantages.tolist() == [0.0] * 4
    assert built.rollout.old_logps is None and built.rollout.ref_logps is None
    assert built.metrics["reward"] == pytest.approx(3.0)  # 2 x mean(0, 1, 2, 3)
    assert built.metrics["rewards/length/mean"] == pytest.approx(1.5)
    assert built.sampled.rewards_per_func[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
