"""The tool turn in the loss, this project against TRL 1.16, on the same rollouts (issue 42, item 5).

    pip install -e ".[bench]"                                    # TRL 1.16 (a benchmark-only dependency)
    python benchmarks/tool_mask_parity.py                        # the replay (~2 min on 2 cores)
    python benchmarks/tool_mask_parity.py --seeds 0 1 2 3 4      # and free runs of both (~2 min per seed)

The set-up: the tool demo's tokenizer and model shape (examples/grpo_tools.py), 80 steps of SFT on transcripts that
all call ``multiply`` (so the model calls it ~2 times in 3); then GRPO with ``tools=[multiply]`` where ``multiply``
returns a fixed 40-letter random string, a reward of 1 when a completion got that string as a tool result, 16
prompts x 4 generations a step, 10 steps. What is measured: the model's NLL (nats per token) of the string as the
tool message of a rendered conversation (16 fixed ones: a prompt, a call, the result, the next header), and of the
tool turn's other (template) tokens, before and after.

1. **Replay.** Ours trains 10 steps and keeps every round's tokens; TRL then trains 10 steps on exactly those
   tokens (its ``_generate_single_turn`` answers each turn with ours, so TRL's own tool loop runs the calls,
   appends its tool turns and builds its ``tool_mask``). Failed calls read as TRL words them in both (the one place
   their tool turns' tokens differ). Compared: every row's loss mask position by position, the advantages, the
   last step's gradient, the final weights and the string's NLL.
2. **Free runs** (``--seeds``): each framework samples its own rollouts; the NLL before and after per seed.

The learning rate is 3e-4: at the issue's 1e-3 this model stops calling after one step, in both frameworks.
Each run is its own process.
"""

import argparse
import collections
import json
import os
import random
import string
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
SECRET = "".join(random.Random(42).choice(string.ascii_letters) for _ in range(40))


def multiply(a: int, b: int) -> int:  # the schema the warm-up rendered (the model calls it); returns SECRET
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return SECRET


def got_it(completions, **kwargs):
    """1 when the completion got SECRET as a tool result."""
    return [1.0 if any(m["role"] == "tool" and m["content"] == SECRET for m in c) else 0.0 for c in completions]


def warm_model(path: str) -> None:
    """The tool demo's tokenizer and model shape, 80 SFT steps on transcripts that all call multiply."""
    from grpo_tools import MODEL_SHAPE, make_splits, sft, sft_conversations, task_tokenizer

    from trainers.cli.tiny import save_tiny_model

    _, _, train = make_splits()
    base = save_tiny_model(os.path.join(path, "base"), tokenizer=task_tokenizer(sft_conversations(train, 0.5)),
                           **MODEL_SHAPE)
    sft(base, sft_conversations(train, 1.0), os.path.join(path, "sft"), 80, 2e-3, 0).save_model(
        os.path.join(path, "warm"))


def nll(model_dir: str) -> dict:
    """The mean NLL of SECRET's tokens and of the tool turn's other tokens over 16 rendered conversations."""
    import torch
    from grpo_tools import make_splits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainers.agents.rendering import tool_schemas

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    held_out, _, _ = make_splits()
    secret, template = [], []
    for row in held_out[:16]:
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}}}
        head = row["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [call]}]
        text = tok.apply_chat_template(head + [{"role": "tool", "name": "multiply", "content": SECRET}],
                                       tools=tool_schemas([multiply]), tokenize=False, add_generation_prompt=True)
        head_text = tok.apply_chat_template(head, tools=tool_schemas([multiply]), tokenize=False)
        head_text = head_text[:head_text.rindex(tok.eos_token) + len(tok.eos_token)]  # up to the call's EOS
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        start = text.index(SECRET, len(head_text))
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        for t in range(1, len(ids)):  # the tool turn's tokens: after the call's EOS
            if offsets[t][0] >= len(head_text):
                nats = -logps[t - 1, ids[t]].item()
                (secret if start <= offsets[t][0] and offsets[t][1] <= start + len(SECRET) else template).append(nats)
    return {"secret": sum(secret) / len(secret), "template": sum(template) / len(template)}


def one(cli) -> None:
    """One framework's run (a subprocess): ``--replay`` ours saves its rounds, TRL replays them."""
    import torch
    from grpo_tools import make_splits
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(1)
    _, _, train = make_splits()
    rows = [{"prompt": r["prompt"]} for r in train[:16 if cli.replay else 16 * cli.steps]]
    fields = {"output_dir": cli.out, "per_device_train_batch_size": 64, "num_generations": 4,
              "max_completion_length": 192, "max_tool_calling_iterations": 1, "learning_rate": cli.lr,
              "max_steps": cli.steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "bf16": False,
              "seed": cli.seed, "beta": 0.0, "disable_tqdm": True}
    model = os.path.join(cli.work, "warm")
    tok = AutoTokenizer.from_pretrained(model)
    grads = {}

    class LastGradient(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for name, param in trainer.model.named_parameters():
                grads[name] = param.grad.detach().clone()

    if cli.one == "ours":
        from trainers import GRPOConfig, GRPOTrainer
        if cli.replay:  # failed calls worded as TRL words them, so both tool turns are the same tokens
            from trainers.agents import runner as tools

            tools._call_error = lambda call, box: None if call.name in box else f"Tool {call.name} not found."

            def trl_result(self, call, name, job):
                self._settle(job)
                error = job.future.exception()
                if error is None:
                    return tools.ToolResult(call.name, str(job.future.result()), failed=False)
                return tools.ToolResult(call.name, str({"error": str(error)}), failed=True)

            tools.ToolRunner._result = trl_result
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[got_it], args=GRPOConfig(**fields),
                              train_dataset=rows, tools=[multiply], callbacks=[LastGradient()])
        episodes, rounds = [], []
        run, build_round = trainer.tool_loop.run, trainer.build_round
        trainer.tool_loop.run = lambda *a, **k: episodes.append(run(*a, **k)) or episodes[-1]
        trainer.build_round = lambda index: rounds.append(build_round(index)) or rounds[-1]
    else:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[got_it],
                              args=GRPOConfig(**fields, use_cpu=True, gradient_checkpointing=False),
                              train_dataset=Dataset.from_list(rows), tools=[multiply], callbacks=[LastGradient()])
        if cli.replay:
            saved = torch.load(os.path.join(cli.work, "ours.pt"))
            turns = collections.defaultdict(collections.deque)  # the ids a turn was sampled from -> its ids
            for prompt, completion, mask in (r for step in saved["rounds"] for r in zip(*step)):
                start = 0
                while start < len(completion):
                    end = start
                    while end < len(completion) and mask[end] == mask[start]:
                        end += 1
                    if mask[start]:
                        turns[tuple(prompt + completion[:start])].append(completion[start:end])
                    start = end
            trainer._generate_single_turn = lambda prompt_ids, *a, **k: (
                [turns[tuple(p)].popleft() for p in prompt_ids], None)
            outputs, score = [], trainer._generate_and_score_completions
            trainer._generate_and_score_completions = lambda inputs: outputs.append(score(inputs)) or outputs[-1]
    trainer.train()
    trainer.save_model(os.path.join(cli.out, "final"))
    result = {"framework": cli.one, "seed": cli.seed, "before": nll(model), "after": nll(os.path.join(cli.out, "final"))}
    if cli.replay and cli.one == "ours":
        last = rounds[-1]
        torch.save({"rounds": [(e.samples.prompt_ids, e.samples.completion_ids, e.samples.model_mask)
                               for e in episodes],
                    "prompt_ids": episodes[-1].samples.prompt_ids, "completion_ids": episodes[-1].samples.completion_ids,
                    "loss_mask": last.loss_mask.cpu(), "advantages": last.advantages.cpu(), "grads": grads,
                    "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}},
                   os.path.join(cli.work, "ours.pt"))
    elif cli.replay:
        result.update(compare(torch.load(os.path.join(cli.work, "ours.pt")), outputs[-1], grads,
                              trainer.model.state_dict()))
    print("RESULT " + json.dumps(result), flush=True)


def compare(ours: dict, out: dict, grads: dict, weights: dict) -> dict:
    """TRL's last round against ours, row by row (rows matched by their tokens), and the gradients and weights."""
    index = {(tuple(p), tuple(c)): i for i, (p, c) in enumerate(zip(ours["prompt_ids"], ours["completion_ids"]))}
    trl_mask = out["completion_mask"] * out["tool_mask"]
    masks_equal = advantages_equal = 0
    for r in range(trl_mask.shape[0]):
        completion = out["completion_ids"][r][out["completion_mask"][r].bool()].tolist()
        i = index[(tuple(out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist()), tuple(completion))]
        masks_equal += trl_mask[r, :len(completion)].tolist() == ours["loss_mask"][i, :len(completion)].tolist()
        advantages_equal += abs(out["advantages"][r].item() - ours["advantages"][i].item()) < 1e-6
    dot = sum((grads[k] * g).sum().item() for k, g in ours["grads"].items())
    norms = [sum((g * g).sum().item() for g in d.values()) ** 0.5 for d in (grads, ours["grads"])]
    weight_gap = max(((weights[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-30)).item()
                     for k, v in ours["weights"].items())
    return {"rows": trl_mask.shape[0], "loss_masks_equal": masks_equal, "advantages_equal": advantages_equal,
            "gradient_cosine": dot / (norms[0] * norms[1]), "weights_max_relative_difference": weight_gap}


def launch(args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True, env=env,
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"run {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=None, help="Where the model and runs go (default: a temporary folder).")
    parser.add_argument("--seeds", type=int, nargs="*", default=[], help="Free runs of both frameworks.")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--one", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.one:
        return one(cli)
    work = cli.work or tempfile.mkdtemp(prefix="tool-mask-parity-")
    if not os.path.isdir(os.path.join(work, "warm")):
        warm_model(work)
    common = ["--work", work, "--steps", str(cli.steps), "--lr", str(cli.lr)]
    ours = launch(common + ["--one", "ours", "--replay", "--out", os.path.join(work, "replay-ours")])
    trl = launch(common + ["--one", "trl", "--replay", "--out", os.path.join(work, "replay-trl")])
    print(f"replay, {cli.steps} steps: loss masks equal on {trl['loss_masks_equal']}/{trl['rows']} rows of the last "
          f"round, advantages on {trl['advantages_equal']}/{trl['rows']}, last gradient cosine "
          f"{trl['gradient_cosine']:.8f}, final weights within {trl['weights_max_relative_difference']:.1e} (relative)")
    print("NLL of the string / of the tool turn's template tokens (nats per token), before -> after:")
    for name, r in (("ours", ours), ("TRL on our rollouts", trl)):
        print(f"  {name:22s} {r['before']['secret']:.3f} -> {r['after']['secret']:.3f}   "
              f"{r['before']['template']:.3f} -> {r['after']['template']:.3f}")
    for seed in cli.seeds:
        for framework in ("ours", "trl"):
            r = launch(common + ["--one", framework, "--seed", str(seed),
                                 "--out", os.path.join(work, f"free-{framework}-{seed}")])
            print(f"free run, seed {seed}, {framework:4s}: string {r['before']['secret']:.2f} -> "
                  f"{r['after']['secret']:.2f}, template {r['before']['template']:.2f} -> {r['after']['template']:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
