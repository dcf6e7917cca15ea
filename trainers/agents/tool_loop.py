"""The tool-calling rollout strategy (TRL's ``tools=`` and ``environment_factory=``), on top of whatever samples
(the policy's lean engine or HF generate, vLLM colocated or as a server):

    rows -> an environment instance per rollout, reset (all at once)            ToolLoop.begin
         -> each prompt rendered with its tools -> prompt ids
         -> sample a turn for every rollout                                     ToolLoop.run
         -> parse each turn; run every call of every rollout at once (ToolRunner)
         -> append the template's tokens for the tool turn and the next assistant header (masked out of the loss)
         -> sample again only for the rollouts that called a tool, from prompt + everything so far (token in,
            token out: nothing the model wrote is re-tokenized)
         -> until a turn has no call, max_tool_calling_iterations rounds of calls, or max_completion_length
            (every turn and tool result together) is used up
         -> Episode: Samples (model_mask, the backend's log-probs; NaN on tool tokens), each rollout's messages
            (TRL's completion form), its environment, counts for the tools/* metrics

A tool result that does not fit the budget left is cut to fit, ending in TRUNCATED_MARKER, and counted in
``tools/truncated_results``; when not even the tool turn's own tokens fit, the rollout ends there (its results
are counted the same way). TRL drops such a result silently.

The loop knows no trainer: a generation backend, the tokenizer, the EOS ids and the processes' collectives
(``run``'s arguments); the caller hears of each finished Episode through its return value (GRPO fires the
``on_episode_end`` callback event with it).

Every process runs the loop in step: each turn, every process samples together (ZeRO-3 gathers, a vLLM server's
request), a process with nothing left to sample keeping the others company with one token of a dummy row.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from trainers.parallel import distributed as dist
from trainers.agents.environments import Environments
from trainers.agents.parsing import Turn, parse_turn
from trainers.agents.rendering import check_tool_template, tool_schemas, tool_turn_ids, toolbox
from trainers.agents.runner import ToolResult, ToolRunner
from trainers.data.formats import chat_ids, is_conversational
from trainers.errors import ConfigError, DatasetFormatError
from trainers.generation.backend import Backend
from trainers.generation.sampling import Samples, SamplingParams, ended

TRUNCATED_MARKER = " ...[truncated]"
MAX_DEFAULT_WORKERS = 64
EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's placeholder when the environment owns the data


@dataclass(frozen=True)
class ToolCounts:
    """What a round's tool calling did on this process (summed over processes for the metrics)."""

    rollouts: int = 0
    calls: int = 0  # calls the model wrote and the loop ran (failures included)
    failures: int = 0  # unknown tool, wrong arguments, raised, timed out
    malformed: int = 0  # tool-call blocks that could not be parsed
    truncated_results: int = 0  # results cut to fit max_completion_length (or not appended: the rollout ended)

    def __add__(self, other: ToolCounts) -> ToolCounts:
        return ToolCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True)
class Episode:
    """A round's rollouts on this process, after the tool loop."""

    samples: Samples  # prompt ids as rendered with the tools; completions: every turn and tool turn; model_mask
    prompts: list[list[dict]]  # per rollout: its prompt, with what reset returned appended (the reward functions')
    messages: list[list[dict]]  # per rollout: its assistant turns and tool messages (the reward functions' completion)
    environments: list | None  # per rollout: its environment instance (environment_factory), else None
    counts: ToolCounts


def tool_metrics(accelerator, counts: ToolCounts) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per rollout) and tools/failure_frequency (failed calls per call), and
    tools/malformed_frequency (unparsable calls per rollout) and tools/truncated_results (a count), over every
    process."""
    total = dist.all_reduce_sum(accelerator, torch.tensor(dataclasses.astuple(counts), dtype=torch.float64,
                                                          device=accelerator.device)).tolist()
    rollouts, calls, failures, malformed, truncated = total
    return {"tools/call_frequency": calls / max(rollouts, 1.0),
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/malformed_frequency": malformed / max(rollouts, 1.0),
            "tools/truncated_results": truncated}


@dataclass(frozen=True)
class ToolOptions:
    """The loop's options (TRL's GRPOConfig fields of the same names)."""

    chat_template_kwargs: dict | None = None
    max_tool_calling_iterations: int | None = None  # None: no limit but the token budget
    tool_workers: int | None = None  # threads running sync tools; None: one per rollout, at most MAX_DEFAULT_WORKERS
    tool_timeout: float | None = None  # seconds per call; None: no limit


class ToolLoop:
    """The tools and environments, and the loop that runs them (module docstring). Built before any model
    loads: the tools' schemas and the chat template are checked then. ``reward_count``: the reward functions
    given besides the environments' (an environment's get_reward may be the only one)."""

    def __init__(self, tools, environment_factory, options: ToolOptions, tokenizer, reward_count: int):
        tools = list(tools or [])
        self.environments = Environments(environment_factory, tools) if environment_factory else None
        names = list(self.environments._factories) if self.environments else [None]
        # the schema each environment's rows render (the standalone tools alone without environments)
        self.schemas = {name: tool_schemas(self.environments.tools_for(name) if self.environments else tools)
                        for name in names}
        self.tools = tools
        self._standalone_box = toolbox(tools)  # the standalone tools by name (checks unique names)
        check_tool_template(tokenizer, options.chat_template_kwargs)
        self.options, self.tokenizer = options, tokenizer
        self.max_iterations = (math.inf if options.max_tool_calling_iterations is None
                               else options.max_tool_calling_iterations)
        self.runner: ToolRunner | None = None  # started with the first round (its size needs the rollout count)
        self.reward_functions = self.environments.reward_functions() if self.environments else []
        if reward_count == 0 and not self.reward_functions:
            raise ConfigError("No reward source provided: pass reward_funcs, or an environment_factory whose "
                              "environment defines get_reward.")

    # ------------------------------------------------------------------ set-up of a round

    def _runner(self, rollouts: int) -> ToolRunner:
        if self.runner is None:
            workers = self.options.tool_workers or max(1, min(rollouts, MAX_DEFAULT_WORKERS))
            self.runner = ToolRunner(workers, self.options.tool_timeout)
        return self.runner

    def check_rows(self, rows: list[dict], name: str, first: int = 0) -> None:
        """Tool calling needs conversational prompts (the chat template renders the tools); with several
        environments each row names its own. Errors name the dataset and the row."""
        for index, row in enumerate(rows, start=first):
            if not is_conversational(row["prompt"]):
                raise DatasetFormatError(f"{name} row {index}: with tools or environment_factory the 'prompt' column "
                                         f"must be a conversation (a list of {{'role', 'content'}} messages), which the "
                                         f"chat template renders with the tools; got {type(row['prompt']).__name__}.")
            if self.environments is not None and self.environments.multi and \
                    row.get("environment") not in self.environments._factories:
                raise DatasetFormatError(f"{name} row {index} has environment={row.get('environment')!r}, which is not "
                                         f"among the environments of environment_factory; expected one of "
                                         f"{list(self.environments._factories)}.")

    def _environment_name(self, row: dict):
        return row.get("environment") if self.environments is not None and self.environments.multi else None

    def begin(self, rows: list[dict], given_ids: list[list[int]]) -> tuple[list, list[list[dict]], list[list[int]]]:
        """This process's rollouts of a round: their environments (taken from the pool and reset, all at once),
        their prompts (a string reset returned is appended to the last message, as in TRL) and prompt ids rendered
        with each rollout's tools. Raises the user's error from reset."""
        runner = self._runner(len(rows))
        messages = [list(row["prompt"]) for row in rows]
        environments, changed = None, set()
        if self.environments is not None:
            names = [self._environment_name(row) for row in rows]
            environments = self.environments.take(names)
            # the environment column routes, it is not reset's (TRL's rule with several environments)
            kwargs = [{k: v for k, v in row.items() if not (self.environments.multi and k == "environment")}
                      for row in rows]
            observations = runner.map([functools.partial(env.reset, **kw) for env, kw in zip(environments, kwargs)])
            for i, observation in enumerate(observations):
                if observation is not None:
                    changed.add(i)
                    last = messages[i][-1]
                    messages[i] = messages[i][:-1] + [{**last, "content": last["content"] + str(observation)}]
        kwargs = dict(self.options.chat_template_kwargs or {})
        prompt_ids = list(given_ids)
        for i, (row, conversation) in enumerate(zip(rows, messages)):
            # the dataset's prompt ids hold every tool's schema: re-rendered where reset changed the prompt or
            # the row's environment has tools of its own
            if i in changed or (self.environments is not None and self.environments.multi):
                schemas = self.schemas[self._environment_name(row)]
                prompt_ids[i] = chat_ids(self.tokenizer, conversation, True, tools=schemas or None, **kwargs)
        return environments, messages, prompt_ids

    def _toolbox(self, environment) -> dict:
        return self._standalone_box if environment is None else self.environments.toolbox_of(environment)

    # ------------------------------------------------------------------ the loop

    def run(self, backend: Backend, rows: list[dict], prompt_ids: list[list[int]], params: SamplingParams, *,
            eos_ids: set[int], accelerator) -> Episode:
        """The tool loop for this process's ``rows`` (module docstring; ``prompt_ids``: their prompts' tokens, as
        the dataset rendered them), sampling through ``backend``; a turn ends at one of ``eos_ids``. Every process calls it together (``accelerator``: their collectives)."""
        acc, budget = accelerator, params.max_new_tokens
        error, environments, prompts, given = None, None, None, prompt_ids
        try:  # user code (reset, the chat template): a failure on one process stops all
            environments, prompts, prompt_ids = self.begin(rows, given)
        except Exception as caught:
            error = caught
        dist.raise_together(acc, error)
        n = len(rows)
        completions: list[list[int]] = [[] for _ in range(n)]
        masks: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int | None]] = [[] for _ in range(n)]  # each token's weight version (None: a tool's)
        messages: list[list[dict]] = [[] for _ in range(n)]
        given_logprobs = True  # the backend gave log-probs (vLLM); the policy itself gives none
        given_versions = True  # the backend tagged each token with its weight version (in-flight weight updates)
        counts = ToolCounts(rollouts=n)
        pending, iteration = list(range(n)), 0
        while True:
            # every process samples together, one dummy token where nothing is left here
            ids = [prompt_ids[i] + completions[i] for i in pending] or [prompt_ids[0]]
            room = max([budget - len(completions[i]) for i in pending], default=1)
            out = backend.sample([prompts[i] for i in pending] or [prompts[0]], ids,
                                 dataclasses.replace(params, max_new_tokens=room))
            given_logprobs = given_logprobs and out.logprobs is not None
            given_versions = given_versions and out.versions is not None
            calling = []
            for j, i in enumerate(pending):
                turn_ids = out.completion_ids[j][:budget - len(completions[i])]
                turn = parse_turn(self.tokenizer, turn_ids, prompt_ids[i] + completions[i],
                                  self.schemas[self._environment_name(rows[i])])
                whole = ended(turn_ids, eos_ids)  # a whole turn, not one cut by the budget
                completions[i] += turn_ids
                masks[i] += [1] * len(turn_ids)
                if out.logprobs is not None:
                    logprobs[i] += out.logprobs[j][:len(turn_ids)]
                if out.versions is not None:
                    versions[i] += out.versions[j][:len(turn_ids)]
                messages[i].append(turn.message)
                counts += ToolCounts(malformed=turn.malformed)
                if turn.calls and whole and iteration < self.max_iterations and len(completions[i]) < budget:
                    calling.append((i, turn))
            pending, called = self._call_tools(calling, environments, completions, masks, logprobs, versions, messages,
                                               budget)
            counts += called
            iteration += 1
            if dist.all_reduce_sum(acc, torch.tensor([float(len(pending))], device=acc.device)).item() == 0:
                break
        # a rollout whose last turn was cut by the budget did not finish (TRL's rule after tool calls)
        samples = Samples(prompt_ids, completions, logprobs if given_logprobs else None, masks,
                          finished=[ended(c, eos_ids) for c in completions],
                          versions=versions if given_versions else None)
        return Episode(samples, prompts, messages, environments, counts)

    def _call_tools(self, calling: list[tuple[int, Turn]], environments, completions, masks, logprobs, versions,
                    messages, budget: int) -> tuple[list[int], ToolCounts]:
        """Run the calls of every rollout in ``calling`` at once, append each rollout's tool turn (cut to the
        budget) to its tokens and messages; -> the rollouts that go on sampling, and what the calls did."""
        if not calling:
            return [], ToolCounts()
        boxes = [self._toolbox(environments[i] if environments else None) for i, _ in calling]
        results = self.runner.run_calls([turn.calls for _, turn in calling], boxes)
        failures, truncated, going_on = 0, 0, []
        for (i, _), rollout_results in zip(calling, results):
            failures += sum(result.failed for result in rollout_results)
            suffix, kept, cut = self._fit(rollout_results, budget - len(completions[i]))
            truncated += cut
            if suffix is None:  # not even the tool turn's own tokens fit: the rollout ends here
                continue
            completions[i] += suffix
            masks[i] += [0] * len(suffix)
            logprobs[i] += [math.nan] * len(suffix)
            versions[i] += [None] * len(suffix)
            messages[i] += [{"role": "tool", "name": r.name, "content": r.content} for r in kept]
            if len(completions[i]) < budget:
                going_on.append(i)
        calls = sum(len(turn.calls) for _, turn in calling)
        return going_on, ToolCounts(calls=calls, failures=failures, truncated_results=truncated)

    def _fit(self, results: list[ToolResult], room: int) -> tuple[list[int] | None, list[ToolResult], int]:
        """The tool turn's tokens for ``results`` within ``room`` tokens: as they are when they fit; else each
        result cut to the same share of its text, the largest that fits, and marked (TRUNCATED_MARKER); None when
        even empty results do not fit. -> (tokens or None, the results as appended, how many were cut)."""
        kwargs = self.options.chat_template_kwargs
        suffix = tool_turn_ids(self.tokenizer, results, kwargs)
        if len(suffix) <= room:
            return suffix, results, 0

        def cut(share: float) -> list[ToolResult]:
            return [dataclasses.replace(r, content=r.content[:int(len(r.content) * share)] + TRUNCATED_MARKER)
                    for r in results]

        empty = cut(0.0)
        best = (tool_turn_ids(self.tokenizer, empty, kwargs), empty)
        if len(best[0]) > room:
            return None, [], len(results)
        low, high = 0.0, 1.0  # a share of each result's text that fits, and one that does not
        for _ in range(12):
            share = (low + high) / 2
            trial = cut(share)
            ids = tool_turn_ids(self.tokenizer, trial, kwargs)
            if len(ids) <= room:
                best, low = (ids, trial), share
            else:
                high = share
        return best[0], best[1], len(results)

    def give_back(self, episode: Episode) -> None:
        """The episode's environments are free for another round (its rewards are computed)."""
        if self.environments is not None and episode.environments is not None:
            self.environments.give_back(episode.environments)

    def twin(self) -> ToolLoop:
        """This loop's tools and environments with a tool runner of its own, for rounds sampled in another thread
        (GRPO's asynchronous producer)."""
        twin = copy.copy(self)
        twin.runner = None
        return twin

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
