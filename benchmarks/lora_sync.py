"""LoRA weight sync to a `trainers vllm-serve` server: the merged weights (vllm_lora_sync="merged": every
weight of the model, each LoRA layer merged as W + BA) against the adapter alone (vLLM's runtime LoRA loading:
the server keeps the base weights and serves the adapter by name), on Qwen2.5-0.5B's shape with r = 16 on every
linear layer of the decoder (random weights; the served dtype, float32 on this CPU, for both).

    python benchmarks/lora_sync.py                 # ~2 minutes on 2 cores, ~8 GB of memory
    python benchmarks/lora_sync.py --shape tiny    # the tiny model: a quick check of the path

Reported per sync: the bytes that reach the server and the seconds (merged: the push through the trainer's
client, median of 3; adapter: the trainer's adapter sync, saving the adapter's files and the server loading them,
median of 3 new versions), and whether greedy completions after each sync equal the policy's
own (the PEFT model merged, in this process). The adapter path needs the server started with `--enable-lora
--max-lora-rank R` (vLLM's flags; `trainers vllm-serve` then sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) and a
folder the server can read (vLLM has no in-memory adapter API).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from trainers.cli.tiny import save_tiny_model  # noqa: E402
from trainers.generation.local_server import free_port, start_local_server  # noqa: E402
from trainers.generation.vllm_client import VLLMClient  # noqa: E402
from trainers.generation.vllm_lora import AdapterFolders  # noqa: E402

SHAPES = {
    "qwen05": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                   vocab_size=151936, rope_theta=1e6),
    "tiny": dict(hidden_size=128, num_layers=2),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7], [10, 11, 12, 13]]


@torch.no_grad()
def reference_greedy(model, tokens: int) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def served_greedy(client: VLLMClient, tokens: int) -> list[list[int]]:
    return client.generate(PROMPTS, temperature=0.0, max_tokens=tokens,
                           generation_kwargs={"ignore_eos": True})["completion_ids"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen05")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    cli = parser.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainers.generation.vllm_common import policy_weights
    from accelerate import Accelerator

    workdir = tempfile.mkdtemp(prefix="lora-sync-")
    model_dir = save_tiny_model(os.path.join(workdir, "base"), **SHAPES[cli.shape])
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                            LoraConfig(r=cli.rank, lora_alpha=2 * cli.rank, target_modules=TARGETS, lora_dropout=0.0))
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    expected = reference_greedy(policy, cli.tokens)  # PEFT applies the adapter (W x + B A x)
    server = start_local_server(model_dir, os.path.join(workdir, "server.log"), max_model_len=512, cores=[1],
                                extra=("--enable-lora", "--max-lora-rank", str(cli.rank), "--max-loras", "2"))
    os.sched_setaffinity(0, {0})
    try:
        client = VLLMClient(server.url, group_port=free_port(), connection_timeout=60, request_timeout=600)
        # the adapter alone, on the server's base weights: the trainer's path (vllm_lora_sync, generation/vllm_lora.py),
        # a new name per version; saving its files and loading it on the server is the sync
        accelerator = Accelerator(cpu=True)
        folders = AdapterFolders(os.path.join(workdir, "adapters"), keep=2)
        adapter_seconds, adapter_bytes, adapter_greedy = [], 0, None
        for version in range(1, 4):
            started = time.perf_counter()
            adapter = folders.save(accelerator, policy, version)
            client.load_adapter(adapter)  # what ServerPool.push_adapter does on every server
            adapter_seconds.append(time.perf_counter() - started)
            adapter_bytes = sum(os.path.getsize(os.path.join(adapter.path, f)) for f in os.listdir(adapter.path)
                                if f.endswith(".safetensors"))
            adapter_greedy = served_greedy(client, cli.tokens)  # the requests name the adapter
        client.adapter = None  # the requests name the base model again
        # the merged weights (vllm_lora_sync="merged"): every weight, each LoRA layer merged
        merged_seconds, merged_bytes = [], 0
        for _ in range(3):
            started = time.perf_counter()
            batches = list(policy_weights(accelerator, policy))
            with client.weight_update():
                for batch in batches:
                    client.update_named_params(batch)
            merged_seconds.append(time.perf_counter() - started)
            merged_bytes = sum(t.numel() * 4 for batch in batches for _, t in batch)  # float32 on the wire
        merged_greedy = served_greedy(client, cli.tokens)
    finally:
        server.stop()
    parameters = sum(p.numel() for p in policy.get_base_model().parameters())
    print(f"\n{cli.shape} ({parameters / 1e6:.0f}M parameters), LoRA r = {cli.rank} on {', '.join(TARGETS)}; "
          f"server on core 1, float32\n")
    print("| sync | bytes per sync | seconds per sync (median of 3) | greedy after it = the policy's |")
    print("|---|---|---|---|")
    print(f"| merged weights | {merged_bytes / 1e6:.1f} MB | {statistics.median(merged_seconds):.3f} s | "
          f"{merged_greedy == expected} |")
    print(f"| adapter alone | {adapter_bytes / 1e6:.2f} MB ({100 * adapter_bytes / merged_bytes:.2f}%) | "
          f"{statistics.median(adapter_seconds):.3f} s | {adapter_greedy == expected} |")


if __name__ == "__main__":
    main()
