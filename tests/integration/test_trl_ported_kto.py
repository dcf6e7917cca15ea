"""TRL's own ``TestKTOTrainer`` cases (huggingface/trl, tests/test_kto_trainer.py), ported by changing the import.

Each case keeps TRL's config and assertions. What changes (each marked ``# port:`` where it is not one of these
global substitutions):

- the Hub models become tiny models built offline (``tests/trl_zen.py``: ``hub[model_id]``, hidden size 32, 2
  layers, the byte-level ChatML tokenizer of ``trainers.cli.tiny``): ``tiny-Qwen2ForCausalLM-2.5`` a tiny Qwen2;
  ``tiny-RemoteForCausalLM`` a tiny model whose code lives in its folder (``auto_map``). TRL's ``setup_method``
  (``self.model``, ``self.ref_model``, ``self.tokenizer`` with ``pad_token = eos_token``) is the ``setup`` fixture;
- ``load_dataset("trl-internal-testing/zen", config, ...)`` becomes ``zen(config, ...)`` (``zen_preference``):
  the Hub's rows (17 train and 2 test rows); ``trl-internal-testing/toolcall``'s ``preference`` config becomes
  ``toolcall_preference()``: conversational rows with a tool call and its result in the prompt and the tools;
- TRL trains its default 3 epochs (9 steps of 8 rows); the training cases without a ``max_steps`` of their own add
  ``max_steps=MAX_STEPS`` to stay short (marked ``# port: max_steps``);
- ``self.tmp_dir`` is pytest's ``tmp_path``; TrlTestCase methods are plain functions; TRL's repeated blocks (the
  "every parameter changed" loop, the PEFT check, the eval-dataset if/elif chain, the train-and-check body of the
  single-option cases) are shared helpers here, with the same statements.

Every case runs against this package and, where ``import trl`` works (TRL 1.16 locally; not in CI), against TRL too:
the ``lib`` fixture (TRL's config gets ``use_cpu=True`` without a bf16 GPU). A case that passes with TRL but not
here is marked ``fails_here(reason)``: a strict xfail for ``lib="trainers"`` only.

Not ported:

- GPU / Liger / bitsandbytes cases: ``test_train_with_liger``, ``test_train_with_liger_kernel_and_peft``,
  ``test_liger_kernel_with_peft_lm_head_raises``, ``test_liger_kernel_with_peft_prompt_learning_raises``,
  ``test_init_fails_with_compute_metrics_and_liger``, ``test_init_fails_with_moe_aux_loss_and_liger`` (Liger),
  ``test_peft_with_quantization`` (bitsandbytes);
- Hub-only: ``test_train_gpt_oss`` (the ``trl-internal-testing/harmony`` data and GPT-OSS's harmony chat template);
- ``test_tag_added`` / ``test_tag_added_peft``: this package tags its models "trainers", on purpose;
- ``TestKTOTrainerVLM`` / ``TestKTOTrainerSlow`` (vision models), and the collator classes
  (``TestDataCollatorForUnpairedPreference``, ``TestDataCollatorForVisionUnpairedPreference``).
"""

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, IterableDatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trl_zen import (ROLE_CAPITAL_TEMPLATE, TinyHub, assert_all_changed, assert_peft_trained, eval_dataset_of,
                           fails_here, lib_fixture, toolcall_preference)
from tests.trl_zen import zen_preference as zen

MAX_STEPS = 3  # port: max_steps (TRL's default 3 epochs would be 9 steps of 8 rows)
QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"

lib = lib_fixture("KTO")


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    return TinyHub(tmp_path_factory.mktemp("hub"))


@pytest.fixture
def setup(hub):
    """TRL's ``setup_method``."""
    model_id = hub[QWEN2]
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    tokenizer.pad_token = tokenizer.eos_token
    return SimpleNamespace(
        model_id=model_id,
        model=AutoModelForCausalLM.from_pretrained(model_id, dtype="float32"),
        ref_model=AutoModelForCausalLM.from_pretrained(model_id),
        tokenizer=tokenizer,
    )


def _train_and_check(lib, model, training_args, dataset, **kwargs):
    """TRL's body of the single-option training cases: train, a train_loss logged, every parameter moved."""
    trainer = lib.KTOTrainer(model=model, args=training_args, train_dataset=dataset, **kwargs)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)
    return trainer


def _eval_dataset(eval_dataset_type):
    return eval_dataset_of(eval_dataset_type, "standard_unpaired_preference")


# -------------------------------------------------------------------------------------------- TestKTOTrainer


@pytest.mark.parametrize(
    "config_name, loss_type, pre_compute, eval_dataset",
    [
        ("standard_preference", "kto", True, True),
        ("standard_unpaired_preference", "kto", False, True),
        ("conversational_implicit_prompt_preference", "apo_zero_unpaired", True, True),
        ("standard_unpaired_preference", "apo_zero_unpaired", False, True),
    ],
)
def test_train(lib, setup, tmp_path, config_name, loss_type, pre_compute, eval_dataset):
    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        gradient_accumulation_steps=1,
        learning_rate=9e-1,
        eval_strategy="steps" if eval_dataset else "no",
        beta=0.1,
        precompute_ref_log_probs=pre_compute,
        loss_type=loss_type,
        report_to="none",
    )

    dataset = zen(config_name)

    trainer = lib.KTOTrainer(
        model=setup.model,
        ref_model=setup.ref_model,
        args=training_args,
        processing_class=setup.tokenizer,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"] if eval_dataset else None,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if param.sum() != 0:  # ignore 0 biases
            assert not torch.equal(param, new_param)


def test_fully_truncated_completion_examples_dropped(lib, setup, tmp_path):
    """The collator truncates with `keep_start`, so an example whose prompt alone fills `max_length` loses every
    completion token; it's dropped during dataset preparation."""
    dataset = Dataset.from_dict(
        {
            "prompt": ["Hi", "This is a very long prompt that fills up the whole max_length budget on its own"],
            "completion": [" there", " yes"],
            "label": [True, False],
        }
    )

    training_args = lib.KTOConfig(output_dir=str(tmp_path), max_length=6, report_to="none")
    trainer = lib.KTOTrainer(model=setup.model_id, args=training_args, train_dataset=dataset)

    # Only the short-prompt example survives.
    assert len(trainer.train_dataset) == 1
    assert trainer.train_dataset[0]["prompt_ids"] == trainer.processing_class("Hi")["input_ids"]


@pytest.mark.parametrize("precompute_ref_log_probs", [False, True])
@pytest.mark.parametrize(
    "eval_dataset_type",
    ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
     "dict_of_iterable_dataset"],
)
def test_evaluate_with_eval_dataset(lib, hub, tmp_path, eval_dataset_type, precompute_ref_log_probs):
    # `evaluate` accepts a raw (unprepared) dataset passed directly, not only a preprocessed `eval_dataset` set
    # at init. See https://github.com/huggingface/trl/issues/6115. Also a regression test: Accelerate's dispatch
    # for `IterableDataset` requires every batch field to be a tensor, which previously broke streaming
    # evaluation. `apo_zero_unpaired` avoids KTO's KL term, which is incompatible with streaming datasets.
    train_dataset = zen("standard_unpaired_preference", split="train")
    streaming = "iterable" in eval_dataset_type
    eval_dataset = _eval_dataset(eval_dataset_type)  # port: TRL's if/elif chain, shared with the cases below

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        loss_type="apo_zero_unpaired",
        precompute_ref_log_probs=precompute_ref_log_probs,
        report_to="none",
    )
    trainer = lib.KTOTrainer(model=hub[QWEN2], args=training_args, train_dataset=train_dataset)

    if streaming and precompute_ref_log_probs:
        with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
            trainer.evaluate(eval_dataset=eval_dataset)
        return

    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    if eval_dataset_type in ("dataset", "iterable_dataset"):
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None
        assert metrics["eval_data2_loss"] is not None


def test_evaluate_precompute_ref_log_probs_after_training_raises(lib, setup, tmp_path):
    # Full fine-tuning with `precompute_ref_log_probs=True` and no `ref_model` uses `self.model` as the reference.
    # That's valid only before training; a dataset passed to `evaluate()` afterwards can't get a correct reference.
    train_dataset = zen("standard_unpaired_preference", split="train")
    eval_dataset = zen("standard_unpaired_preference", split="test")
    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        precompute_ref_log_probs=True,
        report_to="none",
    )
    trainer = lib.KTOTrainer(model=setup.model_id, args=training_args, train_dataset=train_dataset)

    # Before training the reference is available, so evaluating a new dataset works.
    assert trainer.evaluate(eval_dataset=eval_dataset)["eval_loss"] is not None

    trainer.train()

    with pytest.raises(ValueError, match="Cannot compute reference log-probs for a dataset passed to"):
        trainer.evaluate(eval_dataset=eval_dataset)


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "dataset_dict", "dict_of_dataset"])
def test_evaluate_precompute_ref_log_probs_at_init_after_training(lib, setup, tmp_path, eval_dataset_type):
    # Regression for the guard above: an `eval_dataset` set at init has its reference log-probs precomputed once
    # (against the untrained reference) and stored, so no-arg `evaluate()` reuses those stored values and must not
    # raise after training, even with full fine-tuning and `precompute_ref_log_probs=True`.
    train_dataset = zen("standard_unpaired_preference", split="train")
    eval_dataset = _eval_dataset(eval_dataset_type)  # port: TRL's if/elif chain

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        precompute_ref_log_probs=True,
        report_to="none",
    )
    trainer = lib.KTOTrainer(
        model=setup.model_id, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset
    )

    trainer.train()

    metrics = trainer.evaluate()
    if eval_dataset_type == "dataset":
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None
        assert metrics["eval_data2_loss"] is not None


def test_trust_remote_code(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference", split="train")
    model_id = hub["trl-internal-testing/tiny-RemoteForCausalLM"]

    with pytest.raises(ValueError, match="custom code"):
        lib.KTOTrainer(
            model=model_id,
            args=lib.KTOConfig(output_dir=str(tmp_path), report_to="none"),
            train_dataset=dataset,
        )

    trainer = lib.KTOTrainer(
        model=model_id,
        args=lib.KTOConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=True),
        train_dataset=dataset,
    )
    assert type(trainer.model).__name__ == "RemoteForCausalLM"


def test_train_with_ref_model_is_model_raises(lib, setup, tmp_path):
    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        report_to="none",
    )

    dataset = zen("standard_unpaired_preference", split="train")

    with pytest.raises(ValueError):
        lib.KTOTrainer(
            model=setup.model,
            ref_model=setup.model,  # ref_model can't be the same as model
            args=training_args,
            processing_class=setup.tokenizer,
            train_dataset=dataset,
        )


@fails_here("KTOTrainer has no data_collator attribute (AttributeError at trainer.data_collator([example]))")
def test_tokenize_and_process_tokens(lib, setup, tmp_path):
    import multiprocess

    # Pytest/CI often starts background threads before tests run. Under Python 3.12+,
    # using "fork" in a multi-threaded process emits a DeprecationWarning and may deadlock.
    # Force "spawn" to keep this multiprocessing test safe while still exercising `num_proc=2`.
    previous_start_method = multiprocess.get_start_method(allow_none=True)  # port: restored below
    multiprocess.set_start_method("spawn", force=True)
    try:
        training_args = lib.KTOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            max_steps=3,
            gradient_accumulation_steps=1,
            learning_rate=9e-1,
            eval_strategy="steps",
            beta=0.1,
            report_to="none",
        )

        dataset = zen("standard_unpaired_preference")
        train_dataset = dataset["train"]

        trainer = lib.KTOTrainer(
            model=setup.model,
            ref_model=setup.ref_model,
            args=training_args,
            processing_class=setup.tokenizer,
            train_dataset=train_dataset,
            eval_dataset=dataset["test"],
        )
    finally:
        multiprocess.set_start_method(previous_start_method, force=True)  # port: the process-wide start method

    # Verify the tokenization step: dataset stores raw token IDs (aligned with DPO style).
    # prompt_ids must start with the tokenized prompt text.
    prompt_ids = setup.tokenizer(train_dataset["prompt"][0])["input_ids"]
    assert trainer.train_dataset[0]["prompt_ids"][: len(prompt_ids)] == prompt_ids
    # completion_ids are the raw answer tokens (no prompt prefix, no BOS/EOS added yet).
    assert len(trainer.train_dataset[0]["completion_ids"]) > 0

    # Verify the collator output (assembly, BOS/EOS insertion, labels).
    example = trainer.train_dataset[0]
    batch = trainer.data_collator([example])
    # input_ids ends with EOS
    assert batch["input_ids"][0, -1].item() == setup.tokenizer.eos_token_id
    # completion_mask: prompt tokens are 0, completion tokens are 1; at least the prompt is masked
    assert "completion_mask" in batch
    completion_mask = batch["completion_mask"][0].tolist()
    assert 0 in completion_mask and 1 in completion_mask
    first_completion = next(i for i, m in enumerate(completion_mask) if m == 1)
    assert first_completion > 0  # at least the prompt is masked
    assert all(m == 0 for m in completion_mask[:first_completion])


def test_train_without_providing_ref_model(lib, setup, tmp_path):
    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        gradient_accumulation_steps=4,
        learning_rate=9e-1,
        eval_strategy="steps",
        beta=0.1,
        report_to="none",
    )

    dataset = zen("standard_unpaired_preference")

    trainer = lib.KTOTrainer(
        model=setup.model,
        ref_model=None,
        args=training_args,
        processing_class=setup.tokenizer,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if param.sum() != 0:  # ignore 0 biases
            assert not torch.equal(param, new_param)


def test_train_without_providing_ref_model_with_lora(lib, setup, tmp_path):
    from peft import LoraConfig

    lora_config = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        bias="none",
        task_type="CAUSAL_LM",
    )

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        gradient_accumulation_steps=4,
        learning_rate=9e-1,
        eval_strategy="steps",
        beta=0.1,
        report_to="none",
    )

    dataset = zen("standard_unpaired_preference")

    trainer = lib.KTOTrainer(
        model=setup.model,
        ref_model=None,
        args=training_args,
        processing_class=setup.tokenizer,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
        peft_config=lora_config,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        if "lora" in n:
            new_param = trainer.model.get_parameter(n)
            if param.sum() != 0:  # ignore 0 biases
                assert not torch.equal(param, new_param)


@fails_here("KTOTrainer(compute_metrics=...) raises ConfigError: not supported here")
def test_compute_metrics(lib, hub, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
    ref_model = AutoModelForCausalLM.from_pretrained(hub[QWEN2])
    tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
    tokenizer.pad_token = tokenizer.eos_token

    dataset = zen("standard_unpaired_preference")

    def dummy_compute_metrics(*args, **kwargs):
        return {"test": 0.0}

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        do_eval=True,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=2,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    trainer = lib.KTOTrainer(
        model=model,
        ref_model=ref_model,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
        compute_metrics=dummy_compute_metrics,
    )

    trainer.train()

    assert trainer.state.log_history[-2]["eval_test"] == 0.0


def test_train_with_explicit_ref_model(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    # When specifying a ref model, it's usually because we want it to be a different checkpoint, but for testing
    # purposes we will just use the same checkpoint
    ref_model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
    trainer = lib.KTOTrainer(
        model=hub[QWEN2],
        ref_model=ref_model,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
        new_ref_param = trainer.ref_model.get_parameter(n)
        torch.testing.assert_close(param, new_ref_param, msg=f"Reference model parameter {n} has changed.")


def test_train_with_sync_ref_model(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        sync_ref_model=True,
        ref_model_sync_steps=2,  # reduce sync steps to ensure a sync happens
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.KTOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    assert trainer.ref_model is not None
    previous_ref_params = {n: param.clone() for n, param in trainer.ref_model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
        new_ref_param = trainer.ref_model.get_parameter(n)
        assert not torch.equal(previous_ref_params[n], new_ref_param), f"Ref Parameter {n} has not changed."


def test_train_model_dtype(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        model_init_kwargs={"dtype": torch.float16},
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.KTOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        # For some reason model.layers.0.input_layernorm.weight doesn't change in GitHub Actions but does
        # locally. We ignore this parameter for now
        if "layernorm" in n:
            continue
        new_param = trainer.model.get_parameter(n)
        # Check the torch dtype
        assert new_param.dtype == torch.float16
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def test_train_peft_model(lib, hub, tmp_path):
    from peft import LoraConfig, get_peft_model

    model_id = hub[QWEN2]
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    lora_config = LoraConfig()
    model = get_peft_model(model, lora_config)

    dataset = zen("standard_unpaired_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=1.0,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.KTOTrainer(model=model, args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed (except base and ref)
    assert_peft_trained(previous_trainable_params, trainer, base_param_names, skip_ref=True)


# In practice, this test is the same as `test_kto_trainer_without_providing_ref_model_with_lora`, since gradient
# checkpointing is enabled by default in `KTOTrainer`. We keep it as a regression guard: if the default ever
# changes, we still explicitly test PEFT + gradient checkpointing, which has caused issues in the past.
def test_train_with_peft_config_and_gradient_checkpointing(lib, hub, tmp_path):
    from peft import LoraConfig

    model_id = hub[QWEN2]
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_unpaired_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        gradient_checkpointing=True,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    trainer = lib.KTOTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(),
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed
    assert_peft_trained(previous_trainable_params, trainer, base_param_names)


@pytest.mark.parametrize("iterable_as", ["train", "eval", "eval_dict", "eval_iterable_dataset_dict"])
def test_precompute_ref_log_probs_raises_for_iterable_dataset(lib, hub, tmp_path, iterable_as):
    # `precompute_ref_log_probs=True` caches reference log-probs by index, which requires random access and is
    # therefore incompatible with a streaming `IterableDataset` — whether passed directly or nested in a dict or
    # `IterableDatasetDict` as the eval dataset.
    map_dataset = zen("standard_unpaired_preference", split="train")
    iterable_dataset = zen("standard_unpaired_preference", split="train", streaming=True)

    train_dataset, eval_dataset = map_dataset, None
    if iterable_as == "train":
        train_dataset = iterable_dataset
    elif iterable_as == "eval":
        eval_dataset = iterable_dataset
    elif iterable_as == "eval_dict":
        eval_dataset = {"eval": iterable_dataset}
    elif iterable_as == "eval_iterable_dataset_dict":
        eval_dataset = IterableDatasetDict({"eval": iterable_dataset})

    # `apo_zero_unpaired` keeps the trainer setup minimal (no KL-term constraints), so the precompute error is what
    # surfaces. `max_steps` lets the iterable-train case reach the precompute check instead of failing earlier on
    # the missing dataset length required by the learning-rate scheduler.
    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        loss_type="apo_zero_unpaired",
        max_steps=1,
        report_to="none",
        precompute_ref_log_probs=True,
    )
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
        lib.KTOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_train_with_iterable_dataset(lib, hub, tmp_path, loss_type):
    # Streaming `IterableDataset` is supported for all loss types. Loss types that estimate the KL term (all except
    # `apo_zero_unpaired`) build the mismatched KL pairs from neighboring examples within each fixed-order batch,
    # which streaming preserves because it is consumed sequentially.
    dataset = zen("standard_unpaired_preference", split="train", streaming=True)

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        loss_type=loss_type,
        per_device_train_batch_size=2,  # KL-term loss types require a per-device train batch size greater than 1
        max_steps=3,
        report_to="none",
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_chat_template_kwargs(lib, hub, tmp_path):
    dataset = zen("conversational_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
    # The following template is a simplified version of the Qwen chat template, where an additional argument
    # `role_capital` is used to control the capitalization of roles.
    tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE  # port: TRL's template string, in tests/trl_zen.py

    dataset = dataset.add_column("chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))])
    assert "chat_template_kwargs" in dataset.features

    trainer = lib.KTOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )

    assert trainer.processing_class.chat_template == tokenizer.chat_template

    # `chat_template_kwargs` is applied per example: the prepared prompts must contain both the lowercase and the
    # uppercase system header, proving the argument was threaded through tokenization (the dataset alternates
    # `role_capital`). The exact row order is not asserted because preprocessing unpairs the dataset.
    decoded_prompts = [
        trainer.processing_class.decode(trainer.train_dataset[i]["prompt_ids"])
        for i in range(len(trainer.train_dataset))
    ]
    assert any("<|im_start|>SYSTEM" in prompt for prompt in decoded_prompts)
    assert any("<|im_start|>system" in prompt for prompt in decoded_prompts)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_train_toolcall_data(lib, hub, tmp_path):
    dataset = toolcall_preference(split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size
        max_length=512,  # toolcall sequences are longer than standard data, limit length to avoid OOM
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_eval(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference")

    training_args = lib.KTOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none",
                                  max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.KTOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )

    trainer.train()

    assert trainer.state.log_history[0]["eval_loss"] is not None


def test_train_with_multiple_eval_dataset(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference")

    training_args = lib.KTOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none",
                                  max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.KTOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset={"data1": dataset["test"], "data2": dataset["test"]},
    )
    trainer.train()

    assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
    assert trainer.state.log_history[-2]["eval_data2_loss"] is not None


def test_train_dataset_required(lib, hub, tmp_path):
    training_args = lib.KTOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        lib.KTOTrainer(model=hub[QWEN2], args=training_args)


@pytest.mark.parametrize(
    "eval_dataset_type",
    ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
     "dict_of_iterable_dataset", "none"],
)
def test_init_with_eval_dataset(lib, hub, tmp_path, eval_dataset_type):
    # `apo_zero_unpaired` avoids KTO's KL term, which is incompatible with streaming datasets.
    train_dataset = zen("standard_unpaired_preference", split="train")

    if eval_dataset_type == "none":
        eval_dataset = None
    else:
        eval_dataset = _eval_dataset(eval_dataset_type)  # port: TRL's if/elif chain

    training_args = lib.KTOConfig(output_dir=str(tmp_path), loss_type="apo_zero_unpaired", report_to="none")
    trainer = lib.KTOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )

    if eval_dataset_type == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
        # Each split was tokenized independently.
        assert "prompt_ids" in next(iter(trainer.eval_dataset["data1"]))
        assert "prompt_ids" in next(iter(trainer.eval_dataset["data2"]))
    else:
        assert "prompt_ids" in next(iter(trainer.eval_dataset))


# In practice, this test is the same as `test_kto_trainer`, since gradient checkpointing is enabled by default in
# `KTOTrainer`. We keep it as a regression guard: if the default ever changes, we still explicitly test gradient
# checkpointing, which has caused issues in the past.
def test_train_with_gradient_checkpointing(lib, hub, tmp_path):
    dataset = zen("standard_unpaired_preference", split="train")

    training_args = lib.KTOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        gradient_checkpointing=True,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)
