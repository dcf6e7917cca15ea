"""Cases of TRL 1.16's own TestGRPOTrainer / TestSFTTrainer, ported by changing the import (TRL's Hub model and
``trl-internal-testing/zen`` datasets replaced by a tiny offline model and rows of the same shapes). Each asserts
what TRL's test asserts, where scripts, callbacks and dashboards read it: ``eval_loss``, the metrics TRL's
trainers merge into train()'s closing record (``log_history[-1]``), and TRL's public static helpers.
Deliberate differences are listed in docs/migrating-from-trl.md."""

import contextlib
import logging

import pytest
import torch
from datasets import Dataset, DatasetDict

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
PROMPTS = [" ".join(WORDS[i % 7: i % 7 + 3]) for i in range(17)]  # zen's 17 prompt-only training rows
TEXTS = [" ".join(WORDS[i % 9: i % 9 + 5]) for i in range(17)]  # its language-modeling rows


def zen_prompts(split_rows: int = 17) -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS[:split_rows]})


def zen_texts(split_rows: int = 17) -> Dataset:
    return Dataset.from_dict({"text": TEXTS[:split_rows]})


def reward_func1(completions, **kwargs):
    """Rewards longer completions (TRL's test function)."""
    return [float(len(completion)) for completion in completions]


def reward_func2(completions, **kwargs):
    """Rewards completions with more unique letters (TRL's test function)."""
    return [float(len(set(completion))) for completion in completions]


def grpo_args(tmp_path, **overrides) -> GRPOConfig:
    return GRPOConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 3, "num_generations": 3,
                         "max_completion_length": 8, "report_to": "none", "disable_tqdm": True,
                         "save_strategy": "no", "max_steps": 4, "logging_steps": 3, **overrides})


@contextlib.contextmanager
def trainers_warnings():
    """The warnings the package's logger gives inside the block (it does not propagate to the root by default)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("trainers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# ---------------------------------------------------------------------------------------------- GRPO: eval_loss


@pytest.mark.parametrize("kind", ["dataset", "dataset_dict", "dict", "iterable", "dict_of_iterables"])
def test_grpo_evaluate_returns_and_logs_eval_loss(tiny_model_dir, tmp_path, kind):
    """transformers' evaluate() returns eval_loss (eval_<name>_loss per named set); TRL's GRPO computes it with
    compute_loss on the evaluation's completions. Sampled from the policy being evaluated, every ratio is 1:
    loss_type='grpo' averages -A over each group, which is 0 up to rounding."""
    test = zen_prompts(6)
    eval_dataset = {"dataset": test, "dataset_dict": DatasetDict({"a": test, "b": test}),
                    "dict": {"a": test, "b": test}, "iterable": test.to_iterable_dataset(),
                    "dict_of_iterables": {"a": test.to_iterable_dataset(), "b": test.to_iterable_dataset()}}[kind]
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=zen_prompts(),
                          eval_dataset=eval_dataset, args=grpo_args(tmp_path, per_device_eval_batch_size=3,
                                                                    max_steps=1))
    metrics = trainer.evaluate()
    keys = ["eval_loss"] if kind in ("dataset", "iterable") else ["eval_a_loss", "eval_b_loss"]
    for key in keys:
        assert metrics[key] == pytest.approx(0.0, abs=1e-6)
        assert any(key in record for record in trainer.state.log_history)
    assert trainer.state.log_history[-1][keys[-1]] == pytest.approx(metrics[keys[-1]], rel=1e-5, abs=1e-9)


def test_grpo_eval_loss_is_the_loss_of_the_evaluation_batch(tiny_model_dir, tmp_path):
    """With the KL term the eval loss is not 0. Trained a few steps (the policy moves from the reference), then
    evaluated with a reward that is the same for every completion: every advantage is 0, so the loss is
    beta x the KL term alone, and with loss_type='dapo' (a token mean) that is beta x the eval_kl reported."""
    constant = {"on": False}

    def reward(completions, **kwargs):
        return [1.0 if constant["on"] else float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=zen_prompts(),
                          eval_dataset=zen_prompts(6),
                          args=grpo_args(tmp_path, loss_type="dapo", beta=0.5, learning_rate=1e-2, max_steps=3,
                                         per_device_eval_batch_size=6))
    trainer.train()
    constant["on"] = True
    metrics = trainer.evaluate()
    assert metrics["eval_kl"] > 1e-4
    assert metrics["eval_loss"] == pytest.approx(0.5 * metrics["eval_kl"], rel=1e-4)
    constant["on"] = False  # varied rewards: the advantages' term joins the KL term
    assert trainer.evaluate()["eval_loss"] != pytest.approx(0.5 * metrics["eval_kl"], rel=1e-2)


def test_grpo_training_with_eval_steps_logs_eval_loss(tiny_model_dir, tmp_path):
    """TRL's test_training_with_eval (eval_strategy='steps', eval_steps=2), reading the records as scripts do."""
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=zen_prompts(),
                          eval_dataset=zen_prompts(6),
                          args=grpo_args(tmp_path, per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2))
    trainer.train()
    evaluations = [record for record in trainer.state.log_history if "eval_loss" in record]
    assert [record["step"] for record in evaluations] == [2, 4]
    assert all(record["eval_loss"] is not None for record in evaluations)


# ------------------------------------------------------------------------- GRPO: the metrics of train()'s record


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_grpo_reward_weights_reach_the_closing_record(tiny_model_dir, tmp_path, aggregation):
    """TRL's test_training_multiple_reward_funcs_with_weights reads rewards/<name>/mean and /std from
    log_history[-1], the record train() ends with; the logged reward is the weighted sum (in both modes)."""
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[reward_func1, reward_func2], train_dataset=zen_prompts(),
                          args=grpo_args(tmp_path, reward_weights=[0.7, 0.3], learning_rate=0.1,
                                         multi_objective_aggregation=aggregation, max_steps=1, logging_steps=10))
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    last = trainer.state.log_history[-1]
    assert last["train_loss"] is not None
    for key in ("rewards/reward_func1/mean", "rewards/reward_func1/std", "rewards/reward_func2/mean",
                "rewards/reward_func2/std"):
        assert key in last
    expected = 0.7 * last["rewards/reward_func1/mean"] + 0.3 * last["rewards/reward_func2/mean"]
    assert last["reward"] == pytest.approx(expected, rel=1e-6)
    assert last["reward"] != pytest.approx(last["rewards/reward_func1/mean"] + last["rewards/reward_func2/mean"])
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in previous.items())


@pytest.mark.parametrize("adaptive", [False, True])
def test_grpo_logs_policy_loss_with_an_entropy_bonus(tiny_model_dir, tmp_path, adaptive):
    """TRL logs policy_loss (the loss before the bonus) beside loss whenever the bonus is on; with a static
    coefficient, loss = policy_loss - coef x the bonus's entropy, so the two differ."""
    options = {"use_adaptive_entropy": True, "entropy_target": 100.0} if adaptive else {"entropy_coef": 0.1}
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=zen_prompts(),
                          args=grpo_args(tmp_path, logging_steps=1, max_steps=2, **options))
    trainer.train()
    steps = [record for record in trainer.state.log_history if "loss" in record]
    assert len(steps) == 2 and all("policy_loss" in record for record in steps)
    assert "policy_loss" not in trainer.state.log_history[-1]  # step 2 was logged: nothing pending, as TRL
    if not adaptive:  # the first step: the bonus applies (adaptive: no entropy measured yet, none applied)
        assert steps[0]["loss"] < steps[0]["policy_loss"]


def test_grpo_logs_no_policy_loss_without_an_entropy_bonus(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=zen_prompts(),
                          args=grpo_args(tmp_path, logging_steps=1, max_steps=1))
    trainer.train()
    assert not any("policy_loss" in record for record in trainer.state.log_history)


@pytest.mark.parametrize("loss_type", ["bnpo", "cispo", "dapo", "dr_grpo", "grpo"])
def test_grpo_warns_about_a_sequence_ratio_with_a_token_summed_loss(tiny_model_dir, tmp_path, loss_type):
    with trainers_warnings() as records:
        GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=zen_prompts(),
                    args=grpo_args(tmp_path, importance_sampling_level="sequence", loss_type=loss_type))
    said = [r.getMessage() for r in records if "importance_sampling_level='sequence'" in r.getMessage()]
    if loss_type == "grpo":
        assert said == []
    else:
        assert len(said) == 1 and f"the `'{loss_type}'` loss sums per-token contributions" in said[0]
        assert "set `loss_type='grpo'`" in said[0]


# ----------------------------------------------------------------------------------- GRPO: TRL's static helpers


def test_get_off_policy_mask_is_trls():
    """TRL's GRPOTrainer.get_off_policy_mask on fixed tensors (values recorded from TRL 1.16): keep a completion
    whose advantage is >= 0 or whose mean KL(sampler || policy) over its mask is <= the threshold; padding (mask 0)
    and tokens the sampler did not score (NaN) count nothing; an all-padding row has KL 0."""
    nan = float("nan")
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [-0.5], [-2.0]])
    per_token_logps = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -5.0],
                                    [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 9.0], [-1.0, -1.0, 9.0],
                             [nan, -0.5, nan], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    kept = GRPOTrainer.get_off_policy_mask(advantages, per_token_logps, sampling, mask, off_policy_threshold=0.5)
    # row 0: positive advantage; row 1: KL 1.0 over its two real tokens; row 2: KL 0 (its third token is padding);
    # row 3: KL 0.5 / 3 (the NaN tokens count 0); row 4: no tokens, KL 0
    assert kept.shape == (5, 1) and kept.dtype == mask.dtype
    assert kept.squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert GRPOTrainer.get_off_policy_mask(advantages, per_token_logps, sampling, mask, 0.1).squeeze(1).tolist() \
        == [1.0, 0.0, 1.0, 0.0, 1.0]


# --------------------------------------------------------------------------------------------------------- SFT


def sft_args(tmp_path, **overrides) -> SFTConfig:
    return SFTConfig(**{"output_dir": str(tmp_path), "report_to": "none", "disable_tqdm": True,
                        "save_strategy": "no", "per_device_train_batch_size": 8, "num_train_epochs": 3,
                        **overrides})


def test_sft_train_with_eval(tiny_model_dir, tmp_path):
    """TRL's test_train_with_eval: log_history[0]['eval_loss'] with eval_steps=3 (logging_steps 10: the first
    record is the evaluation)."""
    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path, eval_strategy="steps", eval_steps=3),
                         train_dataset=zen_texts(), eval_dataset=zen_texts(6))
    trainer.train()
    assert trainer.state.log_history[0]["eval_loss"] is not None
    assert trainer.state.log_history[0]["step"] == 3


def test_sft_train_with_multiple_eval_dataset(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path, eval_strategy="steps", eval_steps=3),
                         train_dataset=zen_texts(), eval_dataset={"data1": zen_texts(6), "data2": zen_texts(6)})
    trainer.train()
    assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
    assert trainer.state.log_history[-2]["eval_data2_loss"] is not None


@pytest.mark.parametrize("logging_steps", [1, 3, 10])
def test_sft_closing_record_has_mean_token_accuracy(tiny_model_dir, tmp_path, logging_steps):
    """TRL's PEFT and training tests read log_history[-1]['mean_token_accuracy'] after train() (their runs end
    between two logging steps): the mean over the steps after the last step record; none when the last step was
    logged."""
    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path, logging_steps=logging_steps, max_steps=4),
                         train_dataset=zen_texts())
    trainer.train()
    last = trainer.state.log_history[-1]
    assert last["train_loss"] is not None
    steps = [record["step"] for record in trainer.state.log_history if "loss" in record]
    assert steps == {1: [1, 2, 3, 4], 3: [3], 10: []}[logging_steps]
    if logging_steps == 1:
        assert "mean_token_accuracy" not in last
    else:
        assert 0.0 <= last["mean_token_accuracy"] <= 1.0
    assert "loss" not in last and "grad_norm" not in last  # the loop's own metrics stay in the step records


def test_sft_closing_record_without_step_logs_has_the_mean_of_every_step(tiny_model_dir, tmp_path):
    """logging_strategy='no': no step record, and train()'s record has the mean over every step (TRL's metrics
    pile up until the next log, which is train()'s). The same seeded run with a record per step gives them."""
    runs = {}
    for strategy in ("no", "steps"):
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=zen_texts(),
                             args=sft_args(tmp_path / strategy, logging_strategy=strategy, logging_steps=1,
                                           max_steps=3, learning_rate=1e-2))
        trainer.train()
        runs[strategy] = trainer.state.log_history
    assert len(runs["no"]) == 1 and "train_loss" in runs["no"][0]
    per_step = [record["mean_token_accuracy"] for record in runs["steps"] if "loss" in record]
    assert len(per_step) == 3 and len(set(per_step)) > 1
    assert runs["no"][0]["mean_token_accuracy"] == pytest.approx(sum(per_step) / 3, rel=1e-6)


def test_sft_evaluate_returns_eval_mean_token_accuracy(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path, max_steps=1), train_dataset=zen_texts(),
                         eval_dataset=zen_texts(6))
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and 0.0 <= metrics["eval_mean_token_accuracy"] <= 1.0


# ------------------------------------------------------------------------------------------ GRPO: streaming rules


@pytest.mark.parametrize("streamed", ["train", "eval", "eval_dict", "evaluate"])
def test_grpo_refuses_dispatch_batches_with_a_stream(tiny_model_dir, tmp_path, streamed):
    """TRL's GRPOTrainer: an IterableDataset (train, eval, an entry of an eval dict, or given to evaluate())
    with accelerator_config's dispatch_batches=True is a ValueError, in TRL's words."""
    stream = zen_prompts().to_iterable_dataset()
    train = stream if streamed == "train" else zen_prompts()
    evaluation = {"eval": stream, "eval_dict": {"a": zen_prompts(6), "b": stream}}.get(streamed)
    args = grpo_args(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match=r"Iterable datasets require `dispatch_batches=False`, but it is set to "
                                         r"`True` in `accelerator_config`\. Please set it to `False`\."):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=train,
                              eval_dataset=evaluation, args=args)
        trainer.evaluate(eval_dataset=stream)


def test_grpo_streamed_train_set_reads_with_no_worker(tiny_model_dir, tmp_path):
    """TRL: an iterable train set forces dataloader_num_workers=0 (its order keeps each prompt's group together),
    with a warning; a map-style train set keeps its workers when only the eval set is iterable."""
    with trainers_warnings() as records:
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1,
                              train_dataset=zen_prompts().to_iterable_dataset(),
                              args=grpo_args(tmp_path / "a", dataloader_num_workers=2))
    assert trainer.args.dataloader_num_workers == 0 and trainer.prompt_batches.workers == 0
    said = [r.getMessage() for r in records]
    assert any("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
               "provided value (2)." in message for message in said)
    trainer.train()  # the stream trains (max_steps=4 steps, in order)
    assert trainer.state.global_step == 4

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_func1, train_dataset=zen_prompts(),
                          eval_dataset=zen_prompts(6).to_iterable_dataset(),
                          args=grpo_args(tmp_path / "b", dataloader_num_workers=2))
    assert trainer.args.dataloader_num_workers == 2
    assert "eval_loss" in trainer.evaluate()
