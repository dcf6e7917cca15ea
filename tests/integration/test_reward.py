"""RewardTrainer end to end on a tiny model, one CPU process: TRL's loss on one batch, learning a preference
that holds out, the saved model as GRPO's reward model, and clear errors."""

import random
import tempfile

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.conftest import step_records
from tests.floats import FLOAT32_REL, FLOAT64_REL, SAME_HOST_REL
from trainers import GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer
from trainers.errors import ConfigError, DatasetFormatError
from trainers.sampling.rewards import load_reward_model
from trainers.model.losses import BatchCounts

try:
    import trl

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False

ROWS = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green and wide.", "margin": 0.5},
        {"prompt": "2+2=", "chosen": "4", "rejected": "five", "margin": 0.0},
        {"prompt": "Say hi:", "chosen": " hi there", "rejected": " no", "margin": 1.0},
        {"prompt": "Cats", "chosen": " are nice pets.", "rejected": " are loud.", "margin": 0.25}]
# TRL 1.16's RewardTrainer.compute_loss on ROWS (its tokenization and collator) with the weights ``perturbed``
# sets, then cast to float64 (tests/floats.py), without and with center_rewards_coefficient=0.01: from
# test_loss_equals_trls_computed_live.
TRL_LOSSES = {None: 1.33301061, 0.01: 1.57233879}


def perturbed(model) -> None:
    """Every weight moved by 0.05 x randn, the score head drawn anew (seed 0): the same in both frameworks
    whatever their head's initialization."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn_like(parameter)
            if name.startswith("score."):
                parameter.copy_(0.5 * noise)
            else:
                parameter.add_(0.05 * noise)


def our_loss(model_dir, center) -> float:
    trainer = RewardTrainer(model=model_dir, train_dataset=ROWS, args=RewardConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, shuffle_dataset=False, report_to="none",
        center_rewards_coefficient=center))
    perturbed(trainer.model)
    batch = trainer.micro_batch(0, 0)
    # the 8 sequences packed into rows as long as the longest (TRL pads each to it): the same scores
    assert batch.input_ids.shape[0] < 8
    with torch.no_grad():
        loss, _ = trainer.compute_loss(trainer.model_wrapped, batch, BatchCounts(tokens=4, sequences=4,
                                                                                 micro_batches=1))
    return float(loss)


@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_equals_trls_on_one_batch(tiny_model_dir, center):
    assert our_loss(tiny_model_dir, center) == pytest.approx(TRL_LOSSES[center], rel=FLOAT32_REL)


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed")
def test_loss_equals_trls_computed_live(tiny_model_dir):
    """TRL itself on this host: its tokenization of ROWS is ours, its float32 loss ours, and its float64 loss the
    stored reference."""
    from datasets import Dataset

    for center, expected in TRL_LOSSES.items():
        theirs = trl.RewardTrainer(model=tiny_model_dir, train_dataset=Dataset.from_list(ROWS), args=trl.RewardConfig(
            output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
            per_device_train_batch_size=4, center_rewards_coefficient=center))
        ours = RewardTrainer(model=tiny_model_dir, train_dataset=ROWS, args=RewardConfig(
            output_dir=tempfile.mkdtemp(), report_to="none"))
        for column in ("chosen_ids", "rejected_ids", "margin"):
            assert ours.train_dataset[column] == theirs.train_dataset[column], column
        perturbed(theirs.model)
        theirs.model.eval()
        batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
        with torch.no_grad():
            assert float(theirs.compute_loss(theirs.model, dict(batch))) == pytest.approx(
                our_loss(tiny_model_dir, center), rel=SAME_HOST_REL), center
            theirs.model.double()
            assert float(theirs.compute_loss(theirs.model, dict(batch))) == pytest.approx(expected, rel=FLOAT64_REL)


def digits_over_letters(n: int, seed: int) -> list[dict]:
    draw = random.Random(seed)
    pick = lambda chars: "".join(draw.choice(chars) for _ in range(3))  # noqa: E731
    return [{"prompt": pick("xyzw") + ":", "chosen": pick("0123456789"), "rejected": pick("abcdefgh")}
            for _ in range(n)]


def test_a_reward_model_learns_and_grpo_uses_it(tiny_model_dir, tmp_path):
    """Trained on digits-over-letters pairs, it ranks held-out pairs right; saved, it is a reward model GRPO
    loads from the folder (GRPOTrainer(reward_funcs=<folder>)) and that scores digits above letters."""
    trainer = RewardTrainer(model=tiny_model_dir, train_dataset=digits_over_letters(64, 0),
                            eval_dataset=digits_over_letters(16, 1),
                            args=RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                              learning_rate=1e-3, max_steps=20, logging_steps=10,
                                              save_strategy="no", report_to="none", disable_tqdm=True))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_accuracy"] >= 0.9 and after["eval_margin"] > before["eval_margin"] + 1.0
    assert after["eval_loss"] < before["eval_loss"] - 0.3
    logged = next(r for r in step_records(trainer) if "loss" in r)  # the first training step's record
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= set(logged)
    assert logged["min_reward"] <= logged["mean_reward"] <= logged["max_reward"]
    folder = str(tmp_path / "rm")
    trainer.save_model(folder)

    reward = load_reward_model(folder)  # what GRPOTrainer(reward_funcs=folder) calls
    evaluated = digits_over_letters(16, 1)  # eval_min_reward and eval_max_reward: over every eval score
    scores = reward([row["prompt"] for row in evaluated] * 2,
                    [row["chosen"] for row in evaluated] + [row["rejected"] for row in evaluated])
    assert (after["eval_min_reward"], after["eval_max_reward"]) == pytest.approx((min(scores), max(scores)), rel=1e-4)
    held_out = digits_over_letters(16, 2)
    prompts = [row["prompt"] for row in held_out]
    digits = reward(prompts, [row["chosen"] for row in held_out])
    letters = reward(prompts, [row["rejected"] for row in held_out])
    assert sum(d > s for d, s in zip(digits, letters)) >= 14
    grpo = GRPOTrainer(model=tiny_model_dir, reward_funcs=folder, train_dataset=[{"prompt": "xy:"}] * 8,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=8,
                                       num_generations=4, max_completion_length=4, max_steps=1, report_to="none",
                                       save_strategy="no", disable_tqdm=True))
    grpo.train()
    assert isinstance(grpo.reward_funcs[0], torch.nn.Module)
    # one step, not logged (logging_steps 10): its metrics are in train()'s closing record, as TRL's
    assert any(key.startswith("rewards/") and key.endswith("/mean") for key in grpo.state.log_history[-1])


def test_a_reward_model_scores_text_completions_with_its_eos_as_it_was_trained(tiny_model_dir):
    """RewardTrainer trains on sequences ending in EOS and reads the score there; GRPO's reward model scores a
    text completion the same way (TRL scores it without the EOS), a completion that ends with EOS not twice, and a
    conversation as its chat template renders it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reward = load_reward_model(model, tokenizer)
    eos = tokenizer.eos_token

    def score(texts):
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        with torch.no_grad():
            return model(**inputs).logits[:, 0].tolist()

    prompts, completions = ["1+2=", "7+5=", "9+9="], ["3", "21", "81" + eos]
    with_eos = score(["1+2=3" + eos, "7+5=21" + eos, "9+9=81" + eos])
    assert reward(prompts, completions) == pytest.approx(with_eos, rel=1e-6)
    assert score(["1+2=3", "7+5=21"]) != pytest.approx(with_eos[:2], rel=1e-3)  # without it: another position
    messages = [[{"role": "user", "content": "1+2="}]], [[{"role": "assistant", "content": "3"}]]
    rendered = tokenizer.apply_chat_template(messages[0][0] + messages[1][0], tokenize=False)
    assert reward(*messages) == pytest.approx(score([rendered]), rel=1e-6)


def test_bad_input_is_refused_with_the_option_or_row(tiny_model_dir, tmp_path):
    args = RewardConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(DatasetFormatError, match="train_dataset row 1: column 'rejected' is missing"):
        RewardTrainer(model=tiny_model_dir, args=args, train_dataset=[ROWS[0], {"chosen": "b"}])
    with pytest.raises(DatasetFormatError, match="some rows have a 'margin' and some do not"):
        RewardTrainer(model=tiny_model_dir, args=args,
                      train_dataset=[ROWS[0], {"chosen": "a", "rejected": "b", "margin": None}])
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=2"):
        RewardTrainer(model=model, args=args, train_dataset=ROWS)
    with pytest.raises(ConfigError, match="compute_metrics"):
        RewardTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, compute_metrics=lambda p: {})
