"""The tool loop over a real vLLM engine, for tests/integration/vllm_colocate_job.py and vllm_server_job.py (mode
"tools"): each round's first turn is scripted (every rollout calls multiply; an untrained tiny model would not),
every turn after it is vLLM's, sampled from the prompt, the scripted call and the tool turn's tokens as token ids.
Reported per round: the tool messages the reward functions saw and the sampler's log-probs against the trainer's
on the model's own tokens (``sampling/sampling_logp_difference``)."""

import math

from trainers import GRPOConfig, GRPOTrainer
from trainers.cli.tiny import build_tokenizer
from trainers.generation.backend import build_backend
from trainers.generation.sampling import Samples

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
PROMPTS = [[{"role": "user", "content": f"What is 6 times 7? ({i})"}] for i in range(4)]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def scripted_first_turn(engine: str):
    """A backend (for register_backend) over the vLLM backend ``engine`` ("vllm_colocate" or "vllm_server"):
    the first turn of each round (prompts without an assistant turn yet) answers CALL for every rollout; the
    turns after the tool results are the engine's own. ``continuations``: how many times the engine sampled."""

    class ScriptedFirstTurn:
        def __init__(self, inputs):
            self.inner, self.tokenizer = build_backend(engine, inputs), inputs.tokenizer
            self.call_ids = self.tokenizer(CALL + self.tokenizer.eos_token)["input_ids"]
            self.continuations = 0
            self.llm, self.vllm_client = self.inner.llm, self.inner.vllm_client

        def sample(self, prompts, prompt_ids, params):
            if all(self.tokenizer.decode(ids).count("<|im_start|>assistant") == 1 for ids in prompt_ids):
                return Samples(prompt_ids, [list(self.call_ids) for _ in prompt_ids],
                               [[math.nan] * len(self.call_ids) for _ in prompt_ids])
            self.continuations += 1
            return self.inner.sample(prompts, prompt_ids, params)

        def sync_weights(self, step=None):
            self.inner.sync_weights(step)

        def close(self):
            self.inner.close()

    return ScriptedFirstTurn


def tool_trainer(output_dir, model_dir, **overrides) -> GRPOTrainer:
    seen = []

    def saw_the_tool(completions, **kwargs):
        """1 when the rollout holds the tool's answer (42) as a tool message; the messages are recorded."""
        seen.extend(completions)
        return [float(any(m["role"] == "tool" and m["content"] == "42" for m in c)) for c in completions]

    args = GRPOConfig(**{**dict(
        output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=160,
        learning_rate=1e-3, max_steps=2, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
        report_to="none", use_vllm=True, max_tool_calling_iterations=1), **overrides})
    trainer = GRPOTrainer(model=model_dir, processing_class=build_tokenizer(tools=True), reward_funcs=saw_the_tool,
                          args=args, train_dataset=[{"prompt": p} for p in PROMPTS], tools=[multiply])
    trainer.seen_completions = seen
    return trainer


def tool_report(trainer, scripted) -> dict:
    records = [r for r in trainer.state.log_history if "train_runtime" not in r]
    return {"records": records, "continuations": scripted.continuations,
            "completions": trainer.seen_completions[:4]}


def check_tool_rounds(report: dict, in_sync: float) -> None:
    """A "tools" job's report: every rollout called the tool once and the engine went on after
    the tool turn (token ids in), with its log-probs equal to the trainer's on the model's tokens; the reward
    functions saw the tool message."""
    assert report["continuations"] == 2  # one continuation per round, every rollout at once
    for record in report["records"]:
        assert record["tools/call_frequency"] == 1.0 and record["tools/failure_frequency"] == 0.0
        assert record["tools/malformed_frequency"] == 0.0 and record["reward"] == 1.0
        assert record["sampling/sampling_logp_difference/mean"] < in_sync
    for completion in report["completions"]:
        roles = [m["role"] for m in completion]
        assert roles == ["assistant", "tool", "assistant"], completion
        assert completion[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
        assert completion[1] == {"role": "tool", "name": "multiply", "content": "42"}
