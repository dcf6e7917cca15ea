"""GRPOTrainer(tools=..., environment_factory=...) end to end on one tiny model, one CPU process: what the tool
loop (trainers/agents/tool_loop.py) appends, masks, counts and logs, its errors, its concurrency, and exact resume.

An untrained tiny model writes random bytes, never a tool call, and these tests need exact calls (a good one, a
failing one, a malformed one, ...). So the model's sampling is scripted: ``Scripted`` is a generation backend,
registered and chosen with GRPOConfig(generation_backend=...), the one seam between the tool loop and
generation, and answers with fixed turns (the resume test lets the policy write every turn after the first). Everything else is the trainer's own: the loop parses the scripted
tokens, runs the tools, appends the tool turns; the reward functions score the messages; the model computes
log-probs and trains on every token of the rollout.
"""

import asyncio
import copy
import json
import threading
import time

import pytest
import torch

from tests.conftest import config_factory, step_records
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError, DatasetFormatError
from transformers import TrainerCallback

from trainers.agents.tool_loop import TRUNCATED_MARKER, ToolCounts
from trainers.cli.tiny import build_tokenizer, save_tiny_model
from trainers.generation.backend import PolicyBackend, register_backend
from trainers.generation.sampling import Samples
from trainers.grpo.objectives import AGGREGATIONS, OBJECTIVES, GRPOCounts, PolicyInputs

END = "<|im_end|>"
PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {i} times 7?"}]} for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 (width 64, 2 layers) whose tokenizer renders tools (Hermes <tool_call> JSON) and parses them."""
    return save_tiny_model(str(tmp_path_factory.mktemp("tools") / "model"), tokenizer=build_tokenizer(tools=True))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: on a width-64 model (prompts of ~500 tokens: the tools' schemas) a second
    thread gains little and, on a busy 2-core machine, costs several times the step (measured: 0.6 s vs 2-3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


config = config_factory(GRPOConfig, per_device_train_batch_size=8, num_generations=4, max_completion_length=256,
                        learning_rate=1e-2, max_steps=1)


def call(name: str, **arguments) -> str:
    """A tool call in the template's Hermes form, as a model trained on it writes one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Scripted(PolicyBackend):
    """Plays the model (module docstring). ``first(index, text)`` (or ``first[index % len(first)]``): what rollout
    ``index`` of the round writes on its first turn, ``text`` being its prompt decoded; ``then``: every later turn
    (a string, or ``None``: the policy writes it). Each turn ends with the EOS and is cut at the sampling budget, as
    a real backend's. A row's turn is read from its ids (one process: every row sampled together is at the same
    turn). ``calls``: how many times the loop sampled; ``round_started``: when the round's first turn was asked."""

    def __init__(self, inputs, first, then: str | None = "done"):
        super().__init__(inputs)
        self.tokenizer = inputs.tokenizer
        self.first, self.then = first, then
        self.calls, self.round_started = 0, None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def sample(self, prompts, prompt_ids, params):
        self.calls += 1
        turns = [self.tokenizer.decode(ids).count("<|im_start|>assistant") - 1 for ids in prompt_ids]
        if all(turn == 0 for turn in turns):
            self.round_started = time.perf_counter()
        if self.then is None and all(turn > 0 for turn in turns):
            return super().sample(prompts, prompt_ids, params)
        completions = []
        for index, (ids, turn) in enumerate(zip(prompt_ids, turns)):
            if turn == 0:
                text = self.first(index, self.tokenizer.decode(ids)) if callable(self.first) \
                    else self.first[index % len(self.first)]
            else:
                text = self.then
            completions.append(self.encode(text + END)[:params.max_new_tokens])
        return Samples(prompt_ids, completions)


class ScriptedAhead(Scripted):
    """Scripted, able to sample ahead of training (async_generation): its producer is the same script (with
    ``then`` given it reads nothing of the weights)."""

    updates_in_flight = True  # it reads nothing of the weights: a push may land while it samples

    def sync_weights(self, step=None, requests_in_flight=False):
        super().sync_weights(step)

    def producer(self):
        return copy.copy(self)


class Recording(TrainerCallback):
    """Records each round's Rollout (on_rollout_end: ``rounds``), each tool loop's Episode (on_episode_end:
    ``episodes``) and the loop's wall time (``loop_seconds``: from the round's first turn to its episode's end)."""

    def __init__(self):
        self.rounds, self.episodes, self.loop_seconds, self.backend = [], [], [], None

    def on_rollout_end(self, args, state, control, rollout=None, **kwargs):
        self.rounds.append(rollout)

    def on_episode_end(self, args, state, control, episode=None, **kwargs):
        self.loop_seconds.append(time.perf_counter() - self.backend.round_started)
        self.episodes.append(episode)


def build(model_dir, tmp_path, first, then="done", reward_funcs=None, dataset=PROMPTS, eval_dataset=None, **options):
    """A trainer whose backend is scripted (``trainer.backend``: a Scripted), recording each round's Rollout
    (``trainer.rounds``), each tool loop's Episode (``trainer.episodes``) and the loop's wall time
    (``trainer.loop_seconds``)."""
    tools, factory = options.pop("tools", None), options.pop("environment_factory", None)
    register_backend("scripted", lambda inputs: Scripted(inputs, first, then))
    recording = Recording()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_funcs or [Recorder()],
                          args=config(tmp_path, generation_backend="scripted", **options), train_dataset=dataset,
                          eval_dataset=eval_dataset, tools=tools, environment_factory=factory, callbacks=[recording])
    recording.backend = trainer.backend
    trainer.rounds, trainer.episodes, trainer.loop_seconds = recording.rounds, recording.episodes, recording.loop_seconds
    return trainer


class Recorder:
    """A deterministic reward function that keeps what it was given: the completions (TRL's message lists), the
    prompts, the environments and a copy of their state then (an instance is reset and reused next round).
    Rewards differ within a group (the number of characters the tools returned)."""

    __name__ = "recorder"

    def __init__(self):
        self.completions, self.prompts, self.environments, self.states = [], [], [], []

    def __call__(self, prompts, completions, environments=None, **kwargs):
        self.completions += completions
        self.prompts += prompts
        self.environments += environments or []
        self.states += [copy.deepcopy(vars(env)) for env in environments or []]
        return [float(sum(len(m["content"]) for m in c if m["role"] == "tool")) for c in completions]


def tools_of(completion):
    return [(m["name"], m["content"]) for m in completion if m["role"] == "tool"]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def add(a: int, b: int) -> int:
    """Add two integers (an async tool).

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.01)
    return a + b


def tool_turn(result: str) -> str:
    """The template's tokens for a tool turn of one result and the next assistant header (TOOLS_CHAT_TEMPLATE),
    after the model's EOS: the newline the template writes after it comes first."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{END}\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------------- the loop

def test_sync_and_async_tools_run_and_their_tokens_are_masked(model_dir, tmp_path):
    """Even rows call multiply (sync), odd rows add (async): each result is appended as a tool message the reward
    function sees; the rollout is turn 1 + the template's tool turn + turn 2, token for token, and the loss mask is
    0 exactly on the tool turn; the logged lengths count the model's tokens only."""
    def first(index, text):
        return call("multiply", a=index, b=7) if index % 2 == 0 else call("add", a=index, b=100)

    recorder = Recorder()
    trainer = build(model_dir, tmp_path, first, reward_funcs=[recorder], tools=[multiply, add])
    trainer.train()
    encode = trainer.backend.encode
    results = [str(j * 7) if j % 2 == 0 else str(j + 100) for j in range(8)]
    for j, completion in enumerate(recorder.completions):
        name = "multiply" if j % 2 == 0 else "add"
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
        assert completion[0]["tool_calls"] == [{"type": "function", "function": {
            "name": name, "arguments": {"a": j, "b": 7 if j % 2 == 0 else 100}}}]
        assert tools_of(completion) == [(name, results[j])]
        assert completion[2]["content"] == "done"

    (rollout,) = trainer.rounds
    model_lengths = []
    for j in range(8):
        turn1, tool, turn2 = encode(first(j, "") + END), encode(tool_turn(results[j])), encode("done" + END)
        whole = turn1 + tool + turn2
        width = rollout.completion_ids.shape[1]
        assert rollout.completion_ids[j, :len(whole)].tolist() == whole
        assert rollout.completion_attention[j].tolist() == [1] * len(whole) + [0] * (width - len(whole))
        assert rollout.loss_mask[j].tolist() == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2) + \
            [0] * (width - len(whole))
        model_lengths.append(len(turn1) + len(turn2))
    (record,) = step_records(trainer)
    assert record["completions/mean_length"] == pytest.approx(sum(model_lengths) / 8)
    assert record["completions/max_length"] == max(model_lengths)
    assert record["tools/call_frequency"] == 1.0 and record["tools/failure_frequency"] == 0.0
    assert record["tools/malformed_frequency"] == 0.0 and record["tools/truncated_results"] == 0.0
    assert record["grad_norm"] > 0  # rewards differ within each group: the model trained


def explode() -> str:
    """A tool that always fails."""
    raise ValueError("boom")


RELEASE = threading.Event()  # lets the hanging tool's thread finish when its test is done


def hang() -> str:
    """A tool that hangs (a minute, or until its test releases it)."""
    RELEASE.wait(60)
    return "never seen"


def test_failing_malformed_and_hanging_calls_become_error_results(model_dir, tmp_path):
    """An unknown tool, wrong arguments, a raising tool and a tool past tool_timeout each give an {"error": ...}
    result (the round goes on); a call that cannot be parsed is counted as malformed; the tools/* metrics are
    exact: 7 calls of which 5 failed, 1 malformed block, over 8 rollouts."""
    first = [call("multiply", a=3, b=4), call("divide", a=3, b=4), call("multiply", a=3), call("explode"),
             '<tool_call>\n{"name": multiply}\n</tool_call>', call("hang"), "42",
             call("multiply", a=2, b=5) + call("explode")]
    recorder = Recorder()
    trainer = build(model_dir, tmp_path, first, reward_funcs=[recorder], tools=[multiply, explode, hang],
                    tool_timeout=1.0, max_completion_length=320)
    try:
        trainer.train()
    finally:
        RELEASE.set()
    got = [tools_of(c) for c in recorder.completions]
    assert got == [
        [("multiply", "12")],
        [("divide", str({"error": "unknown tool 'divide' (tools: multiply, explode, hang)"}))],
        [("multiply", str({"error": "multiply: missing a required argument: 'b'"}))],
        [("explode", str({"error": "explode raised ValueError: boom"}))],
        [],  # malformed: nothing ran, the rollout ended with its turn
        [("hang", str({"error": "hang timed out after 1 s"}))],
        [],  # no call
        [("multiply", "10"), ("explode", str({"error": "explode raised ValueError: boom"}))],
    ]
    assert [len(c) for c in recorder.completions] == [3, 3, 3, 3, 1, 3, 1, 4]
    assert 1.0 <= trainer.loop_seconds[0] < 10  # the timeout, not the hang
    assert trainer.episodes[0].counts == ToolCounts(rollouts=8, calls=7, failures=5, malformed=1)
    (record,) = step_records(trainer)  # logged values are rounded to 6 significant digits
    assert record["tools/call_frequency"] == 7 / 8 and record["tools/malformed_frequency"] == 1 / 8
    assert record["tools/failure_frequency"] == pytest.approx(5 / 7, abs=1e-6)
    assert record["tools/truncated_results"] == 0


def test_evaluation_reports_the_tool_metrics(model_dir, tmp_path):
    """evaluate() runs the tool loop as a training round does and reports its tools/* metrics with the eval_
    prefix (TRL logs them in both modes): of every 4 rollouts, 3 call a tool and 1 of those calls fails."""
    first = [call("multiply", a=3, b=4), "42", call("explode"), call("multiply", a=1, b=2)]
    trainer = build(model_dir, tmp_path, first, tools=[multiply, explode], eval_dataset=PROMPTS,
                    per_device_eval_batch_size=8)
    metrics = trainer.evaluate()
    assert trainer.backend.calls == 4  # 2 batches of 8 rollouts, each a turn and, after the calls, one more
    assert metrics["eval_tools/call_frequency"] == 0.75
    assert metrics["eval_tools/failure_frequency"] == pytest.approx(1 / 3)
    assert metrics["eval_tools/malformed_frequency"] == 0.0 and metrics["eval_tools/truncated_results"] == 0.0
    assert "eval_reward" in metrics


def long_text() -> str:
    """Returns a long text."""
    return "x" * 1000


def test_a_result_over_the_budget_is_cut_with_a_marker_and_counted(model_dir, tmp_path):
    """max_completion_length=160: even rows call long_text right away, and its 1000 characters are cut to fit,
    ending in TRUNCATED_MARKER; odd rows write 40 characters before their call, leaving no room for even the tool
    turn's own tokens (~70), so the rollout ends there. Every result is counted in tools/truncated_results and no
    completion is longer than the budget."""
    first = [call("long_text"), "y" * 40 + call("long_text")]
    recorder = Recorder()
    trainer = build(model_dir, tmp_path, first, reward_funcs=[recorder], tools=[long_text], max_completion_length=160)
    trainer.train()
    for j, completion in enumerate(recorder.completions):
        if j % 2 == 0:
            ((name, content),) = tools_of(completion)
            assert name == "long_text"
            assert content.endswith(TRUNCATED_MARKER) and content.startswith("x") and len(content) < 200
        else:  # its turn, whole, and nothing after it
            assert [m["role"] for m in completion] == ["assistant"] and len(completion[0]["tool_calls"]) == 1
    (episode,) = trainer.episodes
    lengths = [len(c) for c in episode.samples.completion_ids]
    assert max(lengths) <= 160
    assert all(length >= 160 - 4 for length in lengths[::2])  # cut to fill what was left, not dropped
    (record,) = step_records(trainer)
    assert record["tools/truncated_results"] == 8 and record["tools/call_frequency"] == 1.0


@pytest.fixture(scope="module")
def hermes_model_dir(tmp_path_factory):
    """The same tiny model and template without the tokenizer's response_template: the Hermes text parser's path
    (a Qwen template's tokenizer that ships no parser)."""
    tokenizer = build_tokenizer(tools=True)
    tokenizer.response_template = None
    return save_tiny_model(str(tmp_path_factory.mktemp("hermes") / "model"), tokenizer=tokenizer)


@pytest.mark.parametrize("parser", ["response_template", "hermes"])
def test_a_call_cut_off_by_the_budget_reaches_the_reward_functions_as_written(parser, model_dir, hermes_model_dir,
                                                                            tmp_path):
    """max_completion_length=40 cuts every first turn inside its call (issue 42): the reward functions get the
    text the model wrote, as TRL hands them (no tool_calls: the turn its parser cannot read is its content),
    whichever parser reads the turn; the call is not run, not counted in tools/call_frequency, and counted in
    tools/malformed_frequency."""
    ran = []

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        ran.append((a, b))
        return a * b

    written = ("Hm " + call("multiply", a=552, b=39))[:40]
    recorder = Recorder()
    trainer = build(model_dir if parser == "response_template" else hermes_model_dir, tmp_path,
                    ["Hm " + call("multiply", a=552, b=39)], reward_funcs=[recorder], tools=[multiply],
                    max_completion_length=40)
    trainer.train()
    assert written.endswith('{"name": "multiply", "arg')
    assert recorder.completions == [[{"role": "assistant", "content": written}]] * 8
    assert ran == [] and trainer.backend.calls == 1
    assert trainer.episodes[0].counts == ToolCounts(rollouts=8, malformed=8)
    (record,) = step_records(trainer)
    assert record["tools/call_frequency"] == 0.0 and record["tools/malformed_frequency"] == 1.0
    assert record["completions/clipped_ratio"] == 1.0


def wait_sync(seconds: float) -> str:
    """Waits, then answers.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "ok"


async def wait_async(seconds: float) -> str:
    """Waits, then answers (async).

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return "ok"


@pytest.mark.parametrize("tool", [wait_sync, wait_async], ids=["sync", "async"])
def test_the_calls_of_a_round_run_at_once(tool, model_dir, tmp_path):
    """16 rollouts each call a tool that takes 0.5 s: one after another that is 8 s; the whole tool loop (the
    scripted sampling costs nothing) takes well under 2 s."""
    recorder = Recorder()
    trainer = build(model_dir, tmp_path, [call(tool.__name__, seconds=0.5)], reward_funcs=[recorder], tools=[tool],
                    per_device_train_batch_size=16)
    trainer.train()
    assert [tools_of(c) for c in recorder.completions] == [[(tool.__name__, "ok")]] * 16
    assert 0.5 <= trainer.loop_seconds[0] < 2.0, trainer.loop_seconds
    assert step_records(trainer)[0]["tools/call_frequency"] == 1.0


@pytest.mark.parametrize("iterations", [0, 1])
def test_max_tool_calling_iterations(iterations, model_dir, tmp_path):
    """The model calls a tool on every turn: with 0 iterations no call runs (the rollout is its first turn), with
    1 one round of calls runs and the rollout ends with the next turn (its call is not run)."""
    ran = []

    def ping() -> str:
        """Answers pong."""
        ran.append(1)
        return "pong"

    recorder = Recorder()
    trainer = build(model_dir, tmp_path, [call("ping")], then=call("ping"), reward_funcs=[recorder], tools=[ping],
                    max_tool_calling_iterations=iterations)
    trainer.train()
    assert len(ran) == 8 * iterations
    roles = ["assistant"] if iterations == 0 else ["assistant", "tool", "assistant"]
    assert all([m["role"] for m in c] == roles for c in recorder.completions)
    assert all("tool_calls" in c[-1] for c in recorder.completions)  # the last turn's call was left unrun
    assert trainer.backend.calls == 1 + iterations
    assert step_records(trainer)[0]["tools/call_frequency"] == iterations


# ---------------------------------------------------------------------------------------------------- environments

class Shop:
    """An environment: reset gets the row's columns, buy is its tool, get_reward its reward."""

    made = 0

    def __init__(self):
        Shop.made += 1
        self.resets, self.row, self.bought = 0, None, []

    def reset(self, **row) -> str:
        self.resets += 1
        self.row, self.bought = row, []
        return f" In stock: {row['stock']}."

    def buy(self, item: str, qty: int) -> str:
        """Buy some of an item.

        Args:
            item: What to buy.
            qty: How many.
        """
        self.bought.append((item, qty))
        return f"bought {qty} {item}"

    def _restock(self) -> str:  # private: not a tool
        return "restocked"

    def get_reward(self) -> float:
        return float(sum(qty for _, qty in self.bought))


class Bank:
    def reset(self, **row) -> None:
        self.row, self.total = row, 0

    def deposit(self, amount: int) -> str:
        """Deposit money.

        Args:
            amount: How much.
        """
        self.total += amount
        return f"balance {self.total}"

    def get_reward(self) -> float:
        return self.total / 10


SHOP_ROWS = [{"prompt": [{"role": "user", "content": f"Buy {item}."}], "stock": stock}
             for item, stock in [("apples", 5), ("pears", 7), ("plums", 9), ("figs", 11)]]


def test_an_environment_per_rollout_reset_tools_and_reward(model_dir, tmp_path):
    """environment_factory=Shop: each rollout of a round has its own instance (pooled: 8 instances serve 2
    rounds), reset(**row) gets the row's columns and its string is appended to the prompt, the public method buy
    is a tool (the private _restock is not), get_reward is the reward column "Shop", and reward functions get
    environments=."""
    Shop.made = 0

    def first(index, text):
        return call("_restock") if index == 7 else call("buy", item="apple", qty=index % 4 + 1)

    recorder = Recorder()
    trainer = build(model_dir, tmp_path, first, reward_funcs=[recorder], environment_factory=Shop,
                    dataset=SHOP_ROWS, max_steps=2)
    trainer.train()
    assert Shop.made == 8  # the probe included; the second round reuses the first round's instances
    first_round = trainer.episodes[0].environments
    assert len({id(e) for e in first_round}) == 8 and all(type(e) is Shop for e in first_round)
    for step, episode in enumerate(trainer.episodes):
        assert episode.environments == first_round and recorder.environments[8 * step:8 * step + 8] == first_round
        states = recorder.states[8 * step:8 * step + 8]  # when the reward functions ran
        for j, (state, prompt) in enumerate(zip(states, episode.prompts)):
            row = SHOP_ROWS[[r["stock"] for r in SHOP_ROWS].index(state["row"]["stock"])]
            assert state["row"] == row and state["resets"] == step + 1  # reset once a round, with every column
            assert prompt == [{"role": "user", "content": row["prompt"][0]["content"] + f" In stock: {row['stock']}."}]
            text = trainer.processing_class.decode(episode.samples.prompt_ids[j])
            assert f" In stock: {row['stock']}.<|im_end|>" in text
            assert '"name": "buy"' in text and "_restock" not in text and '"name": "reset"' not in text
            assert '"name": "get_reward"' not in text
            assert state["bought"] == ([] if j == 7 else [("apple", j % 4 + 1)])
            expected = str({"error": "unknown tool '_restock' (tools: buy)"}) if j == 7 else f"bought {j % 4 + 1} apple"
            assert tools_of(episode.messages[j])[0][1] == expected
    assert [r.name for r in trainer.rewards] == ["recorder", "Shop"]
    records = step_records(trainer)
    assert records[0]["rewards/Shop/mean"] == pytest.approx((1 + 2 + 3 + 4 + 1 + 2 + 3 + 0) / 8)
    assert records[0]["tools/failure_frequency"] == 1 / 8


def test_several_environments_routed_by_the_environment_column(model_dir, tmp_path):
    """{"shop": Shop, "bank": Bank}: each row goes to its environment (reset gets its columns but not
    `environment`), its prompt lists that environment's tools only, and each get_reward is its own reward column
    (None, so left out, on the other environment's rows)."""
    rows = [{**SHOP_ROWS[0], "environment": "shop"}, {"prompt": [{"role": "user", "content": "Save."}],
                                                       "stock": 0, "environment": "bank"}]

    def first(index, text):
        return call("buy", item="fig", qty=index + 1) if '"name": "buy"' in text else call("deposit", amount=10 * index)

    recorder = Recorder()
    trainer = build(model_dir, tmp_path, first, reward_funcs=[recorder], dataset=rows,
                    environment_factory={"shop": Shop, "bank": Bank})
    trainer.train()
    (episode,) = trainer.episodes
    kinds = [type(e).__name__ for e in episode.environments]
    assert sorted(kinds) == ["Bank"] * 4 + ["Shop"] * 4
    for j, env in enumerate(episode.environments):
        text = trainer.processing_class.decode(episode.samples.prompt_ids[j])
        if kinds[j] == "Shop":
            assert env.row == SHOP_ROWS[0] and '"name": "buy"' in text and "deposit" not in text
            assert env.bought == [("fig", j + 1)]
        else:
            assert env.row == {"prompt": rows[1]["prompt"], "stock": 0} and '"name": "buy"' not in text
            assert env.total == 10 * j
    shop = [env.get_reward() for env in episode.environments if type(env) is Shop]
    bank = [env.get_reward() for env in episode.environments if type(env) is Bank]
    (record,) = step_records(trainer)
    assert record["rewards/Shop/mean"] == pytest.approx(sum(shop) / 4)
    assert record["rewards/Bank/mean"] == pytest.approx(sum(bank) / 4)
    assert [r.name for r in trainer.rewards] == ["recorder", "Shop", "Bank"]

    unknown = rows + [{**SHOP_ROWS[1], "environment": "casino"}]
    with pytest.raises(DatasetFormatError, match="train_dataset row 2 has environment='casino'.*'shop', 'bank'"):
        GRPOTrainer(model=model_dir, reward_funcs=[recorder], args=config(tmp_path), train_dataset=unknown,
                    environment_factory={"shop": Shop, "bank": Bank})


class Maze:
    """An environment that owns the data: reset takes no row columns and returns the task."""

    def reset(self, **row) -> str:
        self.row, self.steps = row, 0
        return "Find the exit."

    def move(self, direction: str) -> str:
        """Move one step.

        Args:
            direction: north, south, east or west.
        """
        self.steps += 1
        return "exit" if direction == "north" else "wall"

    def get_reward(self) -> float:
        return float(self.steps)


def test_without_a_dataset_the_environment_owns_the_data(model_dir, tmp_path):
    """train_dataset=None with an environment_factory: max_steps is required (TRL's rule); with it, the prompts
    are what reset returns. A dict factory needs a dataset to route rows."""
    with pytest.raises(ConfigError, match="needs max_steps > 0"):
        GRPOTrainer(model=model_dir, args=config(tmp_path, max_steps=-1), environment_factory=Maze)
    with pytest.raises(ConfigError, match="A dict environment_factory .* needs a train_dataset"):
        GRPOTrainer(model=model_dir, args=config(tmp_path), environment_factory={"maze": Maze})

    recorder = Recorder()
    trainer = build(model_dir, tmp_path, [call("move", direction="north"), call("move", direction="west")],
                    reward_funcs=[recorder], dataset=None, environment_factory=Maze)
    trainer.train()
    assert recorder.prompts == [[{"role": "user", "content": "Find the exit."}]] * 8
    assert [tools_of(c) for c in recorder.completions] == [[("move", "exit")], [("move", "wall")]] * 4
    assert step_records(trainer)[0]["rewards/Maze/mean"] == 1.0


def test_configuration_errors_before_training(model_dir, tmp_path):
    """Clear errors when the trainer is built: a prompt that is not a conversation, a chat template that cannot
    render tools (the plain ChatML one), a tool the model cannot be told about (no docstring), and tools together
    with a rollout_func (which runs its own episodes)."""
    def nodoc(x: int) -> int:
        return x

    def trainer(**kwargs):
        return GRPOTrainer(**{"model": model_dir, "reward_funcs": [Recorder()], "args": config(tmp_path),
                              "train_dataset": PROMPTS, "tools": [multiply], **kwargs})

    with pytest.raises(DatasetFormatError, match="train_dataset row 0: with tools or environment_factory the 'prompt' "
                                                 "column must be a conversation"):
        trainer(train_dataset=[{"prompt": "What is 3 times 7?"}])
    with pytest.raises(ConfigError, match="chat template does not render tool calls"):
        trainer(processing_class=build_tokenizer())  # plain ChatML
    with pytest.raises(ConfigError, match="tools: cannot describe nodoc to the model"):
        trainer(tools=[nodoc])
    with pytest.raises(ConfigError, match="pass tools/environment_factory .* or a rollout_func, not both"):
        trainer(rollout_func=lambda prompts, trainer: {})


# ---------------------------------------------------------------------------------------------------- resume

def test_resume_with_tools_is_exact(model_dir, tmp_path):
    """4 steps straight (a checkpoint at step 2) equal 2 steps resumed from that checkpoint: the first turn calls
    multiply, the real sampler writes the turns after the tool's answer (so the restored sampling state matters)."""
    def run(folder, resume=None):
        trainer = build(model_dir, folder, lambda index, text: call("multiply", a=index, b=len(text) % 10),
                        then=None, tools=[multiply], max_steps=4, save_strategy="steps", save_steps=2)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "straight" / "out" / "checkpoint-2"))
    assert len(resumed.episodes) == 2  # steps 3 and 4 only
    for a, b in zip(straight.episodes[2:], resumed.episodes):
        assert a.samples.completion_ids == b.samples.completion_ids and a.messages == b.messages
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)

    def last(trainer):  # the last step's record, without timings
        return {k: v for k, v in step_records(trainer)[-1].items() if k not in ("step_time", "tokens_per_second")}

    assert last(resumed) == last(straight) and last(straight)["tools/call_frequency"] == 1.0
    assert any(r["grad_norm"] > 0 for r in step_records(straight))


def test_the_tool_turn_gets_no_gradient(model_dir, tmp_path):
    """The round's loss mask leaves the tool turn out: through GRPO's objective and its aggregation (what
    compute_loss applies to the policy's log-probs), the gradient of the loss with respect to each completion
    token's log-prob is exactly 0 on the tool turn's tokens and nonzero on the model's own (rows with a nonzero
    advantage); with the tool turn put back into the mask, its tokens get one (the test can fail)."""
    def first(index, text):
        return call("multiply", a=index, b=7)

    trainer = build(model_dir, tmp_path, first, tools=[multiply])
    trainer.train()
    rollout, args = trainer.rounds[0], trainer.args

    def gradient(mask: torch.Tensor) -> torch.Tensor:
        # [n, C]: the policy's log-probs, here equal to the sampler's (on-policy: every ratio 1)
        old = rollout.old_logps if rollout.old_logps is not None else torch.zeros_like(rollout.loss_mask)
        logps = old.clone().requires_grad_()
        policy = OBJECTIVES[args.loss_type](PolicyInputs(logps, old, rollout.advantages, mask), args)
        counts = GRPOCounts(tokens=float(mask.sum()), sequences=float((mask.sum(-1) > 0).sum()), micro_batches=1,
                            max_completion_length=args.max_completion_length)
        AGGREGATIONS[args.loss_type](policy.per_token, mask, counts).backward()
        return logps.grad

    tool_tokens = (rollout.completion_attention == 1) & (rollout.loss_mask == 0)  # [n, C]
    moving = rollout.advantages != 0  # [n]
    assert tool_tokens.sum() > 8 * 40 and moving.sum() >= 4
    grad = gradient(rollout.loss_mask)
    assert torch.all(grad[tool_tokens] == 0)
    assert torch.all(grad[rollout.loss_mask.bool() & moving[:, None]] != 0)
    unmasked = gradient(rollout.completion_attention.float())
    assert torch.all(unmasked[tool_tokens & moving[:, None]] != 0)


def test_tools_and_environments_sampled_ahead_train_as_synchronously(model_dir, tmp_path):
    """async_generation: the tool loop runs in the producer thread (a tool runner of its own) and the
    environments' rewards in the trainer's. With a scripted model (its rollouts do not depend on the weights), 4
    steps with bound 1 train to the synchronous run's weights, with its rewards; the round sampled ahead takes
    other environment instances, so none is reset before its round's rewards are computed."""

    def first(index, text):
        return call("buy", item="apple", qty=index % 4 + 1)

    def run(name, **options):
        register_backend("scripted_ahead", lambda inputs: ScriptedAhead(inputs, first))
        recorder = Recorder()
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[recorder], environment_factory=Shop,
                              train_dataset=SHOP_ROWS, args=config(tmp_path / name, max_steps=4,
                                                                   generation_backend="scripted_ahead", **options))
        trainer.train()
        return trainer, recorder

    Shop.made = 0
    sync, sync_rewards = run("sync")
    made, Shop.made = Shop.made, 0
    ahead, ahead_rewards = run("ahead", async_generation=True, max_staleness=1)
    for a, b in zip(sync.model.parameters(), ahead.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [r["rewards/Shop/mean"] for r in step_records(ahead)] == [r["rewards/Shop/mean"] for r in step_records(sync)]
    # each round's environments, when its rewards were computed, held that round's purchases
    assert [s["bought"] for s in ahead_rewards.states] == [s["bought"] for s in sync_rewards.states]
    assert all(s["bought"] == [("apple", j % 4 + 1)] for j, s in enumerate(ahead_rewards.states[:8]))
    assert made == 8 and Shop.made == 16  # ahead: a second set of instances while the first round is scored
