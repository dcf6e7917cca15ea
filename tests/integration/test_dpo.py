"""DPOTrainer end to end on a tiny model, one CPU process: TRL's losses on one batch, tokenization as TRL's,
learning a preference, the PEFT and precomputed references, and clear errors."""

import math
import random
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import step_records
from tests.floats import FLOAT32_REL, FLOAT32_REL_EXP, FLOAT64_REL, SAME_HOST_REL, assert_trained_alike
from trainers import DPOConfig, DPOTrainer
from trainers.errors import ConfigError, DatasetFormatError
from trainers.model.losses import BatchCounts

try:
    import trl

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False

ROWS = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green and wide."},
        {"prompt": "2+2=", "chosen": "4", "rejected": "five"},
        {"prompt": "Say hi:", "chosen": " hi there", "rejected": " no"},
        {"prompt": "Cats", "chosen": " are nice pets.", "rejected": " are loud."}]
OPTIONS = dict(beta=0.3, label_smoothing=0.1)
CASES = {  # name -> (DPOConfig options beyond OPTIONS)
    **{loss: {"loss_type": [loss]} for loss in ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust",
                                                "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
                                                "apo_down", "discopop", "sft", "sigmoid_norm")},
    "rpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.2]},
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js_divergence": {"f_divergence_type": "js_divergence"},
    "alpha_divergence": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    "ld_alpha": {"ld_alpha": 0.5},
    "wpo": {"use_weighting": True},
}
# TRL 1.16's DPOTrainer.compute_loss on the 4 ROWS (its own tokenization and collator) with the tiny model's
# weights moved by torch.manual_seed(0), 0.05 x randn per parameter (``perturbed``), beta 0.3, label_smoothing
# 0.1, the model then cast to float64 (``model.double()``): a reference without float32's rounding, computed by
# test_losses_equal_trls_computed_live, which runs TRL itself where it is installed.
TRL_LOSSES = {
    "sigmoid": 0.648918748, "hinge": 0.816357613, "ipo": 2.19431925, "exo_pair": 0.458014011, "nca_pair": 1.59891152,
    "robust": 0.625963449, "bco_pair": 1.53081, "sppo_hard": 27.5801888, "aot": 0.667282939,
    "aot_unpaired": 0.667282939, "apo_zero": 0.931596041, "apo_down": 0.869133592, "discopop": 0.756429315,
    "sft": 5.69703436, "sigmoid_norm": 0.66497618, "rpo": 1.78832567, "forward_kl": 149.10611,
    "js_divergence": 0.694743156, "alpha_divergence": 19.5004692, "ld_alpha": 0.658451021, "wpo": 0.39845106,
}


def perturbed(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))


def our_loss(model_dir, case: str) -> float:
    trainer = DPOTrainer(model=model_dir, train_dataset=ROWS, args=DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, shuffle_dataset=False, report_to="none",
        **OPTIONS, **CASES[case]))
    perturbed(trainer.model)
    batch = trainer.micro_batch(0, 0)  # the 4 rows: the step's one micro-batch
    counts = BatchCounts(tokens=float(batch.loss_mask.sum()), sequences=4, micro_batches=1)  # pairs, chosen tokens
    with torch.no_grad():
        loss, _ = trainer.compute_loss(trainer.model_wrapped, batch, counts)
    return float(loss)


@pytest.mark.parametrize("case", list(CASES))
def test_losses_equal_trls_on_one_batch(tiny_model_dir, case):
    tolerance = FLOAT32_REL_EXP if case in ("forward_kl", "alpha_divergence") else FLOAT32_REL
    assert our_loss(tiny_model_dir, case) == pytest.approx(TRL_LOSSES[case], rel=tolerance)


# TRL 1.16's metrics after compute_loss on that batch, loss_type="sigmoid" (its _metrics["train"]; obtained as
# TRL_LOSSES were, by tests/integration/test_dpo.py's setup with trl.DPOTrainer, 2026-11-27)
TRL_METRICS = {"entropy": 5.45998621, "logits/chosen": 0.00442162, "logits/rejected": 0.00910757,
               "mean_token_accuracy": 0.0, "rewards/chosen": -0.51082295, "rewards/rejected": -0.69446516,
               "rewards/accuracies": 0.75, "rewards/margins": 0.18364221, "logps/chosen": -49.84905243,
               "logps/rejected": -52.75053406}


def test_metrics_equal_trls_on_one_batch(tiny_model_dir):
    """Every metric TRL logs for the batch, logits/chosen and logits/rejected (the vocabulary-mean logit, which the
    chunked head computes as hidden @ mean(W) without the logits) included."""
    trainer = DPOTrainer(model=tiny_model_dir, train_dataset=ROWS, args=DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, shuffle_dataset=False, report_to="none",
        loss_type=["sigmoid"], **OPTIONS))
    perturbed(trainer.model)
    batch = trainer.micro_batch(0, 0)
    counts = BatchCounts(tokens=float(batch.loss_mask.sum()), sequences=4, micro_batches=1)
    with torch.no_grad():
        _, stats = trainer.compute_loss(trainer.model_wrapped, batch, counts)
    ours = {name: float(total) / float(count) for name, (total, count) in stats.items()}
    # rewards/* are differences of sums of log-probs near -50, whose rounding is absolute (~3e-6): abs 1e-5
    assert ours == pytest.approx(TRL_METRICS, rel=FLOAT32_REL, abs=1e-5)


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed")
def test_losses_equal_trls_computed_live(tiny_model_dir):
    """TRL itself on this host: its tokenization of ROWS is ours, its float32 loss ours, and its float64 loss the
    stored reference."""
    from datasets import Dataset

    for case, options in CASES.items():
        theirs = trl.DPOTrainer(model=tiny_model_dir, train_dataset=Dataset.from_list(ROWS), args=trl.DPOConfig(
            output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
            per_device_train_batch_size=4, **OPTIONS, **options))
        perturbed(theirs.model)
        theirs.model.eval()
        ours = DPOTrainer(model=tiny_model_dir, train_dataset=ROWS, args=DPOConfig(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, report_to="none", **OPTIONS, **options))
        for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert ours.train_dataset[column] == theirs.train_dataset[column], column
        batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
        with torch.no_grad():
            assert float(theirs.compute_loss(theirs.model, batch)) == pytest.approx(
                our_loss(tiny_model_dir, case), rel=SAME_HOST_REL), case
            theirs.model.double()
            assert float(theirs.compute_loss(theirs.model, batch)) == pytest.approx(TRL_LOSSES[case],
                                                                                    rel=FLOAT64_REL), case


def test_prompts_are_implicit_or_conversational_as_in_trl(tiny_model_dir, tokenizer):
    implicit = [{"chosen": "Q: hi A: yes", "rejected": "Q: hi A: no"}]
    trainer = DPOTrainer(model=tiny_model_dir, train_dataset=implicit,
                         args=DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none"))
    row = trainer.train_dataset[0]
    eos = tokenizer.eos_token_id
    assert row["prompt_ids"] == tokenizer("Q: hi A:")["input_ids"]  # the space goes to the completions
    assert row["chosen_ids"] == tokenizer(" yes")["input_ids"] + [eos]  # text completions end with EOS
    assert row["rejected_ids"] == tokenizer(" no")["input_ids"] + [eos]
    chat = [{"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": [{"role": "assistant", "content": "5"}]}]
    trainer = DPOTrainer(model=tiny_model_dir, train_dataset=chat,
                         args=DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none"))
    row = trainer.train_dataset[0]
    prompt = tokenizer.apply_chat_template(chat[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(row["prompt_ids"]) == prompt
    assert tokenizer.decode(row["chosen_ids"]).startswith("4") and eos not in row["chosen_ids"][:-3]


def arithmetic(a_values, b_values) -> list[dict]:
    """chosen: the right sum; rejected: one more."""
    return [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in a_values
            for b in b_values]


def digits_over_letters(n: int, seed: int) -> list[dict]:
    """A preference a tiny random model learns in a few steps: three digits preferred to three letters, after a
    random prompt."""
    draw = random.Random(seed)
    pick = lambda chars: "".join(draw.choice(chars) for _ in range(3))  # noqa: E731
    return [{"prompt": pick("xyzw") + ":", "chosen": pick("0123456789"), "rejected": pick("abcdefgh")}
            for _ in range(n)]


def test_dpo_learns_a_preference_that_holds_out(tiny_model_dir, tmp_path):
    """Held-out pairs (other prompts and strings) are preferred correctly after training: the implicit
    reward's accuracy and margin rise from 0, the loss falls from log 2."""
    trainer = DPOTrainer(model=tiny_model_dir, train_dataset=digits_over_letters(64, 0),
                         eval_dataset=digits_over_letters(16, 1),
                         args=DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=3e-3,
                                        max_steps=20, logging_steps=10, save_strategy="no", report_to="none",
                                        disable_tqdm=True, beta=0.1))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert before["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start
    assert before["eval_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert after["eval_rewards/accuracies"] >= 0.9 and after["eval_rewards/margins"] > 1.0
    assert after["eval_loss"] < 0.3
    logged = [r for r in step_records(trainer) if "rewards/accuracies" in r and "eval_loss" not in r]
    assert len(logged) == 2 and logged[-1]["rewards/accuracies"] > logged[0]["rewards/accuracies"]


def test_peft_reference_is_the_model_with_its_adapters_off(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    trainer = DPOTrainer(model=tiny_model_dir, train_dataset=arithmetic(range(4), range(4)),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                         args=DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=1e-2,
                                        max_steps=4, logging_steps=1, save_strategy="no", report_to="none",
                                        disable_tqdm=True))
    trainer.train()
    first, last = trainer.state.log_history[0], trainer.state.log_history[-2]
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as the identity
    assert abs(last["rewards/margins"]) > 1e-3
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    trained = [name for name, _ in trainer.model.named_parameters() if "lora_" in name]
    assert trained
    for name, value in trainer.model.named_parameters():  # the base weights did not move
        if "lora_" not in name:
            assert torch.equal(value, base[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name


def test_a_precomputed_reference_trains_the_same(tiny_model_dir, tmp_path):
    finals = []
    for precompute in (False, True):
        trainer = DPOTrainer(model=tiny_model_dir, train_dataset=arithmetic(range(4), range(4)), args=DPOConfig(
            output_dir=str(tmp_path / str(precompute)), per_device_train_batch_size=8, learning_rate=1e-2,
            max_steps=4, save_strategy="no", report_to="none", disable_tqdm=True,
            precompute_ref_log_probs=precompute))
        assert (trainer.ref_model is None) == precompute
        assert ("ref_chosen_logps" in trainer.train_dataset[0]) == precompute
        trainer.train()
        finals.append([p.detach().clone() for p in trainer.model.parameters()])
    assert_trained_alike(*finals, learning_rate=1e-2)


def test_bad_input_is_refused_with_the_option_or_row(tiny_model_dir, tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(DatasetFormatError, match="train_dataset row 1: column 'rejected' is missing"):
        DPOTrainer(model=tiny_model_dir, args=args, train_dataset=[ROWS[0], {"prompt": "a", "chosen": "b"}])
    with pytest.raises(DatasetFormatError, match="row 0 column 'chosen' must be text"):
        DPOTrainer(model=tiny_model_dir, args=args, train_dataset=[{"prompt": "a", "chosen": 3, "rejected": "c"}])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="cannot be the same object"):
        DPOTrainer(model=model, ref_model=model, args=args, train_dataset=ROWS)
    with pytest.raises(ConfigError, match="loss_weights"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ConfigError, match="f_divergence_type"):
        DPOConfig(output_dir=str(tmp_path), loss_type="nca_pair", f_divergence_type="js_divergence")
    with pytest.raises(ConfigError, match="label_smoothing"):
        DPOConfig(output_dir=str(tmp_path), loss_type="exo_pair")
    with pytest.raises(DatasetFormatError, match="No row of train_dataset is left"):  # every prompt >= 3 tokens
        DPOTrainer(model=tiny_model_dir, args=DPOConfig(output_dir=str(tmp_path), max_length=3, report_to="none"),
                   train_dataset=ROWS)
