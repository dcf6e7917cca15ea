"""The tool-calling core of agentic GRPO (trainers/agents/) and the tiny tokenizers' tool template: parsing what
the model wrote, running calls concurrently with errors and timeouts as results, the template checks, and
environments. No model, no trainer: each test runs in well under a second (the concurrency ones in about 0.5 s)."""

import asyncio
import functools
import threading
import time

import pytest

from trainers.agents.environments import Environments
from trainers.agents.parsing import ToolCall, parse_turn
from trainers.agents.rendering import check_tool_template, tool_schemas, tool_turn_ids, toolbox
from trainers.agents.runner import ToolResult, ToolRunner
from trainers.errors import ConfigError, DatasetFormatError
from trainers.cli.tiny import CHATML_TEMPLATE, TOOLS_RESPONSE_TEMPLATE, build_bpe_tokenizer, build_tokenizer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tools=True)


@pytest.fixture(scope="module")
def hermes_tok():
    """The same template without the response template: the text parser's path."""
    tokenizer = build_tokenizer(tools=True)
    tokenizer.response_template = None
    return tokenizer


def call_message(*calls):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}


# ----------------------------------------------------------------------------------------------------------------
# The template
# ----------------------------------------------------------------------------------------------------------------


def test_the_template_renders_tools_and_a_tool_round_trip(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*4?"},
                call_message(("multiply", {"a": 3, "b": 4})),
                {"role": "assistant", "content": "ok", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
                {"role": "tool", "name": "multiply", "content": "12"}, {"role": "tool", "name": "add", "content": "3"},
                {"role": "assistant", "content": "12"}]
    text = tok.apply_chat_template(messages, tools=tool_schemas([multiply]), tokenize=False,
                                   add_generation_prompt=True)
    schema = ('{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.", '
              '"parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first '
              'integer."}, "b": {"type": "integer", "description": "The second integer."}}, "required": ["a", "b"]}, '
              '"return": {"type": "integer"}}}')
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n" + schema + "\n</tools>\n"
        'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n3*4?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>assistant\nok<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n12<|im_end|>\n<|im_start|>assistant\n")
    # without tools it is plain ChatML, a system message included
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.apply_chat_template(plain, tokenize=False) == \
        build_tokenizer().apply_chat_template(plain, tokenize=False)
    assert tok.apply_chat_template(plain[1:], tools=[multiply], tokenize=False).startswith(
        "<|im_start|>system\n# Tools\n<tools>\n")


@pytest.mark.parametrize("build", [build_tokenizer, functools.partial(build_bpe_tokenizer, vocab_size=600)])
def test_the_template_is_prefix_preserving_and_passes_the_check(build):
    tokenizer = build(tools=True)
    check_tool_template(tokenizer, None)
    exchange = [{"role": "user", "content": "3*4?"}, call_message(("multiply", {"a": 3, "b": 4}))]
    head = tokenizer.apply_chat_template(exchange, tokenize=True, return_dict=False)
    head = head[:len(head) - head[::-1].index(tokenizer.eos_token_id)]  # trimmed after its last EOS
    whole = tokenizer.apply_chat_template(exchange + [{"role": "tool", "name": "multiply", "content": "12"}],
                                          tokenize=True, return_dict=False, add_generation_prompt=True)
    assert whole[:len(head)] == head
    suffix = tool_turn_ids(tokenizer, [ToolResult("multiply", "12", False)], None)
    assert suffix == whole[len(head):]
    assert tokenizer.decode(suffix) == \
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_tool_turn_ids_of_several_results(tok):
    ids = tool_turn_ids(tok, [ToolResult("multiply", "12", False), ToolResult("add", "{'error': 'x'}", True)], {})
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n"
                               "{'error': 'x'}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_build_tokenizer_defaults_are_unchanged():
    assert build_tokenizer().chat_template == CHATML_TEMPLATE
    assert getattr(build_tokenizer(), "response_template", None) is None
    assert build_tokenizer(chat_template=False).chat_template is None


def test_the_response_template_survives_save_pretrained(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.response_template == TOOLS_RESPONSE_TEMPLATE
    assert loaded.chat_template == tok.chat_template
    prefix = loaded.apply_chat_template([{"role": "user", "content": "3*4?"}], tokenize=True, return_dict=False,
                                        add_generation_prompt=True)
    completion = loaded('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
                        add_special_tokens=False)["input_ids"]
    assert loaded.parse_response(completion, prefix=prefix) == \
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "multiply",
                                                                               "arguments": {"a": 3, "b": 4}}}]}


def test_check_tool_template_names_the_problem():
    chatml = build_tokenizer()
    with pytest.raises(ConfigError, match=r"loses its tool name, argument key, argument value.*Qwen2\.5's"):
        check_tool_template(chatml, None)
    no_template = build_tokenizer(chat_template=False)
    with pytest.raises(ConfigError, match="has no chat template"):
        check_tool_template(no_template, None)
    raising = build_tokenizer()
    raising.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ConfigError, match="cannot render a tool conversation.*no tools here"):
        check_tool_template(raising, None)
    # renders everything, but an assistant turn with tool calls changes once a tool result follows it
    shifting = build_tokenizer(tools=True)
    closing = "{{- '<|im_end|>\n' }}{%- elif message['role'] == 'tool' %}"
    assert shifting.chat_template.count(closing) == 1
    shifting.chat_template = shifting.chat_template.replace(
        closing, "{{- ('' if loop.last else ' ') + '<|im_end|>\n' }}{%- elif message['role'] == 'tool' %}")
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        check_tool_template(shifting, None)
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        tool_turn_ids(shifting, [ToolResult("f", "1", False)], None)


# ----------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, tools=(multiply,)):
    return tokenizer.apply_chat_template([{"role": "user", "content": "3*4?"}], tools=list(tools), tokenize=True,
                                         return_dict=False, add_generation_prompt=True)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


GOOD = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
TWO = ('Let me see.<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
       '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>')


@pytest.mark.parametrize("which", ["tok", "hermes_tok"])
def test_parse_turn_good_completions(which, request):
    tokenizer = request.getfixturevalue(which)
    turn = parse_turn(tokenizer, ids(tokenizer, GOOD), prompt_ids(tokenizer), [multiply])
    assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}),)
    assert turn.malformed == 0
    assert turn.message == call_message(("multiply", {"a": 3, "b": 4}))

    turn = parse_turn(tokenizer, ids(tokenizer, TWO), prompt_ids(tokenizer), [multiply, add])
    assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("add", {"a": 1, "b": 2}))
    assert turn.message["content"] == "Let me see."
    assert turn.malformed == 0

    turn = parse_turn(tokenizer, ids(tokenizer, "It is 12.<|im_end|>"), prompt_ids(tokenizer), [multiply])
    assert turn == parse_turn(tokenizer, ids(tokenizer, "It is 12.<|im_end|>"), None, [])
    assert (turn.message, turn.calls, turn.malformed) == ({"role": "assistant", "content": "It is 12."}, (), 0)
    # the rendered turn reads back as the same call
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "3*4?"}, turn.message], tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\nIt is 12.<|im_end|>\n")


def test_parse_turn_types_arguments_with_the_tool_schema(tok):
    text = '<tool_call>\n{"name": "multiply", "arguments": {"a": "3", "b": 4}}\n</tool_call><|im_end|>'
    assert parse_turn(tok, ids(tok, text), prompt_ids(tok), [multiply]).calls == (ToolCall("multiply",
                                                                                           {"a": 3, "b": 4}),)


BAD_JSON = 'x<tool_call>\n{"name": "multiply", "arguments": {"a": 3,}}\n</tool_call><|im_end|>'
NO_NAME = '<tool_call>\n{"arguments": {"a": 3}}\n</tool_call><|im_end|>'
NOT_OBJECT = '<tool_call>\n{"name": "multiply", "arguments": [3, 4]}\n</tool_call><|im_end|>'
TRUNCATED = 'Hm <tool_call>\n{"name": "multiply", "argu'
PARTIAL = ('<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>'
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>')


@pytest.mark.parametrize("which", ["tok", "hermes_tok"])
@pytest.mark.parametrize("text", [BAD_JSON, NO_NAME, NOT_OBJECT, TRUNCATED])
def test_parse_turn_counts_a_malformed_call_and_never_raises(which, text, request):
    tokenizer = request.getfixturevalue(which)
    turn = parse_turn(tokenizer, ids(tokenizer, text), prompt_ids(tokenizer), [multiply])
    assert turn.calls == ()
    assert turn.malformed == 1
    assert "tool_calls" not in turn.message
    assert turn.message["role"] == "assistant"
    assert isinstance(turn.message["content"], str)


@pytest.mark.parametrize("which", ["tok", "hermes_tok"])
def test_a_block_that_is_not_a_call_stays_in_the_content(which, request):
    """What the model wrote reaches the reward functions: a turn whose block has bad JSON or was cut off by the
    length limit is its text, as TRL's parse_response falls back to (transformers' parser fails the whole turn;
    the Hermes text parser keeps the block that is not a call where it was)."""
    tokenizer = request.getfixturevalue(which)
    for text in (BAD_JSON, TRUNCATED, "<tool_call>\n"):
        turn = parse_turn(tokenizer, ids(tokenizer, text), prompt_ids(tokenizer), [multiply])
        assert turn.message == {"role": "assistant", "content": text.removesuffix("<|im_end|>")}, text
        assert (turn.calls, turn.malformed) == ((), 1)


def test_a_call_cut_off_at_every_token_is_the_text_written_with_either_parser(tok, hermes_tok):
    """A turn cut after each of its tokens: wherever the cut leaves no whole call, both parsers give TRL's form,
    the text as written and no tool_calls (only a cut after the JSON's last brace, before </tool_call>, reads
    as a call in transformers' parser; the loop does not run a call of a turn without its EOS)."""
    text = 'Hm <tool_call>\n{"name": "multiply", "arguments": {"a": 552, "b": 39}}\n</tool_call>'
    tokens = ids(tok, text)
    end = text.index("}}") + 2
    for n in range(len(ids(tok, "Hm <")), len(tokens)):  # from the block's first character
        written = tok.decode(tokens[:n])
        for tokenizer in (tok, hermes_tok):
            turn = parse_turn(tokenizer, tokens[:n], prompt_ids(tokenizer), [multiply])
            if tokenizer is tok and end <= len(written):  # the JSON is whole
                continue
            assert (turn.message, turn.calls) == ({"role": "assistant", "content": written}, ()), written


@pytest.mark.parametrize("which", ["tok", "hermes_tok"])
def test_parse_turn_keeps_the_good_call_of_a_partly_malformed_turn(which, request):
    tokenizer = request.getfixturevalue(which)
    turn = parse_turn(tokenizer, ids(tokenizer, PARTIAL), prompt_ids(tokenizer), [multiply, add])
    assert turn.calls == (ToolCall("add", {"a": 1, "b": 2}),)
    assert turn.malformed == 1
    assert turn.message["tool_calls"] == call_message(("add", {"a": 1, "b": 2}))["tool_calls"]


def test_parse_turn_without_any_tool_format_is_content(tok):
    plain = build_tokenizer()
    turn = parse_turn(plain, ids(plain, GOOD), None, [multiply])
    assert (turn.calls, turn.malformed) == ((), 0)
    assert turn.message == {"role": "assistant", "content": GOOD.removesuffix("<|im_end|>")}
    assert parse_turn(tok, [], prompt_ids(tok), [multiply]) == \
        parse_turn(plain, [], None, []) == parse_turn(tok, [], None, [])
    assert parse_turn(tok, [], None, []).message == {"role": "assistant", "content": ""}


# ----------------------------------------------------------------------------------------------------------------
# Schemas and toolboxes
# ----------------------------------------------------------------------------------------------------------------


def test_tool_schemas_are_transformers_schemas():
    from transformers.utils import get_json_schema

    assert tool_schemas([multiply, add]) == [get_json_schema(multiply), get_json_schema(add)]
    assert tool_schemas([multiply])[0]["function"]["parameters"]["properties"]["a"] == \
        {"type": "integer", "description": "The first integer."}


def test_tool_schemas_errors_name_the_function():
    def undocumented(a: int) -> int:
        return a

    def untyped(a):
        """Do it.

        Args:
            a: A thing.
        """

    with pytest.raises(ConfigError, match="cannot describe undocumented to the model: .*no docstring"):
        tool_schemas([undocumented])
    with pytest.raises(ConfigError, match="cannot describe untyped to the model: .*type hint"):
        tool_schemas([untyped])
    with pytest.raises(ConfigError, match="is not callable"):
        tool_schemas([3])


def test_toolbox_by_name_and_duplicates():
    assert toolbox([multiply, add]) == {"multiply": multiply, "add": add}

    def other():
        pass

    other.__name__ = "multiply"
    with pytest.raises(ConfigError, match="two tools are named 'multiply'"):
        toolbox([multiply, other])


# ----------------------------------------------------------------------------------------------------------------
# Running calls
# ----------------------------------------------------------------------------------------------------------------


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


async def async_sleepy(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "awake"


@pytest.fixture
def runner():
    runner = ToolRunner(workers=16, timeout=None)
    yield runner
    runner.close()


def test_sixteen_sync_calls_run_at_once(runner):
    calls = [[ToolCall("sleepy", {"seconds": 0.5})] for _ in range(16)]
    start = time.perf_counter()
    results = runner.run_calls(calls, [{"sleepy": sleepy}] * 16)
    assert time.perf_counter() - start < 2
    assert results == [[ToolResult("sleepy", "slept", failed=False)]] * 16


def test_sixteen_async_calls_run_at_once(runner):
    calls = [[ToolCall("async_sleepy", {"seconds": 0.5})] * 2 for _ in range(8)]
    start = time.perf_counter()
    results = runner.run_calls(calls, [{"async_sleepy": async_sleepy}] * 8)
    assert time.perf_counter() - start < 2
    assert results == [[ToolResult("async_sleepy", "awake", failed=False)] * 2] * 8


def test_a_mix_of_sync_async_and_failing_calls_keeps_call_order(runner):
    def broken(x: int) -> int:
        raise ValueError("x" * 300)

    tools = {"multiply": multiply, "add": add, "sleepy": sleepy, "async_sleepy": async_sleepy, "broken": broken}
    calls = [[ToolCall("sleepy", {"seconds": 0.5}), ToolCall("async_sleepy", {"seconds": 0.5}),
              ToolCall("multiply", {"a": 3, "b": 4})],
             [ToolCall("foo", {}), ToolCall("multiply", {"a": 3}), ToolCall("multiply", {"a": 1, "b": 2, "c": 3})],
             [],
             [ToolCall("broken", {"x": 1}), ToolCall("add", {"a": 1, "b": 2})]]
    start = time.perf_counter()
    results = runner.run_calls(calls, [tools] * 4)
    assert time.perf_counter() - start < 1
    assert results[0] == [ToolResult("sleepy", "slept", False), ToolResult("async_sleepy", "awake", False),
                          ToolResult("multiply", "12", False)]
    assert results[1] == [
        ToolResult("foo", str({"error": "unknown tool 'foo' (tools: multiply, add, sleepy, async_sleepy, broken)"}),
                   True),
        ToolResult("multiply", str({"error": "multiply: missing a required argument: 'b'"}), True),
        ToolResult("multiply", str({"error": "multiply: got an unexpected keyword argument 'c'"}), True)]
    assert results[2] == []
    assert results[3] == [ToolResult("broken", str({"error": "broken raised ValueError: " + "x" * 200 + "..."}),
                                     True), ToolResult("add", "3", False)]


def test_an_async_tool_that_raises_and_a_list_result(runner):
    async def fails() -> str:
        raise KeyError("nope")

    def blocks() -> list:
        return [{"type": "text", "text": "hi"}]

    results = runner.run_calls([[ToolCall("fails", {}), ToolCall("blocks", {})]], [toolbox([fails, blocks])])
    assert results == [[ToolResult("fails", str({"error": "fails raised KeyError: 'nope'"}), True),
                        ToolResult("blocks", "[{'type': 'text', 'text': 'hi'}]", False)]]


def test_a_hanging_tool_times_out_and_the_round_goes_on():
    release = threading.Event()

    def hangs() -> str:
        release.wait()
        return "late"

    async def async_hangs() -> str:
        await asyncio.Event().wait()

    before = set(threading.enumerate())
    runner = ToolRunner(workers=2, timeout=0.3)
    started = []
    try:
        tools = toolbox([hangs, async_hangs, multiply, sleepy])
        start = time.perf_counter()
        results = runner.run_calls([[ToolCall("hangs", {}), ToolCall("multiply", {"a": 2, "b": 3})],
                                    [ToolCall("async_hangs", {}), ToolCall("sleepy", {"seconds": 0.1})]],
                                   [tools, tools])
        elapsed = time.perf_counter() - start
        assert 0.3 <= elapsed < 1.5
        assert results == [[ToolResult("hangs", str({"error": "hangs timed out after 0.3 s"}), True, True),
                            ToolResult("multiply", "6", False)],
                           [ToolResult("async_hangs", str({"error": "async_hangs timed out after 0.3 s"}), True,
                                       True), ToolResult("sleepy", "slept", False)]]
        # the hung thread left the pool: the next round still has two workers, and a call's timeout counts from
        # its own start (four 0.2 s calls on two workers take 0.4 s, none times out)
        results = runner.run_calls([[ToolCall("sleepy", {"seconds": 0.2})] * 4], [tools])
        assert results == [[ToolResult("sleepy", "slept", False)] * 4]
        started = runner_threads(before)
        assert sorted(t.name for t in started) == ["tool-loop"] + ["tool-worker"] * 3  # the hung one, two others
    finally:
        release.set()
        runner.close()
    for thread in started:  # the hung call returns once released, and its thread ends
        thread.join(timeout=5)
        assert not thread.is_alive()


def test_map_runs_sync_and_async_together_and_reraises_the_first_error(runner):
    start = time.perf_counter()
    assert runner.map([functools.partial(sleepy, 0.5), functools.partial(async_sleepy, 0.5), lambda: 7]) == \
        ["slept", "awake", 7]
    assert time.perf_counter() - start < 1
    finished = []

    def slow_then_done():
        time.sleep(0.3)
        finished.append(True)

    def late():
        time.sleep(0.1)
        raise RuntimeError("late")

    async def early():
        raise RuntimeError("early")

    with pytest.raises(RuntimeError, match="late"):  # the first in order, not in time
        runner.map([slow_then_done, late, early])
    assert finished == [True]  # re-raised after all finished


def runner_threads(before):
    return [thread for thread in threading.enumerate() if thread not in before and thread.name.startswith("tool-")]


def test_close_leaves_no_thread_and_is_idempotent():
    before = set(threading.enumerate())
    runner = ToolRunner(workers=4, timeout=1)
    assert runner_threads(before) == []  # started lazily
    runner.run_calls([[ToolCall("multiply", {"a": 1, "b": 2}), ToolCall("async_sleepy", {"seconds": 0.01})]],
                     [toolbox([multiply, async_sleepy])])
    started = runner_threads(before)
    assert sorted(thread.name for thread in started) == ["tool-loop"] + ["tool-worker"] * 4
    runner.close()
    runner.close()
    assert not any(thread.is_alive() for thread in started)
    assert runner_threads(before) == []
    with pytest.raises(RuntimeError, match="closed"):
        runner.map([lambda: 1])


def test_runner_options_are_checked():
    with pytest.raises(ConfigError, match="workers .* must be a positive integer, got 0"):
        ToolRunner(workers=0, timeout=None)
    with pytest.raises(ConfigError, match="timeout .* got -1"):
        ToolRunner(workers=1, timeout=-1)


# ----------------------------------------------------------------------------------------------------------------
# Environments
# ----------------------------------------------------------------------------------------------------------------


class Shop:
    made = 0

    def __init__(self):
        Shop.made += 1
        self.bought = []

    def reset(self, **row) -> str | None:
        self.bought = []
        return row.get("hint")

    def buy(self, item: str, qty: int) -> str:
        """Buy something.

        Args:
            item: What to buy.
            qty: How many.
        """
        self.bought.append((item, qty))
        return f"bought {qty} {item}"

    def get_reward(self) -> float:
        return float(len(self.bought))

    def _private(self):
        pass


class Bank:
    def reset(self, **row) -> None:
        self.balance = 0

    def deposit(self, amount: int) -> str:
        """Deposit money.

        Args:
            amount: How much.
        """
        self.balance += amount
        return str(self.balance)


class Oracle:
    def reset(self, **row) -> None:
        pass

    async def get_reward(self) -> float:
        await asyncio.sleep(0.2)
        return 1.0


def test_environments_probe_and_pool():
    Shop.made = 0
    environments = Environments(Shop, [multiply])
    assert not environments.multi and Shop.made == 1
    assert [tool.__name__ for tool in environments.tools_for(None)] == ["multiply", "buy"]
    first = environments.take([None] * 3)
    assert Shop.made == 3  # the probe is reused
    environments.give_back(first)  # the round is scored
    second = environments.take([None] * 2)
    assert all(a is b for a, b in zip(second, first[:2]))  # given back: reused, in their order
    # while `second` is held (a round sampled ahead of one not yet scored): other instances, never its own
    held = environments.take([None] * 2)
    assert held[0] is first[2] and Shop.made == 4 and not any(h is s for h in held for s in second)
    environments.give_back(second + held)
    assert environments.take([None] * 4) == second + held and Shop.made == 4
    box = environments.toolbox_of(first[1])
    assert list(box) == ["multiply", "buy"]
    assert box["buy"]("apple", 2) == "bought 2 apple" and first[1].bought == [("apple", 2)]
    assert first[0].bought == []


def test_environment_errors():
    class NoReset:
        def act(self) -> str:
            return ""

    with pytest.raises(ConfigError, match="environment_factory: NoReset has no callable reset"):
        Environments(NoReset, [])
    with pytest.raises(ConfigError, match=r"environment_factory\['bank'\]: NoReset has no callable reset"):
        Environments({"shop": Shop, "bank": NoReset}, [])
    with pytest.raises(ConfigError, match="environment_factory must be callable .* got int"):
        Environments(3, [])

    def buy(item: str) -> str:
        """Buy.

        Args:
            item: What.
        """
        return item

    with pytest.raises(ConfigError, match="two tools are named 'buy'"):
        Environments(Shop, [buy])
    with pytest.raises(DatasetFormatError, match=r"rollout 1 has environment='mall'.*\['shop', 'bank'\]"):
        Environments({"shop": Shop, "bank": Bank}, []).take(["shop", "mall"])


def test_dict_routing_and_rewards_with_none_for_another_class():
    environments = Environments({"shop": Shop, "bank": Bank, "store": Shop}, [])
    assert environments.multi
    assert [tool.__name__ for tool in environments.tools_for("bank")] == ["deposit"]
    assert [tool.__name__ for tool in environments.tools_for("store")] == ["buy"]
    taken = environments.take(["bank", "shop", "store", "shop"])
    assert [type(e).__name__ for e in taken] == ["Bank", "Shop", "Shop", "Shop"]
    assert len({id(e) for e in taken}) == 4
    assert list(environments.toolbox_of(taken[0])) == ["deposit"]
    taken[1].buy("pear", 1)
    rewards = environments.reward_functions()
    assert [name for name, _ in rewards] == ["Shop"]  # one per class, Bank has none
    assert rewards[0][1](environments=taken, prompts=["p"] * 4) == [None, 1.0, 0.0, 0.0]


def test_an_async_get_reward_gives_an_async_reward_function():
    environments = Environments({"oracle": Oracle, "shop": Shop}, [])
    names = [name for name, _ in environments.reward_functions()]
    assert names == ["Oracle", "Shop"]
    oracle_reward = dict(environments.reward_functions())["Oracle"]
    assert asyncio.iscoroutinefunction(oracle_reward)
    taken = environments.take(["oracle", "shop", "oracle", "oracle"])
    start = time.perf_counter()
    assert asyncio.run(oracle_reward(taken)) == [1.0, None, 1.0, 1.0]
    assert time.perf_counter() - start < 0.5  # the rollouts' get_reward are awaited together
