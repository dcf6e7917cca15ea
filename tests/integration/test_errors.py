"""Bad input gets an error that names the culprit and what would be valid, before training starts."""

import pytest

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError, DatasetFormatError, ModelLoadError, RewardFunctionError, TrainersError


def sft(model, rows, tmp_path, **overrides):
    args = SFTConfig(**{"output_dir": str(tmp_path), "max_steps": 1, "disable_tqdm": True, "save_strategy": "no",
                        "per_device_train_batch_size": 2, **overrides})
    return SFTTrainer(model=model, args=args, train_dataset=rows)


def grpo(model, rows, tmp_path, reward=lambda completions, **kw: [0.0] * len(completions), **overrides):
    args = GRPOConfig(**{"output_dir": str(tmp_path), "max_steps": 1, "disable_tqdm": True, "save_strategy": "no",
                         "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4,
                         **overrides})
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=rows)


def test_grpo_dataset_without_prompt(tiny_model_dir, tmp_path):
    with pytest.raises(DatasetFormatError, match=r"columns \['question'\]; GRPO needs a 'prompt' column"):
        grpo(tiny_model_dir, [{"question": "hi"}], tmp_path)


def test_sft_dataset_with_no_known_columns(tiny_model_dir, tmp_path):
    with pytest.raises(DatasetFormatError, match=r"train_dataset has columns \['body'\], none of the known SFT formats.*'messages'"):
        sft(tiny_model_dir, [{"body": "hi"}], tmp_path)


@pytest.mark.parametrize("trainer", [sft, grpo])
def test_empty_dataset(trainer, tiny_model_dir, tmp_path):
    with pytest.raises(DatasetFormatError, match="train_dataset is empty"):
        trainer(tiny_model_dir, [], tmp_path)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"Model path '.*no/such/model' does not exist"):
        sft(str(tmp_path / "no/such/model"), [{"text": "hi"}], tmp_path)


def test_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        sft(str(tmp_path / "empty"), [{"text": "hi"}], tmp_path)


def test_conversational_data_without_a_chat_template(tiny_model_dir, tokenizer, tmp_path):
    tokenizer = type(tokenizer).from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    with pytest.raises(DatasetFormatError, match="no chat template.*chat_template"):
        SFTTrainer(model=tiny_model_dir, processing_class=tokenizer, train_dataset=rows,
                   args=SFTConfig(output_dir=str(tmp_path)))
    with pytest.raises(DatasetFormatError, match="no chat template.*chat_template"):
        GRPOTrainer(model=tiny_model_dir, processing_class=tokenizer, reward_funcs=lambda **kw: [], args=GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=8), train_dataset=[{"prompt": rows[0]["messages"][:1]}])


def test_a_prompt_longer_than_the_context(tiny_model_dir, tmp_path):
    # the tiny model has a context of 2048 tokens; one byte per token
    with pytest.raises(DatasetFormatError, match=r"row 1: the prompt has 2000 tokens; with max_completion_length=100"):
        grpo(tiny_model_dir, [{"prompt": "short"}, {"prompt": "x" * 2000}], tmp_path, max_completion_length=100)
    with pytest.raises(ConfigError, match=r"3001 tokens, more than the model's context of 2048. Set max_length <= 2048"):
        sft(tiny_model_dir, [{"text": "x" * 3000}], tmp_path, max_length=4096)


@pytest.mark.parametrize("named", [False, True])
def test_an_eval_row_longer_than_the_context_names_its_eval_dataset(tiny_model_dir, tmp_path, named):
    """The model checks of every eval dataset, the trainer's own and each named one, run when the model loads."""
    label = r"eval_dataset\['long'\]" if named else "eval_dataset"

    def given(rows):
        return {"short": rows[:1], "long": rows[1:]} if named else rows

    row = 0 if named else 1  # the long prompt is the first row of its own named dataset
    with pytest.raises(DatasetFormatError, match=label + rf" row {row}: the prompt has 2000 tokens"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    train_dataset=[{"prompt": "short"}], eval_dataset=given([{"prompt": "short"}, {"prompt": "x" * 2000}]),
                    args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                    max_completion_length=100, disable_tqdm=True))
    with pytest.raises(ConfigError, match=label + r": a sample has 3001 tokens, more than the model's context"):
        SFTTrainer(model=tiny_model_dir, train_dataset=[{"text": "short"}],
                   eval_dataset=given([{"text": "short"}, {"text": "x" * 3000}]),
                   args=SFTConfig(output_dir=str(tmp_path), max_length=4096, disable_tqdm=True))


def test_a_raising_reward_is_named_with_the_sample(tiny_model_dir, tmp_path):
    def judge(completions, **kwargs):
        raise KeyError("score")

    trainer = grpo(tiny_model_dir, [{"prompt": "abc"}], tmp_path, reward=judge)
    with pytest.raises(RewardFunctionError, match=r"'judge' raised KeyError: 'score' on sample 0 \(prompt 'abc'\)"):
        trainer.train()


@pytest.mark.parametrize("bad, message", [
    (lambda completions, **kw: [1.0], r"'bad' returned 1 rewards for 4 completions"),
    (lambda completions, **kw: ["high"] * len(completions), r"'bad' returned 'high' for sample 0"),
])
def test_rewards_of_the_wrong_length_or_type(tiny_model_dir, tmp_path, bad, message):
    bad.__name__ = "bad"
    trainer = grpo(tiny_model_dir, [{"prompt": "abc"}], tmp_path, reward=bad)
    with pytest.raises(RewardFunctionError, match=message):
        trainer.train()


def test_an_unknown_reward_name(tiny_model_dir, tmp_path):
    with pytest.raises(RewardFunctionError, match=r"'acuracy' is neither a built-in \(\['accuracy', 'code_execution', 'format', 'overlong'\]\)"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs="acuracy", args=GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=8), train_dataset=[{"prompt": "a"}])


@pytest.mark.parametrize("options, culprit", [
    ({"learning_rate": -1e-5}, "learning_rate"), ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
    ({"max_completion_length": 0}, "max_completion_length"), ({"loss_type": "ppo"}, "loss_type"),
    ({"scale_rewards": "sometimes"}, "scale_rewards"), ({"importance_sampling_level": "word"}, "importance_sampling_level"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type"), ({"num_generations": 1}, "num_generations"),
    ({"vllm_mode": "remote"}, "vllm_mode"), ({"vllm_server_base_url": "localhost:8000"}, "vllm_server_base_url"),
    ({"num_generation": 4}, "num_generation"),
])
def test_config_errors_name_the_option(options, culprit):
    with pytest.raises(ConfigError, match=culprit):
        GRPOConfig(**options)


def test_every_error_is_one_of_ours():
    for error in (ConfigError, DatasetFormatError, ModelLoadError, RewardFunctionError):
        assert issubclass(error, TrainersError)


def test_the_accuracy_reward_without_an_answer_column_fails_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(RewardFunctionError, match=r"'answer' \(or 'solution'\) column; train_dataset has \['prompt'\]"):
        grpo(tiny_model_dir, [{"prompt": "abc"}], tmp_path, reward="accuracy")


def test_latex_answers_without_math_verify_fail_at_construction(tiny_model_dir, tmp_path, monkeypatch):
    from trainers.sampling import reward_functions

    monkeypatch.setattr(reward_functions, "math_verify_missing", lambda: True)
    rows = [{"prompt": "1+1", "solution": "2"}, {"prompt": "1/3", "solution": r"\frac{1}{3}"}]
    with pytest.raises(RewardFunctionError, match=r"train_dataset column 'solution' holds LaTeX answers \(row 1: "
                                                  r"'\\\\frac\{1\}\{3\}'\).*pip install math-verify"):
        grpo(tiny_model_dir, rows, tmp_path, reward="accuracy")


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "distill"])
def test_fsdp_is_refused_for_the_trainers_that_sample(trainer, tiny_model_dir, tmp_path, monkeypatch):
    """Under fsdp2.yaml (`accelerate launch` sets ACCELERATE_USE_FSDP) the sampling trainers refuse before
    building anything: generation is not synced across processes there and the vLLM sync would send shards."""
    from trainers import DistillationConfig, DistillationTrainer, RLOOConfig, RLOOTrainer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    rows = [{"prompt": "12+3="}] * 4
    with pytest.raises(ConfigError, match=r"FSDP \(fsdp2.yaml\) is not supported yet .* zero3.yaml"):
        if trainer == "grpo":
            GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                        args=GRPOConfig(output_dir=str(tmp_path)), train_dataset=rows)
        elif trainer == "rloo":
            RLOOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                        args=RLOOConfig(output_dir=str(tmp_path)), train_dataset=rows)
        else:
            DistillationTrainer(model=tiny_model_dir, teacher_model=tiny_model_dir,
                                args=DistillationConfig(output_dir=str(tmp_path)), train_dataset=rows)
