"""Asynchronous GRPO (async_generation) on one CPU process, without a vLLM server: the engine is tests/copy_engine.py,
a copy of the policy updated only by weight syncs, sampling with its own seeds and returning its log-probs, as the
server does (test_vllm_async.py runs the same pipeline against a real server). What the pipeline promises: bound 0
is the synchronous run; a bound k keeps every round within k weight syncs and the producer ahead; each prompt is
used once per epoch; a resumed run continues the data where the trained steps ended (tools and environments:
test_tool_loop.py); a producer that raises or stalls stops the run with a checkpoint; options are checked before training."""

import json
import time

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

import trainers.data.streaming
from tests.conftest import config_factory, digits, step_records
from tests.copy_engine import CopyEngine
from trainers import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError, GenerationError, VLLMServerError

WORDS = ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on", "mat", "dog", "sun", "red", "big", "top", "one", "two"]
PROMPTS = [{"prompt": w} for w in WORDS]


@pytest.fixture(autouse=True)
def fresh_engine_records():
    CopyEngine.pushes, CopyEngine.versions, CopyEngine.fail_at, CopyEngine.stall_at = [], [], None, None
    CopyEngine.pushed_in_flight, CopyEngine.finish_fails_at = [], None
    yield
    CopyEngine.fail_at = CopyEngine.stall_at = CopyEngine.finish_fails_at = None


config = config_factory(GRPOConfig, per_device_train_batch_size=16, num_generations=8, max_completion_length=6,
                        learning_rate=1e-2, max_steps=6, generation_backend="copy_engine")


class Prompts:
    """A reward (digits) that records which prompts each optimizer step's rounds held."""

    __name__ = "digits"

    def __init__(self):
        self.seen: list[tuple[int, str]] = []

    def __call__(self, prompts, completions, trainer_state=None, **kwargs):
        self.seen += [(trainer_state.global_step, p) for p in prompts]
        return digits(completions)


def train(tiny_model_dir, args, dataset=PROMPTS, reward=None, resume=None, **kwargs) -> GRPOTrainer:
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward or digits, args=args, train_dataset=dataset,
                          **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_bound_zero_is_the_synchronous_run(tiny_model_dir, tmp_path):
    """max_staleness=0: each round sampled with the weights of the step that trains on it (by the same seeds),
    so the weights after 6 steps are the synchronous run's, bit for bit; staleness 0 is logged."""
    sync = train(tiny_model_dir, config(tmp_path, "sync"))
    pushes = list(CopyEngine.pushes)
    bound0 = train(tiny_model_dir, config(tmp_path, "async", async_generation=True, max_staleness=0))
    assert same_weights(sync, bound0)
    assert CopyEngine.versions == [(s, s) for s in range(6)] and CopyEngine.pushes[len(pushes):] == pushes
    assert [r["sample/staleness_max"] for r in step_records(bound0)] == [0.0] * 6


class ProducerAhead(TrainerCallback):
    """Training slower than sampling: each step ends only once the producer has sampled every round the bound lets
    it sample by then (the rounds up to `bound` sync intervals past the trainer's), or after 10 s. Waiting for those
    rounds, rather than sleeping a fixed time, keeps the test independent of how fast the host samples: with a fixed
    0.5 s a loaded 2-core host once fell a round short. A producer that does not run ahead still fails the test."""

    def __init__(self, bound: int, every: int, steps: int):
        self.bound, self.every, self.steps = bound, every, steps

    def on_step_end(self, args, state, control, **kwargs):
        ended = state.global_step - 1  # its weights were pushed at the start of its sync interval
        allowed = min(self.steps, (ended // self.every + self.bound + 1) * self.every)
        deadline = time.monotonic() + 10
        while len(CopyEngine.versions) < allowed and time.monotonic() < deadline:
            time.sleep(0.01)


def test_bound_zero_is_the_synchronous_run_with_lora(tiny_model_dir, tmp_path):
    """A LoRA policy: its merged weights (W + BA) are what each sync pushes; bound 0 is again the synchronous run."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    sync = train(tiny_model_dir, config(tmp_path, "sync", learning_rate=5e-2), peft_config=lora())
    bound0 = train(tiny_model_dir, config(tmp_path, "async", learning_rate=5e-2, async_generation=True,
                                          max_staleness=0), peft_config=lora())
    assert same_weights(sync, bound0)
    assert not same_weights(sync, train(tiny_model_dir, config(tmp_path, "base")))  # the adapters trained


def test_distillation_samples_ahead_and_skips_its_off_policy_rounds(tiny_model_dir, tmp_path):
    """DistillationTrainer with lmbda=0.5: the producer samples only the rounds drawn on-policy (the others come
    from the dataset), and bound 0 is the synchronous run."""
    from tests.conftest import noisy_model
    from trainers import DistillationConfig, DistillationTrainer

    rows = [{"prompt": w, "completion": w[::-1]} for w in WORDS]

    def distill(name, **overrides):
        args = DistillationConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                                  max_completion_length=6, learning_rate=1e-2, max_steps=6, logging_steps=1,
                                  save_strategy="no", disable_tqdm=True, seed=0, report_to="none", lmbda=0.5,
                                  generation_backend="copy_engine", **overrides)
        trainer = DistillationTrainer(model=tiny_model_dir, teacher_model=noisy_model(tiny_model_dir), args=args,
                                      train_dataset=rows)
        trainer.train()
        return trainer

    sync = distill("sync")
    on_policy = [s for s in range(6) if sync.on_policy(s)]
    assert 0 < len(on_policy) < 6
    CopyEngine.versions = []
    bound0 = distill("async", async_generation=True, max_staleness=0)
    assert [first for first, _ in CopyEngine.versions] == on_policy
    assert same_weights(sync, bound0)


@pytest.mark.parametrize("bound, every", [(1, 1), (2, 1), (1, 2)])
def test_every_round_is_within_the_bound_and_the_producer_runs_ahead(tiny_model_dir, tmp_path, bound, every):
    """max_staleness=k, weight_sync_steps=N: the weights are pushed every N steps; each round is sampled with
    weights at most k syncs older than its step's (the producer waits rather than go staler), and as stale as
    that allows once the producer is ahead; the logged staleness is what the producer used, and so is each logged
    completion's model_version. Whole rounds on one version (in_flight_weight_updates=False): the pushes wait for
    the round in flight."""
    trainer = train(tiny_model_dir, config(tmp_path, async_generation=True, max_staleness=bound,
                                           weight_sync_steps=every, max_steps=8, log_completions=True,
                                           in_flight_weight_updates=False),
                    callbacks=[ProducerAhead(bound, every, steps=8)])
    assert CopyEngine.pushes == list(range(0, 8, every))
    lags = [first // every - held // every for first, held in CopyEngine.versions]
    assert [first for first, _ in CopyEngine.versions] == list(range(8))
    assert all(0 <= lag <= bound for lag in lags), CopyEngine.versions
    assert lags[-3:] == [bound] * 3, CopyEngine.versions  # ahead: as far as the bound lets it
    logged = [r["sample/staleness_max"] for r in step_records(trainer)]
    assert logged == [float(lag) for lag in lags]
    with open(tmp_path / "out" / "completions.jsonl") as f:
        versions = {}
        for line in f:
            record = json.loads(line)
            versions.setdefault(record["step"], set()).add(record["model_version"])
    assert versions == {first + 1: {held} for first, held in CopyEngine.versions}


def test_in_flight_weight_updates_tag_each_token_and_keep_the_bound(tiny_model_dir, tmp_path, caplog):
    """in_flight_weight_updates (the default): the trainer pushes while the producer samples, and the engine takes
    the weights between two tokens (as the server between decode steps), so rounds sampled across a push have
    tokens of two versions. Every token is within max_staleness=1 of the step that trains on it and never newer,
    versions never go back within a completion, a record's model_version is its round's oldest token's, and the
    step's sample/updated_in_flight counts the completions sampled across a push."""
    trainer = train(tiny_model_dir, config(tmp_path, async_generation=True, max_staleness=1, max_steps=8,
                                           max_completion_length=24, log_completions=True))
    with open(tmp_path / "out" / "completions.jsonl") as f:
        records = [json.loads(line) for line in f]
    by_step: dict[int, list] = {}
    for record in records:
        tokens = [v for v, start, end in record["version_spans"] for _ in range(start, end)]
        trained_at = record["step"] - 1  # the optimizer step whose round it is
        assert all(trained_at - 1 <= v <= trained_at for v in tokens), (record["step"], record["version_spans"])
        assert tokens == sorted(tokens)
        by_step.setdefault(record["step"], []).append(tokens)
    for step, rows in by_step.items():
        assert {r["model_version"] for r in records if r["step"] == step} == {min(min(t) for t in rows)}
    mixed = {step: sum(len(set(t)) > 1 for t in rows) / len(rows) for step, rows in by_step.items()}
    logged = {r["step"]: r["sample/updated_in_flight"] for r in step_records(trainer)}
    print(f"\nin flight: share of completions sampled across a push, by step {mixed}")
    assert logged == pytest.approx(mixed) and sum(v > 0 for v in mixed.values()) >= 2, mixed
    # every push in flight says so (the engine holds the producers' requests for it): a completion may cross any
    crossed = {v for rows in by_step.values() for t in rows for v in sorted(set(t))[1:]}
    assert crossed and CopyEngine.pushed_in_flight == CopyEngine.pushes, (crossed, CopyEngine.pushed_in_flight)


@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_is_used_once_per_epoch(tiny_model_dir, tmp_path, monkeypatch, stream):
    """Bound 2, 16 prompts, 2 per round: each of the 16 prompts is trained on num_generations times per epoch
    (8 steps), none lost or repeated though rounds are read and sampled ahead; a stream's too."""
    monkeypatch.setattr(trainers.data.streaming, "CHUNK_ROWS", 3)
    reward = Prompts()
    dataset = Dataset.from_list(PROMPTS).to_iterable_dataset() if stream else PROMPTS
    train(tiny_model_dir, config(tmp_path, async_generation=True, max_staleness=2, max_steps=16), dataset, reward)
    for epoch in range(2):
        steps = range(8 * epoch, 8 * epoch + 8)
        used = sorted(prompt for step, prompt in reward.seen if step in steps)
        assert used == sorted(WORDS * 8), (epoch, used)


def test_a_resumed_run_continues_the_data_where_the_trained_steps_ended(tiny_model_dir, tmp_path, monkeypatch):
    """A streamed dataset, bound 2, a checkpoint at step 3 while rounds for steps 4-5 were already read and sampled:
    the resumed run discards them and trains steps 4-6 on the prompts the uninterrupted run trained them on."""
    monkeypatch.setattr(trainers.data.streaming, "CHUNK_ROWS", 3)

    def stream():
        return Dataset.from_list(PROMPTS).to_iterable_dataset()

    straight = Prompts()
    train(tiny_model_dir, config(tmp_path, "straight", async_generation=True, max_staleness=2), stream(), straight)
    first = Prompts()
    train(tiny_model_dir, config(tmp_path, "split", async_generation=True, max_staleness=2, max_steps=3,
                                 save_strategy="steps", save_steps=3), stream(), first)
    rest = Prompts()
    resumed = train(tiny_model_dir, config(tmp_path, "split", async_generation=True, max_staleness=2), stream(), rest,
                    resume=True)
    assert [s for s, _ in rest.seen][0] == 3 and resumed.state.global_step == 6
    assert first.seen + rest.seen == straight.seen


def test_a_producer_that_raises_stops_the_run_with_a_checkpoint(tiny_model_dir, tmp_path):
    """The producer's 4th round raises (user code in the sampler): every process stops with a GenerationError
    naming the round and the cause, a checkpoint of the last step is written, and the run resumes from it."""
    CopyEngine.fail_at = 4
    args = config(tmp_path, async_generation=True, max_staleness=1)
    with pytest.raises(GenerationError) as caught:
        train(tiny_model_dir, args)
    message = str(caught.value)
    assert "the producer failed sampling round 3" in message and "failing on round 4, as the test asked" in message
    assert "Training stopped after step 3; checkpoint written to" in message and "checkpoint-3" in message
    CopyEngine.fail_at = None
    resumed = train(tiny_model_dir, args, resume=True)
    assert resumed.state.global_step == 6


def test_a_stalled_producer_stops_the_run_within_its_timeouts(tiny_model_dir, tmp_path):
    """Weights between rounds: the producer's 3rd round never ends (a request that hangs): the trainer's next
    weight sync waits at most request_timeout + weight_sync_timeout for it, then every process stops with a
    GenerationError and a checkpoint; no thread keeps the run from ending. (In flight, the push does not wait for
    the round: the heartbeat notices the stall, as in the next test.)"""
    CopyEngine.stall_at = 3
    args = config(tmp_path, async_generation=True, max_staleness=1, request_timeout=2, weight_sync_timeout=2,
                  heartbeat_stale_after_s=30, in_flight_weight_updates=False)
    started = time.monotonic()
    with pytest.raises(GenerationError, match="did not finish its round within 4 s") as caught:
        train(tiny_model_dir, args)
    assert time.monotonic() - started < 30
    assert "Training stopped after step 2; checkpoint written to" in str(caught.value)


def test_a_push_that_fails_as_it_finishes_stops_the_run_at_once_with_a_checkpoint(tiny_model_dir, tmp_path):
    """In flight the trainer goes on while the engine finishes a push; step 3's fails there (as a server whose load
    fails: it stays paused). Bound 0: the trainer waits for round 3, which will not come: it stops at once with the
    push's error (not at heartbeat_stale_after_s), with a checkpoint of step 3, which resumes."""
    CopyEngine.finish_fails_at = 3
    args = config(tmp_path, async_generation=True, max_staleness=0, request_timeout=2, heartbeat_stale_after_s=300)
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match="the push of step 3 failed as it finished") as caught:
        train(tiny_model_dir, args)
    assert time.monotonic() - started < 60
    assert "Training stopped after step 3; checkpoint written to" in str(caught.value)
    CopyEngine.finish_fails_at = None
    assert train(tiny_model_dir, args, resume=True).state.global_step == 6


def test_a_silent_producer_is_noticed_by_its_heartbeat(tiny_model_dir, tmp_path):
    """Bound 0: the trainer waits for the round the stalled producer holds; after heartbeat_stale_after_s without
    progress it stops, naming the round and the step."""
    CopyEngine.stall_at = 3
    args = config(tmp_path, async_generation=True, max_staleness=0, request_timeout=2, heartbeat_stale_after_s=3)
    started = time.monotonic()
    with pytest.raises(GenerationError, match=r"round 2 \(for optimizer step 2\) is not ready and the producer has "
                                              r"shown no progress for \d+ s \(heartbeat_stale_after_s=3\)"):
        train(tiny_model_dir, args)
    assert time.monotonic() - started < 30


def test_options_are_checked_before_training(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="`weight_sync_steps=2` is invalid; it applies to asynchronous generation"):
        config(tmp_path, weight_sync_steps=2)
    with pytest.raises(ConfigError, match="use_vllm=True with vllm_mode='server'"):
        config(tmp_path, generation_backend=None, async_generation=True)
    with pytest.raises(ConfigError, match="the colocated engine shares this process"):
        config(tmp_path, generation_backend=None, async_generation=True, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ConfigError, match="`in_flight_weight_updates=False` is invalid; it applies to asynchronous"):
        config(tmp_path, in_flight_weight_updates=False)
    with pytest.raises(GenerationError, match="WholeRoundsEngine cannot take new weights while its producer samples"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                    args=config(tmp_path, generation_backend="copy_engine_whole_rounds", async_generation=True))
    with pytest.raises(GenerationError, match="PolicyBackend cannot sample ahead of training"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                    args=config(tmp_path, generation_backend="policy", async_generation=True))
    with pytest.raises(ConfigError, match="a rollout_func runs the trainer's code"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, rollout_func=lambda p, t: {},
                    args=config(tmp_path, async_generation=True))
    with pytest.raises(ConfigError, match="`rollout_worker`"):
        AsyncGRPOTrainer(tiny_model_dir, digits, AsyncGRPOConfig(output_dir=str(tmp_path)), PROMPTS,
                         rollout_worker=object())


def test_async_grpo_config_takes_trls_options_and_defaults():
    """AsyncGRPOConfig takes every option TRL's experimental AsyncGRPOConfig declares for itself, with its defaults
    (the TrainingArguments ones are GRPOConfig's, and so are all of GRPOConfig's)."""
    import dataclasses

    pytest.importorskip("trl.experimental.async_grpo")  # the bench extra installs TRL
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLConfig
    from trl.trainer.base_config import _BaseConfig

    inherited = {f.name for f in dataclasses.fields(_BaseConfig)}
    own = [f for f in dataclasses.fields(TRLConfig) if f.name not in inherited or f.name in (
        "learning_rate", "logging_steps", "lr_scheduler_type", "gradient_checkpointing")]
    ours = AsyncGRPOConfig(output_dir="out")
    for f in own:
        if f.name in ("ignore_data_skip", "model_init_kwargs"):  # ours never replays data; dtype: below
            continue
        assert hasattr(ours, f.name), f.name
        expected = f.default
        value = getattr(ours, f.name)
        assert value == expected, (f.name, value, expected)
    assert ours.async_generation and ours.use_vllm and ours.vllm_mode == "server"
    assert ours.model_init_kwargs == {"dtype": "float32"}
