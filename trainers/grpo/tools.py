"""Tool calling for GRPO rollouts (TRL's ``tools=`` and ``environment_factory=``): parse the calls a model wrote
(``parse_turn``; model output never raises, lost blocks are counted), run every call of a round at once with
failures and timeouts as results (``ToolRunner``; TRL runs one rollout after another), check the chat template and
render a tool turn's tokens to append to the model's own (``check_tool_template``, ``tool_turn_ids``), and pool
environment instances (``Environments``). No trainer here: the rollout stage drives these."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from trainers.errors import ConfigError, DatasetFormatError

_TEMPLATE_FIX = ("Give the tokenizer a chat template that renders tools, e.g. Qwen2.5's "
                 "(trainers.cli.tiny.TOOLS_CHAT_TEMPLATE for the tiny offline tokenizers)")


# -- Parsing what the model wrote -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote."""
    name: str
    arguments: dict


@dataclass(frozen=True)
class Turn:
    """One assistant turn the model wrote, parsed. ``message`` is TRL's form: ``{"role": "assistant", "content":
    str}`` plus ``"tool_calls": [{"type": "function", "function": {"name", "arguments"}}]`` when it has calls (only
    the valid ones, so the chat template can render it back). ``malformed`` counts the tool-call blocks that could
    not be parsed (bad JSON, no ``"name"`` string, arguments not an object, cut off by the length limit)."""
    message: dict
    calls: tuple[ToolCall, ...]
    malformed: int


def _valid_call(raw: Any) -> ToolCall | None:
    """A parsed call (``{"type": "function", "function": {...}}`` or flat ``{name, arguments}``), or None when it
    is unusable. Missing arguments are ``{}`` (templates omit them for calls without arguments); arguments written
    as a JSON string are decoded."""
    function = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = {} if function.get("arguments") is None else function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(function["name"], arguments) if isinstance(arguments, dict) else None


def _message(content: str, calls: Sequence[ToolCall], extra: Mapping | None = None) -> dict:
    message = {**(extra or {}), "role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message


def _opening_pattern(response_template: Mapping) -> re.Pattern | None:
    """How the response template opens a tool call (to count the blocks the parser lost), or None."""
    field = (response_template.get("fields") or {}).get("tool_calls") or {}
    literals = [field["open"]] if isinstance(field.get("open"), str) else field.get("open") or []
    try:
        return re.compile("|".join(map(re.escape, literals)) or field["open_pattern"], re.DOTALL)
    except (KeyError, TypeError, re.error):
        return None


def _parse_with_transformers(tokenizer, completion_ids, prefix_ids, tools) -> Turn:
    """transformers' parser raises on a bad block (the whole turn is then content, as in TRL) or may drop one:
    either way the ``<tool_call>`` openings in the text that did not become a valid call are counted."""
    template = getattr(tokenizer, "response_template", None)
    pattern = _opening_pattern(template) if template is not None else re.compile(re.escape("<tool_call>"))
    openings = len(pattern.findall(tokenizer.decode(completion_ids))) if pattern is not None else 0
    try:
        if template is not None:
            parsed = tokenizer.parse_response(completion_ids, prefix=prefix_ids or [], tools=tools or None)
        else:  # the legacy ``response_schema`` parser takes neither
            parsed = tokenizer.parse_response(completion_ids)
    except Exception:  # noqa: BLE001 - the model's output, whatever it is, must not stop training
        parsed = None
    if not isinstance(parsed, dict):
        return Turn(_message(tokenizer.decode(completion_ids, skip_special_tokens=True), ()), (), openings)
    extra = dict(parsed)
    raw_calls = extra.pop("tool_calls", None)
    raw_calls = raw_calls if isinstance(raw_calls, list) else []
    calls = tuple(call for call in map(_valid_call, raw_calls) if call is not None)
    content = extra.pop("content", None)
    content = content.removesuffix(tokenizer.eos_token or "") if isinstance(content, str) else ""
    malformed = max(openings - len(calls), len(raw_calls) - len(calls), 0)
    return Turn(_message(content, calls, extra), calls, malformed)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


def _json_call(body: str) -> ToolCall | None:
    try:
        return _valid_call(json.loads(body))
    except ValueError:
        return None


def _parse_hermes(tokenizer, completion_ids) -> Turn:
    """The Qwen/Hermes form: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, each parsed on
    its own (a bad or unclosed block is counted, the good ones still run). When every block is a call, the text
    outside them is the content; a block that is not one (bad JSON, cut off by the length limit) stays in the
    content as the model wrote it, so the reward functions see it (TRL: a turn its parser cannot read is its
    text, ``"<tool_call>\\n{\\"name\\": \\"mul"`` for a call cut off)."""
    text = tokenizer.decode(completion_ids)
    text = text.split(tokenizer.eos_token)[0] if tokenizer.eos_token else text
    found = [_json_call(match[1]) if match[2] else None for match in _HERMES_BLOCK.finditer(text)]
    calls = tuple(call for call in found if call is not None)
    if len(calls) == len(found):
        return Turn(_message(_HERMES_BLOCK.sub("", text).strip(), calls), calls, 0)
    # only the blocks that became calls leave the content (they are its tool_calls)
    content = _HERMES_BLOCK.sub(lambda match: "" if match[2] and _json_call(match[1]) else match[0], text)
    return Turn(_message(content, calls), calls, len(found) - len(calls))


def _renders_hermes(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "<tool_call>" in t for t in templates)


def parse_turn(tokenizer, completion_ids: list[int], prefix_ids: list[int] | None, tools: list) -> Turn:
    """Parse one assistant turn: with the tokenizer's ``response_template`` (transformers' ``parse_response``,
    given the prompt ``prefix_ids`` and the ``tools``, which type the arguments) or legacy ``response_schema``;
    else, when the chat template renders ``<tool_call>``, the Hermes form from the text; else the text is the
    content. Never raises on model output."""
    completion_ids = list(completion_ids)
    if not completion_ids:
        return Turn(_message("", ()), (), 0)
    if getattr(tokenizer, "response_template", None) is not None or \
            getattr(tokenizer, "response_schema", None) is not None:
        return _parse_with_transformers(tokenizer, completion_ids, prefix_ids, tools)
    if _renders_hermes(tokenizer):
        return _parse_hermes(tokenizer, completion_ids)
    return Turn(_message(tokenizer.decode(completion_ids, skip_special_tokens=True), ()), (), 0)


# -- Running the calls ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as the tool message's content: ``str(result)`` (as TRL), or for a failure
    ``str({"error": "<short text naming the function>"})``."""
    name: str
    content: str
    failed: bool
    timed_out: bool = False


def _failure(name: str, text: str, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, str({"error": text}), failed=True, timed_out=timed_out)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _call_error(call: ToolCall, tools: Mapping[str, Callable]) -> str | None:
    """Why ``call`` cannot be made (unknown tool, arguments that do not fit the signature), or None."""
    fn = tools.get(call.name)
    if fn is None:
        return f"unknown tool {call.name!r} (tools: {', '.join(tools)})"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins): the call itself will tell
        return None
    try:
        signature.bind(**call.arguments)
    except TypeError as error:
        return f"{getattr(fn, '__name__', call.name)}: {error}"
    return None


@dataclass
class _Job:
    """One call in flight. Its timeout counts from ``started`` (a call waiting for a free worker does not spend
    its time waiting); ``abandoned``: it timed out, and its worker thread left the pool."""
    is_async: bool
    future: Future | None = None
    started: float | None = None
    worker: threading.Thread | None = None
    abandoned: bool = False


class ToolRunner:
    """Runs every tool call of a round at once: async tools on one event loop (a daemon thread, started lazily),
    sync tools on ``workers`` daemon threads (started lazily); each call limited to ``timeout`` seconds from its
    start (None: no limit).

    Python cannot stop a thread: a sync tool that runs past its timeout gets the timed-out result, the round goes
    on, and the call keeps running on its thread until it returns. That thread leaves the pool (another takes its
    place, so later rounds keep ``workers`` threads) and ends when the call returns; being a daemon thread, it does
    not keep the process alive. A timed-out async call is cancelled. An async tool that blocks (``time.sleep``
    instead of ``await asyncio.sleep``) stalls every async call: make such a tool sync.
    """

    def __init__(self, workers: int, timeout: float | None):
        if type(workers) is not int or workers < 1:
            raise ConfigError(f"ToolRunner: workers (tool_workers) must be a positive integer, got {workers!r}")
        if timeout is not None and (type(timeout) not in (int, float) or not timeout > 0):
            raise ConfigError(f"ToolRunner: timeout (tool_timeout) must be positive seconds or None, got {timeout!r}")
        self.workers, self.timeout = workers, timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # the pool's threads (not those left with a hung call)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the pool, the loop, and a job's hand-over when it times out
        self._changed = threading.Condition()  # notified whenever a job starts or finishes
        self._closed = False

    def _start_worker(self) -> None:
        thread = threading.Thread(target=self._work, name="tool-worker", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            job, fn = item
            job.worker, job.started = threading.current_thread(), time.monotonic()
            self._notify()
            try:
                job.future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - handed to the caller with the result
                job.future.set_exception(error)
            with self._lock:
                if job.abandoned:  # it timed out and another thread took this one's place
                    return

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="tool-loop", daemon=True)
            self._loop_thread.start()
        return self._loop

    def _notify(self, *_) -> None:
        with self._changed:
            self._changed.notify_all()

    def _submit(self, fn: Callable[[], Any]) -> _Job:
        """Start ``fn()`` on the loop (async) or queue it for a worker (sync)."""
        job = _Job(inspect.iscoroutinefunction(fn))  # async def functions, methods, partials
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolRunner is closed")
            if job.is_async:
                async def call():
                    return await fn()

                job.started = time.monotonic()
                job.future = asyncio.run_coroutine_threadsafe(call(), self._event_loop())
            else:
                while len(self._threads) < self.workers:
                    self._start_worker()
                job.future = Future()
                self._queue.put((job, fn))
        job.future.add_done_callback(self._notify)
        return job

    def _wait(self, jobs: list[_Job], timeout: float | None) -> None:
        """Block until every job has finished or run ``timeout`` seconds since it started."""
        with self._changed:
            while True:
                now = time.monotonic()
                waiting = [job for job in jobs if not job.future.done()
                           and (timeout is None or job.started is None or now < job.started + timeout)]
                if not waiting:
                    return
                deadlines = [job.started + timeout for job in waiting if timeout is not None and job.started]
                self._changed.wait(min(deadlines) - now if deadlines else None)

    def _settle(self, job: _Job) -> bool:
        """True when the job finished; else give it up: cancel it (async) or replace its thread (sync)."""
        with self._lock:
            if job.future.done():
                return True
            job.abandoned = True
            if job.is_async:
                job.future.cancel()
            elif not self._closed:
                self._threads.remove(job.worker)
                self._start_worker()
            return False

    def run_calls(self, calls: list[Sequence[ToolCall]],
                  toolboxes: list[Mapping[str, Callable]]) -> list[list[ToolResult]]:
        """``calls[i]``: rollout i's calls of this turn; ``toolboxes[i]``: its tools by name. All calls of all
        rollouts run concurrently; the results come back in call order. Never raises for a tool's failure."""
        if len(calls) != len(toolboxes):
            raise ValueError(f"run_calls: {len(calls)} rollouts of calls but {len(toolboxes)} toolboxes")
        results: list[list[ToolResult | None]] = [[None] * len(rollout) for rollout in calls]
        pending = []
        for i, (rollout, tools) in enumerate(zip(calls, toolboxes)):
            for j, call in enumerate(rollout):
                error = _call_error(call, tools)
                if error is not None:
                    results[i][j] = _failure(call.name, error)
                else:
                    fn = tools[call.name]
                    pending.append((i, j, call, fn, self._submit(functools.partial(fn, **call.arguments))))
        self._wait([job for *_, job in pending], self.timeout)
        for i, j, call, fn, job in pending:
            results[i][j] = self._result(call, getattr(fn, "__name__", call.name), job)
        return results

    def _result(self, call: ToolCall, name: str, job: _Job) -> ToolResult:
        if not self._settle(job):
            return _failure(call.name, f"{name} timed out after {self.timeout:g} s", timed_out=True)
        error = job.future.exception()
        if error is None:
            return ToolResult(call.name, str(job.future.result()), failed=False)
        if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt: not the tool's answer
            raise error
        return _failure(call.name, f"{name} raised {type(error).__name__}: {_short(str(error))}")

    def map(self, functions: list[Callable[[], Any]]) -> list[Any]:
        """Run zero-argument callables (sync, or async ones such as ``functools.partial(async_fn, ...)``)
        concurrently, without a timeout; their results in order. The first exception (in order) is re-raised
        after all have finished: used for ``reset`` and ``get_reward``, whose failure is the user's bug."""
        jobs = [self._submit(fn) for fn in functions]
        self._wait(jobs, None)
        for job in jobs:
            if job.future.exception() is not None:
                raise job.future.exception()
        return [job.future.result() for job in jobs]

    def close(self) -> None:
        """Stop the worker threads and the event loop (idempotent). Calls still running are waited for, except
        those already given up after their timeout."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads, loop, loop_thread = list(self._threads), self._loop, self._loop_thread
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            loop_thread.join()
            loop.close()


async def _cancel_all() -> None:
    """Cancel the loop's other tasks (timed-out calls still unwinding) and let them finish."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- Schemas, toolboxes and the chat template -------------------------------------------------------------------------

def _name_of(tool: Any) -> str:
    if not callable(tool):
        raise ConfigError(f"tools: {tool!r} is not callable; a tool is a function (or an environment's method)")
    name = getattr(tool, "__name__", None)
    if not isinstance(name, str):
        raise ConfigError(f"tools: {tool!r} has no __name__; a tool is a function (the model calls it by name)")
    return name


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """The JSON schemas the chat template renders into the prompt, built exactly as transformers does
    (``get_json_schema``: type hints and a Google-style docstring), so the model sees what it sees under TRL."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        name = _name_of(tool)
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:  # transformers' own exceptions, reworded
            raise ConfigError(f"tools: cannot describe {name} to the model: {error}. A tool needs a type hint on "
                              f"every argument and a Google-style docstring with an Args: entry for each") from error
    return schemas


def toolbox(tools: list[Callable]) -> dict[str, Callable]:
    """The tools by name: the model calls a tool by its ``__name__``, so two tools of one name are an error."""
    box: dict[str, Callable] = {}
    for tool in tools:
        name = _name_of(tool)
        if name in box:
            raise ConfigError(f"tools: two tools are named {name!r}; the model calls a tool by name, so tool "
                              f"names (functions and environment methods) must be unique")
        box[name] = tool
    return box


def _render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: Mapping) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _suffix_ids(tokenizer, tool_messages: list[dict], kwargs: Mapping) -> list[int] | None:
    """TRL's ``_get_tool_suffix_ids``: render a dummy exchange with and without the tool turn (and the next
    assistant header), trim the shorter at its last EOS (templates add "\\n" after it), and return what the tool
    turn adds; None when the shorter rendering is not a prefix of the longer (not prefix-preserving)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    exchange = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = _render_ids(tokenizer, exchange, False, kwargs)
    full = _render_ids(tokenizer, exchange + tool_messages, True, kwargs)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    prefix = prefix[:eos[-1] + 1] if eos else prefix
    return full[len(prefix):] if full[:len(prefix)] == prefix else None


def check_tool_template(tokenizer, chat_template_kwargs: dict | None) -> None:
    """Before training: the chat template must render a whole tool exchange (user -> assistant with tool_calls ->
    tool: the tool's name, an argument's key and value, the tool's answer all appear) and be prefix-preserving
    (``tool_turn_ids`` appends a tool turn's tokens to the model's own). TRL's ``supports_tool_calling`` and
    ``is_chat_template_prefix_preserving``."""
    kwargs = dict(chat_template_kwargs or {})
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tools: the tokenizer has no chat template. {_TEMPLATE_FIX}.")
    parts = {"tool name": "tool_name_a8f3", "argument key": "arg_key_b9d4", "argument value": "arg_value_d6e7",
             "tool result": "tool_content_c4f9"}
    call = {"type": "function", "function": {"name": parts["tool name"],
                                             "arguments": {parts["argument key"]: parts["argument value"]}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": parts["tool name"], "content": parts["tool result"]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        suffix = _suffix_ids(tokenizer, messages[2:], kwargs)
    except Exception as error:  # any failure to render: the template's problem
        raise ConfigError(f"tools: the tokenizer's chat template cannot render a tool conversation (user -> "
                          f"assistant with tool_calls -> tool): {type(error).__name__}: {error}. "
                          f"{_TEMPLATE_FIX}.") from error
    dropped = [part for part, sentinel in parts.items() if sentinel not in text]
    if dropped:
        raise ConfigError(f"tools: the tokenizer's chat template does not render tool calls: a tool conversation "
                          f"loses its {', '.join(dropped)}. {_TEMPLATE_FIX}.")
    if suffix is None:
        raise ConfigError(f"tools: the tokenizer's chat template is not prefix-preserving: an assistant turn with "
                          f"tool calls renders differently once a tool result follows it, so the tool turn's tokens "
                          f"cannot be appended to the model's. {_TEMPLATE_FIX}.")


def tool_turn_ids(tokenizer, results: list[ToolResult], chat_template_kwargs: dict | None) -> list[int]:
    """The template's tokens for a tool turn holding ``results`` (in order) and the next assistant header: what
    follows the model's EOS before it writes again."""
    if not results:
        raise ValueError("tool_turn_ids: no results")
    messages = [{"role": "tool", "name": result.name, "content": result.content} for result in results]
    suffix = _suffix_ids(tokenizer, messages, dict(chat_template_kwargs or {}))
    if suffix is None:
        raise ConfigError(f"tools: the tokenizer's chat template is not prefix-preserving for a tool turn of "
                          f"{[result.name for result in results]}. {_TEMPLATE_FIX}.")
    return suffix


# -- Environments -----------------------------------------------------------------------------------------------------

def _methods(instance: Any) -> list[Callable]:
    """An environment's tools: its public methods other than ``reset`` and ``get_reward``, bound. Listed on the
    class, as TRL does (listing the instance would evaluate its properties)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class Environments:
    """TRL's ``environment_factory``: one callable (every row) or ``{name: callable}`` (rows routed by their
    ``environment`` column). An instance per rollout, pooled and reset (construct once, reset often: an instance
    may hold a costly resource); its public methods other than ``reset``/``get_reward`` are its tools."""

    def __init__(self, factory: Callable | Mapping[str, Callable], standalone_tools: list[Callable]):
        self.multi = isinstance(factory, Mapping)
        factories = dict(factory) if self.multi else {None: factory}
        if not factories:
            raise ConfigError("environment_factory: an empty dict; give {name: factory} for each environment")
        self._factories = factories
        self._standalone = list(standalone_tools)
        self._pool: dict[Any, list] = {}
        self._tools: dict[Any, list[Callable]] = {}
        for name, make in factories.items():
            where = f"environment_factory[{name!r}]" if self.multi else "environment_factory"
            if not callable(make):
                raise ConfigError(f"{where} must be callable (a class or a function returning an environment), "
                                  f"got {type(make).__name__}")
            instance = make()  # the probe seeds the pool
            if not callable(getattr(instance, "reset", None)):
                raise ConfigError(f"{where}: {type(instance).__name__} has no callable reset(**row); every "
                                  f"environment needs one (it may return a string appended to the prompt)")
            self._tools[name] = self._standalone + _methods(instance)
            toolbox(self._tools[name])  # names must be unique
            self._pool[name] = [instance]

    def _check(self, name: Any, index: int | None = None) -> None:
        if name not in self._factories:
            where = f"rollout {index} has " if index is not None else ""
            raise DatasetFormatError(f"{where}environment={name!r}, which is not among the environments of "
                                     f"environment_factory; expected one of {list(self._factories)}")

    def tools_for(self, name: Any) -> list[Callable]:
        """The tools a row of environment ``name`` offers (``None`` for a single factory): for its prompt's
        schema and its parser."""
        self._check(name)
        return list(self._tools[name])

    def take(self, names: list) -> list:
        """One instance per rollout (``names[i]``: rollout i's environment), reusing the pool; it grows only
        when a round needs more instances of an environment than were ever made. The caller resets them."""
        for index, name in enumerate(names):
            self._check(name, index)
        taken, used = [], {}
        for name in names:
            index = used.get(name, 0)
            if index == len(self._pool[name]):
                self._pool[name].append(self._factories[name]())
            used[name] = index + 1
            taken.append(self._pool[name][index])
        return taken

    def toolbox_of(self, instance: Any) -> dict[str, Callable]:
        """The standalone tools and the instance's bound methods, by name."""
        return toolbox(self._standalone + _methods(instance))

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """One reward function per environment class that has ``get_reward`` (a class under two names counts
        once), named after the class: ``fn(environments, **kwargs)`` -> one value per rollout, ``None`` for the
        rollouts of another class (left out of the weighted sum). An async ``get_reward`` gives an async function
        awaiting all rollouts together."""
        classes = []
        for pool in self._pool.values():
            cls = type(pool[0])
            if callable(getattr(cls, "get_reward", None)) and cls not in classes:
                classes.append(cls)
        return [(cls.__name__, _reward_function(cls)) for cls in classes]


def _reward_function(cls: type) -> Callable:
    """The exact class, not isinstance: an environment subclassing another is not scored twice."""
    if inspect.iscoroutinefunction(cls.get_reward):
        async def get_reward(environments, **kwargs):
            async def one(environment):
                return await environment.get_reward() if type(environment) is cls else None
            return list(await asyncio.gather(*(one(environment) for environment in environments)))
    else:
        def get_reward(environments, **kwargs):
            return [environment.get_reward() if type(environment) is cls else None for environment in environments]
    get_reward.__name__ = get_reward.__qualname__ = cls.__name__
    return get_reward
