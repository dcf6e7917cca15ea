"""Rewards served from elsewhere, against real local servers started with the CLI: ``trainers sandbox-serve`` (the
code_execution reward's remote executor) and ``trainers reward-serve`` (a reward model behind a URL in
reward_funcs). Both listen on 127.0.0.1 by default and refuse requests without their key; the remote executor
judges as the local one does, the reward server scores as the in-process reward model does, and a reward server
that dies mid-run stops the run with a checkpoint."""

import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import TrainerCallback

from tests.conftest import REPO, config_factory, free_port
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import RemoteServiceError
from trainers.execution import ExecutionLimits, LocalExecutor, Program, RemoteExecutor, parse_tests
from trainers.sampling.rewards import load_reward_model, resolve_reward
from trainers.services.http import post_json

pytestmark = pytest.mark.slow

KEY = "test-key-123"
config = config_factory(GRPOConfig, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                        learning_rate=1e-2, max_steps=2)
PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12"] * 4]


def serve(*args: str) -> tuple[subprocess.Popen, str]:
    """``trainers <args>`` on a free port with KEY; (the process, its URL) once /health answers with the key."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "trainers.cli.main", *args, "--port", str(port), "--api-key",
                                KEY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {process.stdout.read()[-3000:]}")
        try:
            post_json(url, "/info", {}, KEY, 2, "server")
            return process, url
        except RemoteServiceError:
            time.sleep(0.3)
    process.kill()
    raise AssertionError("the server did not answer within 120 s")


def stop(process: subprocess.Popen) -> str:
    process.kill()
    return process.communicate()[0]


def test_the_sandbox_server_needs_its_key_and_judges_as_the_local_executor():
    limits = ["--cpu_seconds", "2", "--wall_seconds", "3", "--max_workers", "2"]
    process, url = serve("sandbox-serve", *limits)
    try:
        tests = parse_tests("assert add(2, 3) == 5\nassert add(0, 0) == 0", "tests", 0)
        programs = [Program("def add(a, b):\n    return a + b", tests), Program("def add(a, b):\n    return a", tests),
                    Program("def add(a, b):\n    while True:\n        pass", tests), Program(None, tests),
                    Program("print(input()[::-1])", parse_tests([{"input": "abc", "output": "cba"}], "t", 0))]
        remote = RemoteExecutor(url, api_key=KEY).run(programs)
        local = LocalExecutor(ExecutionLimits(cpu_seconds=2, wall_seconds=3), max_workers=2).run(programs)
        assert [o.status for o in remote] == ["passed", "failed", "timeout", "no code", "passed"]
        assert [(o.status, o.passed, o.total) for o in remote] == [(o.status, o.passed, o.total) for o in local]
        with pytest.raises(RemoteServiceError, match=rf"sandbox server at {url} answered /run with HTTP 401"):
            RemoteExecutor(url, api_key="").run(programs[:1])
        with pytest.raises(RemoteServiceError, match="HTTP 401 \\(give the server's key\\)"):
            RemoteExecutor(url, api_key="wrong").run(programs[:1])
        with pytest.raises(RemoteServiceError, match="HTTP 400"):
            post_json(url, "/run", {"programs": [{"code": "x"}]}, KEY, 10, "sandbox server")
    finally:
        output = stop(process)
    assert f"serving on {url} (a key is required)" in output  # 127.0.0.1: the loopback default


class KillAfterFirstStep(TrainerCallback):
    def __init__(self, process):
        self.process = process

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.process.kill()
            self.process.wait()


def test_the_reward_server_scores_as_the_model_does_and_its_death_stops_the_run_with_a_checkpoint(
        tiny_model_dir, tokenizer, tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    rm_config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64, num_labels=1,
                            pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(rm_config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    process, url = serve("reward-serve", "--model", str(tmp_path / "rm"), "--batch-size", "3")
    try:
        os.environ["TRAINERS_REWARD_API_KEY"] = KEY
        remote = resolve_reward(url, 8)
        local = load_reward_model(str(tmp_path / "rm"))
        prompts = ["abc", "hello", "xyz", "12", "the"]
        completions = ["def", " world", "zy", "34", " cat sat"]
        assert remote.name == "rm"
        got, expected = remote.func(prompts, completions), local(prompts, completions)
        assert got == pytest.approx(expected, abs=1e-5) and len(set(got)) > 1
        chat, answer = [[{"role": "user", "content": "hi"}]] * 2, [[{"role": "assistant", "content": "yo"}]] * 2
        assert remote.func(chat, answer) == pytest.approx(local(chat, answer), abs=1e-5)
        # the trainer's chat_template_kwargs reach the server's template, as the in-process model's
        kwargs = {"add_generation_prompt": True}
        with_kwargs = resolve_reward(url, 8, chat_template_kwargs=kwargs).func(chat, answer)
        in_process = load_reward_model(str(tmp_path / "rm"), chat_template_kwargs=kwargs)(chat, answer)
        assert with_kwargs == pytest.approx(in_process, abs=1e-5)
        assert with_kwargs != pytest.approx(remote.func(chat, answer), abs=1e-5)  # they changed what was scored
        with pytest.raises(RemoteServiceError, match="HTTP 401"):
            post_json(url, "/score", {"prompts": ["a"], "completions": ["b"]}, None, 10, "reward server")

        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=url, train_dataset=PROMPTS,
                              args=config(tmp_path, max_steps=3), callbacks=[KillAfterFirstStep(process)])
        with pytest.raises(RemoteServiceError, match="checkpoint written to .*checkpoint-1"):
            trainer.train()
        assert trainer.state.log_history[0]["rewards/rm/std"] > 0  # step 1 was scored by the server
        assert os.path.isdir(tmp_path / "out" / "checkpoint-1")
    finally:
        os.environ.pop("TRAINERS_REWARD_API_KEY", None)
        stop(process)
