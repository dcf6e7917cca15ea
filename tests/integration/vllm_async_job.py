"""Asynchronous GRPO (async_generation) against the server tests/integration/test_vllm_async.py started, in its own
process (the trainer imports vLLM when it is installed). Writes ``OUT/report.json`` (``report-<rank>.json`` with
several processes; ``OUT/MODE/report.json`` for exact and learn).

    python tests/integration/vllm_async_job.py exact,learn URL MODEL_DIR GROUP_PORT OUT
        both below, one after the other in this process (a process of its own each would spend ~15 s starting).
    python tests/integration/vllm_async_job.py exact URL MODEL_DIR GROUP_PORT OUT
        4 steps synchronous, then 4 with async_generation and max_staleness=0: the same weights.
    python tests/integration/vllm_async_job.py learn URL MODEL_DIR GROUP_PORT OUT
        24 steps of the digits task with max_staleness=1: the reward rises; each step's staleness and waits, and
        the completions.jsonl records (each token's weight version).
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 \\
        tests/integration/vllm_async_job.py zero3 URL MODEL_DIR GROUP_PORT OUT
        3 steps, 2 processes under ZeRO-3, max_staleness=1: each process's producer samples its own rows.
    python tests/integration/vllm_async_job.py stall URL MODEL_DIR GROUP_PORT OUT SERVER_PGID
        the server is stopped (SIGSTOP) after step 2, mid-run: the run stops within request_timeout with a
        checkpoint; the server continues (SIGCONT) and the checkpoint resumes asynchronously for 2 more steps.
    python tests/integration/vllm_async_job.py die URL MODEL_DIR GROUP_PORT OUT SERVER_PGID
        the server is killed after step 2: the run stops with a VLLMServerError and a checkpoint of step 2.
"""

import json
import os
import signal
import sys
import time

from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest
from tests.conftest import digits  # noqa: E402
from trainers import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer  # noqa: E402
from trainers.errors import GenerationError, VLLMServerError  # noqa: E402

PROMPTS = ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]
STOP_AFTER = 2  # stall, die: the server is stopped or killed once this many steps are done


def options(url, group_port, out, **overrides) -> dict:
    return {**dict(output_dir=os.path.join(out, "run"), per_device_train_batch_size=16, num_generations=8,
                   max_completion_length=8, learning_rate=1e-2, max_steps=24, logging_steps=1, save_strategy="no",
                   disable_tqdm=True, seed=0, report_to="none", vllm_server_base_url=url, vllm_group_port=group_port,
                   vllm_server_timeout=10, lr_scheduler_type="linear", gradient_checkpointing=False), **overrides}


def grpo(model_dir, url, group_port, out, **overrides) -> GRPOTrainer:
    """A synchronous GRPOTrainer in server mode (with async_generation=True among ``overrides``: asynchronous)."""
    args = GRPOConfig(**options(url, group_port, out, use_vllm=True, vllm_mode="server", **overrides))
    return GRPOTrainer(model=model_dir, reward_funcs=digits, args=args,
                       train_dataset=[{"prompt": p} for p in PROMPTS * 4])


def async_grpo(model_dir, url, group_port, out, **overrides) -> AsyncGRPOTrainer:
    """TRL's experimental contract: AsyncGRPOConfig / AsyncGRPOTrainer, its argument order."""
    args = AsyncGRPOConfig(**options(url, group_port, out, **overrides))
    return AsyncGRPOTrainer(model_dir, digits, args, [{"prompt": p} for p in PROMPTS * 4])


def records(trainer) -> list[dict]:
    return [r for r in trainer.state.log_history if "train_runtime" not in r]


def weights(trainer) -> list[float]:
    return [float(p.detach().double().sum()) for p in trainer.model.parameters()]


def exact(url, model_dir, group_port, out) -> dict:
    sync = grpo(model_dir, url, group_port, os.path.join(out, "sync"), max_steps=4)
    sync.train()
    bound0 = async_grpo(model_dir, url, group_port, os.path.join(out, "async"), max_steps=4, max_staleness=0)
    bound0.train()
    return {"sync": weights(sync), "async": weights(bound0), "records": records(bound0),
            "closing": bound0.state.log_history[-1]}


def learn(url, model_dir, group_port, out) -> dict:
    trainer = async_grpo(model_dir, url, group_port, out, max_staleness=1, log_completions=True)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    with open(os.path.join(out, "run", "completions.jsonl")) as f:
        completions = [json.loads(line) for line in f]
    return {"records": records(trainer), "seconds": seconds, "completions": completions}


def zero3(url, model_dir, group_port, out) -> dict:
    trainer = async_grpo(model_dir, url, group_port, out, max_staleness=1, max_steps=3,
                         per_device_train_batch_size=8)
    trainer.train()
    report = {"records": records(trainer), "weights": weights(trainer),
              "is_main_process": trainer.accelerator.is_main_process}
    trainer.end()
    return report


def interrupted(url, model_dir, group_port, out, pgid, how) -> dict:
    """The server is stopped (``how`` = "stall": SIGSTOP, continued later) or killed after STOP_AFTER steps."""

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STOP_AFTER:
                os.killpg(pgid, signal.SIGSTOP if how == "stall" else signal.SIGKILL)

    timeouts = dict(request_timeout=5, weight_sync_timeout=5, heartbeat_stale_after_s=20)
    trainer = async_grpo(model_dir, url, group_port, out, max_staleness=1, max_steps=6, **timeouts)
    trainer.add_callback(Stop())
    report = {}
    started = time.perf_counter()
    try:
        trainer.train()
    except (VLLMServerError, GenerationError) as error:
        # a VLLMServerError, or a subclass of it (VLLMServerDown: the server did not answer)
        family = "VLLMServerError" if isinstance(error, VLLMServerError) else type(error).__name__
        report["error"], report["error_type"] = str(error), family
    report["seconds_to_stop"] = time.perf_counter() - started
    report["steps_done"] = trainer.state.global_step
    report["checkpoints"] = sorted(os.listdir(os.path.join(out, "run")))
    if how == "stall":  # the server goes on; the checkpoint resumes, asynchronously, for two more steps
        os.killpg(pgid, signal.SIGCONT)
        resumed = async_grpo(model_dir, url, group_port, out, max_staleness=1, max_steps=STOP_AFTER + 2,
                             **timeouts)
        resumed.train(resume_from_checkpoint=True)
        report["resumed_steps"] = [r["step"] for r in records(resumed)]
    return report


def main():
    mode, url, model_dir, group_port, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    if mode == "zero3":
        report, name = zero3(url, model_dir, group_port, out), f"report-{os.environ.get('RANK', '0')}.json"
    elif mode in ("stall", "die"):
        report, name = interrupted(url, model_dir, group_port, out, int(sys.argv[6]), mode), "report.json"
    else:  # exact, learn, or both ("exact,learn"), one after the other in this process, each in OUT/MODE
        for each in mode.split(","):
            folder = os.path.join(out, each)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "report.json"), "w") as f:
                json.dump({"exact": exact, "learn": learn}[each](url, model_dir, group_port, folder), f)
        return
    with open(os.path.join(out, name), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
