"""TRL's own ``TestDPOTrainer`` cases (huggingface/trl, tests/test_dpo_trainer.py), ported by changing the import.

Each case keeps TRL's config and assertions. What changes (each marked ``# port:`` where it is not one of these
global substitutions):

- the Hub models become tiny models built offline (``tests/trl_zen.py``: ``hub[model_id]``, hidden size 32, 2
  layers, the byte-level ChatML tokenizer of ``trainers.cli.tiny``): ``tiny-Qwen2ForCausalLM-2.5`` a tiny Qwen2, and
  the other architectures of ``test_train`` (Cohere2, Glm4Moe, GptOss, Qwen3Moe, NemotronH, Olmo3, Lfm2) tiny twins
  of that architecture; ``tiny-RemoteForCausalLM`` a tiny model whose code lives in its folder (``auto_map``);
- ``load_dataset("trl-internal-testing/zen", config, ...)`` becomes ``zen(config, ...)`` (``zen_preference``):
  the Hub's rows (17 train and 2 test rows); ``trl-internal-testing/toolcall``'s ``preference`` config becomes
  ``toolcall_preference()``: conversational rows with a tool call and its result in the prompt and the tools;
- TRL trains its default 3 epochs (9 steps of 8 rows); the training cases add ``max_steps=MAX_STEPS`` to stay
  short (marked ``# port: max_steps``);
- ``self.tmp_dir`` is pytest's ``tmp_path``; TrlTestCase methods are plain functions; TRL's repeated blocks (the
  "every parameter changed" loop, the PEFT check, the eval-dataset if/elif chain, the train-and-check body of the
  single-option cases) are shared helpers here, with the same statements.

Every case runs against this package and, where ``import trl`` works (TRL 1.16 locally; not in CI), against TRL too:
the ``lib`` fixture (TRL's config gets ``use_cpu=True`` without a bf16 GPU). A case that passes with TRL but not
here is marked ``fails_here(reason)``: a strict xfail for ``lib="trainers"`` only.

Not ported:

- GPU / Liger / bitsandbytes / kernels cases: ``test_train_with_liger``, ``test_train_with_liger_kernel_and_peft``,
  ``test_liger_kernel_with_peft_lm_head_raises``, ``test_liger_kernel_with_peft_prompt_learning_raises``,
  ``test_init_fails_with_moe_aux_loss_and_liger``, ``test_init_fails_with_compute_metrics_and_liger`` (Liger),
  ``test_train_padding_free`` (flash-attention kernels on an Ampere GPU), ``test_peft_with_quantization``
  (bitsandbytes);
- Hub-only: ``test_train_gpt_oss`` (the ``trl-internal-testing/harmony`` data and GPT-OSS's harmony chat template);
- ``test_tag_added`` / ``test_tag_added_peft``: this package tags its models "trainers", on purpose;
- TRL 1.16 fails it (the source is a newer TRL): ``test_train_moe_peft_model`` (1.16 still adds a "ref" adapter
  next to a LoRA with ``target_parameters``: ``assert "ref" not in trainer.model.peft_config`` fails);
- ``TestDPOTrainerVLM`` / ``TestDPOTrainerSlow`` (vision models), and the collator classes
  (``TestDataCollatorForPreference``, ``TestDataCollatorForVisionPreference``).
"""

import pytest
import torch
from datasets import Dataset, IterableDatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trl_zen import (ROLE_CAPITAL_TEMPLATE, TinyHub, assert_all_changed, assert_peft_trained, eval_dataset_of,
                           fails_here, lib_fixture, toolcall_preference)
from tests.trl_zen import zen_preference as zen

MAX_STEPS = 3  # port: max_steps (TRL's default 3 epochs would be 9 steps of 8 rows)
QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"

lib = lib_fixture("DPO")


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    return TinyHub(tmp_path_factory.mktemp("hub"))


# -------------------------------------------------------------------------------------------- TestDPOTrainer


@pytest.mark.parametrize(
    "model_id",
    [
        "trl-internal-testing/tiny-Cohere2ForCausalLM",
        "trl-internal-testing/tiny-Glm4MoeForCausalLM",
        "trl-internal-testing/tiny-GptOssForCausalLM",
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5",
        "trl-internal-testing/tiny-Qwen3MoeForCausalLM",
        "trl-internal-testing/tiny-NemotronHForCausalLM-nano",
        "trl-internal-testing/tiny-Olmo3ForCausalLM",
        "trl-internal-testing/tiny-Lfm2ForCausalLM",
        "trl-internal-testing/tiny-Lfm2ForCausalLM-2.5",
    ],
)
def test_train(lib, hub, tmp_path, model_id):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(model=hub[model_id], args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # MoE models log the load-balancing auxiliary loss (on by default)
    if trainer.aux_loss_enabled:
        assert trainer.state.log_history[-1]["aux_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def _eval_dataset(eval_dataset_type):
    return eval_dataset_of(eval_dataset_type, "standard_preference")


@pytest.mark.parametrize("precompute_ref_log_probs", [False, True])
@pytest.mark.parametrize(
    "eval_dataset_type",
    ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
     "dict_of_iterable_dataset"],
)
def test_evaluate_with_eval_dataset(lib, hub, tmp_path, eval_dataset_type, precompute_ref_log_probs):
    # `evaluate` accepts a raw (unprepared) dataset passed directly, not only a preprocessed `eval_dataset` set
    # at init. See https://github.com/huggingface/trl/issues/6115.
    train_dataset = zen("standard_preference", split="train")
    streaming = "iterable" in eval_dataset_type
    eval_dataset = _eval_dataset(eval_dataset_type)  # port: TRL's if/elif chain, shared with the cases below

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path), precompute_ref_log_probs=precompute_ref_log_probs, report_to="none"
    )
    trainer = lib.DPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=train_dataset)

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


def test_evaluate_precompute_ref_log_probs_after_training_raises(lib, hub, tmp_path):
    # Full fine-tuning with `precompute_ref_log_probs=True` and no `ref_model` uses `self.model` as the reference.
    # That's valid only before training; a dataset passed to `evaluate()` afterwards can't get a correct reference.
    train_dataset = zen("standard_preference", split="train")
    eval_dataset = zen("standard_preference", split="test")
    training_args = lib.DPOConfig(output_dir=str(tmp_path), max_steps=1, precompute_ref_log_probs=True,
                                  report_to="none")
    trainer = lib.DPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=train_dataset)

    # Before training the reference is available, so evaluating a new dataset works.
    assert trainer.evaluate(eval_dataset=eval_dataset)["eval_loss"] is not None

    trainer.train()

    with pytest.raises(ValueError, match="Cannot compute reference log-probs for a dataset passed to"):
        trainer.evaluate(eval_dataset=eval_dataset)


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "dataset_dict", "dict_of_dataset"])
def test_evaluate_precompute_ref_log_probs_at_init_after_training(lib, hub, tmp_path, eval_dataset_type):
    # Regression for the guard above: an `eval_dataset` set at init has its reference log-probs precomputed once
    # (against the untrained reference) and stored, so no-arg `evaluate()` reuses those stored values and must not
    # raise after training, even with full fine-tuning and `precompute_ref_log_probs=True`.
    train_dataset = zen("standard_preference", split="train")
    eval_dataset = _eval_dataset(eval_dataset_type)  # port: TRL's if/elif chain

    training_args = lib.DPOConfig(output_dir=str(tmp_path), max_steps=1, precompute_ref_log_probs=True,
                                  report_to="none")
    trainer = lib.DPOTrainer(
        model=hub[QWEN2], args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset
    )

    trainer.train()

    metrics = trainer.evaluate()
    if eval_dataset_type == "dataset":
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None
        assert metrics["eval_data2_loss"] is not None


def test_trust_remote_code(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train")
    model_id = hub["trl-internal-testing/tiny-RemoteForCausalLM"]

    with pytest.raises(ValueError, match="custom code"):
        lib.DPOTrainer(
            model=model_id,
            args=lib.DPOConfig(output_dir=str(tmp_path), report_to="none"),
            train_dataset=dataset,
        )

    trainer = lib.DPOTrainer(
        model=model_id,
        args=lib.DPOConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=True),
        train_dataset=dataset,
    )
    assert type(trainer.model).__name__ == "RemoteForCausalLM"


@pytest.mark.parametrize(
    "config_name",
    [
        "standard_preference",
        "conversational_preference",
        "standard_implicit_prompt_preference",
        "conversational_implicit_prompt_preference",
    ],
)
def test_train_dataset_format(lib, hub, tmp_path, config_name):
    dataset = zen(config_name, split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_train_model(lib, hub, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")

    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(model=model, args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


@pytest.mark.parametrize(
    "loss_type",
    [
        "sigmoid",
        "hinge",
        "ipo",
        "exo_pair",
        "nca_pair",
        "robust",
        "bco_pair",
        "sppo_hard",
        "aot",
        "aot_unpaired",
        "apo_zero",
        "apo_down",
        "discopop",
        "sft",
        "sigmoid_norm",
    ],
)
def test_train_loss_types(lib, hub, tmp_path, loss_type):
    dataset = zen("standard_preference")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        label_smoothing=1e-3 if loss_type == "exo_pair" else 0.0,
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        eval_strategy="steps",
        eval_steps=3,
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def _train_and_check(lib, model, training_args, dataset):
    """TRL's body of the single-option training cases: train, a train_loss logged, every parameter moved."""
    trainer = lib.DPOTrainer(model=model, args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_train_multi_loss_types(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        loss_type=["sigmoid", "bco_pair", "sft"],  # this specific combination is used in MPO
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_wpo(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        use_weighting=True,
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_ld(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        ld_alpha=0.5,
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


@pytest.mark.parametrize("f_divergence_type", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
def test_train_with_f_divergence(lib, hub, tmp_path, f_divergence_type):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        f_divergence_type=f_divergence_type,
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_explicit_ref_model(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    # When specifying a ref model, it's usually because we want it to be a different checkpoint, but for testing
    # purposes we will just just use the same checkpoint
    ref_model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
    trainer = lib.DPOTrainer(
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
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        sync_ref_model=True,
        ref_model_sync_steps=2,  # reduce sync steps to ensure a sync happens
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

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
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        model_init_kwargs={"dtype": torch.float16},
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        # For some reasonn model.layers.0.input_layernorm.weight doesn't change in GitHub Actions but does
        # locally. We ignore this parameter for now
        if "layernorm" in n:
            continue
        new_param = trainer.model.get_parameter(n)
        # Check the torch dtype
        assert new_param.dtype == torch.float16
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


# ------------------------------------------------------------------------------------------------------- PEFT


def test_train_dense_with_peft_config_lora(lib, hub, tmp_path):
    from peft import LoraConfig

    model_id = hub[QWEN2]
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=1.0,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    trainer = lib.DPOTrainer(
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


def test_train_moe_with_peft_config(lib, hub, tmp_path):
    from peft import LoraConfig

    model_id = hub["trl-internal-testing/tiny-GptOssForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    trainer = lib.DPOTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]),
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed
    assert_peft_trained(previous_trainable_params, trainer, base_param_names)


def test_train_peft_model(lib, hub, tmp_path):
    from peft import LoraConfig, get_peft_model

    model_id = hub[QWEN2]
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")

    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    lora_config = LoraConfig()
    model = get_peft_model(model, lora_config)

    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=1.0,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(model=model, args=training_args, train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed (except base and ref)
    assert_peft_trained(previous_trainable_params, trainer, base_param_names, skip_ref=True)


# In practice, this test is the same as `test_train_dense_with_peft_config_lora`, since gradient checkpointing is
# enabled by default in `DPOTrainer`. We keep it as a regression guard: if the default ever changes, we still
# explicitly test PEFT + gradient checkpointing, which has caused issues in the past.
def test_train_with_peft_config_and_gradient_checkpointing(lib, hub, tmp_path):
    from peft import LoraConfig

    model_id = hub[QWEN2]
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        gradient_checkpointing=True,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    trainer = lib.DPOTrainer(
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


# ------------------------------------------------------------------------------------------- datasets, eval


@pytest.mark.parametrize("iterable_as", ["train", "eval", "eval_dict", "eval_iterable_dataset_dict"])
def test_precompute_ref_log_probs_raises_for_iterable_dataset(lib, hub, tmp_path, iterable_as):
    # `precompute_ref_log_probs=True` caches reference log-probs by index, which requires random access and is
    # therefore incompatible with a streaming `IterableDataset` — whether passed directly or nested in a dict or
    # `IterableDatasetDict` as the eval dataset.
    map_dataset = zen("standard_preference", split="train")
    iterable_dataset = zen("standard_preference", split="train", streaming=True)

    train_dataset, eval_dataset = map_dataset, None
    if iterable_as == "train":
        train_dataset = iterable_dataset
    elif iterable_as == "eval":
        eval_dataset = iterable_dataset
    elif iterable_as == "eval_dict":
        eval_dataset = {"eval": iterable_dataset}
    elif iterable_as == "eval_iterable_dataset_dict":
        eval_dataset = IterableDatasetDict({"eval": iterable_dataset})

    # `max_steps` lets the iterable-train case reach the precompute check instead of failing earlier on the
    # missing dataset length required by the learning-rate scheduler.
    training_args = lib.DPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                  precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
        lib.DPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )


def test_train_with_iterable_dataset(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train", streaming=True)

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        max_steps=3,
        report_to="none",
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_chat_template_kwargs(lib, hub, tmp_path):
    dataset = zen("conversational_preference", split="train")

    training_args = lib.DPOConfig(
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

    trainer = lib.DPOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )

    assert trainer.processing_class.chat_template == tokenizer.chat_template

    for i in range(2):
        role = "SYSTEM" if i else "system"
        system_prompt = (
            f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
        )
        system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
        assert trainer.train_dataset[i]["prompt_ids"][: len(system_prompt_ids)] == system_prompt_ids

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_fully_truncated_completion_examples_dropped(lib, hub, tmp_path):
    """With `keep_start` truncation, an example whose prompt alone fills `max_length` loses every completion token
    in the collator, so it's dropped during dataset preparation."""
    dataset = Dataset.from_dict(
        {
            "prompt": ["Hi", "This is a very long prompt that fills up the whole max_length budget on its own"],
            "chosen": [" there", " yes"],
            "rejected": [" bye", " no"],
        }
    )

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        max_length=6,
        truncation_mode="keep_start",
        report_to="none",
    )
    trainer = lib.DPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    # Only the short-prompt example survives.
    assert len(trainer.train_dataset) == 1
    assert trainer.train_dataset[0]["prompt_ids"] == trainer.processing_class("Hi")["input_ids"]


def test_train_toolcall_data(lib, hub, tmp_path):
    dataset = toolcall_preference(split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size
        max_length=512,  # toolcall sequences are longer than standard data, limit length to avoid OOM
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)


def test_train_with_eval(lib, hub, tmp_path):
    dataset = zen("standard_preference")

    training_args = lib.DPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none",
                                  max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.DPOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )

    trainer.train()

    assert trainer.state.log_history[0]["eval_loss"] is not None


def test_train_with_multiple_eval_dataset(lib, hub, tmp_path):
    dataset = zen("standard_preference")

    training_args = lib.DPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none",
                                  max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.DPOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset={"data1": dataset["test"], "data2": dataset["test"]},
    )
    trainer.train()

    assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
    assert trainer.state.log_history[-2]["eval_data2_loss"] is not None


def test_train_dataset_required(lib, hub, tmp_path):
    training_args = lib.DPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        lib.DPOTrainer(model=hub[QWEN2], args=training_args)


@pytest.mark.parametrize(
    "eval_dataset_type",
    ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
     "dict_of_iterable_dataset", "none"],
)
def test_init_with_eval_dataset(lib, hub, tmp_path, eval_dataset_type):
    train_dataset = zen("standard_preference", split="train")

    if eval_dataset_type == "none":
        eval_dataset = None
    else:
        eval_dataset = _eval_dataset(eval_dataset_type)  # port: TRL's if/elif chain

    training_args = lib.DPOConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.DPOTrainer(
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


@fails_here("DPOTrainer(compute_metrics=...) raises ConfigError: not supported here (deprecated in TRL's DPO)")
def test_train_with_compute_metrics(lib, hub, tmp_path):
    dataset = zen("standard_preference")

    def dummy_compute_metrics(eval_pred):
        return {"my_metric": 0.123}

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        eval_strategy="steps",
        eval_steps=3,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.DPOTrainer(
        model=hub[QWEN2],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
        compute_metrics=dummy_compute_metrics,
    )

    trainer.train()

    assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123


# In practice, this test is the same as `test_train`, since gradient checkpointing is enabled by default in
# `DPOTrainer`. We keep it as a regression guard: if the default ever changes, we still explicitly test gradient
# checkpointing, which has caused issues in the past.
def test_train_with_gradient_checkpointing(lib, hub, tmp_path):
    dataset = zen("standard_preference", split="train")

    training_args = lib.DPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        gradient_checkpointing=True,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, hub[QWEN2], training_args, dataset)
