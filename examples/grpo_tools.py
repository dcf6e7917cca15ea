"""A tiny model learns through RL to call a tool for what it cannot do in its head: multiply 3-digit numbers.

    python examples/grpo_tools.py            # no network, no GPU; ~2 minutes on 2 CPU cores (docs/grpo.md)
    python examples/grpo_tools.py --vllm_server [--async_generation]   # sampling from a vLLM server it starts

1. Generate problems ("What is 123 * 456?") and split them: held out for the final score, validation, training.
2. Build a tiny Qwen2 and a tokenizer whose chat template renders tools (Qwen2.5's Hermes <tool_call> form with
   a short system block: trainers/cli/tiny.py). The tokenizer is a BPE trained on the task's own transcripts,
   words one token, digits one token each, so a whole conversation is ~210 tokens instead of ~640 bytes.
3. Warm up with SFT, in two stages. First on transcripts that all call ``multiply`` (an assistant turn with the
   call, the tool's result, then "The answer is 56088."), until the model, made to call, answers most
   validation problems right: it has then learned to copy the numbers into the call and the tool's result
   into its answer, which a tiny model learns suddenly, after a step that moves with the seed and the machine.
   Then briefly on transcripts of which only a minority call and the rest answer straight away. It cannot
   multiply 3-digit numbers in its head, so after the warm-up its greedy answers are guesses and wrong, while
   the few samples that call the tool get most problems right.
4. Train with GRPO (``tools=[multiply]``) and an exact-answer reward: the samples that called the tool score,
   the guesses do not, and the model learns to call. Reported: greedy held-out accuracy and tool calls per
   problem, before and after RL, and the reward and tools/call_frequency of the training rounds.
"""

import argparse
import os
import random
import time

import torch
from transformers import TrainerCallback

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.generation.sampling import SamplingParams, generate
from trainers.agents.parsing import parse_turn
from trainers.agents.rendering import tool_schemas, tool_turn_ids, toolbox
from trainers.agents.runner import ToolRunner
from trainers.cli.tiny import build_task_tokenizer, build_tokenizer, save_tiny_model
from trainers.generation.local_server import start_local_server


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


TOOLS = [multiply]
MODEL_SHAPE = {"hidden_size": 128, "num_layers": 4}
CALL_START = "<tool_call>\n"  # how a call opens in the template (trainers/cli/tiny.py); one token


def make_splits(seed: int = 0, digits: int = 3, held_out: int = 200, validation: int = 64,
                train: int = 3000) -> tuple[list[dict], list[dict], list[dict]]:
    """Distinct pairs of ``digits``-digit numbers -> (held out, validation, train) rows: a conversational
    prompt, the two numbers and the expected final answer."""
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < held_out + validation + train:
        pairs.add((rng.randint(low, high), rng.randint(low, high)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "a": a, "b": b,
             "answer": f"The answer is {a * b}."} for a, b in ordered]
    return rows[:held_out], rows[held_out:held_out + validation], rows[held_out + validation:]


def transcript(row: dict, calls_tool: bool) -> list[dict]:
    """A problem's SFT conversation: a call to ``multiply``, its result and the answer; or the answer alone."""
    if not calls_tool:
        return row["prompt"] + [{"role": "assistant", "content": row["answer"]}]
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}}}
    return row["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "name": "multiply", "content": str(row["a"] * row["b"])},
                            {"role": "assistant", "content": row["answer"]}]


def final_answer(messages: list[dict]) -> str:
    """The content of the last assistant message: the answer (a completion is a list of messages with tools)."""
    contents = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
    return contents[-1].strip() if contents else ""


def exact_answer(completions, answer, **kwargs):
    """1.0 when the final answer is exactly "The answer is <the product>.", else 0.0."""
    return [1.0 if final_answer(messages) == expected else 0.0 for messages, expected in zip(completions, answer)]


def greedy_eval(model, tokenizer, rows: list[dict], force_call: bool = False, max_turn_tokens: int = 48
                ) -> tuple[float, float]:
    """Greedy answers with the tool, as in training (token in, token out): a turn; where it calls ``multiply``,
    the call runs, the tool turn's tokens are appended and the answer follows. ``force_call`` starts every first
    turn with a call (the warm-up's check that calls and answers are right). -> (accuracy, calls per problem)."""
    was_training = model.training
    model.eval()
    schemas = tool_schemas(TOOLS)
    eos = {tokenizer.eos_token_id}
    params = SamplingParams(max_new_tokens=max_turn_tokens, do_sample=False)
    forced = tokenizer(CALL_START, add_special_tokens=False)["input_ids"] if force_call else []
    prompts = [list(tokenizer.apply_chat_template(r["prompt"], tools=schemas, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for r in rows]
    first = generate(model, [p + forced for p in prompts], params, tokenizer.pad_token_id, eos)
    answers, calling = [], {}  # calling: rollout index -> (prompt + its first turn, that turn's calls)
    for i, (prompt, generated) in enumerate(zip(prompts, first)):
        turn_ids = forced + generated
        turn = parse_turn(tokenizer, turn_ids, prompt, schemas)
        answers.append(turn.message["content"].strip())
        if turn.calls and turn_ids[-1:] == [tokenizer.eos_token_id]:
            calling[i] = (prompt + turn_ids, turn.calls)
    runner = ToolRunner(workers=1, timeout=None)  # the training loop's runner: its error results, its checks
    try:
        results = runner.run_calls([calls for _, calls in calling.values()], [toolbox(TOOLS)] * len(calling))
    finally:
        runner.close()
    follow_up = {i: ids + tool_turn_ids(tokenizer, turn_results, None)
                 for (i, (ids, _)), turn_results in zip(calling.items(), results)}
    calls = sum(len(turn_calls) for _, turn_calls in calling.values())
    if follow_up:
        second = generate(model, list(follow_up.values()), params, tokenizer.pad_token_id, eos)
        for i, turn_ids in zip(follow_up, second):
            answers[i] = tokenizer.decode(turn_ids, skip_special_tokens=True).strip()
    model.train(was_training)
    accuracy = sum(answer == r["answer"] for answer, r in zip(answers, rows)) / len(rows)
    return accuracy, calls / len(rows)


class StopWhenCallsAreRight(TrainerCallback):
    """Every ``every`` steps: greedy validation accuracy with the call forced; stops training at ``target``."""

    def __init__(self, validation: list[dict], target: float, every: int):
        self.validation, self.target, self.every = validation, target, every
        self.accuracy = 0.0

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every == 0:
            self.accuracy, _ = greedy_eval(model, processing_class, self.validation, force_call=True)
            print(f"  SFT {state.global_step} steps: validation accuracy when calling {self.accuracy:.1%}",
                  flush=True)
            control.should_training_stop = self.accuracy >= self.target
        return control


def sft_conversations(train: list[dict], call_share: float, seed: int = 0) -> list[list[dict]]:
    """Transcripts of the training problems: ``call_share`` of them call the tool, the rest answer straight away."""
    rng = random.Random(seed)
    return [transcript(r, rng.random() < call_share) for r in train]


def task_tokenizer(conversations: list[list[dict]]):
    """A BPE trained on the transcripts as the tool template renders them (trainers/cli/tiny.py)."""
    renderer = build_tokenizer(tools=True)  # the same template; used here only to render text
    schemas = tool_schemas(TOOLS)
    texts = [renderer.apply_chat_template(c, tools=schemas, tokenize=False) for c in conversations]
    return build_task_tokenizer(texts, tools=True)


def sft(model, conversations: list[list[dict]], output_dir: str, steps: int, learning_rate: float, seed: int,
        callbacks=(), processing_class=None) -> SFTTrainer:
    """``steps`` of SFT on the transcripts, the assistant turns only (assistant_only_loss: the prompt and the
    tool's result are masked out); the trained trainer."""
    rows = [{"messages": c, "tools": tool_schemas(TOOLS)} for c in conversations]
    args = SFTConfig(
        output_dir=output_dir, per_device_train_batch_size=16, learning_rate=learning_rate, max_steps=steps,
        lr_scheduler_type="constant_with_warmup", warmup_steps=20, assistant_only_loss=True,
        max_length=256,  # a whole transcript is ~210 tokens, ~120 of them the system block listing the tool
        save_strategy="no", logging_steps=50, disable_tqdm=True, seed=seed, bf16=False, report_to="none")
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=processing_class,
                         callbacks=list(callbacks))
    trainer.train()
    return trainer


def warm_up(model_path: str, train: list[dict], validation: list[dict], output_dir: str, call_share: float,
            target: float, max_steps: int, mix_steps: int, seed: int = 0, every: int = 50):
    """The SFT warm-up, in two stages. 1: transcripts that all call the tool, until the model, made to call,
    answers ``target`` of the validation problems right (copying three digits twice into the call and the result
    into the answer is what takes a tiny model from scratch longest: on transcripts that call only a third of
    the time it had not learned it after 1,500 steps). 2: ``mix_steps`` steps on transcripts of which only
    ``call_share`` call, the rest guessing, which sets how often the model calls before RL. Stage 1 checks the
    validation accuracy every ``every`` steps. Returns (model, tokenizer)."""
    stop = StopWhenCallsAreRight(validation, target, every=every)
    calling = sft(model_path, sft_conversations(train, 1.0, seed), os.path.join(output_dir, "calls"), max_steps,
                  2e-3, seed, callbacks=[stop])
    if stop.accuracy < target:
        raise RuntimeError(f"SFT warm-up stopped at {max_steps} steps with validation accuracy when calling "
                           f"{stop.accuracy:.1%} < --warmup_target {target:.0%}: RL from there gets little reward")
    mixed = sft(calling.unwrapped_model, sft_conversations(train, call_share, seed + 1),
                os.path.join(output_dir, "mixed"), mix_steps, 1e-3, seed, processing_class=calling.processing_class)
    return mixed.unwrapped_model, mixed.processing_class


def grpo_settings(output_dir: str, steps: int, learning_rate: float, num_generations: int, seed: int) -> dict:
    """The RL stage's config fields (the same names in TRL's GRPOConfig). 16 rollouts a step; a rollout is a
    call (34 tokens), its tool turn (~20) and the answer (~12), or the answer alone."""
    return {"output_dir": output_dir, "per_device_train_batch_size": 16, "num_generations": num_generations,
            "max_completion_length": 96, "max_tool_calling_iterations": 1, "learning_rate": learning_rate,
            "max_steps": steps, "logging_steps": 5, "logging_first_step": True, "save_strategy": "no", "bf16": False,
            "beta": 0.0, "seed": seed, "report_to": "none", "disable_tqdm": True}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/grpo-tools")
    parser.add_argument("--digits", type=int, default=3, help="Digits of each factor.")
    parser.add_argument("--call_share", type=float, default=0.3,
                        help="Share of stage 2's transcripts that call the tool.")
    parser.add_argument("--warmup_target", type=float, default=0.6,
                        help="Validation accuracy when calling that ends stage 1 of the warm-up.")
    parser.add_argument("--max_sft_steps", type=int, default=1500, help="At most this many steps of stage 1.")
    parser.add_argument("--mix_steps", type=int, default=100, help="Steps of stage 2.")
    parser.add_argument("--grpo_steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=5e-4, help="GRPO's learning rate.")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--held_out", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm_server", action="store_true",
                        help="Sample from a vLLM server this script starts on the warm-started model (on one CPU "
                             "core, the trainer on the others; needs vLLM: bash scripts/setup.sh vllm).")
    parser.add_argument("--async_generation", action="store_true",
                        help="With the server: sample ahead of training (docs/grpo.md, 'Asynchronous generation').")
    parser.add_argument("--max_staleness", type=int, default=1, help="With --async_generation: the bound.")
    parser.add_argument("--warm_start", help="Skip the SFT warm-up: RL from this saved model (with its tokenizer), "
                                             "e.g. OUTPUT_DIR/warm-start of an earlier run.")
    cli = parser.parse_args(argv)

    started = time.time()
    held_out, validation, train = make_splits(cli.seed, cli.digits, cli.held_out)
    tokenizer = task_tokenizer(sft_conversations(train, 0.5, cli.seed))  # both kinds of transcript
    base = save_tiny_model(os.path.join(cli.output_dir, "base-model"), tokenizer=tokenizer, **MODEL_SHAPE)
    print(f"1. tiny model built offline; {len(train)} training / {len(validation)} validation / "
          f"{len(held_out)} held-out problems", flush=True)

    start = cli.warm_start or os.path.join(cli.output_dir, "warm-start")  # a warm-up saves its warm start there
    if cli.warm_start:  # a warm start saved before
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"2. the SFT warm start from {cli.warm_start}", flush=True)
        model, tokenizer = AutoModelForCausalLM.from_pretrained(cli.warm_start), AutoTokenizer.from_pretrained(
            cli.warm_start)
    else:
        print(f"2. SFT warm-up: transcripts that call the tool, then {cli.mix_steps} steps on transcripts of which "
              f"{cli.call_share:.0%} call", flush=True)
        model, tokenizer = warm_up(base, train, validation, os.path.join(cli.output_dir, "sft"), cli.call_share,
                                   cli.warmup_target, cli.max_sft_steps, cli.mix_steps, seed=cli.seed)
        model.save_pretrained(start)
        tokenizer.save_pretrained(start)
    before = greedy_eval(model, tokenizer, held_out)
    print(f"   held-out after SFT (greedy): accuracy {before[0]:.1%}, tool calls per problem {before[1]:.2f}  "
          f"({time.time() - started:.0f} s)", flush=True)

    settings = grpo_settings(cli.output_dir, cli.grpo_steps, cli.learning_rate, cli.num_generations, cli.seed)
    server, threads, cores = None, torch.get_num_threads(), sorted(os.sched_getaffinity(0))
    if cli.vllm_server or cli.async_generation:  # the saved warm start, served on the last core
        model = start  # the trainer loads it from there: the server checks it serves the trainer's model
        server = start_local_server(start, os.path.join(cli.output_dir, "server.log"), max_model_len=512,
                                    cores=cores[-1:])
        print(f"   the warm start served at {server.url} (started in {server.startup_seconds:.0f} s)", flush=True)
        os.sched_setaffinity(0, cores[:-1] or cores)
        torch.set_num_threads(max(1, len(cores) - 1))
        settings.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
        if cli.async_generation:
            settings.update(async_generation=True, max_staleness=cli.max_staleness)
    mode = ("asynchronous, bound " + str(cli.max_staleness)) if cli.async_generation else \
        "vLLM server" if server else "the lean engine"
    print(f"3. GRPO with tools=[multiply]: {cli.grpo_steps} steps, exact-answer reward ({mode})", flush=True)
    try:
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=exact_answer,
                              train_dataset=train, tools=TOOLS, args=GRPOConfig(**settings))
        rl_started = time.time()
        trainer.train()
        rl_seconds = time.time() - rl_started
    finally:
        if server is not None:
            server.stop()
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
    logged = [r for r in trainer.state.log_history if "tools/call_frequency" in r and "loss" in r]  # steps
    for record in logged:
        print(f"   step {record['step']:3d}: reward {record['reward']:.2f}, "
              f"tools/call_frequency {record['tools/call_frequency']:.2f}", flush=True)
    after = greedy_eval(trainer.unwrapped_model, tokenizer, held_out)
    trainer.save_model(os.path.join(cli.output_dir, "final"))

    print(f"\nheld-out (greedy, {len(held_out)} unseen problems): accuracy {before[0]:.1%} -> {after[0]:.1%}, "
          f"tool calls per problem {before[1]:.2f} -> {after[1]:.2f}")
    print(f"GRPO {rl_seconds:.0f} s; total {time.time() - started:.0f} s; model saved to "
          f"{os.path.join(cli.output_dir, 'final')}")
    return before, after, logged


if __name__ == "__main__":
    main()
