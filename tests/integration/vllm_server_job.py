"""GRPO with use_vllm=True, vllm_mode="server", against the server tests/integration/test_vllm_server.py started
(`trainers vllm-serve`), run in its own process: the trainer imports vLLM when it is installed (to check
generation_kwargs), which the pytest process should not. Writes ``OUT/report.json`` (``OUT/MODE/report.json`` for
the modes run together).

    python tests/integration/vllm_server_job.py MODE[,MODE...] URL MODEL_DIR GROUP_PORT OUT
        the single-process modes below (follow, tools, repeat, rloo, distill), one after the other in this process,
        each writing OUT/MODE/report.json (a process of their own each would spend ~15 s starting).
    python tests/integration/vllm_server_job.py follow URL MODEL_DIR GROUP_PORT OUT
        24 steps of the digits task (the reward rises); after each round's sampling the server's greedy
        completions of a few probe prompts against the policy's own (the lean engine, float32 both); during
        SYNC_OFF the weight sync is skipped (a backend registered by this job).
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 \\
        tests/integration/vllm_server_job.py distributed URL MODEL_DIR GROUP_PORT OUT
        3 steps, 2 processes: the main process sends every process's prompts and the weights; the same checks on
        each process. Writes ``OUT/report-<rank>.json``.
    python tests/integration/vllm_server_job.py tools URL MODEL_DIR GROUP_PORT OUT
        2 steps of the tool loop (tests/integration/vllm_tool_rounds.py): the server continues every rollout after
        its tool result.
    python tests/integration/vllm_server_job.py repeat URL MODEL_DIR GROUP_PORT OUT
        three 4-step runs (seeds 0, 0, 1): the two with seed 0 end with the same weights.
    python tests/integration/vllm_server_job.py rloo URL MODEL_DIR GROUP_PORT OUT
        4 steps of RLOOTrainer sampling through the server: the same checks.
    python tests/integration/vllm_server_job.py distill URL MODEL_DIR GROUP_PORT OUT
        4 steps of DistillationTrainer sampling through the server (a local teacher): the same checks.
    python tests/integration/vllm_server_job.py die URL MODEL_DIR GROUP_PORT SERVER_PGID OUT
        the server is killed after step KILL_AFTER: the run stops with a VLLMServerError and a checkpoint, which a
        run without vLLM then resumes for one more step.
"""

import json
import os
import signal
import sys
import time

import torch
from transformers import TrainerCallback

from trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trainers.errors import VLLMServerError
from trainers.generation.backend import register_backend
from trainers.generation.local_server import free_port
from trainers.generation.sampling import SamplingParams, generate
from trainers.generation.vllm_remote import VLLMRemote

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_tool_rounds import scripted_first_turn, tool_report, tool_trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest
from tests.conftest import digits, noisy_model  # noqa: E402

PROMPTS = ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]
PROBES = ["abc", "hello", "12", "the cat", "xyz", "sat on", "7", "q"]
SYNC_OFF = range(3, 6)  # follow: these steps sample without pushing the policy's weights first
KILL_AFTER = 2  # die: the server is killed once this many steps are done


def trainer_for(url, model_dir, group_port, out, rloo=False, **overrides):
    config, trainer = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    args = config(**{**dict(
        output_dir=os.path.join(out, "run"), per_device_train_batch_size=16, num_generations=8,
        max_completion_length=8, learning_rate=1e-2, max_steps=24, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, report_to="none", use_vllm=True, vllm_mode="server",
        vllm_server_base_url=url, vllm_group_port=group_port, vllm_server_timeout=10), **overrides})
    return trainer(model=model_dir, reward_funcs=digits, args=args, train_dataset=[{"prompt": p} for p in PROMPTS * 4])


class Checks(TrainerCallback):
    """After each round (on_rollout_end, before any optimizer step on it): the server's greedy probes against
    the policy's."""

    def __init__(self, trainer):
        self.trainer, self.rounds = trainer, []
        self.probe_ids = [trainer.processing_class(p)["input_ids"] for p in PROBES]
        trainer.add_callback(self)

    def on_rollout_end(self, args, state, control, **kwargs):
        greedy = SamplingParams(max_new_tokens=8, do_sample=False)
        server, _ = self.trainer.vllm_generation.generate(self.probe_ids, greedy)
        trainer = self.trainer
        # the policy's own greedy completions in float32, outside the launcher's bf16 autocast, as the server runs
        policy = generate(trainer.unwrapped_model, self.probe_ids, greedy, trainer.processing_class.pad_token_id,
                          trainer.eos_ids)
        self.rounds.append({"step": state.global_step, "equal": server == policy})


class SyncOff(VLLMRemote):
    """The server backend, except that during SYNC_OFF the server keeps the weights of the step before
    (registered as a backend: the test's negative case, that the weight sync is what keeps the server right)."""

    def sync_weights(self, step=None):
        if step not in SYNC_OFF:
            super().sync_weights(step)


register_backend("vllm_sync_off", SyncOff)
register_backend("scripted_first_turn", scripted_first_turn("vllm_server"))


def records(trainer):
    return [r for r in trainer.state.log_history if "train_runtime" not in r]


def follow(url, model_dir, group_port, out):
    trainer = trainer_for(url, model_dir, group_port, out, use_vllm=False, generation_backend="vllm_sync_off")
    checks = Checks(trainer)
    started = time.perf_counter()
    trainer.train()
    seconds, trained = time.perf_counter() - started, records(trainer)
    closed = trainer.vllm_generation.vllm_client is None
    # used again after train() closed the client: evaluation connects, pushes the weights and samples
    evaluation = trainer.evaluate(eval_dataset=[{"prompt": p} for p in PROMPTS[:4]])
    return {"rounds": checks.rounds, "records": trained, "seconds": seconds, "client_closed": closed,
            "eval_reward": evaluation["eval_reward"], "eval_rounds": len(checks.rounds),
            "closed_after_evaluate": trainer.vllm_generation.vllm_client is None}


def group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def die(url, model_dir, group_port, out, pgid):
    trainer = trainer_for(url, model_dir, group_port, out)
    checks = Checks(trainer)

    class Kill(TrainerCallback):  # the server dies between two steps (OOM killer, machine lost)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == KILL_AFTER:
                os.killpg(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.2)

    trainer.add_callback(Kill)
    report = {}
    started = time.perf_counter()
    try:
        trainer.train()
    except VLLMServerError as error:
        report["error"] = str(error)
    report["seconds_to_stop"] = time.perf_counter() - started
    report["rounds"] = checks.rounds
    report["steps_done"] = trainer.state.global_step
    report["checkpoints"] = sorted(os.listdir(os.path.join(out, "run")))
    report["client_closed"] = trainer.vllm_generation.vllm_client is None
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    # the checkpoint resumes (here without vLLM): the weights of the step the run stopped after, one step more
    resumed_weights = {}

    class Loaded(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            resumed_weights.update({name: p.detach().clone() for name, p in model.named_parameters()})

    resumed = trainer_for(url, model_dir, group_port, out, use_vllm=False, max_steps=KILL_AFTER + 1)
    resumed.add_callback(Loaded)
    resumed.train(resume_from_checkpoint=True)
    report["resumed_steps"] = [r["step"] for r in records(resumed)]  # the checkpoint's log history, and step 3
    report["resumed_weights_equal"] = sorted(weights) == sorted(resumed_weights) and all(
        torch.equal(weights[name], resumed_weights[name]) for name in weights)
    return report


def distributed(url, model_dir, group_port, out):
    trainer = trainer_for(url, model_dir, group_port, out, per_device_train_batch_size=8, max_steps=3)
    checks = Checks(trainer)
    trainer.train()
    report = {"rounds": checks.rounds, "records": records(trainer),
              "client_closed": trainer.vllm_generation.vllm_client is None,
              "is_main_process": trainer.accelerator.is_main_process}
    trainer.end()
    return report


def rloo(url, model_dir, group_port, out):
    trainer = trainer_for(url, model_dir, group_port, out, rloo=True, max_steps=4)
    checks = Checks(trainer)
    trainer.train()
    return {"rounds": checks.rounds, "records": records(trainer)}


def tools(url, model_dir, group_port, out):
    trainer = tool_trainer(os.path.join(out, "run"), model_dir, vllm_mode="server", vllm_server_base_url=url,
                           vllm_group_port=group_port, vllm_server_timeout=10, use_vllm=False,
                           generation_backend="scripted_first_turn")
    trainer.train()
    return tool_report(trainer, trainer.backend)


def repeat(url, model_dir, group_port, out):
    """Three 4-step runs against the server: seeds 0, 0 and 1. Each first pushes its initial weights; every
    completion is sampled with its own seed (trainers/generation/vllm_common.py row_seeds)."""
    report = {"weights": [], "groups_vary": []}
    for seed in (0, 0, 1):
        completions = []

        class Completions(TrainerCallback):
            def on_rollout_end(self, args, state, control, samples=None, **kwargs):
                completions.append(samples.completion_ids)

        trainer = trainer_for(url, model_dir, group_port, os.path.join(out, f"seed{seed}-{len(report['weights'])}"),
                              max_steps=4, seed=seed)
        trainer.add_callback(Completions())
        trainer.train()
        report["weights"].append([float(p.detach().double().sum()) for p in trainer.model.parameters()])
        # a group's 8 completions (one prompt's) are not copies of one another
        report["groups_vary"].append(all(len({tuple(c) for c in round_[:8]}) > 1 for round_ in completions))
        report.setdefault("completions", []).append(completions)
    return report


def distill(url, model_dir, group_port, out):
    from trainers import DistillationConfig, DistillationTrainer

    teacher = noisy_model(model_dir)
    args = DistillationConfig(output_dir=os.path.join(out, "run"), per_device_train_batch_size=16,
                              max_completion_length=8, learning_rate=1e-2, max_steps=4, logging_steps=1,
                              save_strategy="no", disable_tqdm=True, seed=0, report_to="none", use_vllm=True,
                              vllm_mode="server", vllm_server_base_url=url, vllm_group_port=group_port,
                              vllm_server_timeout=10)
    trainer = DistillationTrainer(model=model_dir, teacher_model=teacher, args=args,
                                  train_dataset=[{"prompt": p} for p in PROMPTS * 4])
    checks = Checks(trainer)
    trainer.train()
    return {"rounds": checks.rounds, "records": records(trainer)}


# the modes that run in one process, several one after the other (each pushes its own weights to the server first)
SINGLE_RUNS = {"follow": follow, "tools": tools, "repeat": repeat, "distill": distill, "rloo": rloo}


def main():
    mode, url, model_dir, group_port, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[-1]
    if mode == "distributed":
        report = distributed(url, model_dir, group_port, out)
        name = f"report-{os.environ.get('RANK', '0')}.json"
    elif mode == "die":
        report, name = die(url, model_dir, group_port, out, int(sys.argv[5])), "report.json"
    else:  # one or several of SINGLE_RUNS ("follow,repeat"), one after the other, each in OUT/MODE
        for index, each in enumerate(mode.split(",")):
            folder = os.path.join(out, each)
            os.makedirs(folder, exist_ok=True)
            # a port of its own: follow's trainer keeps its client (and the port) after evaluate()
            port = group_port if index == 0 else free_port()
            with open(os.path.join(folder, "report.json"), "w") as f:
                json.dump(SINGLE_RUNS[each](url, model_dir, port, folder), f)
        return
    with open(os.path.join(out, name), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
