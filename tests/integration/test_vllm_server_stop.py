"""A vLLM server that dies mid-run (a VLLMServerError from the rollout stage) stops GRPO training with a
resumable checkpoint of the last step, and the resumed run equals an uninterrupted one: no vLLM needed here (the
error comes from a rollout_func, as a client of a dead server raises it; tests/integration/test_vllm_server.py
kills a real server). A streamed dataset, so that a round's prompts read before the failure must be read again."""

import pytest
import torch
from datasets import Dataset

import trainers.data.streaming
from tests.conftest import digits, step_records
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import VLLMServerError

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on", "mat", "dog"]]
URL = "http://127.0.0.1:8000"
FAIL_AT = 4  # the server dies before step 4's round (rounds serve 2 steps: round 2 is the first one lost)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 3 raw rows: the failed round's prompts span a chunk boundary."""
    monkeypatch.setattr(trainers.data.streaming, "CHUNK_ROWS", 3)


def run(tiny_model_dir, output_dir, fail_at=None, resume=None):
    """6 steps; the rollout samples the policy (as the trainer would) and records the prompts of each round;
    with ``fail_at`` it raises what a client of a dead server raises when that step's round is sampled."""
    prompts = []

    def rollout(batch, trainer):
        if trainer.state.global_step == fail_at:
            raise VLLMServerError(f"The vLLM server at {URL} did not answer POST /v1/completions: [Errno 111] "
                                  f"Connection refused. Is it still running?")
        prompts.append(sorted(set(batch)))
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in batch]
        return {"prompt_ids": prompt_ids, "completion_ids": trainer.generate(prompt_ids), "logprobs": None}

    args = GRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, steps_per_generation=2, learning_rate=1e-2, max_steps=6,
                      logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False,
                      report_to="none")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, rollout_func=rollout, args=args,
                          train_dataset=Dataset.from_list(PROMPTS).to_iterable_dataset())
    error = None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except VLLMServerError as caught:
        error = caught
    return trainer, prompts, error


def test_a_dead_server_stops_with_a_checkpoint_that_resumes_exactly(tiny_model_dir, tmp_path):
    straight, straight_prompts, error = run(tiny_model_dir, tmp_path / "straight")
    assert error is None
    stopped, first, error = run(tiny_model_dir, tmp_path / "split", fail_at=FAIL_AT)
    assert stopped.state.global_step == FAIL_AT
    message = str(error)
    assert message.startswith(f"The vLLM server at {URL} did not answer POST /v1/completions")
    checkpoint = tmp_path / "split" / f"checkpoint-{FAIL_AT}"
    assert f"Training stopped after step {FAIL_AT}; checkpoint written to {checkpoint}" in message
    assert "resume_from_checkpoint=True" in message
    assert sorted(p.name for p in (tmp_path / "split").glob("checkpoint-*")) == [checkpoint.name]

    resumed, rest, error = run(tiny_model_dir, tmp_path / "split", resume=True)
    assert error is None
    # the failed round's prompts are read again after the resume, not skipped (a stream is read in order)
    assert first + rest == straight_prompts and len(straight_prompts) == 3
    # the log history holds the checkpoint's steps 1-4 and the resumed 5-6: the same as the straight run's
    assert [r["step"] for r in step_records(resumed)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in step_records(resumed)] == [r["loss"] for r in step_records(straight)]
    for a, b in zip(resumed.unwrapped_model.parameters(), straight.unwrapped_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_dead_server_before_the_first_step_writes_no_checkpoint(tiny_model_dir, tmp_path):
    trainer, _, error = run(tiny_model_dir, tmp_path / "out", fail_at=0)
    assert "No optimizer step was done, so no checkpoint was written." in str(error)
    assert trainer.state.global_step == 0 and not list((tmp_path / "out").glob("checkpoint-*"))
