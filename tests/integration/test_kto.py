"""KTOTrainer end to end on a tiny model, one CPU process: TRL's loss on one batch (with its KL reference
point), paired data unpaired as TRL does, learning, a precomputed reference, and clear errors."""

import random
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import step_records
from tests.floats import FLOAT32_REL, FLOAT64_REL, SAME_HOST_REL, assert_trained_alike
from trainers import KTOConfig, KTOTrainer
from trainers.errors import ConfigError, DatasetFormatError
from trainers.model.losses import BatchCounts

try:
    import trl

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False

ROWS = [{"prompt": "The sky is", "completion": " blue.", "label": True},
        {"prompt": "2+2=", "completion": "five", "label": False},
        {"prompt": "Say hi:", "completion": " hi there", "label": True},
        {"prompt": "Cats", "completion": " are loud.", "label": False}]
CASES = {"kto": {}, "weighted": {"desirable_weight": 1.3, "undesirable_weight": 0.7},
         "apo_zero_unpaired": {"loss_type": "apo_zero_unpaired"}}
# TRL 1.16's KTOTrainer.compute_loss on ROWS (its tokenization, mismatched pairs and collator), beta 0.3, with the
# reference and the policy ``moved`` (seeds 0 and 1), both then cast to float64 (tests/floats.py): the KL reference
# point is 0.35, so the kto losses differ from apo_zero_unpaired's. From test_loss_equals_trls_computed_live, which
# runs TRL where installed.
TRL_LOSSES = {"kto": 0.588448286, "weighted": 0.592815757, "apo_zero_unpaired": 0.587101579}


def moved(model, seed: int, scale: float):
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn_like(parameter))
    return model


def reference(model_dir):
    return moved(AutoModelForCausalLM.from_pretrained(model_dir), 0, 0.05)


def our_loss(model_dir, case: str) -> tuple[float, dict]:
    trainer = KTOTrainer(model=model_dir, ref_model=reference(model_dir), train_dataset=ROWS,
                         args=KTOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                                        report_to="none", beta=0.3, **CASES[case]))
    moved(trainer.model, 1, 0.02)
    with torch.no_grad():
        loss, stats = trainer.compute_loss(trainer.model_wrapped, trainer.micro_batch(0, 0),
                                           BatchCounts(tokens=4, sequences=4, micro_batches=1))
    return float(loss), stats


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_trls_on_one_batch(tiny_model_dir, case):
    loss, stats = our_loss(tiny_model_dir, case)
    assert loss == pytest.approx(TRL_LOSSES[case], rel=FLOAT32_REL)
    assert (float(stats["kl"][0]) > 0.3) == (case != "apo_zero_unpaired")


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed")
def test_loss_equals_trls_computed_live(tiny_model_dir):
    """TRL itself on this host: its tokenization and mismatched pairs of ROWS are ours, its float32 loss ours, and its
    float64 loss the stored reference."""
    from datasets import Dataset

    for case, options in CASES.items():
        theirs = trl.KTOTrainer(model=tiny_model_dir, ref_model=reference(tiny_model_dir),
                                train_dataset=Dataset.from_list(ROWS), args=trl.KTOConfig(
                                    output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
                                    per_device_train_batch_size=4, beta=0.3, **options))
        ours = KTOTrainer(model=tiny_model_dir, train_dataset=ROWS, args=KTOConfig(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, report_to="none", **options))
        for column in ("prompt_ids", "completion_ids", "label"):
            assert ours.train_dataset[column] == theirs.train_dataset[column], column
        if case != "apo_zero_unpaired":
            assert ours.train_dataset["kl_completion_ids"] == theirs.train_dataset["KL_completion_ids"]
        moved(theirs.model, 1, 0.02)
        theirs.model.eval()
        batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
        with torch.no_grad():
            assert float(theirs.compute_loss(theirs.model, dict(batch))) == pytest.approx(
                our_loss(tiny_model_dir, case)[0], rel=SAME_HOST_REL), case
            theirs.model.double()
            theirs.ref_model.double()
            assert float(theirs.compute_loss(theirs.model, dict(batch))) == pytest.approx(TRL_LOSSES[case],
                                                                                          rel=FLOAT64_REL), case


def test_paired_rows_are_unpaired_and_mismatched_as_trl_does(tiny_model_dir):
    paired = [{"prompt": f"p{i}:", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(3)]
    trainer = KTOTrainer(model=tiny_model_dir, train_dataset=paired, args=KTOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, report_to="none"))
    rows = trainer.train_dataset
    # every chosen completion (label True), then every rejected one (False)
    assert rows["label"] == [True, True, True, False, False, False]
    tokenizer = trainer.processing_class
    decoded = [tokenizer.decode(ids) for ids in rows["completion_ids"]]
    eos = tokenizer.eos_token
    assert decoded == [f"c0{eos}", f"c1{eos}", f"c2{eos}", f"r0{eos}", f"r1{eos}", f"r2{eos}"]
    # mismatched pairs within runs of per_device_train_batch_size rows: row i gets row i - 1's completion
    kl = [tokenizer.decode(ids) for ids in rows["kl_completion_ids"]]
    assert kl == [f"c1{eos}", f"c0{eos}", f"r0{eos}", f"c2{eos}", f"r2{eos}", f"r1{eos}"]


def digits_or_letters(n: int, seed: int) -> list[dict]:
    """Unpaired rows: three digits are desirable, three letters not."""
    draw = random.Random(seed)
    rows = []
    for i in range(n):
        desirable = i % 2 == 0
        rows.append({"prompt": "".join(draw.choice("xyzw") for _ in range(3)) + ":",
                     "completion": "".join(draw.choice("0123456789" if desirable else "abcdefgh") for _ in range(3)),
                     "label": desirable})
    return rows


def test_kto_learns_desirable_completions(tiny_model_dir, tmp_path):
    trainer = KTOTrainer(model=tiny_model_dir, train_dataset=digits_or_letters(64, 0),
                         eval_dataset=digits_or_letters(16, 1),
                         args=KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=3e-3,
                                        max_steps=16, logging_steps=8, save_strategy="no", report_to="none",
                                        disable_tqdm=True))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert before["eval_rewards/chosen"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start
    assert after["eval_rewards/chosen"] > 0.1 > -0.1 > after["eval_rewards/rejected"]
    assert after["eval_loss"] < before["eval_loss"] - 0.05
    logged = [r for r in step_records(trainer) if "loss" in r and "eval_loss" not in r]
    assert {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "entropy"} <= set(logged[0])
    assert logged[-1]["rewards/margins"] == pytest.approx(logged[-1]["rewards/chosen"] - logged[-1]["rewards/rejected"])


def test_a_precomputed_reference_trains_the_same(tiny_model_dir, tmp_path):
    finals = []
    for precompute in (False, True):
        trainer = KTOTrainer(model=tiny_model_dir, train_dataset=digits_or_letters(16, 0), args=KTOConfig(
            output_dir=str(tmp_path / str(precompute)), per_device_train_batch_size=8, learning_rate=1e-2,
            max_steps=3, save_strategy="no", report_to="none", disable_tqdm=True,
            precompute_ref_log_probs=precompute))
        assert (trainer.ref_model is None) == precompute
        trainer.train()
        finals.append([p.detach().clone() for p in trainer.model.parameters()])
    assert_trained_alike(*finals, learning_rate=1e-2)


def test_bad_input_is_refused_with_the_option_or_row(tiny_model_dir, tmp_path):
    args = KTOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2)
    with pytest.raises(DatasetFormatError, match="train_dataset row 0 column 'label' must be True"):
        KTOTrainer(model=tiny_model_dir, args=args, train_dataset=[{**row, "label": "yes"} for row in ROWS])
    with pytest.raises(DatasetFormatError, match="train_dataset row 0: column 'completion' is missing"):
        KTOTrainer(model=tiny_model_dir, args=args, train_dataset=[{"prompt": "a", "label": True}])
    with pytest.raises(ConfigError, match="requires `train_sampling_strategy='sequential'`"):
        KTOTrainer(model=tiny_model_dir, train_dataset=ROWS, args=KTOConfig(
            output_dir=str(tmp_path), report_to="none", train_sampling_strategy="random"))
    with pytest.raises(ConfigError, match="batch size must be > 1"):
        KTOTrainer(model=tiny_model_dir, train_dataset=ROWS, args=KTOConfig(
            output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=1))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="cannot be the same object"):
        KTOTrainer(model=model, ref_model=model, args=args, train_dataset=ROWS)


def test_the_preference_trainers_take_trls_arguments_in_trls_order():
    """TRL 1.16's __init__ parameters, in order (from its sources): a script passing them by position ports."""
    import inspect

    from trainers import DPOTrainer, RewardTrainer

    trl_order = {
        DPOTrainer: ["model", "ref_model", "args", "data_collator", "train_dataset", "eval_dataset",
                     "processing_class", "compute_metrics", "callbacks", "optimizers", "quantization_config",
                     "peft_config"],
        KTOTrainer: ["model", "ref_model", "args", "data_collator", "train_dataset", "eval_dataset",
                     "processing_class", "compute_metrics", "callbacks", "optimizers", "quantization_config",
                     "peft_config"],
        RewardTrainer: ["model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class",
                        "compute_metrics", "callbacks", "optimizers", "optimizer_cls_and_kwargs",
                        "preprocess_logits_for_metrics", "quantization_config", "peft_config"],
    }
    for trainer, order in trl_order.items():
        assert list(inspect.signature(trainer.__init__).parameters)[1:] == order, trainer.__name__
        if HAVE_TRL:
            theirs = getattr(trl, trainer.__name__)
            assert list(inspect.signature(theirs.__init__).parameters)[1:] == order, trainer.__name__
