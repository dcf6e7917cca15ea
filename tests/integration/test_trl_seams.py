"""The seams where TRL and transformers user code meets the trainers (issue 33): train()'s closing log entry,
a plain TrainingArguments as args, accelerator_config, cast_lm_head_to_fp32, the model card tags and the error
for a missing train_dataset. Each test is written as a TRL user's script or test would read the trainer."""

import json

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import AcceleratorConfig

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError, DatasetFormatError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

ROWS = as_sft_rows(reverse_digits_rows(16, seed=0))
PROMPTS = [{"prompt": f"{i}{i + 1}="} for i in range(8)]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def sft_args(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
                   save_strategy="no", report_to="none", disable_tqdm=True)
    return SFTConfig(**{**options, **overrides})


def grpo_args(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=4, max_steps=2, save_strategy="no", report_to="none", disable_tqdm=True)
    return GRPOConfig(**{**options, **overrides})


# ---------------------------------------------------------------------------------------------------- the last log entry

def test_train_appends_transformers_summary_to_log_history(tiny_model_dir, tmp_path):
    """transformers' Trainer.train() logs its summary last: scripts read log_history[-1]["train_loss"]."""
    logged = []

    class OnLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs))

    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path, logging_steps=1), train_dataset=ROWS,
                         callbacks=[OnLog()])
    output = trainer.train()
    last = trainer.state.log_history[-1]
    # transformers' summary; the trainer's own metrics were all in the step records (step 2 was logged), and TRL's
    # log() merges only those still pending
    assert set(last) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                         "train_loss", "epoch", "step"}
    assert last["step"] == 2 and last["epoch"] == pytest.approx(trainer.state.epoch)
    assert last["train_loss"] == pytest.approx(output.training_loss, rel=1e-5)
    assert last["train_loss"] == pytest.approx((trainer.state.log_history[0]["loss"]
                                                + trainer.state.log_history[1]["loss"]) / 2, rel=1e-5)
    for name in ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"):
        assert last[name] == pytest.approx(output.metrics[name], rel=1e-5)
    # on_log gets it, as in transformers (unrounded: records keep 6 significant digits)
    assert logged[-1] == pytest.approx({k: v for k, v in last.items() if k != "step"}, rel=1e-5)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        assert json.loads(f.readlines()[-1]) == last


# ---------------------------------------------------------------------------------------------------- TrainingArguments

def test_a_plain_training_arguments_is_converted_as_trl_does(tiny_model_dir, tmp_path):
    """TRL's SFTTrainer converts a transformers.TrainingArguments to its config; so do both trainers here."""
    arguments = TrainingArguments(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4, max_steps=2,
                                  learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                                  report_to="none", disable_tqdm=True)
    trainer = SFTTrainer(model=tiny_model_dir, args=arguments, train_dataset=ROWS)
    assert isinstance(trainer.args, SFTConfig)
    assert trainer.args.learning_rate == 3e-3 and trainer.args.max_steps == 2
    trainer.train()
    assert [r["learning_rate"] for r in trainer.state.log_history if "loss" in r] == [3e-3, 3e-3]

    grpo = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=PROMPTS, args=TrainingArguments(
        output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=8, max_steps=1, report_to="none"))
    assert isinstance(grpo.args, GRPOConfig) and grpo.args.per_device_train_batch_size == 8

    with pytest.raises(ConfigError, match=r"TrainingArguments given was converted to SFTConfig.*`push_to_hub=True`"):
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                   args=TrainingArguments(output_dir=str(tmp_path / "x"), push_to_hub=True))


# ---------------------------------------------------------------------------------------------------- accelerator_config

def test_accelerator_config_forms_and_errors(tmp_path):
    path = tmp_path / "accelerator.json"
    path.write_text(json.dumps({"split_batches": True, "dispatch_batches": False}))
    for given in ({"split_batches": True, "dispatch_batches": False}, str(path),
                  AcceleratorConfig(split_batches=True, dispatch_batches=False)):
        config = SFTConfig(output_dir=str(tmp_path), accelerator_config=given)
        assert config.split_batches and config.accelerator_config["dispatch_batches"] is False
    assert not SFTConfig(output_dir=str(tmp_path)).split_batches
    with pytest.raises(ConfigError, match="accelerator_config has no key 'split_batch'"):
        SFTConfig(output_dir=str(tmp_path), accelerator_config={"split_batch": True})
    with pytest.raises(ConfigError, match=r"accelerator_config\['even_batches'\]=False is not supported"):
        GRPOConfig(output_dir=str(tmp_path), accelerator_config={"even_batches": False})
    with pytest.raises(ConfigError, match="no such JSON file"):
        SFTConfig(output_dir=str(tmp_path), accelerator_config=str(tmp_path / "missing.json"))


def test_split_batches_on_one_process_changes_nothing(tiny_model_dir, tmp_path):
    """split_batches=True: per_device_train_batch_size is the batch of all processes (one process: all of it)."""
    runs = {}
    for split in (False, True):
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_args(
            tmp_path / str(split), accelerator_config={"split_batches": split, "dispatch_batches": True}))
        trainer.train()
        assert trainer.per_process_train_batch_size == 4 and trainer.effective_batch_size == 4
        runs[split] = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert runs[True] == runs[False]


# ---------------------------------------------------------------------------------------------------- cast_lm_head_to_fp32

def test_cast_lm_head_to_fp32_keeps_the_logits_in_float32(tiny_model_dir, tmp_path):
    """TRL's GRPO option: the head (tied to the embeddings in this model) in float32, the body in bf16."""
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=PROMPTS, args=grpo_args(
        tmp_path, beta=0.1, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"}))
    model = trainer.unwrapped_model
    assert model.lm_head.weight.dtype == torch.float32 and trainer.ref_model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7]])
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16  # the body still runs in bf16
    assert model(ids).logits.dtype == torch.float32
    # the reference has its own head: training moves the policy's, not the reference's
    before = trainer.ref_model.lm_head.weight.detach().clone()
    trainer.train()
    assert torch.equal(trainer.ref_model.lm_head.weight, before)
    assert not torch.equal(model.lm_head.weight.detach(), before)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state  # [1, 3, H] bf16
        expected = hidden.float() @ model.lm_head.weight.T
        torch.testing.assert_close(model(ids).logits, expected)

    plain = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=PROMPTS,
                        args=grpo_args(tmp_path / "plain", model_init_kwargs={"dtype": "bfloat16"}))
    assert plain.unwrapped_model(ids).logits.dtype == torch.bfloat16


def test_cast_lm_head_to_fp32_refuses_an_adapter_on_the_head(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    with pytest.raises(ConfigError, match="cast_lm_head_to_fp32=True` does not work when the output head carries"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=PROMPTS,
                    args=grpo_args(tmp_path, cast_lm_head_to_fp32=True),
                    peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))


# ---------------------------------------------------------------------------------------------------- smaller contracts

def test_model_tags_and_the_missing_train_dataset(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path), train_dataset=ROWS)
    assert {"trainers", "sft"} <= set(trainer.model.model_tags)
    grpo = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=PROMPTS,
                       args=grpo_args(tmp_path / "g"))
    assert {"trainers", "grpo"} <= set(grpo.model.model_tags)
    with pytest.raises(DatasetFormatError, match="`train_dataset` is required"):
        SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path))
    with pytest.raises(ValueError, match="`train_dataset` is required"):  # TRL raises a ValueError; ours is one
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=grpo_args(tmp_path / "g"))


def test_transformers_trainer_attributes(tiny_model_dir, tmp_path):
    """What transformers' Trainer exposes and user code reads: model_wrapped, control, is_*_enabled, is_in_train,
    the trainable parameter count and learning rates; push_to_hub raises instead of skipping the upload."""
    seen_in_train = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen_in_train.append(trainer.is_in_train)

    trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path, max_steps=1), train_dataset=ROWS,
                         callbacks=[Probe()])
    assert trainer.model_wrapped is trainer.model and trainer.control is trainer.callback_handler.control
    assert not trainer.is_deepspeed_enabled and not trainer.is_fsdp_enabled
    assert trainer.get_num_trainable_parameters() == sum(p.numel() for p in trainer.model.parameters())
    assert trainer.get_learning_rates() == [1e-3, 1e-3]  # the decay and no-decay groups, before the first step
    assert trainer.is_in_train is False
    trainer.train()
    assert seen_in_train == [True] and trainer.is_in_train is False
    with pytest.raises(ConfigError, match="does not upload to the Hub"):
        trainer.push_to_hub()


def test_a_model_folder_without_tokenizer_files_is_refused(tiny_model_dir, tmp_path):
    """transformers 5 builds an empty tokenizer (special tokens only) from a folder without tokenizer files."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_model_dir}/{name}", bare / name)
    from trainers.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="has no tokenizer files"):
        SFTTrainer(model=str(bare), args=sft_args(tmp_path), train_dataset=ROWS)


def test_trainers_of_another_mixed_precision_in_one_process(tiny_model_dir, tmp_path):
    """transformers starts each Trainer from a fresh AcceleratorState: a notebook can build a bf16 trainer, then a
    float32 one (Accelerate refused the second: 'AcceleratorState has already been initialized')."""
    precisions = []
    for name, bf16 in (("bf16", True), ("fp32", False)):
        trainer = SFTTrainer(model=tiny_model_dir, args=sft_args(tmp_path / name, bf16=bf16, max_steps=1),
                             train_dataset=ROWS)
        trainer.train()
        precisions.append(trainer.accelerator.mixed_precision)
    assert precisions == ["bf16", "no"]
