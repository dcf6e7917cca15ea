"""The parts of use_vllm that need no engine: TRL's sampling-option mapping, the weights sent to the engine (a
tied head, LoRA merged), and the clear error without vLLM. The engine itself: tests/integration/test_vllm_colocate.py."""

import pytest
import torch
from accelerate import Accelerator

import trainers.loop.base
import trainers.generation.vllm_common
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError
from trainers.generation.sampling import SamplingParams
from trainers.generation.vllm_common import policy_weights, vllm_sampling_kwargs
from trainers.cli.tiny import build_model


def test_sampling_options_map_as_trl_maps_them():
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, min_p=None,
                            repetition_penalty=1.1, extra={"seed": 3, "top_p": 0.5})
    kwargs = vllm_sampling_kwargs(params, {7, 2})
    assert kwargs == {"n": 1, "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.5, "top_k": 5, "min_p": 0.0,
                      "max_tokens": 12, "logprobs": 0, "stop_token_ids": [2, 7], "seed": 3}  # generation_kwargs win
    greedy = vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, do_sample=False), {2})
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["min_p"]) == (0.0, 0, 1.0, 0.0)


def _sent(model) -> dict[str, torch.Tensor]:
    return {name: tensor for batch in policy_weights(Accelerator(cpu=True), model) for name, tensor in batch}


def test_the_full_state_dict_is_sent_tied_head_included():
    model = build_model(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert "lm_head.weight" not in dict(model.named_parameters())  # tied: the trap
    sent = _sent(model)
    expected = model.state_dict()
    assert sorted(sent) == sorted(expected) and "lm_head.weight" in sent
    assert all(torch.equal(sent[name], expected[name]) for name in expected)


def test_lora_is_sent_merged_without_touching_the_policy():
    from peft import LoraConfig, get_peft_model

    base = build_model(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():  # B starts at 0: make the adapter count
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    before = {name: p.clone() for name, p in model.named_parameters()}
    sent = _sent(model)
    # an engine that serves the adapter itself gets the base weights under the same names (vllm_lora_sync)
    base_only = {name: t for batch in policy_weights(Accelerator(cpu=True), model, merge_lora=False)
                 for name, t in batch}
    assert torch.equal(base_only["model.layers.0.self_attn.q_proj.weight"],
                       before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    merged = model.merge_and_unload().state_dict()  # peft's own merge, for reference (after _sent)
    assert sorted(base_only) == sorted(merged)
    assert sorted(sent) == sorted(merged)
    assert all(torch.allclose(sent[name], merged[name], atol=1e-6) for name in merged)
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    with pytest.raises(ConfigError, match="DoRA"):
        dora = get_peft_model(build_model(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1),
                              LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
        _sent(dora)


def test_use_vllm_without_vllm_is_a_clear_error_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(trainers.generation.vllm_common, "vllm_missing", lambda: "vLLM is not importable (ImportError: x)")
    monkeypatch.setattr(trainers.loop.base, "load_causal_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=r"`use_vllm=True` with vllm_mode=.colocate. needs vLLM here: vLLM is not importable"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, use_vllm=True),
                    train_dataset=[{"prompt": "a"}])


def test_a_groups_rows_become_one_seeded_request_for_n_completions():
    """Rows of one prompt with consecutive seeds: one request for n completions from the first seed (vLLM seeds its
    n with s, s + 1, ...); a new prompt or a break in the seeds starts another; the requests keep the rows' order."""
    from trainers.generation.vllm_remote import seeded_requests

    rows = [[1, 2]] * 3 + [[3]] * 2 + [[1, 2]]
    assert seeded_requests(rows, [10, 11, 12, 13, 14, 15]) == [([[1, 2]], 3, 10), ([[3]], 2, 13), ([[1, 2]], 1, 15)]
    assert seeded_requests(rows[:2], [10, 20]) == [([[1, 2]], 1, 10), ([[1, 2]], 1, 20)]
    assert seeded_requests([], []) == []


@pytest.mark.parametrize("inflight, most", [(-1, 4), (1, 1), (2, 2)])
def test_the_producers_requests_in_flight_are_at_most_max_inflight_tasks(tmp_path, inflight, most):
    """async_generation's sampler (ServerSampler, one process's rows) sends a round's requests together, at most
    max_inflight_tasks at once (-1: up to 16): 4 prompts, 4 requests, through its pool of servers (here one), on
    the token route (in_flight_weight_updates: each token's weight version comes back)."""
    import threading
    import time

    from trainers.generation.backend import BackendInputs
    from trainers.generation.sampling import GenerationContext
    from trainers.generation.vllm_remote import ServerSampler
    from trainers.generation.vllm_servers import ServerPool

    class Client:  # the server's client, counting the requests in flight
        def __init__(self):
            self.lock, self.now, self.most = threading.Lock(), 0, 0

        def generate_tokens(self, prompt_ids, n, seed, sampling_params):  # the token route (in flight)
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            time.sleep(0.1)
            with self.lock:
                self.now -= 1
            return {"completion_ids": [[7, 1]] * n, "logprobs": None, "versions": [[3, 3]] * n}

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", async_generation=True,
                      max_inflight_tasks=inflight)
    context = GenerationContext(Accelerator(cpu=True), pad_id=0, eos_ids=frozenset({1}))
    client = Client()
    pool = ServerPool(["http://stand-in:8000"], lambda url, wait: client)  # one server: this client
    sampler = ServerSampler(BackendInputs(context, None, None, None, args, 4), pool)
    samples = sampler.sample(["a", "b", "c", "d"], [[2], [3], [4], [5]], SamplingParams(max_new_tokens=2))
    assert samples.completion_ids == [[7, 1]] * 4 and client.most == most
    assert samples.versions == [[3, 3]] * 4  # each token's weight version, as the server tagged it


def test_row_seeds_follow_the_run_seed_the_step_and_the_call(tiny_model_dir):
    """The seeds depend on the run's seed, the step of the last weight sync and the calls since, nothing else: the
    same for the same place in a run, others elsewhere, consecutive within a call."""
    from types import SimpleNamespace

    from trainers.generation.vllm_common import VLLMBackend

    class NoEngine(VLLMBackend):  # the seed bookkeeping only: no engine, no weights
        def _push_weights(self, batches):
            pass

    def backend(seed):
        context = SimpleNamespace(accelerator=SimpleNamespace(process_index=0), eos_ids=frozenset({2}))
        return NoEngine(SimpleNamespace(context=context, config=SimpleNamespace(seed=seed), sampling=None, policy=None))

    def seeds_of(engine):
        engine.sync_weights(0)
        first, second = engine.row_seeds(3), engine.row_seeds(3)
        engine.sync_weights(1)
        return first, second, engine.row_seeds(3)

    a, b, other = seeds_of(backend(0)), seeds_of(backend(0)), seeds_of(backend(1))
    assert a == b and a != other
    first, second, after_sync = a
    assert first[1] == first[0] + 1 and len({first[0], second[0], after_sync[0]}) == 3
    assert all(0 <= seed + 8 < 2**31 for seed in first + second + after_sync)
