"""Unit tests for trainers/config/training.py and trainers/config/options.py: validation, unknown/TRL-only options, TRL-mirroring
defaults."""

import dataclasses
import math

import pytest

from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.config.training import TrainingConfig
from trainers.dpo.config import DPOConfig
from trainers.errors import ConfigError
from trainers.grpo.config import GRPOConfig
from trainers.config.options import check_constraints, describe_constraints, opt
from trainers.sft.config import SFTConfig

ALL_CONFIGS = [TrainingConfig, SFTConfig, GRPOConfig]


# ------------------------------------------------------------------------------------------------------------
# Validation in __post_init__
# ------------------------------------------------------------------------------------------------------------

# (config class, kwargs, field the message must name)
INVALID = [
    # The ones the brief lists explicitly.
    (TrainingConfig, {"learning_rate": -1}, "learning_rate"),
    (GRPOConfig, {"learning_rate": -1e-6}, "learning_rate"),
    (TrainingConfig, {"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
    (GRPOConfig, {"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
    (TrainingConfig, {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    (SFTConfig, {"max_length": 0}, "max_length"),
    (GRPOConfig, {"max_completion_length": 0}, "max_completion_length"),
    (GRPOConfig, {"num_generations": 1}, "num_generations"),
    (SFTConfig, {"loss_type": "chunked"}, "loss_type"),
    (GRPOConfig, {"loss_type": "ppo"}, "loss_type"),
    (GRPOConfig, {"scale_rewards": "std"}, "scale_rewards"),
    (GRPOConfig, {"importance_sampling_level": "sequence_level"}, "importance_sampling_level"),
    (TrainingConfig, {"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type"),
    (TrainingConfig, {"save_strategy": "best"}, "save_strategy"),
    (TrainingConfig, {"eval_strategy": "always"}, "eval_strategy"),
    (TrainingConfig, {"warmup_steps": 5, "warmup_ratio": 0.1}, "warmup_ratio"),
    (TrainingConfig, {"warmup_steps": 0.05, "warmup_ratio": 0.1}, "warmup_ratio"),
    (TrainingConfig, {"bf16": True, "fp16": True}, "fp16"),
    (GRPOConfig, {"vllm_server_base_url": "localhost:8000"}, "vllm_server_base_url"),
    (GRPOConfig, {"vllm_server_base_url": "http://"}, "vllm_server_base_url"),
    (GRPOConfig, {"generation_batch_size": 16, "steps_per_generation": 2}, "steps_per_generation"),
    # The rest of the checks.
    (TrainingConfig, {"learning_rate": float("inf")}, "learning_rate"),
    (TrainingConfig, {"learning_rate": float("nan")}, "learning_rate"),
    (TrainingConfig, {"learning_rate": "1e-4"}, "learning_rate"),
    (TrainingConfig, {"per_device_train_batch_size": 2.0}, "per_device_train_batch_size"),
    (TrainingConfig, {"per_device_train_batch_size": True}, "per_device_train_batch_size"),
    (TrainingConfig, {"per_device_eval_batch_size": 0}, "per_device_eval_batch_size"),
    (TrainingConfig, {"logging_steps": 0}, "logging_steps"),
    (TrainingConfig, {"save_steps": -5}, "save_steps"),
    (TrainingConfig, {"weight_decay": -0.01}, "weight_decay"),
    (TrainingConfig, {"adam_beta1": 1.0}, "adam_beta1"),
    (TrainingConfig, {"adam_beta2": -0.1}, "adam_beta2"),
    (TrainingConfig, {"adam_epsilon": 0}, "adam_epsilon"),
    (TrainingConfig, {"optim": "sgd"}, "optim"),
    (TrainingConfig, {"max_grad_norm": -1.0}, "max_grad_norm"),
    (TrainingConfig, {"num_train_epochs": 0}, "num_train_epochs"),
    (TrainingConfig, {"max_steps": 0}, "max_steps"),
    (TrainingConfig, {"max_steps": -2}, "max_steps"),
    (TrainingConfig, {"max_steps": 10.0}, "max_steps"),
    (TrainingConfig, {"warmup_steps": -1}, "warmup_steps"),
    (TrainingConfig, {"warmup_steps": 2.5}, "warmup_steps"),
    (TrainingConfig, {"warmup_ratio": 1.0}, "warmup_ratio"),
    (TrainingConfig, {"warmup_ratio": -0.1}, "warmup_ratio"),
    (TrainingConfig, {"eval_steps": 0}, "eval_steps"),
    (TrainingConfig, {"save_total_limit": 0}, "save_total_limit"),
    (TrainingConfig, {"report_to": ["wandb", 3]}, "report_to"),
    (TrainingConfig, {"report_to": None}, "report_to"),
    (SFTConfig, {"max_length": -4}, "max_length"),
    (SFTConfig, {"max_length": 12.5}, "max_length"),
    (SFTConfig, {"packing": True, "max_length": None}, "max_length"),
    (SFTConfig, {"truncation_mode": "keep_middle"}, "truncation_mode"),
    (SFTConfig, {"packing_strategy": "wrapped_around"}, "packing_strategy"),
    (SFTConfig, {"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
    (SFTConfig, {"pad_to_multiple_of": "eight"}, "pad_to_multiple_of"),
    (GRPOConfig, {"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
    (SFTConfig, {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    (GRPOConfig, {"num_generations": 0}, "num_generations"),
    (GRPOConfig, {"num_generations": 4.0}, "num_generations"),
    (GRPOConfig, {"max_completion_length": -1}, "max_completion_length"),
    (GRPOConfig, {"num_iterations": 0}, "num_iterations"),
    (GRPOConfig, {"temperature": 0.0}, "temperature"),
    (GRPOConfig, {"top_p": 0.0}, "top_p"),
    (GRPOConfig, {"top_p": 1.01}, "top_p"),
    (GRPOConfig, {"top_k": -1}, "top_k"),
    (GRPOConfig, {"beta": -0.04}, "beta"),
    (GRPOConfig, {"epsilon": 0.0}, "epsilon"),
    (GRPOConfig, {"epsilon_high": 0.0}, "epsilon_high"),
    (GRPOConfig, {"delta": 1.0}, "delta"),
    (GRPOConfig, {"generation_batch_size": 0}, "generation_batch_size"),
    (GRPOConfig, {"steps_per_generation": -1}, "steps_per_generation"),
    (GRPOConfig, {"num_completions_to_print": 0}, "num_completions_to_print"),
    (GRPOConfig, {"lr_scheduler_type": "greedy"}, "lr_scheduler_type"),
    (TrainingConfig, {"load_best_model_at_end": True}, "load_best_model_at_end"),  # no evaluations
    (TrainingConfig, {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "no"},
     "load_best_model_at_end"),
    (TrainingConfig, {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"},
     "load_best_model_at_end"),
    (TrainingConfig, {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 30, "save_steps": 50},
     "save_steps"),
    (TrainingConfig, {"load_best_model_at_end": True, "eval_strategy": "steps", "save_steps": 25},
     "save_steps"),  # eval_steps defaults to logging_steps (10)
    (TrainingConfig, {"save_strategy": "best", "eval_strategy": "steps"}, "save_strategy"),
    (TrainingConfig, {"metric_for_best_model": "loss"}, "metric_for_best_model"),
    (TrainingConfig, {"include_num_input_tokens_seen": "yes"}, "include_num_input_tokens_seen"),
    (TrainingConfig, {"eval_delay": -1}, "eval_delay"),
    (TrainingConfig, {"torch_empty_cache_steps": 0}, "torch_empty_cache_steps"),
    (TrainingConfig, {"data_seed": 1.5}, "data_seed"),
    (GRPOConfig, {"sync_ref_model": True}, "sync_ref_model"),  # beta 0: no reference
    (GRPOConfig, {"ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha"),
    (GRPOConfig, {"ref_model_sync_steps": 0}, "ref_model_sync_steps"),
    (GRPOConfig, {"entropy_coef": float("nan")}, "entropy_coef"),
    (GRPOConfig, {"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min"),
    (GRPOConfig, {"entropy_coef_delta": -0.1}, "entropy_coef_delta"),
    (TrainingConfig, {"ddp_backend": "tcp"}, "ddp_backend"),
    (SFTConfig, {"include_for_metrics": "inputs"}, "include_for_metrics"),  # a list, not a string
    (GRPOConfig, {"reward_weights": 5}, "reward_weights"),
    (TrainingConfig, {"log_level_replica": "loud"}, "log_level_replica"),
    (TrainingConfig, {"router_aux_loss_coef": float("inf")}, "router_aux_loss_coef"),
    (SFTConfig, {"include_for_metrics": ["inputs", "logits"]}, "include_for_metrics"),
    (SFTConfig, {"neftune_noise_alpha": 0.0}, "neftune_noise_alpha"),
    (GRPOConfig, {"entropy_target": -1.0}, "entropy_target"),
    (GRPOConfig, {"vespo_k_pos": float("inf")}, "vespo_k_pos"),
    (GRPOConfig, {"generation_engine": "vllm"}, "generation_engine"),
    (GRPOConfig, {"vllm_importance_sampling_cap": -1.0}, "vllm_importance_sampling_cap"),
]


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_defaults_are_valid(cls):
    cls()  # every invalid case below differs from a valid default only in its kwargs


@pytest.mark.parametrize(
    "cls,kwargs,field_name", INVALID, ids=[f"{c.__name__}-{'-'.join(f'{k}={v!r}' for k, v in kw.items())}"
                                           for c, kw, _ in INVALID]
)
def test_invalid_value_raises_config_error_naming_the_field(cls, kwargs, field_name):
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert f"`{field_name}=" in message
    assert message.startswith(cls.__name__ + ":")


def test_both_warmups_message_names_both_fields():
    with pytest.raises(ConfigError, match="warmup_steps or warmup_ratio, not both"):
        TrainingConfig(warmup_steps=5, warmup_ratio=0.1)


def test_bf16_and_fp16_message_names_both():
    with pytest.raises(ConfigError, match=r"set bf16 or fp16, not both"):
        SFTConfig(bf16=True, fp16=True)


def test_generation_batch_size_and_steps_per_generation_message_names_both():
    with pytest.raises(ConfigError, match="set generation_batch_size or steps_per_generation, not both"):
        GRPOConfig(generation_batch_size=16, steps_per_generation=2)


def test_invalid_choice_message_lists_valid_values():
    with pytest.raises(ConfigError) as info:
        GRPOConfig(loss_type="ppo")
    for valid in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert valid in str(info.value)
    with pytest.raises(ConfigError) as info:
        TrainingConfig(lr_scheduler_type="reduce_lr_on_plateau")
    for valid in ("linear", "cosine", "constant", "constant_with_warmup"):
        assert valid in str(info.value)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (TrainingConfig, {"num_train_epochs": 0, "max_steps": 5}),  # epochs ignored when max_steps > 0
        (TrainingConfig, {"warmup_steps": 0.5}),  # a fraction
        (TrainingConfig, {"warmup_steps": 3.0}),  # a whole-number float counts steps
        (TrainingConfig, {"warmup_ratio": 0.99}),
        (TrainingConfig, {"max_grad_norm": None}),
        (TrainingConfig, {"max_grad_norm": 0}),
        (TrainingConfig, {"bf16": True, "fp16": False}),
        (TrainingConfig, {"bf16": False, "fp16": True}),
        (TrainingConfig, {"report_to": ["tensorboard", "wandb"]}),
        (TrainingConfig, {"eval_strategy": "steps", "eval_steps": 3, "save_strategy": "epoch"}),
        (TrainingConfig, {"adam_beta1": 0.0}),
        (SFTConfig, {"max_length": None}),
        (SFTConfig, {"packing": True, "max_length": 64, "truncation_mode": "keep_end"}),
        (SFTConfig, {"pad_to_multiple_of": 8}),
        (SFTConfig, {"packing": True, "packing_strategy": "wrapped", "loss_type": "dft"}),
        (SFTConfig, {"padding_free": True, "max_length": None}),
        (SFTConfig, {"padding_free": True, "packing": True}),
        (GRPOConfig, {"pad_to_multiple_of": 16}),
        (GRPOConfig, {"num_generations": 2}),
        (GRPOConfig, {"generation_batch_size": 16}),
        (GRPOConfig, {"steps_per_generation": 4}),
        (GRPOConfig, {"top_k": None}),
        (GRPOConfig, {"top_p": 1.0, "delta": 1.5, "epsilon_high": 0.28}),
        (GRPOConfig, {"scale_rewards": "batch", "importance_sampling_level": "sequence", "loss_type": "dr_grpo"}),
    ],
)
def test_valid_edge_values_are_accepted(cls, kwargs):
    config = cls(**kwargs)
    for key, value in kwargs.items():
        assert getattr(config, key) == value


# ------------------------------------------------------------------------------------------------------------
# Unknown and TRL-only options
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_unknown_option_near_miss_suggests_the_field(cls):
    with pytest.raises(ConfigError) as info:
        cls(learning_rat=1e-4)
    message = str(info.value)
    assert f"{cls.__name__} has no option `learning_rat`" in message
    assert "Did you mean" in message
    assert "`learning_rate`" in message


def test_unknown_option_suggestion_is_class_specific():
    with pytest.raises(ConfigError, match=r"Did you mean .*`num_generations`"):
        GRPOConfig(num_generation=4)
    with pytest.raises(ConfigError, match=r"Did you mean .*`max_length`"):
        SFTConfig(max_lenght=128)


def test_unknown_option_without_near_miss_has_no_suggestion():
    with pytest.raises(ConfigError) as info:
        TrainingConfig(zzqqxx=1)
    message = str(info.value)
    assert "has no option `zzqqxx`" in message
    assert "Did you mean" not in message


def test_option_of_another_config_is_unknown():
    with pytest.raises(ConfigError, match="GRPOConfig has no option `packing`"):
        GRPOConfig(packing=True)
    with pytest.raises(ConfigError, match="SFTConfig has no option `num_generations`"):
        SFTConfig(num_generations=4)
    with pytest.raises(ConfigError, match="TrainingConfig has no option `max_length`"):
        TrainingConfig(max_length=16)


@pytest.mark.parametrize("cls", ALL_CONFIGS)
@pytest.mark.parametrize(
    "name,value",
    [("push_to_hub", False), ("hub_model_id", None), ("label_smoothing_factor", 0.0), ("label_names", None),
     ("save_on_each_node", False), ("dataloader_pin_memory", True), ("use_liger_kernel", False)],
)
def test_trl_only_option_at_trl_default_is_accepted(cls, name, value):
    assert TRL_ONLY_OPTIONS[name] == value
    config = cls(**{name: value}, learning_rate=3e-4)
    assert config.learning_rate == 3e-4  # the other options still apply
    assert name not in {f.name for f in dataclasses.fields(config)}
    assert getattr(config, name) == value  # a TRL script may read it (`if training_args.push_to_hub:`)
    assert getattr(cls(), name) == value  # also when it was not given
    setattr(config, name, value)  # setting TRL's default changes nothing


def test_trl_only_option_set_after_construction_is_refused():
    config = SFTConfig()
    with pytest.raises(ConfigError, match="`push_to_hub=True` is a TRL option"):
        config.push_to_hub = True
    assert config.push_to_hub is False
    grpo = GRPOConfig()  # include_for_metrics is SFT's own option, and a TRL-only one for GRPO
    grpo.include_for_metrics.append("inputs")  # a fresh copy of the default each time: TRL's stays as it was
    assert grpo.include_for_metrics == [] and TRL_ONLY_OPTIONS["include_for_metrics"] == []
    with pytest.raises(AttributeError, match="no attribute 'not_an_option'"):
        config.not_an_option


@pytest.mark.parametrize("cls", ALL_CONFIGS)
@pytest.mark.parametrize(
    "name,value",
    [("push_to_hub", True), ("hub_model_id", "me/model"), ("label_smoothing_factor", 0.1), ("torch_compile", True),
     ("save_on_each_node", True), ("use_liger_kernel", True), ("eval_accumulation_steps", 4)],
)
def test_trl_only_option_at_other_value_is_refused(cls, name, value):
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    message = str(info.value)
    assert f"`{name}=" in message
    assert "TRL" in message
    assert repr(TRL_ONLY_OPTIONS[name]) in message  # says which value would be accepted
    assert message.startswith(cls.__name__ + ":")


def test_trl_only_options_do_not_shadow_real_fields():
    """A TRL-only option is a field of no config, except TrainingArguments options only SFT implements
    (neftune_noise_alpha, and what compute_metrics receives): GRPO still accepts them only at TRL's default."""
    fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in ALL_CONFIGS}
    sft_only = {"neftune_noise_alpha", "prediction_loss_only", "include_for_metrics", "eval_do_concat_batches",
                "batch_eval_metrics"}
    assert set(TRL_ONLY_OPTIONS) & set.union(*fields.values()) == sft_only
    assert sft_only <= fields[SFTConfig] and "loss_type" in fields[GRPOConfig] & fields[SFTConfig]
    with pytest.raises(ConfigError, match="only its default False"):
        GRPOConfig(batch_eval_metrics=True)
    assert SFTConfig(neftune_noise_alpha=5.0).neftune_noise_alpha == 5.0
    with pytest.raises(ConfigError, match="only its default None"):
        GRPOConfig(neftune_noise_alpha=5.0)


def test_positional_argument_and_signature_preserved():
    config = TrainingConfig("some/dir")
    assert config.output_dir == "some/dir"
    import inspect

    params = inspect.signature(SFTConfig.__init__).parameters
    assert "max_length" in params and "learning_rate" in params
    assert params["learning_rate"].default == 2e-5


# ------------------------------------------------------------------------------------------------------------
# scale_rewards booleans, defaults, properties
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [(True, "group"), (False, "none"), ("batch", "batch"),
                                            ("group", "group"), ("none", "none")])
def test_scale_rewards_accepts_booleans(value, expected):
    assert GRPOConfig(scale_rewards=value).scale_rewards == expected


def test_trl_mirroring_defaults():
    base, sft, grpo = TrainingConfig(), SFTConfig(), GRPOConfig()
    assert base.learning_rate == 5e-5
    assert sft.learning_rate == 2e-5
    assert grpo.learning_rate == 1e-6
    assert grpo.loss_type == "dapo"
    assert grpo.num_generations == 8
    assert grpo.beta == 0.0
    assert grpo.scale_rewards == "group"
    assert grpo.importance_sampling_level == "token"
    assert grpo.epsilon == 0.2
    assert grpo.max_completion_length == 512
    assert grpo.remove_unused_columns is False
    assert sft.remove_unused_columns is True
    for config in (base, sft, grpo):
        assert config.logging_steps == 10
        assert config.lr_scheduler_type == "linear"
        assert config.per_device_train_batch_size == 8
        assert config.gradient_accumulation_steps == 1
        assert config.seed == 42
        assert config.bf16 is None
    assert sft.max_length == 1024
    assert sft.loss_type == "nll"
    assert sft.completion_only_loss is None
    assert sft.assistant_only_loss is False
    assert sft.packing is False


def test_every_field_has_help_text():
    for cls in ALL_CONFIGS:
        for f in dataclasses.fields(cls):
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"], f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize(
    "kwargs,expected",
    [({}, None), ({"warmup_steps": 0.1}, 0.1), ({"warmup_ratio": 0.2}, 0.2), ({"warmup_steps": 5}, None),
     ({"warmup_steps": 1}, None), ({"warmup_steps": 0.999}, 0.999)],
)
def test_warmup_fraction(kwargs, expected):
    fraction = TrainingConfig(**kwargs).warmup_fraction
    if expected is None:
        assert fraction is None
    else:
        assert isinstance(fraction, float) and math.isclose(fraction, expected)


def test_clip_high():
    assert GRPOConfig().clip_high == 0.2
    assert GRPOConfig(epsilon=0.1).clip_high == 0.1
    assert GRPOConfig(epsilon_high=0.28).clip_high == 0.28


def test_sampler_correction_options_are_checked():
    """TRL's vllm_importance_sampling_* (they correct a rollout_func's sampler here): names in the errors."""
    config = GRPOConfig()
    assert (config.vllm_importance_sampling_correction, config.vllm_importance_sampling_mode,
            config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max) == \
        (True, "sequence_mask", None, 3.0)  # TRL's defaults
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode.*one of: 'token_truncate'"):
        GRPOConfig(vllm_importance_sampling_mode="token")
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_min.*less than "
                                          "vllm_importance_sampling_clip_max \\(3.0\\)"):
        GRPOConfig(vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_max"):
        GRPOConfig(vllm_importance_sampling_clip_max=-1.0)
    assert GRPOConfig(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=None) \
        .vllm_importance_sampling_clip_min == 0.5
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        capped = GRPOConfig(vllm_importance_sampling_cap=2.0)  # TRL's old name for the upper bound
    assert capped.vllm_importance_sampling_clip_max == 2.0


def test_to_dict_round_trips():
    config = SFTConfig(learning_rate=1e-4, max_length=256, packing=True)
    as_dict = config.to_dict()
    assert as_dict["learning_rate"] == 1e-4
    assert as_dict["max_length"] == 256
    assert as_dict["packing"] is True
    assert set(as_dict) == {f.name for f in dataclasses.fields(SFTConfig)}
    assert SFTConfig(**as_dict) == config



def test_boolean_learning_rate_is_refused():
    with pytest.raises(ConfigError, match="learning_rate"):
        SFTConfig(learning_rate=True)


def test_best_model_defaults_follow_transformers():
    both = dict(eval_strategy="steps", save_strategy="steps", eval_steps=10, save_steps=20)
    config = TrainingConfig(load_best_model_at_end=True, **both)
    assert (config.metric_for_best_model, config.greater_is_better) == ("loss", False)
    for metric, greater in (("eval_loss", False), ("reward", True), ("eval_mean_token_accuracy", True)):
        assert TrainingConfig(metric_for_best_model=metric, **both).greater_is_better is greater
    assert TrainingConfig(metric_for_best_model="loss", greater_is_better=True, **both).greater_is_better is True
    # save_strategy="best" needs no matching eval schedule
    TrainingConfig(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="best")


@pytest.mark.parametrize("value,expected", [(True, "all"), (False, "no"), ("non_padding", "non_padding")])
def test_include_num_input_tokens_seen_accepts_booleans(value, expected):
    assert TrainingConfig(include_num_input_tokens_seen=value).include_num_input_tokens_seen == expected


def test_activation_checkpointing_is_transformers_5s_name_for_gradient_checkpointing():
    config = SFTConfig(activation_checkpointing=True, activation_checkpointing_kwargs={"every_n_layers": 2})
    assert config.gradient_checkpointing is True and config.gradient_checkpointing_kwargs == {"every_n_layers": 2}
    config = GRPOConfig(gradient_checkpointing=True)
    assert config.activation_checkpointing is True and config.activation_checkpointing_kwargs is None
    assert SFTConfig().activation_checkpointing is False
    assert SFTConfig(**SFTConfig(activation_checkpointing=True).to_dict()).gradient_checkpointing is True
    with pytest.raises(ConfigError, match="`activation_checkpointing=False`.*disagrees with gradient_checkpointing"):
        SFTConfig(gradient_checkpointing=True, activation_checkpointing=False)


# ------------------------------------------------------------------------------------------------------------
# Constraints declared with opt(): one declaration drives the check, the error and the reference
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Probe:
    steps: int = opt(-1, "Steps.", choices=(-1,), ge=1, note="-1: unlimited")
    rate: float | None = opt(0.5, "A rate.", gt=0, le=1, finite=True)
    mode: str = opt("a", "A mode.", choices=("a", "b"))
    parts: list[str] = opt([], "Parts.", choices=("x", "y"))
    scale: float = opt(1.0, "No constraint.")


def test_opt_stores_constraints_in_the_metadata():
    fields = {f.name: f for f in dataclasses.fields(_Probe)}
    assert dict(fields["rate"].metadata) == {"help": "A rate.", "gt": 0, "le": 1, "finite": True}
    assert fields["mode"].metadata["choices"] == ("a", "b")
    assert dict(fields["scale"].metadata) == {"help": "No constraint."}
    assert _Probe().parts == [] and _Probe().parts is not _Probe().parts


@pytest.mark.parametrize("name,words", [
    ("steps", "≥ 1, or -1 (-1: unlimited)"), ("rate", "a finite number in (0, 1], or None"),
    ("mode", "one of: 'a', 'b'"), ("parts", "a list of: 'x', 'y'"), ("scale", ""),
])
def test_constraints_in_words(name, words):
    assert describe_constraints(next(f for f in dataclasses.fields(_Probe) if f.name == name)) == words


@pytest.mark.parametrize("kwargs,ok", [
    ({}, True), ({"steps": 3}, True), ({"steps": 0}, False), ({"steps": -2}, False),
    ({"rate": None}, True), ({"rate": 1}, True), ({"rate": 0.0}, False), ({"rate": float("nan")}, False),
    ({"mode": "b"}, True), ({"mode": "c"}, False), ({"parts": ["y", "x"]}, True), ({"parts": ["z"]}, False),
    ({"scale": -1e9}, True),
])
def test_check_constraints(kwargs, ok):
    probe = _Probe(**kwargs)
    if ok:
        check_constraints(probe)
    else:
        with pytest.raises(ConfigError, match=rf"^_Probe: `{next(iter(kwargs))}=.*` is invalid; it must be "):
            check_constraints(probe)


@pytest.mark.parametrize("cls,kwargs,message", [
    (GRPOConfig, {"num_generations": 1},
     "GRPOConfig: `num_generations=1` is invalid; it must be ≥ 2 (GRPO compares completions within a group)."),
    (TrainingConfig, {"max_steps": 0},
     "TrainingConfig: `max_steps=0` is invalid; it must be ≥ 1, or -1 (-1 trains for num_train_epochs)."),
    (TrainingConfig, {"adam_beta1": 1.0}, "TrainingConfig: `adam_beta1=1.0` is invalid; it must be in [0, 1)."),
    (SFTConfig, {"max_length": 0}, "SFTConfig: `max_length=0` is invalid; it must be ≥ 1, or None."),
    (TrainingConfig, {"learning_rate": float("inf")},
     "TrainingConfig: `learning_rate=inf` is invalid; it must be a finite number ≥ 0."),
    (SFTConfig, {"learning_rate": -1e-5},
     "SFTConfig: `learning_rate=-1e-05` is invalid; it must be a finite number ≥ 0."),
    (DPOConfig, {"learning_rate": float("nan")},
     "DPOConfig: `learning_rate=nan` is invalid; it must be a finite number ≥ 0."),
    (TrainingConfig, {"optim": "sgd"},
     "TrainingConfig: `optim='sgd'` is invalid; it must be one of: 'adamw_torch', 'adamw_torch_fused'."),
    (TrainingConfig, {"max_grad_norm": -1.0},
     "TrainingConfig: `max_grad_norm=-1.0` is invalid; it must be ≥ 0, or None (0 or None disables clipping)."),
])
def test_declared_constraint_errors_say_what_is_valid(cls, kwargs, message):
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert str(info.value) == message


def test_help_texts_do_not_restate_declared_choices():
    """The reference shows each field's choices; a help text that lists them again goes stale."""
    for cls in ALL_CONFIGS:
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices", ())
            if len(choices) > 1:
                assert repr(tuple(choices)) not in f.metadata["help"], f"{cls.__name__}.{f.name}"


def test_no_field_accepts_a_single_value():
    """A field with a single allowed value is a TRL-only option instead (accepted at TRL's default)."""
    for cls in ALL_CONFIGS:
        for f in dataclasses.fields(cls):
            bounded = any(k in f.metadata for k in ("ge", "gt", "le", "lt", "finite"))
            assert bounded or len(f.metadata.get("choices", (1, 2))) > 1, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("cls,name,default,other", [
    (GRPOConfig, "use_transformers_continuous_batching", False, True),
])
def test_single_value_options_are_trl_only(cls, name, default, other):
    """TRL 1.16's default is accepted and read back; any other value is refused with the TRL-only message."""
    assert TRL_ONLY_OPTIONS[name] == default and name not in {f.name for f in dataclasses.fields(cls)}
    assert getattr(cls(**{name: default}), name) == default == getattr(cls(), name)
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}: `{name}={other!r}` is a TRL option .*only its "
                                          rf"default {default!r} is accepted"):
        cls(**{name: other})
