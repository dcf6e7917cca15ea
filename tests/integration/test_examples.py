"""The shipped examples run (with tiny settings), and TRL-style scripts run after changing only the import."""

import json
import os

import pytest

from tests.conftest import load_example


def test_sft_example_on_its_embedded_default_and_resume(tmp_path):
    sft = load_example("sft")
    sft.main(["--output_dir", str(tmp_path), "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "3",
              "--logging_steps", "1", "--disable_tqdm", "true"])
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")
    sft.main(["--output_dir", str(tmp_path), "--max_steps", "4", "--logging_steps", "1", "--disable_tqdm", "true",
              "--resume_from_checkpoint", "true"])
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # logged: steps 1-3 (in the checkpoint; the first run's closing summary is not), step 4 after resuming, the summary
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4] and "train_runtime" in records[-1]


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_rl_examples_with_a_local_file_and_named_rewards(name, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12=", "answer": "21"}\n{"prompt": "34=", "answer": "43"}\n')
    load_example(name).main(["--model", tiny_model_dir, "--dataset", str(data), "--reward_funcs", "accuracy",
                               "overlong", "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                               "--per_device_train_batch_size", "8", "--num_generations", "4",
                               "--max_completion_length", "4", "--save_strategy", "no", "--disable_tqdm", "true"])
    assert os.path.isfile(tmp_path / "out" / "final" / "model.safetensors")


def test_distillation_example_on_its_embedded_default_and_with_a_local_file(tiny_model_dir, tmp_path):
    distill = load_example("distillation")
    distill.main(["--output_dir", str(tmp_path / "tiny"), "--max_steps", "2", "--disable_tqdm", "true"])
    assert os.path.isfile(tmp_path / "tiny" / "tiny-teacher" / "config.json")  # the embedded teacher, built
    assert os.path.isfile(tmp_path / "tiny" / "final" / "model.safetensors")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12=", "completion": "21"}\n{"prompt": "34=", "completion": "43"}\n')
    distill.main(["--model", tiny_model_dir, "--teacher_model_name_or_path", tiny_model_dir, "--dataset", str(data),
                  "--lmbda", "0.5", "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                  "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--save_strategy", "no",
                  "--logging_steps", "1", "--disable_tqdm", "true"])
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[-2]["step"] == 2 and records[-2]["loss"] == pytest.approx(0.0, abs=1e-6)  # its own teacher


def test_grpo_example_names_a_missing_dataset(tiny_model_dir, tmp_path):
    from trainers.data.formats import DatasetFormatError

    with pytest.raises(DatasetFormatError, match="--dataset '.*nope.jsonl' does not exist"):
        load_example("grpo").main(["--model", tiny_model_dir, "--dataset", str(tmp_path / "nope.jsonl")])


def test_the_demos_warm_up_reaches_its_target_and_saves_it(arithmetic_warm_start):
    """The GRPO demo's SFT warm-up (examples/grpo_arithmetic.py's warm_up at its defaults), built once for the test
    run by the arithmetic_warm_start fixture: it stops at 45% greedy validation accuracy or above (the jump from ~2%
    comes at a step that moves with the host), and the saved warm start is that model to the last bit."""
    demo = load_example("grpo_arithmetic")
    _, validation, _ = demo.make_splits()
    assert arithmetic_warm_start.validation_accuracy >= 0.45
    model, tokenizer = demo.load_warm_start(arithmetic_warm_start.folder)
    assert demo.greedy_accuracy(model, tokenizer, validation) == arithmetic_warm_start.validation_accuracy


def test_the_demo_learns_what_the_readme_says(arithmetic_warm_start, tmp_path):
    # The README's main command from its SFT warm start (the warm-up is the test above). Five seeds ended GRPO at
    # 90-92% from SFT starts of 51-76% (docs/grpo.md); the bounds leave room for another machine's rounding.
    before, after = load_example("grpo_arithmetic").main(["--output_dir", str(tmp_path), "--warm_start",
                                                          arithmetic_warm_start.folder])
    assert after >= 0.8, (before, after)
    assert after - before >= 0.1, (before, after)
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


@pytest.mark.slow
def test_the_execution_demo_learns_through_code_execution_alone(tmp_path):
    """examples/grpo_execution.py as the docs run it (~90 s): seeds 0-2 went from 47-54% to 88-100% held out, every
    answer an expression Python evaluates; the bounds leave room for another machine's rounding."""
    before, after = load_example("grpo_execution").main(["--output_dir", str(tmp_path)])
    assert after >= 0.75 and after - before >= 0.2, (before, after)
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


def test_the_distillation_demo_meets_its_mark(arithmetic_warm_start, tmp_path):
    """examples/distill_arithmetic.py from the GRPO demo's start (~52%) with a quicker teacher (300 SFT steps: ~91%
    held out): the student reaches 80% of the teacher's accuracy by distillation alone (~50 s on 2 cores)."""
    results = load_example("distill_arithmetic").main(["--output_dir", str(tmp_path), "--warm_start",
                                                       arithmetic_warm_start.folder, "--teacher_sft_steps", "300",
                                                       "--max_steps", "150"])
    assert results["teacher"] >= 0.85 and results["before"] < 0.8 * results["teacher"], results
    assert results["distillation"] is not None, results["distillation_curve"]  # reached 80% of the teacher's
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


def test_a_demo_warm_up_that_never_reaches_its_target_says_so(tiny_model_dir, tmp_path):
    demo = load_example("grpo_arithmetic")
    _, validation, train = demo.make_splits()
    with pytest.raises(RuntimeError, match="--warmup_target"):
        demo.warm_up(tiny_model_dir, train[:64], validation[:8], str(tmp_path), target=1.01, stage_steps=1,
                     max_stages=2)


def test_a_trl_grpo_script_runs_with_only_the_import_changed(tiny_model_dir, tmp_path):
    from datasets import Dataset

    # --- a TRL script, verbatim except for the two imports ---
    from trainers import GRPOConfig, GRPOTrainer
    from trainers.sampling.reward_functions import accuracy_reward, get_soft_overlong_punishment, think_format_reward

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}] * 8)
    training_args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
        max_completion_length=8, learning_rate=1e-6, beta=0.0, loss_type="dapo", logging_steps=1, max_steps=1,
        report_to="none", bf16=False, gradient_checkpointing=True, push_to_hub=False, remove_unused_columns=False,
        save_strategy="no", seed=42, use_vllm=False, log_completions=False, scale_rewards="group",
        dataloader_num_workers=0, logging_strategy="steps",
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[accuracy_reward, think_format_reward, get_soft_overlong_punishment(8, 2)],
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
    # ---
    assert trainer.state.global_step == 1
    assert "rewards/accuracy_reward/mean" in trainer.state.log_history[0]


def test_a_trl_sft_script_runs_with_only_the_import_changed(tiny_model_dir, tmp_path):
    from datasets import Dataset

    from trainers import SFTConfig, SFTTrainer

    dataset = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}]}] * 8)
    training_args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=2e-5,
        max_length=64, packing=True, num_train_epochs=1, logging_steps=1, report_to="none", bf16=False,
        gradient_checkpointing=True, assistant_only_loss=True, dataset_text_field="text", save_strategy="no",
        eval_strategy="no", warmup_ratio=0.1, lr_scheduler_type="cosine", push_to_hub=False, save_only_model=False,
    )
    trainer = SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset, peft_config=None)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert trainer.state.global_step == 1 and os.path.isfile(tmp_path / "final" / "model.safetensors")

