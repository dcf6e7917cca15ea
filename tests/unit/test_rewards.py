"""The reward-function contract, built-in rewards, reward models, and GRPO's process-aware group layout."""

import math

import pytest
import torch

from trainers.sampling.reward_functions import accuracy_reward, format_reward, soft_overlong_penalty
from trainers.sampling.rewards import Reward, RewardFunctionError, RewardLogs, call_rewards, resolve_reward
from trainers.data.samplers import group_slots

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "The answer is 4.", "7"]
IDS = [[50], [1, 2, 3], [55, 56]]


def call(func, columns=None, name="f"):
    return call_rewards([Reward(name, func)], PROMPTS, COMPLETIONS, IDS, columns or {})[:, 0]


def test_columns_arrive_as_keyword_arguments_and_none_becomes_nan():
    seen = {}

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(answer=answer, ids=completion_ids, state=kwargs.get("trainer_state"))
        return [1.0, None, 0.5]

    values = call_rewards([Reward("r", reward)], PROMPTS, COMPLETIONS, IDS, {"answer": ["2", "4", "6"]},
                          {"trainer_state": "STATE"})[:, 0]
    assert seen == {"answer": ["2", "4", "6"], "ids": IDS, "state": "STATE"}
    assert values[0].item() == 1.0 and math.isnan(values[1].item()) and values[2].item() == 0.5


def test_wrong_length_is_named():
    with pytest.raises(RewardFunctionError, match=r"'short' returned 2 rewards for 3 completions"):
        call(lambda **kw: [1.0, 2.0], name="short")


@pytest.mark.parametrize("bad", ["1.0", [1.0], float("nan")])
def test_non_numbers_are_named_with_the_sample(bad):
    with pytest.raises(RewardFunctionError, match=r"'odd' returned .* for sample 1"):
        call(lambda **kw: [0.0, bad, 0.0], name="odd")


def test_a_raising_function_is_named_with_the_failing_sample():
    def fragile(completions, **kwargs):
        return [1.0 / (len(c) - 1) for c in completions]  # divides by zero on "2" (sample 0)... and "7"

    with pytest.raises(RewardFunctionError, match=r"'fragile' raised ZeroDivisionError.*sample 0") as info:
        call(fragile, name="fragile")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_tensor_scalars_and_bools_are_accepted():
    assert call(lambda **kw: [torch.tensor(1.0), 2, 3.5]).tolist() == [1.0, 2.0, 3.5]
    assert call(lambda completions, **kw: [c == "2" for c in completions]).tolist() == [1.0, 0.0, 0.0]  # as TRL


def test_log_metric_and_log_extra_reach_the_logs():
    def judged(completions, log_metric, log_extra, **kwargs):
        log_metric("judge/calls", 3)
        log_metric("judge/calls", torch.tensor(5.0))
        log_extra("verdict", ["ok" if c == "2" else "no" for c in completions])
        return [1.0, 0.0, 0.0]

    logs = RewardLogs()
    call_rewards([Reward("judged", judged)], PROMPTS, COMPLETIONS, IDS, {}, logs=logs)
    assert logs.metrics == {"judge/calls": [3.0, 5.0]} and logs.extra == {"verdict": ["ok", "no", "no"]}


@pytest.mark.parametrize("misuse, message", [
    (lambda log_metric, log_extra: log_metric("x", "high"), r"log_metric\('x', 'high'\)"),
    (lambda log_metric, log_extra: log_extra("why", ["a"]), r"log_extra column 'why' got 1 values for 3"),
])
def test_misused_log_hooks_are_named(misuse, message):
    def reward(log_metric, log_extra, **kwargs):
        misuse(log_metric, log_extra)
        return [0.0, 0.0, 0.0]

    with pytest.raises(RewardFunctionError, match=message):
        call(reward)


def test_async_functions_run_concurrently_beside_sync_ones():
    import asyncio

    seen = {}

    async def waits(completions, **kwargs):  # finishes only once `signals` has run: they must run together
        seen["event"] = event = seen.get("event") or asyncio.Event()
        await asyncio.wait_for(event.wait(), timeout=10)
        return [1.0] * len(completions)

    async def signals(completions, **kwargs):
        await asyncio.sleep(0.01)
        seen["event"].set()
        return [2.0] * len(completions)

    rewards = [Reward("waits", waits), Reward("sync", lambda completions, **kw: [3.0] * len(completions)),
               Reward("signals", signals)]
    values = call_rewards(rewards, PROMPTS, COMPLETIONS, IDS, {})  # [3, 3]
    assert values.tolist() == [[1.0, 3.0, 2.0]] * 3

    async def inside_a_running_loop():  # as in Jupyter, where asyncio.run would refuse
        return call_rewards([Reward("signals", signals)], PROMPTS, COMPLETIONS, IDS, {})

    seen["event"] = asyncio.Event()
    assert asyncio.run(inside_a_running_loop()).tolist() == [[2.0]] * 3


def test_a_raising_async_function_is_named_with_the_failing_sample():
    async def fragile(completions, **kwargs):
        return [1.0 / (len(c) - 1) for c in completions]

    with pytest.raises(RewardFunctionError, match=r"'fragile' raised ZeroDivisionError.*sample 0"):
        call(fragile, name="fragile")


def test_accuracy_compares_numbers_and_strings():
    assert accuracy_reward(COMPLETIONS, answer=["2", "4", "6"]) == [1.0, 1.0, 0.0]
    assert accuracy_reward(["abc ", "abd"], answer=["abc", "abc"]) == [1.0, 0.0]
    assert accuracy_reward(["x", "y"], solution=[None, "y"]) == [None, 1.0]
    assert accuracy_reward([[{"role": "assistant", "content": "it is 12"}]], answer=[12]) == [1.0]
    with pytest.raises(RewardFunctionError, match="'answer'"):
        accuracy_reward(["1"])


def test_accuracy_finds_text_answers_in_boxed_and_answer_blocks():
    completions = ["<think>capital</think><answer> Paris </answer>", r"so \boxed{\text{no}} and \boxed{Paris}",
                   "It is Paris.", r"\boxed{Lyon}"]
    assert accuracy_reward(completions, answer=["Paris"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_accuracy_compares_latex_answers_like_trl():
    pytest.importorskip("math_verify")
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}"]  # TRL's docstring example
    completions = [[{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{3}}"}],
                   [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{2}}"}]]
    assert accuracy_reward(completions, solutions) == [1.0, 0.0]
    # equal values in other forms; the reference is read whole (TRL reads 2\sqrt{3} as 2)
    assert accuracy_reward([r"\boxed{\frac{2}{6}}", r"thus \boxed{\sqrt{12}}", r"\boxed{2}", "no answer"],
                           solution=[r"\frac{1}{3}", r"2\sqrt{3}", r"2\sqrt{3}", r"\pi"]) == [1.0, 1.0, 0.0, 0.0]
    # a reference that marks its own answer ($...$ or \boxed) is parsed as it stands
    marked = [r"The answer is $\frac{1}{3}$", r"\boxed{0.5}"]
    assert accuracy_reward([r"\boxed{\frac{1}{3}}"] * 2, solution=marked) == [1.0, 0.0]


def test_latex_answers_without_math_verify_are_an_error(monkeypatch):
    from trainers.sampling import reward_functions

    monkeypatch.setattr(reward_functions, "math_verify_missing", lambda: True)
    reward_functions.latex_checker.cache_clear()  # a checker built before would not look again
    assert accuracy_reward(["4"], answer=["4"]) == [1.0]  # numbers and text need no math_verify
    with pytest.raises(RewardFunctionError, match="math_verify, which is not installed: pip install math-verify"):
        accuracy_reward([r"\boxed{\frac{1}{3}}"], answer=[r"\frac{1}{3}"])


def test_format_reward():
    good = "<think>add them</think>\n<answer>4</answer>"
    assert format_reward([good, "4", "<answer>4</answer>"]) == [1.0, 0.0, 0.0]


def test_soft_overlong_penalty_by_hand():
    penalty = soft_overlong_penalty(max_completion_length=8, soft_cache_length=4)
    ids = [[0] * n for n in (3, 4, 5, 8, 9)]
    # free up to 4 tokens; then (4 - L) / 4; -1 beyond 8
    assert penalty(completion_ids=ids) == pytest.approx([0.0, 0.0, -0.25, -1.0, -1.0])


def test_resolve_names_modules_and_errors(tmp_path, monkeypatch):
    assert resolve_reward("accuracy", 8).func is accuracy_reward
    assert resolve_reward("overlong", 8).name == "overlong"
    module = tmp_path / "my_rewards.py"
    module.write_text("def longer(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = resolve_reward("my_rewards:longer", 8)
    assert reward.name == "longer" and reward.func(completions=["ab"]) == [2.0]
    with pytest.raises(RewardFunctionError, match="'nonsense'.*built-in"):
        resolve_reward("nonsense", 8)
    with pytest.raises(RewardFunctionError, match="could not be imported"):
        resolve_reward("my_rewards:missing", 8)
    with pytest.raises(RewardFunctionError, match="callables"):
        resolve_reward(42, 8)


def test_a_reward_model_scores_with_logit_zero(tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForSequenceClassification(config).eval()
    reward = resolve_reward(model, 8, processing_class=tokenizer)
    scores = reward.func(prompts=["ab", "c"], completions=["cd", "def"])
    with torch.no_grad():
        # read at the EOS appended to the text, where RewardTrainer trains the score
        expected = model(**tokenizer(["abcd" + tokenizer.eos_token], return_tensors="pt")).logits[0, 0].item()
    assert scores[0] == pytest.approx(expected, rel=1e-5)
    assert len(scores) == 2


def test_a_reward_model_renders_chats_with_the_chat_template_kwargs(tokenizer):
    import copy

    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = "{{ flavour }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForSequenceClassification(config).eval()
    reward = resolve_reward(model, 8, processing_class=tokenizer, chat_template_kwargs={"flavour": "xy"})
    score = reward.func(prompts=[[{"role": "user", "content": "ab"}]], completions=[[{"role": "assistant",
                                                                                       "content": "cd"}]])[0]
    with torch.no_grad():
        expected = model(**tokenizer(["xyabcd"], return_tensors="pt")).logits[0, 0].item()
    assert score == pytest.approx(expected, rel=1e-5)


def test_group_slots_layout_across_processes():
    prompts = [7, 3, 5]  # the round's prompts, identical on every process
    shares = [group_slots(prompts, 4, 2, p) for p in range(2)]
    assert shares == [[7, 7, 7, 7, 3, 3], [3, 3, 5, 5, 5, 5]]  # group of prompt 3 straddles the processes
    assert group_slots(prompts, 4, 1, 0) == shares[0] + shares[1]
    with pytest.raises(ValueError, match="evenly"):
        group_slots(prompts, 3, 2, 0)


def test_think_format_reward_is_trls():
    from trainers.sampling.reward_functions import think_format_reward

    completions = [[{"content": "<think>\nThis is my reasoning.\n</think>\nThis is my answer."}],
                   [{"content": "<think>\nThis is my reasoning.\nThis is my answer."}],
                   [{"content": "<think>a</think><think>b</think>"}], "<think>x</think> plain text"]
    assert think_format_reward(completions) == [1.0, 0.0, 0.0, 1.0]


def test_a_partial_is_named_after_its_function_as_in_trl():
    import functools

    def scaled(completions, scale, **kwargs):
        return [scale] * len(completions)

    assert resolve_reward(functools.partial(functools.partial(scaled, scale=2.0)), 8).name == "scaled"


def test_a_sample_no_function_scores_is_warned_about_in_trls_words(caplog):
    def first_only(completions, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    def never(completions, **kwargs):
        return [None] * len(completions)

    with caplog.at_level("WARNING", logger="trainers"):
        values = call_rewards([Reward("a", first_only), Reward("b", never)], PROMPTS, COMPLETIONS, IDS,
                              {"answer": ["2", "4", "6"]}, {"trainer_state": object()})
    assert values[0].tolist() == [1.0, pytest.approx(float("nan"), nan_ok=True)]
    assert torch.isnan(values[1:]).all()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["All reward functions returned None for the following kwargs:\n"
                        "{'answer': '4', 'prompt': '2+2=', 'completion': 'The answer is 4.'}\n"
                        "Please ensure that at least one reward function returns a valid reward."]
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainers"):
        call_rewards([Reward("a", first_only), Reward("b", lambda completions, **kw: [0.0] * 3)], PROMPTS,
                     COMPLETIONS, IDS, {})
    assert not caplog.records  # every sample has a score from some function
