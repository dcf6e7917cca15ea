"""The tool demo (examples/grpo_tools.py) learns: from its SFT warm start, which calls ``multiply`` on a minority of
samples, GRPO with ``tools=[multiply]`` and an exact-answer reward raises the reward and the call frequency of its
rounds, and the greedy held-out accuracy. The warm start is the one saved in tests/data/tool-warm-start (the demo's
warm-up at seed 0: docs/testing.md says why and how it was made); the warm-up's steps are checked below."""

import os

import pytest

from tests.conftest import TOOL_WARM_START, load_example


def load_demo():
    return load_example("grpo_tools")


@pytest.mark.slow
def test_the_tool_demo_learns_to_call_the_tool(tmp_path):
    """30 GRPO steps (~20 s), seed 0. With --seed 0 to 5 from this warm start (2 threads, AMD AVX2 host; the seed
    also draws the problems): the first step's call frequency 0-0.25, the last's 0.93-0.99; the reward from 0-0.19
    to 0.38-0.53 on the last two logged steps; greedy held-out accuracy from 0% to 61-89%, every problem calling.
    The bounds below hold for all six (docs/testing.md)."""
    before, after, logged = load_demo().main(["--output_dir", str(tmp_path), "--warm_start", TOOL_WARM_START,
                                              "--grpo_steps", "30", "--held_out", "64"])
    first, last = logged[0], logged[-1]
    # the warm-up leaves a minority of samples calling (--call_share 0.3); the reward comes from the calls
    assert first["tools/call_frequency"] < 0.5, first
    assert last["tools/call_frequency"] >= first["tools/call_frequency"] + 0.3, (first, last)
    # a step's reward is over 16 rollouts: the last two logged steps' mean (+0.28 at least over the seeds above)
    assert (logged[-1]["reward"] + logged[-2]["reward"]) / 2 >= first["reward"] + 0.2, logged
    # greedy: a guess before RL (the model cannot multiply in its head), a call and the right answer after
    assert before[1] < 0.5 and before[0] < 0.2, before
    assert after[1] > 0.8 and after[0] >= before[0] + 0.4, (before, after)
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


def test_the_warm_up_stops_at_its_target_or_says_it_was_not_reached(tmp_path, capsys):
    """The warm-up's two stages on a few problems: stage 1 stops once the model, made to call, answers the target
    share right (0: at its first check, step 2), stage 2 then trains its steps; a target it cannot reach within
    max_steps is an error naming --warmup_target."""
    demo = load_demo()
    held_out, validation, train = demo.make_splits(held_out=4, validation=4, train=32)
    tokenizer = demo.task_tokenizer(demo.sft_conversations(train, 0.5))
    from trainers.cli.tiny import save_tiny_model

    base = save_tiny_model(str(tmp_path / "base"), tokenizer=tokenizer, hidden_size=32, num_layers=1)
    model, _ = demo.warm_up(base, train, validation, str(tmp_path / "sft"), call_share=0.3, target=0.0, max_steps=4,
                            mix_steps=2, every=2)
    assert capsys.readouterr().out.count("validation accuracy when calling") == 1  # stopped at its first check
    assert model.config.vocab_size >= len(tokenizer)
    with pytest.raises(RuntimeError, match="--warmup_target"):
        demo.warm_up(base, train, validation, str(tmp_path / "sft2"), call_share=0.3, target=1.01, max_steps=2,
                     mix_steps=1, every=2)


def test_the_reward_reads_the_final_answer_of_a_tool_conversation():
    demo = load_demo()
    row = demo.make_splits(held_out=1, validation=0, train=0)[0][0]
    called = demo.transcript(row, calls_tool=True)[1:]  # the completion: call, tool result, answer
    guessed = [{"role": "assistant", "content": "The answer is 1."}]
    assert called[0]["tool_calls"] and called[1]["role"] == "tool"
    assert demo.exact_answer([called, guessed], [row["answer"]] * 2) == [1.0, 0.0]
