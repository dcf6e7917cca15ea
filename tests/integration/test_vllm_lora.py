"""Adapter-only LoRA sync (vllm_lora_sync) against a real vLLM server started with --enable-lora (one for this
module: a tiny width-128 Qwen2, CPU, fp32): GRPO with a LoRA policy sends the adapter alone at each sync, and the
server, serving it by name on its own base weights, samples what the policy would (greedy equal after every push,
log-probs equal to the trainer's); asynchronous GRPO's requests keep the adapter they were sent with, so each
completion is one version, within the bound. The colocated engine's adapter path is
test_vllm_colocate.py's LoRA test; the choice between the two paths is tests/unit/test_vllm_lora.py's."""

import json
import os
import urllib.request

import pytest
import torch
from transformers import TrainerCallback

from tests.conftest import digits, step_records
from trainers.generation.local_server import start_local_server
from trainers.generation.sampling import SamplingParams

IN_SYNC = 1e-4  # |log pi_server - log pi_policy| per token, float32 both (W x + B A x on either side)
PROBES = [[1, 2, 3, 4], [10, 20, 30], [5, 6], [100, 101, 102]]


@pytest.fixture(scope="module")
def lora_server(vllm_python, tmp_path_factory):
    from trainers.cli.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("vllm_lora")
    model_dir = save_tiny_model(str(root / "model"), hidden_size=128, num_layers=2)
    server = start_local_server(model_dir, str(root / "server.log"), max_model_len=512,
                                extra=("--python", vllm_python, "--enable-lora", "--max-lora-rank", "8",
                                       "--max-loras", "2"))
    try:
        yield server, model_dir
    finally:
        server.stop(grace=5)


class Follow(TrainerCallback):
    """After each round: the server's greedy completions of PROBES (through the trainer's backend: they name the
    adapter) and the policy's own."""

    def __init__(self, trainer):
        self.trainer, self.rounds = trainer, []
        trainer.add_callback(self)

    def on_rollout_end(self, args, state, control, **kwargs):
        greedy = SamplingParams(max_new_tokens=8, do_sample=False)
        served, _ = self.trainer.vllm_generation.generate(PROBES, greedy)
        self.rounds.append({"step": state.global_step, "served": served, "policy": self.trainer.generate(PROBES, greedy)})


def served_models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as answer:
        return [m["id"] for m in json.load(answer)["data"]]


def lora_args(out, url, **extra):
    from trainers import GRPOConfig

    return GRPOConfig(**{**dict(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        learning_rate=5e-2, max_steps=4, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
        report_to="none", use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_lora_sync="adapter"),
        **extra})


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)


def test_the_server_serves_the_synced_adapter_and_samples_as_the_policy(lora_server, tmp_path):
    """4 GRPO steps: after every push the server's greedy completions equal the policy's, while the policy's own
    move away from the base model's (so following it is not standing still); the sampler's log-probs equal the
    trainer's; the server holds the newest two adapters by name; what a sync wrote is the adapter alone."""
    from trainers import GRPOTrainer

    server, model_dir = lora_server
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=lora_args(tmp_path / "run", server.url),
                          train_dataset=[{"prompt": p} for p in ["abc", "hello", "xyz", "12"] * 4],
                          peft_config=lora_config())
    follow = Follow(trainer)
    trainer.train()
    assert [r["step"] for r in follow.rounds] == [0, 1, 2, 3]
    assert all(r["served"] == r["policy"] for r in follow.rounds), follow.rounds
    assert follow.rounds[-1]["policy"] != follow.rounds[0]["policy"]  # the adapter moved the policy's greedy
    assert all(r["sampling/sampling_logp_difference/mean"] < IN_SYNC for r in step_records(trainer))
    adapters = [name for name in served_models(server.url) if name.startswith("policy-")]
    assert len(adapters) == 2, adapters  # the current one and the one before (vllm_lora.py's keep)
    folders = sorted(os.listdir(tmp_path / "run" / ".vllm_lora"))
    assert len(folders) == 2 and set(folders) == set(adapters)
    sent = sum(os.path.getsize(tmp_path / "run" / ".vllm_lora" / folders[0] / f)
               for f in os.listdir(tmp_path / "run" / ".vllm_lora" / folders[0]))
    lora_bytes = sum(p.numel() * 4 for n, p in trainer.model.named_parameters() if "lora_" in n)
    model_bytes = sum(p.numel() * 4 for p in trainer.model.get_base_model().parameters())
    assert sent < 2 * lora_bytes + 10_000 and sent < model_bytes / 20, (sent, lora_bytes, model_bytes)


def test_asynchronous_requests_keep_their_adapter(lora_server, tmp_path):
    """Asynchronous GRPO (bound 1, in flight) with adapter sync: no pause is needed, each request finishes on the
    adapter it was sent with, so every completion's tokens are of one version, never more than one push behind."""
    from trainers import GRPOTrainer

    server, model_dir = lora_server
    args = lora_args(tmp_path / "run", server.url, async_generation=True, max_staleness=1, log_completions=True,
                     max_steps=6)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=args,
                          train_dataset=[{"prompt": p} for p in ["abc", "hello", "xyz", "12"] * 8],
                          peft_config=lora_config())
    trainer.train()
    with open(tmp_path / "run" / "completions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 6 * 8
    assert all(len(row["version_spans"]) == 1 for row in rows), [row["version_spans"] for row in rows]
    for row in rows:
        trained_at = row["step"] - 1  # the optimizer step whose round it is
        assert trained_at - 1 <= row["version_spans"][0][0] <= trained_at, row
    assert all(r["sample/updated_in_flight"] == 0 for r in step_records(trainer))
    assert torch.isfinite(torch.tensor([r["loss"] for r in step_records(trainer)])).all()


def test_merged_sync_of_a_lora_policy_keeps_the_server_on_the_policy(lora_server, tmp_path):
    """vllm_lora_sync='merged' against the same server: every weight sent with each LoRA layer merged (W + BA), the
    requests naming the base model; greedy equal to the policy's after every push."""
    from trainers import GRPOTrainer

    server, model_dir = lora_server
    args = lora_args(tmp_path / "run", server.url, vllm_lora_sync="merged", max_steps=3)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=args,
                          train_dataset=[{"prompt": p} for p in ["abc", "hello", "xyz", "12"] * 4],
                          peft_config=lora_config())
    follow = Follow(trainer)
    trainer.train()
    assert all(r["served"] == r["policy"] for r in follow.rounds) and len(follow.rounds) == 3, follow.rounds
    assert follow.rounds[-1]["policy"] != follow.rounds[0]["policy"]
    assert not os.path.exists(tmp_path / "run" / ".vllm_lora")
