"""The tool demo (examples/grpo_tools.py) learns: after an SFT warm-up that ends with the model calling
``multiply`` on a minority of problems, GRPO with ``tools=[multiply]`` and an exact-answer reward raises the reward
and the call frequency of its rounds, and the greedy held-out accuracy."""

import importlib.util
import os

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def load_demo():
    spec = importlib.util.spec_from_file_location("grpo_tools", os.path.join(REPO, "examples", "grpo_tools.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_demo_learns_to_call_the_tool(tmp_path):
    before, after, logged = load_demo().main(["--output_dir", str(tmp_path), "--grpo_steps", "20",
                                              "--held_out", "64"])
    first, last = logged[0], logged[-1]
    # the warm-up leaves a minority of samples calling (--call_share 0.3); the reward comes from the calls
    assert first["tools/call_frequency"] < 0.5, first
    assert last["tools/call_frequency"] >= first["tools/call_frequency"] + 0.3, (first, last)
    assert last["reward"] >= first["reward"] + 0.25, (first, last)
    # greedy: a guess before RL (the model cannot multiply in its head), a call and the right answer after
    assert before[1] < 0.5 and before[0] < 0.2, before
    assert after[1] > 0.8 and after[0] >= before[0] + 0.4, (before, after)
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


def test_the_reward_reads_the_final_answer_of_a_tool_conversation():
    demo = load_demo()
    row = demo.make_splits(held_out=1, validation=0, train=0)[0][0]
    called = demo.transcript(row, calls_tool=True)[1:]  # the completion: call, tool result, answer
    guessed = [{"role": "assistant", "content": "The answer is 1."}]
    assert called[0]["tool_calls"] and called[1]["role"] == "tool"
    assert demo.exact_answer([called, guessed], [row["answer"]] * 2) == [1.0, 0.0]
