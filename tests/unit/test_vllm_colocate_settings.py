"""The colocated engine's settings on a GPU, decided without one (``engine_settings``), and vLLM's sleep mode
(``SleepMode``), in the order the colocated
backend drives it: asleep after start and after each round; every step's weight sync wakes the weights only; a
round wakes the KV cache too. vLLM has no sleep mode on CPU, so the engine here is a stand-in that keeps vLLM's
contract (level 2 discards weights and KV cache; ``wake_up(tags)`` brings back what it names; generating or loading
weights into discarded memory fails); the real one runs in benchmarks/gpu_check.py on a GPU. And the free-memory
check made before vLLM starts, so that every process raises together (``free_memory_error``)."""

import pytest
import torch

from trainers.generation.vllm_colocate import SleepMode, engine_settings, free_memory_error


class SleepingEngine:
    def __init__(self):
        self.awake = {"weights", "kv_cache"}
        self.weights_loaded = True
        self.calls = []

    def sleep(self, level):
        assert level == 2
        self.awake.clear()
        self.weights_loaded = False  # level 2 discards the weights: they must be loaded again
        self.calls.append("sleep")

    def wake_up(self, tags):
        self.awake |= set(tags)
        self.calls.append(f"wake {','.join(tags)}")

    def load_weights(self):
        if "weights" not in self.awake:
            raise RuntimeError("weights written into discarded memory")
        self.weights_loaded = True
        self.calls.append("load")

    def generate(self):
        if self.awake != {"weights", "kv_cache"} or not self.weights_loaded:
            raise RuntimeError(f"generate with {sorted(self.awake)} awake, weights loaded: {self.weights_loaded}")
        self.calls.append("generate")


def push(engine, sleep_mode):
    """VLLMColocate._push_weights: wake the weights, then load the policy's into them."""
    sleep_mode.wake_weights()
    engine.load_weights()


@pytest.mark.parametrize("sync_every_round", [True, False])
def test_every_round_has_its_weights_and_its_kv_cache(sync_every_round):
    engine = SleepingEngine()
    sleep_mode = SleepMode(engine)
    sleep_mode.sleep()  # after start: asleep until the first round
    for step in range(3):
        if sync_every_round or step == 0:
            push(engine, sleep_mode)  # the optimizer step's weight sync, before the round
        sleep_mode.wake_for_round(lambda: push(engine, sleep_mode))
        engine.generate()
        sleep_mode.sleep()
    assert engine.calls.count("generate") == 3
    # each round: weights woken and loaded once (by the sync, or again from the policy), then the KV cache
    assert engine.calls[:5] == ["sleep", "wake weights", "load", "wake kv_cache", "generate"]


@pytest.mark.parametrize("mixed_precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                                    ("no", torch.float32)])
def test_on_a_gpu_the_engine_takes_the_training_precision_and_cuda_sized_batches(mixed_precision, dtype):
    settings = engine_settings("cuda", torch.float32, mixed_precision, 32768, None)
    # not the float32 policy's dtype; not a whole 32k context of batched tokens for vLLM's memory profiling
    assert settings == {"dtype": dtype, "max_num_batched_tokens": 4096, "enforce_eager": False}
    assert engine_settings("cuda", torch.float32, "bf16", 32768, True)["enforce_eager"] is True


def test_on_cpu_the_engine_is_the_policys_as_before():
    assert engine_settings("cpu", torch.float32, "bf16", 32768, None) == {
        "dtype": torch.float32, "max_num_batched_tokens": 32768, "enforce_eager": True}
    assert engine_settings("cpu", torch.bfloat16, "no", 1024, False) == {
        "dtype": torch.bfloat16, "max_num_batched_tokens": 4096, "enforce_eager": False}


def test_a_card_too_full_for_the_engine_is_found_before_vllm_starts():
    """vLLM's own rule (free >= utilization x total), with the numbers and the option in the message; a card
    with exactly enough passes."""
    total = 80 * 2**30
    assert free_memory_error(free=24 * 2**30, total=total, utilization=0.3) is None
    error = free_memory_error(free=20 * 2**30, total=total, utilization=0.3)
    assert "vllm_gpu_memory_utilization=0.3" in str(error)
    assert "asks for 24.0 GiB of its device's 80.0 GiB and 20.0 GiB are free" in str(error)
