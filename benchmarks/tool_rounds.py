"""A tool-calling round's time, this project against TRL 1.16, on the same script (issue 35, "Concurrency").

    pip install -e ".[bench]"                          # TRL 1.16 (a benchmark-only dependency)
    python benchmarks/tool_rounds.py                   # S = 0.5 s and 0 s, sync and async tools (~7 min, 2 cores)
    python benchmarks/tool_rounds.py --repeats 2       # min / median / max over repeats (~13 min)
    python benchmarks/tool_rounds.py --sleeps 0.5 --kinds sync

The script both frameworks run (``--one``, each run in its own process, with one torch thread; runs of the two
alternate, TRL first then ours, ours then TRL, ...): a tiny Qwen2 (width 64, 2 layers) with
build_tokenizer(tools=True)'s tool-capable template, conversational prompts, ``tools=[lookup]`` where ``lookup``
sleeps S seconds and returns a number (``time.sleep`` in a plain function, or ``asyncio.sleep`` in an
``async def``), per_device_train_batch_size=16 (16 rollouts a round, one round a step), num_generations=4,
max_tool_calling_iterations=1, max_completion_length=160.

An untrained model would not call the tool, so each round's first turn is scripted in both: every rollout
answers one ``lookup`` call (ours: the tool loop's first sampling is replaced, as
tests/integration/vllm_tool_rounds.py's ScriptedFirstTurn does; TRL: the first ``_generate_single_turn`` of each
``_generate``). The tool runs, its result is appended, and the model's own continuation is sampled after it.

Reported per row (tool kind, S): seconds per optimizer step (median over the steps after the warm-up) and the
ratio ours/TRL; the round's time outside sampling (ours: ``ToolLoop.run``, TRL: ``_generate``, each less the time
spent in its sampler: the tool calls, parsing and templating), the longest continuation each sampler generated,
and ``tools/call_frequency`` from both logs (the same script should log the same metric: 1.0, one call per
rollout). TRL runs the calls of a round one rollout after another (an async tool is gathered within its own
rollout only), so its round should pay ~16 x S; this project runs every call of the round at once, ~S. S = 0
gives each loop's own overhead.
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from run_one import StepClock  # benchmarks/ is on the path when this runs as a script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": 7}}\n</tool_call>'
SLEEP = [0.0]  # the run's S, set from --sleep before the trainer is built


def sync_lookup(key: int) -> int:
    """Look a number up in a slow service.

    Args:
        key: The number to look up.
    """
    time.sleep(SLEEP[0])
    return key + 1


async def async_lookup(key: int) -> int:
    """Look a number up in a slow service.

    Args:
        key: The number to look up.
    """
    await asyncio.sleep(SLEEP[0])
    return key + 1


sync_lookup.__name__ = async_lookup.__name__ = "lookup"  # the same tool name (and schema) in every run
TOOLS = {"sync": sync_lookup, "async": async_lookup}


def reward_length(completions, **kwargs):
    """The last turn's length: varied, so every group has a gradient in both frameworks."""
    return [len(str(c[-1].get("content") or "")) / 100 for c in completions]


def rows(n: int = 64) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is the value of entry {i}?"}]} for i in range(n)]


def config_fields(cli) -> dict:
    return dict(output_dir=cli.out, max_steps=cli.steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                report_to="none", gradient_checkpointing=False, seed=0, per_device_train_batch_size=16,
                num_generations=4, max_completion_length=cli.completion_length, learning_rate=1e-6, beta=0.0,
                max_tool_calling_iterations=1)


class RoundClock:
    """Per round: the rollout's wall time outside sampling (the tool calls, parsing, templating: what the loop
    itself costs; ours: ToolLoop.run, TRL: _generate, each less the time in its sampler) and the longest
    continuation the sampler returned (tokens)."""

    def __init__(self):
        self.outside: list[float] = []
        self.tokens: list[int] = []
        self._sampling = 0.0

    @contextlib.contextmanager
    def round(self):
        self._sampling, started = 0.0, time.perf_counter()
        yield
        self.outside.append(time.perf_counter() - started - self._sampling)

    @contextlib.contextmanager
    def sampling(self):
        started = time.perf_counter()
        yield
        self._sampling += time.perf_counter() - started

    def sampled(self, completion_ids: list[list[int]]) -> None:
        self.tokens.append(max(len(c) for c in completion_ids))


def run_ours(cli, tokenizer, call_ids):
    from trainers import GRPOConfig, GRPOTrainer
    from trainers.generation.sampling import Samples

    trainer = GRPOTrainer(model=cli.model, processing_class=tokenizer, reward_funcs=reward_length,
                          train_dataset=rows(), args=GRPOConfig(**config_fields(cli)), tools=[TOOLS[cli.kind]])
    inner_run, inner_sample = trainer.tool_loop.run, trainer.backend.sample
    first, rounds = [False], RoundClock()

    def run(*args, **kwargs):  # a round starts: its first sampling is the scripted call
        first[0] = True
        with rounds.round():
            return inner_run(*args, **kwargs)

    def sample(prompts, prompt_ids, params):
        if first[0]:
            first[0] = False
            return Samples(prompt_ids, [list(call_ids) for _ in prompt_ids])
        with rounds.sampling():
            out = inner_sample(prompts, prompt_ids, params)
        rounds.sampled(out.completion_ids)
        return out

    trainer.tool_loop.run, trainer.backend.sample = run, sample
    clock = StepClock()
    original = trainer.after_optimizer_step  # called once per step, right after the optimizer step
    trainer.after_optimizer_step = lambda metrics: (clock.tick(), original(metrics))[1]
    clock.tick()
    trainer.train()
    trainer.end()
    return clock.times, rounds, [r for r in trainer.state.log_history if "loss" in r]


def run_trl(cli, tokenizer, call_ids):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            clock.tick()

        def on_step_end(self, *args, **kwargs):
            clock.tick()

    trainer = GRPOTrainer(model=cli.model, processing_class=tokenizer, reward_funcs=reward_length,
                          train_dataset=Dataset.from_list(rows()), callbacks=[Clock()],
                          args=GRPOConfig(**config_fields(cli), use_cpu=True), tools=[TOOLS[cli.kind]])
    # TRL 1.16: _generate(prompts) samples the round's first turn with _generate_single_turn(prompt_ids, images,
    # multimodal_fields, num_generations) -> (completion ids, log-probs or None), then _tool_call_loop runs the
    # calls and samples the continuations with _generate_single_turn again.
    inner_generate, inner_single = trainer._generate, trainer._generate_single_turn
    first, rounds = [False], RoundClock()

    def generate(prompts):
        first[0] = True
        with rounds.round():
            return inner_generate(prompts)

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if first[0]:
            first[0] = False
            return [list(call_ids) for _ in prompt_ids], None
        with rounds.sampling():
            completion_ids, logprobs = inner_single(prompt_ids, images, multimodal_fields, num_generations,
                                                    has_tool_images)
        rounds.sampled(completion_ids)
        return completion_ids, logprobs

    trainer._generate, trainer._generate_single_turn = generate, single_turn
    trainer.train()
    return clock.times, rounds, [r for r in trainer.state.log_history if "loss" in r]


def run_one(cli) -> None:
    """One run (``--one ours|trl``): prints RESULT and a JSON line."""
    import torch

    sys.path.insert(0, REPO)
    from trainers.cli.tiny import build_tokenizer

    if cli.threads:
        torch.set_num_threads(cli.threads)
    SLEEP[0] = cli.sleep
    tokenizer = build_tokenizer(tools=True)
    call_ids = tokenizer(CALL + tokenizer.eos_token)["input_ids"]
    times, rounds, logs = (run_ours if cli.one == "ours" else run_trl)(cli, tokenizer, call_ids)
    result = {"step_times": times, "outside_sampling": rounds.outside, "continuation_tokens": rounds.tokens, "call_frequency": [r.get("tools/call_frequency") for r in logs],
              "failure_frequency": [r.get("tools/failure_frequency") for r in logs],
              "mean_length": [r.get("completions/mean_length") for r in logs]}
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


def run(framework: str, kind: str, sleep: float, cli) -> dict:
    out = tempfile.mkdtemp(dir=cli.workdir)
    command = [sys.executable, os.path.abspath(__file__), "--one", framework, "--kind", kind, "--sleep", str(sleep),
               "--model", cli.model, "--out", out, "--steps", str(cli.steps),
               "--completion_length", str(cli.completion_length), "--threads", str(cli.threads)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    process = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if process.returncode != 0:
        raise RuntimeError(f"{framework} {kind} S={sleep} failed:\n{process.stdout[-2000:]}\n{process.stderr[-4000:]}")
    line = next(l for l in process.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def fmt(values: list[float], digits: int = 2) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sleeps", type=float, nargs="+", default=[0.5, 0.0], help="Tool sleep times S (seconds).")
    parser.add_argument("--kinds", nargs="+", choices=sorted(TOOLS), default=["sync", "async"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="Steps left out of the median.")
    parser.add_argument("--completion_length", type=int, default=160,
                        help="max_completion_length: the scripted call (69 tokens), the tool turn (54) and the "
                             "model's continuation together.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in each run (0: torch's default). One: on a 2-core machine shared with "
                             "other jobs, two threads spin against them (HF generate here went 33x slower).")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench-tools"))
    parser.add_argument("--json", help="Write every run's numbers here.")
    # one run, in its own process
    parser.add_argument("--one", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=sorted(TOOLS), help=argparse.SUPPRESS)
    parser.add_argument("--sleep", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.one:
        return run_one(cli)
    if cli.steps <= cli.warmup:
        parser.error(f"--steps ({cli.steps}) must exceed --warmup ({cli.warmup})")
    os.makedirs(cli.workdir, exist_ok=True)
    sys.path.insert(0, REPO)
    from trainers.cli.tiny import build_tokenizer, save_tiny_model

    cli.model = os.path.join(cli.workdir, "model-tools")
    if not os.path.exists(os.path.join(cli.model, "config.json")):
        save_tiny_model(cli.model, tokenizer=build_tokenizer(tools=True), hidden_size=64, num_layers=2)
    results = {}  # (kind, S) -> {"ours": [runs], "trl": [runs]}
    started = time.time()
    for repeat in range(cli.repeats):
        for kind in cli.kinds:
            for sleep in cli.sleeps:
                entry = results.setdefault((kind, sleep), {"ours": [], "trl": []})
                for framework in (("trl", "ours") if repeat % 2 == 0 else ("ours", "trl")):
                    entry[framework].append(run(framework, kind, sleep, cli))
                    print(f"[{time.time() - started:.0f}s] {framework} {kind} S={sleep}: step times "
                          f"{[round(t, 2) for t in entry[framework][-1]['step_times']]}", flush=True)

    def per_step(runs, key="step_times"):  # each run's median over the steps (rounds) after the warm-up
        return [statistics.median(r[key][cli.warmup:]) for r in runs]

    header = ["tool", "S (s)", "TRL s/step", "ours s/step", "ours/TRL (min / median / max)",
              "TRL round outside sampling", "ours round outside sampling", "continuation tokens TRL / ours",
              "tools/call_frequency TRL / ours"]
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for (kind, sleep), entry in results.items():
        trl, ours = per_step(entry["trl"]), per_step(entry["ours"])
        cells = [kind, f"{sleep:g}", f"{statistics.median(trl):.2f}", f"{statistics.median(ours):.2f}",
                 fmt([o / t for o, t in zip(ours, trl)])]
        cells += [f"{statistics.median(per_step(entry[f], 'outside_sampling')):.2f} s" for f in ("trl", "ours")]
        cells.append(" / ".join(f"{max(t for r in entry[f] for t in r['continuation_tokens'])}" for f in ("trl", "ours")))
        frequencies = {f: sorted({v for r in entry[f] for v in r["call_frequency"]}) for f in ("trl", "ours")}
        cells.append(f"{frequencies['trl']} / {frequencies['ours']}")
        print("| " + " | ".join(cells) + " |")
    print(f"\n{cli.repeats} repeats, {cli.steps} steps a run ({cli.warmup} warm-up), total {time.time() - started:.0f} s")
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump({f"{k} {s}": v for (k, s), v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
