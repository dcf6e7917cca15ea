"""TRL 1.16's own scripts (trl/scripts/sft.py, grpo.py, dpo.py, reward.py and kto.py) port by changing the import.

Each test runs the body of the script's ``main`` as TRL ships it, from the model arguments to ``trainer.end()``,
with ``trl`` replaced by ``trainers`` and the dataset loading replaced by rows (no network). The values come in as
strings where TRL's parser gives strings (``--resume_from_checkpoint true``).
"""

import pytest

from tests.conftest import step_records
from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

SFT_ROWS = as_sft_rows(reverse_digits_rows(32, seed=1))
GRPO_ROWS = [{"prompt": f"Reverse the digits {i}{i + 1}{i + 2}:"} for i in range(8)]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def run_trl_main(trainer_class, model_name_or_path, training_args, dataset):
    """trl/scripts/sft.py main(), TRL 1.16, from "model_init_kwargs" on (ModelConfig at its defaults); dpo.py,
    reward.py and kto.py have the same body with their own trainer (``trainer_class``)."""
    model_init_kwargs = dict(revision="main", trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=None, dtype="float32")
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    trainer = trainer_class(
        model=model_name_or_path,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"] if training_args.eval_strategy != "no" else None,
        quantization_config=None,  # get_quantization_config(model_args) without --load_in_4bit/8bit
        peft_config=None,  # get_peft_config(model_args) without --use_peft
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        raise AssertionError("push_to_hub reads as TRL's default, False")
    trainer.end()
    return trainer


def sft_args(tmp_path, **overrides):
    return SFTConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "learning_rate": 1e-3,
                        "logging_steps": 1, "save_steps": 2, "disable_tqdm": True, "report_to": "none", "seed": 0,
                        **overrides})


def test_trl_sft_script_trains_saves_and_resumes(tiny_model_dir, tmp_path):
    dataset = {"train": SFT_ROWS, "test": SFT_ROWS[:8]}
    first = run_trl_main(SFTTrainer, tiny_model_dir, sft_args(tmp_path, max_steps=2), dataset)
    assert first.state.global_step == 2
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "checkpoint-2").is_dir()

    # `--resume_from_checkpoint true` as TRL's parser hands it over: a string
    args = sft_args(tmp_path, max_steps=4, resume_from_checkpoint="true", eval_strategy="steps", eval_steps=4)
    assert args.resume_from_checkpoint is True and args.do_eval is True
    second = run_trl_main(SFTTrainer, tiny_model_dir, args, dataset)
    steps = [r["step"] for r in second.state.log_history if "loss" in r]
    assert second.state.global_step == 4
    assert steps == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's history, 3-4 were trained now
    assert [r["step"] for r in second.state.log_history if "eval_loss" in r] == [4]


def test_train_without_an_argument_resumes_from_the_config(tiny_model_dir, tmp_path):
    run_trl_main(SFTTrainer, tiny_model_dir, sft_args(tmp_path, max_steps=2), {"train": SFT_ROWS, "test": []})
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=SFT_ROWS,
                         args=sft_args(tmp_path, max_steps=3, resume_from_checkpoint=checkpoint))
    trainer.train()
    assert trainer.state.global_step == 3
    assert len([r for r in trainer.state.log_history if "loss" in r]) == 3


PAIRS = [{"prompt": [{"role": "user", "content": f"{a}+{a}?"}],
          "chosen": [{"role": "assistant", "content": str(2 * a)}],
          "rejected": [{"role": "assistant", "content": str(2 * a + 1)}]} for a in range(8)]


@pytest.mark.parametrize("method, eval_metric", [("dpo", "eval_rewards/accuracies"), ("reward", "eval_loss"),
                                                 ("kto", "eval_loss")])
def test_trl_preference_scripts_train_evaluate_and_save(method, eval_metric, tiny_model_dir, tmp_path):
    """dpo.py, reward.py and kto.py (KTO unpairs the pairs) on conversational preference rows, evaluating."""
    from datasets import Dataset, DatasetDict

    import trainers

    config, trainer_class = {"dpo": (trainers.DPOConfig, trainers.DPOTrainer),
                             "reward": (trainers.RewardConfig, trainers.RewardTrainer),
                             "kto": (trainers.KTOConfig, trainers.KTOTrainer)}[method]
    training_args = config(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                           report_to="none", bf16=False, eval_strategy="steps", eval_steps=2, save_strategy="no")
    dataset = DatasetDict({"train": Dataset.from_list(PAIRS), "test": Dataset.from_list(PAIRS[:4])})
    trainer = run_trl_main(trainer_class, tiny_model_dir, training_args, dataset)
    assert trainer.state.global_step == 2 and (tmp_path / "model.safetensors").is_file()
    assert eval_metric in trainer.state.log_history[-2]


def test_trl_grpo_script_trains(tiny_model_dir, tmp_path):
    """trl/scripts/grpo.py main(), TRL 1.16, from the trainer on (reward functions resolved by the script)."""
    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                               max_completion_length=4, max_steps=2, save_strategy="no", disable_tqdm=True,
                               report_to="none", resume_from_checkpoint=None, do_train=True, local_rank=-1)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[length_reward],
        args=training_args,
        train_dataset=GRPO_ROWS,
        eval_dataset=None,
        quantization_config=None,
        peft_config=None,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()  # transformers' methods, one process
    assert not training_args.push_to_hub
    trainer.end()
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_quantization_config_is_refused_by_name(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="quantization_config is not supported"):
        SFTTrainer(model=tiny_model_dir, train_dataset=SFT_ROWS, args=sft_args(tmp_path, max_steps=1),
                   quantization_config={"load_in_4bit": True})


def test_script_only_fields_follow_transformers(monkeypatch):
    assert SFTConfig().do_eval is False
    assert SFTConfig(eval_strategy="epoch").do_eval is True  # transformers sets it for scripts that read it
    assert GRPOConfig(do_train=True, do_predict=True).do_train is True
    assert SFTConfig(resume_from_checkpoint="False").resume_from_checkpoint is None
    assert SFTConfig(resume_from_checkpoint="out/checkpoint-3").resume_from_checkpoint == "out/checkpoint-3"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert SFTConfig(local_rank=1).local_rank == 1  # what the deepspeed launcher passes with --local_rank=1
    with pytest.raises(ConfigError, match="local_rank=0.*LOCAL_RANK=1"):
        SFTConfig(local_rank=0)
    monkeypatch.delenv("LOCAL_RANK")
    assert SFTConfig(local_rank=0).local_rank == 0  # no launcher variable: nothing to check against


def test_given_optimizer_and_scheduler_train_the_model(tiny_model_dir, tmp_path):
    """transformers' optimizers=(optimizer, lr_scheduler): plain SGD at a constant rate moves each weight by
    exactly -lr x its gradient, and the scheduler's rate is the one logged."""
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1)  # 0.05 throughout
    grads = {}

    class KeepGradients(TrainerCallback):  # the gradients the optimizer is about to step with
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    trainer = SFTTrainer(model=model, train_dataset=SFT_ROWS, optimizers=(optimizer, scheduler),
                         args=sft_args(tmp_path, max_steps=1, max_grad_norm=None, save_strategy="no"),
                         callbacks=[KeepGradients()])
    assert trainer.lr_scheduler is scheduler
    trainer.train()
    assert trainer.state.log_history[0]["learning_rate"] == pytest.approx(0.05)
    for name, param in trainer.unwrapped_model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - 0.05 * grads[name])


def test_optimizer_cls_and_kwargs_and_the_optimizer_checks(tiny_model_dir, tmp_path):
    import torch

    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=SFT_ROWS, args=sft_args(tmp_path, max_steps=1),
                         optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}))
    inner = trainer.optimizer.optimizer
    assert isinstance(inner, torch.optim.SGD) and inner.param_groups[0]["momentum"] == 0.9
    assert [g["weight_decay"] for g in inner.param_groups] == [0.0, 0.0]  # the decay split, as transformers
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="must be that model instance, not a path"):
        SFTTrainer(model=tiny_model_dir, train_dataset=SFT_ROWS, args=sft_args(tmp_path),
                   optimizers=(torch.optim.SGD(other.parameters(), lr=0.1), None))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="parameters that are not the model's"):
        SFTTrainer(model=model, train_dataset=SFT_ROWS, args=sft_args(tmp_path),
                   optimizers=(torch.optim.SGD(other.parameters(), lr=0.1), None))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="the lr_scheduler must be built on the optimizer"):
        SFTTrainer(model=model, train_dataset=SFT_ROWS, args=sft_args(tmp_path), optimizers=(
            None, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)))
    with pytest.raises(ConfigError, match="pass one of them"):
        SFTTrainer(model=model, train_dataset=SFT_ROWS, args=sft_args(tmp_path), optimizers=(optimizer, None),
                   optimizer_cls_and_kwargs=(torch.optim.SGD, {}))


def test_given_optimizer_resumes_exactly(tiny_model_dir, tmp_path):
    """Momentum (the optimizer's state) and a decaying schedule come back from the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    def run(out, max_steps, resume=None):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        trainer = SFTTrainer(model=model, train_dataset=SFT_ROWS, optimizers=(optimizer, scheduler),
                             args=sft_args(tmp_path / out, max_steps=max_steps, save_steps=2))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("straight", 4)
    run("split", 2)
    resumed = run("split", 4, resume=True)
    assert [r["learning_rate"] for r in step_records(resumed)] == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025],
                                                                                    rel=1e-5)
    for (name, a), b in zip(straight.unwrapped_model.named_parameters(), resumed.unwrapped_model.parameters()):
        assert torch.equal(a, b), name
