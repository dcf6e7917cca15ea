"""DistillationTrainer end to end on tiny models, one CPU process: a student learns a teacher's behaviour on its own
completions, logs TRL's metric names, its loss is TRL's divergence of the round it trained on, TRL's contract
(options, arguments, the trl/scripts/distillation.py body), lmbda's off-policy rounds, and errors before training."""

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import config_factory, Rounds, digits, step_records
from trainers import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError, DatasetFormatError

try:
    import trl

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"] * 4]


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model trained with GRPO to write digits (16 steps, its reward from 0.07 to ~1.0)."""
    out = str(tmp_path_factory.mktemp("teacher") / "model")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, args=GRPOConfig(
        output_dir=out, per_device_train_batch_size=16, num_generations=4, max_completion_length=8,
        learning_rate=3e-2, max_steps=16, save_strategy="no", disable_tqdm=True, report_to="none", seed=0))
    trainer.train()
    assert trainer.state.log_history[-1]["reward"] > 0.9  # the closing record: steps 11-16's mean (logged at 10)
    trainer.save_model(out)
    trainer.processing_class.save_pretrained(out)
    return out


config = config_factory(DistillationConfig, per_device_train_batch_size=16, max_completion_length=8, learning_rate=3e-2,
                        max_steps=2)


def digit_share(texts: list[str]) -> float:
    return sum(digits(texts)) / len(texts)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_student_learns_the_teachers_digits_and_logs_trls_metrics(tiny_model_dir, teacher_dir, tmp_path, beta):
    """Forward and reverse KL: the student's own completions go from ~4% digits (a fresh model) to the teacher's
    habit, with no reward anywhere."""
    trainer = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=PROMPTS,
                                  args=config(tmp_path, max_steps=16, logging_steps=4, beta=beta))
    rounds = Rounds()
    trainer.add_callback(rounds)
    trainer.train()
    decode = trainer.processing_class.batch_decode
    shares = [digit_share(decode(samples.completion_ids, skip_special_tokens=True)) for samples in rounds.samples]
    assert shares[0] < 0.1 and sum(shares[-4:]) / 4 > 0.8, shares
    records = step_records(trainer)
    assert records[-1]["loss"] < 0.1 * records[0]["loss"], [r["loss"] for r in records]
    for key in ("loss", "entropy", "completions/mean_length", "completions/clipped_ratio",
                "completions/mean_terminated_length", "num_tokens", "learning_rate", "grad_norm"):
        assert key in records[-1], key
    assert not any(key.startswith("reward") or key in ("kl", "frac_reward_zero_std") for key in records[-1])
    assert trainer.ref_model is None and trainer.teacher_model is not None and trainer.beta == beta


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed")
@pytest.mark.parametrize("beta,temperature", [(0.5, 1.0), (1.0, 0.7)])
def test_the_loss_is_trls_divergence_of_the_round(tiny_model_dir, teacher_dir, tmp_path, beta, temperature):
    """Step 1 trains on one round in one micro-batch: its logged loss is TRL 1.16's _chunked_divergence_loss on
    that round, from both models' last hidden states before the step."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    trainer = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=PROMPTS,
                                  args=config(tmp_path, max_steps=1, beta=beta, temperature=temperature))
    rounds = Rounds()
    trainer.add_callback(rounds)
    trainer.train()
    rollout = rounds.rollouts[0]
    input_ids, attention_mask, position_ids = rollout.model_inputs()
    width = rollout.completion_ids.shape[1]
    hidden = []
    for path in (tiny_model_dir, teacher_dir):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        output_hidden_states=True)
        hidden.append((out.hidden_states[-1][:, -width - 1:-1], model.get_output_embeddings().weight))
    (student_hidden, student_weight), (teacher_hidden, teacher_weight) = hidden
    expected, _, _ = _chunked_divergence_loss(student_hidden, teacher_hidden, student_weight, teacher_weight,
                                              rollout.loss_mask, beta, temperature=temperature)
    assert step_records(trainer)[0]["loss"] == pytest.approx(float(expected), rel=1e-4)


def test_options_and_defaults_are_trls():
    """TRL's defaults; GRPO's options are none of its fields (tests/unit/test_trl_config_fields.py holds every field
    against TRL 1.16's)."""
    args = DistillationConfig(output_dir="unused")
    assert (args.beta, args.temperature, args.learning_rate, args.max_completion_length, args.lmbda,
            args.num_generations) == (1.0, 1.0, 1e-6, 512, 1.0, 1)
    for option, value in (("loss_type", "grpo"), ("reward_weights", [1.0]), ("epsilon", 0.3)):
        with pytest.raises(ConfigError, match=f"DistillationConfig has no option `{option}`"):
            DistillationConfig(output_dir="unused", **{option: value})
    with pytest.raises(ConfigError, match="beta"):
        DistillationConfig(output_dir="unused", beta=1.5)
    with pytest.raises(ConfigError, match="temperature"):  # a served teacher's log-probs are at temperature 1
        DistillationConfig(output_dir="unused", teacher_model_server_url="http://localhost:8001", temperature=0.7)
    with pytest.raises(ConfigError, match="teacher_model_server_url"):
        DistillationConfig(output_dir="unused", teacher_model_server_url="localhost:8001")


def test_rounds_of_several_completions_per_prompt_trained_twice(tiny_model_dir, teacher_dir, tmp_path):
    """The sampling base's round options (this project's additions): num_generations=2 samples each prompt twice
    (the teacher scores both), and num_iterations=2 trains each round twice: 2 steps from one round of 16
    completions of 8 prompts."""
    trainer = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=PROMPTS,
                                  args=config(tmp_path, num_generations=2, num_iterations=2))
    rounds = Rounds()
    trainer.add_callback(rounds)
    trainer.train()
    assert len(rounds.rollouts) == 1 and rounds.rollouts[0].completion_ids.shape[0] == 16
    prompts = rounds.samples[0].prompt_ids
    assert all(prompts[i] == prompts[i + 1] for i in range(0, 16, 2))  # a prompt's completions side by side
    records = step_records(trainer)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert records[1]["loss"] != pytest.approx(records[0]["loss"], rel=1e-3)  # the same round, after a step on it


def test_distillation_takes_trls_arguments_in_trls_order():
    order = ["model", "teacher_model", "args", "train_dataset", "eval_dataset", "processing_class", "callbacks",
             "optimizers", "quantization_config", "peft_config", "tools"]
    ours = list(inspect.signature(DistillationTrainer.__init__).parameters)[1:]
    assert ours == order + ["rollout_func", "environment_factory"]
    if HAVE_TRL:
        assert list(inspect.signature(trl.DistillationTrainer.__init__).parameters)[1:] == order


def test_trl_distillation_script_trains_and_saves(tiny_model_dir, teacher_dir, tmp_path):
    """trl/scripts/distillation.py main(), TRL 1.16, from the trainer on, with evaluation."""
    training_args = DistillationConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                       max_completion_length=4, max_steps=2, save_strategy="no", disable_tqdm=True,
                                       report_to="none", eval_strategy="steps", eval_steps=2,
                                       teacher_model_name_or_path=teacher_dir)
    dataset = {"train": PROMPTS[:8], "test": PROMPTS[:2]}
    trainer = DistillationTrainer(
        model=tiny_model_dir,
        teacher_model=training_args.teacher_model_name_or_path,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"] if training_args.eval_strategy != "no" else None,
        quantization_config=None,
        peft_config=None,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_model(training_args.output_dir)
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "model.safetensors").is_file()
    evaluated = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert len(evaluated) == 1 and evaluated[0]["eval_loss"] > 0 and "eval_entropy" in evaluated[0]
    assert not any(key.startswith("eval_reward") for key in evaluated[0])


def test_lmbda_trains_some_rounds_on_the_datasets_completions(tiny_model_dir, teacher_dir, tmp_path):
    """lmbda=0.5: the rounds trainer.on_policy says are off-policy hold the dataset's completion (its tokens and
    EOS) for each prompt, the others the student's samples; lmbda=0: every round is the dataset's."""
    rows = [{"prompt": r["prompt"], "completion": "4242"} for r in PROMPTS]
    trainer = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=rows,
                                  args=config(tmp_path, max_steps=8, lmbda=0.5, per_device_train_batch_size=8))
    rounds = Rounds()
    trainer.add_callback(rounds)
    trainer.train()
    tokenizer = trainer.processing_class
    dataset_ids = tokenizer("4242", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    kinds = [trainer.on_policy(index) for index in range(8)]
    assert 0 < sum(kinds) < 8, kinds  # both kinds drawn
    for on_policy, rollout in zip(kinds, rounds.rollouts):
        from_dataset = [row[:len(dataset_ids)].tolist() == dataset_ids for row in rollout.completion_ids]
        assert all(from_dataset) != on_policy, (on_policy, rollout.completion_ids)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in step_records(trainer))
    everything = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=rows,
                                     args=config(tmp_path, max_steps=1, lmbda=0.0))
    assert not everything.on_policy(0) and kinds == [trainer.on_policy(index) for index in range(8)]  # seeded


def test_errors_before_training(tiny_model_dir, teacher_dir, tmp_path):
    with pytest.raises(ConfigError, match="needs a teacher"):
        DistillationTrainer(model=tiny_model_dir, train_dataset=PROMPTS, args=config(tmp_path))
    with pytest.raises(ConfigError, match="not both"):
        DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=PROMPTS,
                            args=config(tmp_path, teacher_model_server_url="http://127.0.0.1:9"))
    with pytest.raises(DatasetFormatError, match="train_dataset row 0 has no 'completion'.*lmbda"):
        DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=PROMPTS,
                            args=config(tmp_path, lmbda=0.5))
    from trainers.cli.tiny import save_tiny_model

    wider = save_tiny_model(str(tmp_path / "other-vocab"), hidden_size=64, num_layers=2, vocab_size=300)
    with pytest.raises(ConfigError, match="vocab_size 259 but the teacher model has vocab_size 300"):
        DistillationTrainer(model=tiny_model_dir, teacher_model=wider, train_dataset=PROMPTS, args=config(tmp_path))


def test_a_lora_student_trains_its_adapter_only(tiny_model_dir, teacher_dir, tmp_path):
    """With peft_config the student's adapter learns (its head is the base model's plain linear one, so the
    divergence stays chunked) and the base weights do not move."""
    from peft import LoraConfig

    trainer = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir, train_dataset=PROMPTS,
                                  args=config(tmp_path, max_steps=3, beta=0.0),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    moved = {name for name in before if not torch.equal(before[name], after[name].detach())}
    assert moved and all("lora_" in name for name in moved), sorted(moved)
    assert trainer.chunked and all(r["loss"] > 0 for r in step_records(trainer))
