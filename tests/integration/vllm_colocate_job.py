"""GRPO with use_vllm=True (colocate), run in its own process: vLLM's CPU worker pins OpenMP threads and turns
torch.set_num_threads into a no-op for the whole process, so it never runs inside the pytest process. One engine
at a time. Writes ``OUT/report-<rank>.json``, or with several modes (comma-separated, run one after the other in
this process, each engine shut down before the next starts) ``OUT/MODE/report-0.json``.

    python tests/integration/vllm_colocate_job.py single OUT        # 24 steps: learning, greedy equality, SYNC_OFF
    python tests/integration/vllm_colocate_job.py rloo OUT          # RLOOTrainer, 4 steps
    python tests/integration/vllm_colocate_job.py distill OUT       # DistillationTrainer, 4 steps
    python tests/integration/vllm_colocate_job.py lora OUT          # LoRA; SIGTERM, resume, then an exception
    python tests/integration/vllm_colocate_job.py tools OUT         # the tool loop (vllm_tool_rounds.py), 2 steps
    accelerate launch --config_file accelerate_configs/{multi_gpu,zero3}.yaml --num_processes 2 \\
        tests/integration/vllm_colocate_job.py distributed OUT

The check after every round's sampling: the engine's greedy completions of a few probe prompts against the
policy's own (the lean engine, float32 both), so the engine holds this step's weights.
"""

import json
import math
import os
import signal
import sys
import tempfile
import threading
import weakref

import torch

from transformers import TrainerCallback

from trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trainers.cli.tiny import save_tiny_model
from trainers.errors import ConfigError
from trainers.generation.backend import register_backend
from trainers.generation.sampling import SamplingParams
from trainers.generation.vllm_colocate import VLLMColocate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_tool_rounds import scripted_first_turn, tool_report, tool_trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest
from tests.conftest import child_processes, digits, noisy_model  # noqa: E402

PROMPTS = ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]
PROBES = ["abc", "hello", "12", "the cat"]
SYNC_OFF = range(4, 7)  # single: these steps sample without syncing the engine first (the test's negative case)


class Checks(TrainerCallback):
    """After each round (on_rollout_end, before any optimizer step on it): the engine's greedy probes against
    the policy's."""

    def __init__(self, trainer):
        self.trainer, self.rounds, self.engines = trainer, [], []  # engines: a weak reference to each started
        self.probe_ids = [trainer.processing_class(p)["input_ids"] for p in PROBES]
        trainer.add_callback(self)

    def on_rollout_end(self, args, state, control, samples=None, **kwargs):
        trainer = self.trainer
        if not any(ref() is trainer.vllm_generation.llm for ref in self.engines):
            self.engines.append(weakref.ref(trainer.vllm_generation.llm))
        greedy = SamplingParams(max_new_tokens=8, do_sample=False)
        engine, _ = trainer.vllm_generation.generate(self.probe_ids, greedy)
        policy = trainer.generate(self.probe_ids, greedy)  # the policy itself (the lean engine), float32
        core = trainer.vllm_generation.llm.llm_engine  # the adapters it holds, where it serves LoRA
        self.rounds.append({"step": state.global_step, "equal": engine == policy, "children": child_processes(),
                            "adapters": sorted(core.list_loras()) if core.vllm_config.lora_config else None,
                            "logprobs_given": not any(math.isnan(v) for row in samples.logprobs for v in row),
                            "tie_gaps": tie_gaps(trainer.unwrapped_model, self.probe_ids, engine, policy,
                                                 trainer.accelerator.mixed_precision)})
        self.rounds[-1]["equal_but_ties"] = all(gap <= tie for gap, tie in self.rounds[-1]["tie_gaps"])


@torch.no_grad()
def tie_gaps(model, prompts, engine, policy, mixed_precision: str) -> list[tuple[float, float]]:
    """Where the engine's greedy completion first differs from the policy's: the gap between the policy's two
    largest logits there, and the gap under which it is a near tie, which rounding in either implementation may
    decide: 1e-4, or two roundings of the precision the policy computes in at the logits' size (under the
    templates' bf16 mixed precision, Accelerate's autocast around the model's forward gives bf16 logits, 2^-7 apart
    near 1.5: a gap seen on an AVX2 host). One pair per probe that differs."""
    eps = torch.finfo({"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)).eps
    gaps = []
    for prompt, ours, theirs in zip(prompts, policy, engine):
        if ours == theirs:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        top = model(torch.tensor([prompt + ours[:at]])).logits[0, -1].float().topk(2).values
        gaps.append((float(top[0] - top[1]), max(1e-4, 2 * eps * float(top[0].abs()))))
    return gaps


class SyncOff(VLLMColocate):
    """The colocated engine, except that during SYNC_OFF it keeps the weights of the step before (registered
    as a backend: the test's negative case, that the weight sync is what keeps the engine right)."""

    def sync_weights(self, step=None):
        if step not in SYNC_OFF:
            super().sync_weights(step)


register_backend("vllm_sync_off", SyncOff)
register_backend("scripted_first_turn", scripted_first_turn("vllm_colocate"))


def engine_state(trainer, checks, threads_before) -> dict:
    """Whether the engines are gone: each LLM released (its last reference dropped), no thread they started left,
    no child process."""
    new_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    return {"llm_is_none": trainer.vllm_generation.llm is None, "engines": len(checks.engines),
            "llm_collected": all(ref() is None for ref in checks.engines),
            # an idle ThreadPoolExecutor worker was left once in a clean CI run (origin not found yet: issue 34's
            # note); the engine's own threads and processes are what must not outlive it
            "new_threads": [n for n in new_threads if n != "tqdm_monitor" and not n.startswith("ThreadPoolExecutor-")],
            "children": child_processes()}


def write(out, rank, report):
    with open(os.path.join(out, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)


def trainer_for(out, mode, model_dir, reward=digits, **overrides):
    base = dict(output_dir=os.path.join(out, "run"), per_device_train_batch_size=16, num_generations=8,
                max_completion_length=8, learning_rate=1e-2, max_steps=24, logging_steps=1, save_strategy="no",
                disable_tqdm=True, seed=0, use_vllm=True, report_to="none")
    peft_config = None
    if mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    if mode == "distributed":
        base.update(per_device_train_batch_size=8, max_steps=3)
    if mode == "rloo":  # RLOOTrainer on the colocated engine: the sampling base's rollout stage
        base.update(max_steps=4)
        return RLOOTrainer(model=model_dir, reward_funcs=reward, args=RLOOConfig(**{**base, **overrides}),
                           train_dataset=[{"prompt": p} for p in PROMPTS * 4])
    if mode == "distill":  # DistillationTrainer on the colocated engine, from a teacher moved by seeded noise
        from trainers import DistillationConfig, DistillationTrainer

        teacher = noisy_model(model_dir)
        base.pop("num_generations")
        base.update(max_steps=4)
        return DistillationTrainer(model=model_dir, teacher_model=teacher, args=DistillationConfig(**base),
                                   train_dataset=[{"prompt": p} for p in PROMPTS * 4])
    args = GRPOConfig(**{**base, **overrides})
    return GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, peft_config=peft_config,
                       train_dataset=[{"prompt": p} for p in PROMPTS * 4])


def main():
    modes, out = sys.argv[1], sys.argv[2]
    model_dir = os.path.join(out, "model")
    # every process writes the same files, each atomically (save_tiny_model); head_dim 32: vLLM's CPU attention
    # wants >= 32
    save_tiny_model(model_dir, hidden_size=128, num_layers=2)
    threads_before = {t.ident for t in threading.enumerate()}
    if "," not in modes:
        return run(modes, out, model_dir, threads_before)
    for mode in modes.split(","):  # one after the other, each engine shut down before the next starts
        os.makedirs(os.path.join(out, mode), exist_ok=True)
        run(mode, os.path.join(out, mode), model_dir, threads_before)


def run(mode, out, model_dir, threads_before):
    rank = int(os.environ.get("RANK", "0"))
    if mode == "lora":
        return lora(out, model_dir, threads_before)
    if mode == "tools":
        trainer = tool_trainer(os.path.join(out, "run"), model_dir, use_vllm=False,
                               generation_backend="scripted_first_turn")
        trainer.train()
        return write(out, rank, tool_report(trainer, trainer.backend))
    # single: the engine of SyncOff (the colocated one, which skips the sync during SYNC_OFF)
    overrides = dict(use_vllm=False, generation_backend="vllm_sync_off") if mode == "single" else {}
    trainer = trainer_for(out, mode, model_dir, **overrides)
    checks = Checks(trainer)
    trainer.train()
    report = {"rounds": checks.rounds, "records": [r for r in trainer.state.log_history if "train_runtime" not in r],
              "after_train": engine_state(trainer, checks, threads_before)}
    if mode == "distributed":  # the run's own process group survives the engine's shutdown
        gathered = trainer.accelerator.gather(torch.tensor([float(rank)]))
        report["gather_after_close"] = gathered.tolist()
        report["start_failure"] = start_failure(out, model_dir, rank)
        write(out, rank, report)
        trainer.end()
    else:
        write(out, rank, report)


def start_failure(out, model_dir, rank) -> str | None:
    """A second trainer whose engine cannot start on process 1 alone (its temporary folder is missing, so the
    engine's model folder cannot be written): the error each process raised, None if it raised none. Both must
    raise, before either enters vLLM's start (whose collectives would hold process 0 until their timeout)."""
    tempdir = tempfile.tempdir
    if rank == 1:
        tempfile.tempdir = os.path.join(out, "missing")
    try:
        trainer_for(os.path.join(out, "failing"), "distributed", model_dir)
    except ConfigError as error:
        return str(error)
    finally:
        tempfile.tempdir = tempdir
    return None


def lora(out, model_dir, threads_before):
    """LoRA (the engine serves the adapter, vllm_lora_sync's 'auto'): a SIGTERM during step 1 stops the run after it with a checkpoint (the
    engine shut down); the resumed run starts a new engine, and an exception in a reward function at step 3
    shuts that one down too."""
    state = {"calls": 0}

    def reward(completions, **kwargs):
        state["calls"] += 1
        if state["calls"] == 2:  # step 1's round: the loop finishes the step, checkpoints and exits
            signal.raise_signal(signal.SIGTERM)
        if state["calls"] == 4:  # the resumed run's step 3
            raise ValueError("reward function failed on purpose")
        return digits(completions)

    trainer = trainer_for(out, "lora", model_dir, reward=reward, max_steps=4, save_strategy="steps", save_steps=100)
    checks = Checks(trainer)
    report = {}
    try:
        trainer.train()
    except SystemExit as stop:
        report["signal_exit_code"] = stop.code
    report["after_signal"] = engine_state(trainer, checks, threads_before)
    report["checkpoints"] = sorted(os.listdir(os.path.join(out, "run")))
    try:
        trainer.train(resume_from_checkpoint=True)
    except Exception as error:
        report["error"] = f"{type(error).__name__}: {error}"
    report["after_error"] = engine_state(trainer, checks, threads_before)
    report["rounds"] = checks.rounds
    report["records"] = [r for r in trainer.state.log_history if "train_runtime" not in r]
    # the adapter moved the weights (B starts at 0): the engine's equality is not the base model's
    report["lora_b_abs_sum"] = sum(p.abs().sum().item() for n, p in trainer.model.named_parameters() if "lora_B" in n)
    write(out, 0, report)


if __name__ == "__main__":
    main()
