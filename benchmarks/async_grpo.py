"""Asynchronous against synchronous GRPO with the placement held fixed: a `trainers vllm-serve` server on one CPU
core, the trainer on the other, the GRPO demo's task (examples/grpo_arithmetic.py: its SFT warm start, its
settings), the same steps, one after the other in this process.

    python benchmarks/async_grpo.py                      # 800 steps each, about 10 minutes on 2 cores
    python benchmarks/async_grpo.py --steps 200 --bounds 1 2 --modes in_flight
    python benchmarks/async_grpo.py --modes in_flight --alternate 100 --seed 1   # the runs in turn, 100 steps each

Reported per run: seconds per optimizer step (median, and the whole run), the trainer's idle time (synchronous: the
time it waits for the server's completions, measured around the backend's sample; asynchronous: the time it
waits for a round, perf/rollout_wait_s, and for a producer to finish its round before a weight push), the
server's idle time (synchronous: the step minus its sampling; asynchronous: the producer's wait for weights or
room, rollout/backpressure_s), and held-out greedy accuracy every --eval_every steps (evaluation is not timed);
then, by window of --eval_every steps, each run's median step, share of completions sampled across a push and
wait for completions. The host's speed drifts by minutes: with --alternate K the runs train in turn, K steps at a
time (each block resumes from its checkpoint), so that the drift falls on all of them alike.
Each bound runs with the weights pushed in flight (in_flight_weight_updates=True, the default) and between rounds
(False), unless --modes says otherwise; "tokens across a push" is the share of completions sampled across one.
Nothing else may run on the machine meanwhile (two jobs on two cores stall each other: ../shared/NOTES.md).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from grpo_arithmetic import MODEL_SHAPE, exact_answer, greedy_accuracy, grpo_settings, make_splits, warm_up  # noqa: E402

from trainers import GRPOConfig, GRPOTrainer  # noqa: E402
from trainers.cli.tiny import save_tiny_model  # noqa: E402
from trainers.generation.backend import register_backend  # noqa: E402
from trainers.generation.local_server import free_port, start_local_server  # noqa: E402
from trainers.generation.vllm_remote import VLLMRemote  # noqa: E402

SERVER_CORE, TRAINER_CORE = 1, 0


class TimedServer(VLLMRemote):
    """The server backend, timing its sampling (the synchronous trainer's wait for completions)."""

    sampling_seconds = push_seconds = 0.0

    def sync_weights(self, step=None):
        started = time.perf_counter()
        try:
            super().sync_weights(step)
        finally:
            TimedServer.push_seconds += time.perf_counter() - started

    def sample(self, prompts, prompt_ids, params):
        started = time.perf_counter()
        try:
            return super().sample(prompts, prompt_ids, params)
        finally:
            TimedServer.sampling_seconds += time.perf_counter() - started


register_backend("timed_server", TimedServer)


class Record(TrainerCallback):
    """Per step: its time, the sampling time (synchronous) or the pipeline's metrics (asynchronous); held-out
    accuracy every ``every`` steps, outside the step times."""

    def __init__(self, held_out, every):
        self.held_out, self.every, self.steps, self.accuracy, self.trainer = held_out, every, [], {}, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "step_time" in logs:
            self.steps.append({**logs, "sampling_s": TimedServer.sampling_seconds, "push_s": TimedServer.push_seconds})
            TimedServer.sampling_seconds = TimedServer.push_seconds = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            trainer = self.trainer
            self.accuracy[state.global_step] = greedy_accuracy(trainer.unwrapped_model, trainer.processing_class,
                                                               self.held_out)


class Run(TrainerCallback):
    """One run (sync, or async at a bound and mode), trained to ``steps`` in one go or in blocks (``train_to``:
    each block stops at its last step, whose checkpoint the next block resumes from)."""

    def __init__(self, start: str, train_rows, held_out, url: str, steps: int, every: int, bound: int | None,
                 mode: str = "in_flight", seed: int = 0, block: int = 0):
        self.bound, self.mode, self.wall, self.stop_at, self.trained = bound, mode, 0.0, steps, 0
        fields = grpo_settings(tempfile.mkdtemp(prefix="async-grpo-"), steps=steps, seed=seed)
        fields.update(logging_steps=1, disable_tqdm=True, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=url, vllm_group_port=free_port())
        if block:
            fields.update(save_strategy="steps", save_steps=block)
        if bound is None:
            fields.update(use_vllm=False, generation_backend="timed_server")
        else:
            fields.update(async_generation=True, max_staleness=bound, in_flight_weight_updates=mode == "in_flight")
        self.record = Record(held_out, every)
        self.trainer = GRPOTrainer(model=start, reward_funcs=exact_answer, train_dataset=train_rows,
                                   args=GRPOConfig(**fields), callbacks=[self.record, self])
        self.record.trainer = self.trainer
        self.record.accuracy[0] = greedy_accuracy(self.trainer.unwrapped_model, self.trainer.processing_class,
                                                  held_out)
        # the server takes weights from one trainer's group at a time: each train() call connects afresh
        self.trainer.close_generation()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.stop_at:
            control.should_training_stop = True

    def train_to(self, step: int) -> None:
        self.stop_at = step
        started = time.perf_counter()
        self.trainer.train(resume_from_checkpoint=self.trained > 0)
        self.wall += time.perf_counter() - started
        self.trained = step

    def summary(self) -> dict:
        self.trainer.end()
        record, bound, mode, every = self.record, self.bound, self.mode, self.record.every
        rows = record.steps[1:]  # the first step pays the first round and the server's warm-up
        step = statistics.median(r["step_time"] for r in rows)
        if bound is None:
            trainer_idle = statistics.mean(r["sampling_s"] for r in rows)
            server_idle = statistics.mean(r["step_time"] - r["sampling_s"] for r in rows)
            push = statistics.mean(r["push_s"] for r in rows)
        else:
            trainer_idle = statistics.mean(r["perf/rollout_wait_s"] + r["perf/weight_sync_wait_s"] for r in rows)
            server_idle = statistics.mean(r["rollout/backpressure_s"] for r in rows)
            push = statistics.mean(r["perf/weight_sync_s"] - r["perf/weight_sync_wait_s"] for r in rows)
        return {"name": "sync" if bound is None else f"async, bound {bound}, {mode.replace('_', ' ')}",
                "step": step, "wall": self.wall,
                "mixed": statistics.mean(r.get("sample/updated_in_flight", 0.0) for r in rows),
                "trainer_idle": trainer_idle, "server_idle": server_idle, "push": push, "accuracy": record.accuracy,
                "staleness": statistics.mean(r.get("sample/staleness_mean", 0.0) for r in rows),
                "reward": statistics.mean(r["reward"] for r in record.steps[-50:]),
                "windows": [(statistics.median(r["step_time"] for r in rows[i:i + every]),
                             statistics.mean(r.get("sample/updated_in_flight", 0.0) for r in rows[i:i + every]),
                             statistics.mean(r.get("perf/rollout_wait_s", r["sampling_s"]) for r in rows[i:i + every]))
                            for i in range(0, len(rows), every)]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--bounds", type=int, nargs="+", default=[1])
    parser.add_argument("--modes", nargs="+", default=["in_flight", "between_rounds"],
                        choices=["in_flight", "between_rounds"])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--seed", type=int, default=0, help="the RL runs' seed (the SFT warm start stays seed 0's)")
    parser.add_argument("--alternate", type=int, default=0, metavar="K",
                        help="train the runs in turn, K steps at a time (each block resumes from its checkpoint), so "
                             "that the host's drift falls on all of them alike; 0: one whole run after the other")
    cli = parser.parse_args()
    workdir = cli.workdir or tempfile.mkdtemp(prefix="async-grpo-bench-")
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)

    held_out, validation, train_rows = make_splits()
    start = os.path.join(workdir, "start")
    if not os.path.isdir(start):  # the demo's SFT warm start (about half right), saved for the server
        base = save_tiny_model(os.path.join(workdir, "base"), **MODEL_SHAPE)
        model, tokenizer = warm_up(base, train_rows, validation, os.path.join(workdir, "sft"), 0.45)
        model.save_pretrained(start)
        tokenizer.save_pretrained(start)
    server = start_local_server(start, os.path.join(workdir, "server.log"), max_model_len=512, cores=[SERVER_CORE])
    print(f"server up in {server.startup_seconds:.0f} s on core {SERVER_CORE}", flush=True)
    try:
        configs = [(None, "in_flight")] + [(bound, mode) for bound in cli.bounds for mode in cli.modes]
        if cli.alternate:  # every run built first, then trained block by block, in turn
            runs = [Run(start, train_rows, held_out, server.url, cli.steps, cli.eval_every, bound, mode,
                        seed=cli.seed, block=cli.alternate) for bound, mode in configs]
            for step in range(cli.alternate, cli.steps + cli.alternate, cli.alternate):
                for one in runs:
                    one.train_to(min(step, cli.steps))
            results = [one.summary() for one in runs]
        else:  # one after the other
            results = []
            for bound, mode in configs:
                one = Run(start, train_rows, held_out, server.url, cli.steps, cli.eval_every, bound, mode,
                          seed=cli.seed)
                one.train_to(cli.steps)
                results.append(one.summary())
    finally:
        server.stop()
    sync = results[0]["step"]
    print(f"\n| run | s/step (median) | vs sync | whole run | trainer idle / step | server idle / step | "
          f"weight push / step | mean staleness | tokens across a push | held-out accuracy every "
          f"{cli.eval_every} steps | reward, last 50 steps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        curve = " ".join(f"{100 * r['accuracy'][s]:.1f}" for s in sorted(r["accuracy"]))
        print(f"| {r['name']} | {r['step']:.3f} | {sync / r['step']:.2f}x | {r['wall']:.0f} s | "
              f"{r['trainer_idle']:.3f} s | {r['server_idle']:.3f} s | {r['push']:.3f} s | {r['staleness']:.2f} | "
              f"{100 * r['mixed']:.0f}% | {curve} | {r['reward']:.3f} |")
    print(f"\nby {cli.eval_every}-step window: s/step (median), completions across a push, the trainer's wait for "
          f"completions (s/step)")
    for r in results:
        print(f"  {r['name']}: {'  '.join(f'{w:.3f} {100 * m:.0f}% {t:.3f}' for w, m, t in r['windows'])}")


if __name__ == "__main__":
    main()
