"""The sampling trainers' configs against TRL 1.16's: each has exactly TRL's fields and defaults plus this project's
additions, each addition named in the trainer's guide. The configs compose the sampling base's options
(trainers/sampling/config.py); none keeps a list of options it refuses."""

import dataclasses
import pathlib

import pytest

from trainers import DistillationConfig, GRPOConfig, RLOOConfig
from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.errors import ConfigError
from trainers.grpo.asynchronous import AsyncGRPOConfig

trl = pytest.importorskip("trl")

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"

# What every sampling trainer adds to TRL (SamplingConfig): engines, tool threads, vLLM's eager switch and server
# key, asynchronous generation; and what GRPO and RLOO add (PolicyGradientConfig): the policy's forwards, dynamic sampling
SAMPLING = {"generation_engine", "generation_backend", "tool_workers", "tool_timeout", "vllm_enforce_eager",
            "async_generation", "max_staleness", "max_inflight_tasks", "queue_maxsize", "weight_sync_steps",
            "weight_sync_timeout", "request_timeout", "heartbeat_stale_after_s", "fork_threshold_tokens", "in_flight_weight_updates", "vllm_lora_sync",
            "vllm_server_api_key"}
POLICY_GRADIENT = {"dynamic_sampling", "padding_free", "token_budget", "skip_zero_gradient_rows"}
ADDITIONS = {
    GRPOConfig: (SAMPLING | POLICY_GRADIENT, "grpo.md"),
    # TRL's RLOO has neither (GRPO's): its tools and the float32 head are this project's
    RLOOConfig: (SAMPLING | POLICY_GRADIENT | {"cast_lm_head_to_fp32", "max_tool_calling_iterations"}, "rloo.md"),
    # TRL's distillation samples one completion per round slot; here rounds are shaped as the others' are
    DistillationConfig: (SAMPLING | {"cast_lm_head_to_fp32", "mask_truncated_completions", "num_generations",
                                     "num_generations_eval", "generation_batch_size", "steps_per_generation",
                                     "num_iterations", "lmbda", "teacher_model_server_url", "loss_top_k",
                                     "loss_add_tail"}, "distillation.md"),
}
# TRL's defaults this project sets otherwise, each said in docs/migrating-from-trl.md or the field's help
DIFFER = {
    "output_dir": "TRL's None becomes 'trainer_output' in __post_init__; the same value once built",
    "disable_tqdm": "TRL's None becomes False in __post_init__ (no tqdm off by default)",
    "gradient_checkpointing": "off by default here (docs/migrating-from-trl.md)",
}
ASYNC_DIFFER = {
    "ignore_data_skip": "a TRL-only option at False: a resumed run skips the data it trained on",
    "remove_unused_columns": "every column reaches the reward functions, as GRPOConfig",
}


def default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def options(config_class) -> dict:
    """A config's options and their defaults: its fields, and the TRL options accepted only at TRL's default."""
    return {**TRL_ONLY_OPTIONS, **{f.name: default(f) for f in dataclasses.fields(config_class)}}


def own_fields(config_class) -> set[str]:
    """The fields beyond transformers' TrainingArguments (ours: beyond TRL's own base, TrainingConfig)."""
    from transformers import TrainingArguments

    from trainers.config.training import TrainingConfig

    base = TrainingArguments if config_class.__module__.startswith("trl") else TrainingConfig
    return {f.name for f in dataclasses.fields(config_class)} - {f.name for f in dataclasses.fields(base)}


PAIRS = [(GRPOConfig, "GRPOConfig"), (RLOOConfig, "RLOOConfig"), (DistillationConfig, "DistillationConfig")]


@pytest.mark.parametrize("ours,name", PAIRS, ids=[name for _, name in PAIRS])
def test_fields_are_trls_plus_the_documented_additions(ours, name):
    theirs = getattr(trl, name)
    additions, guide = ADDITIONS[ours]
    ours_options, their_fields = options(ours), {f.name: default(f) for f in dataclasses.fields(theirs)}
    assert set(their_fields) <= set(ours_options), sorted(set(their_fields) - set(ours_options))
    assert own_fields(ours) - own_fields(theirs) == additions
    text = (DOCS / guide).read_text()
    assert not [option for option in sorted(additions) if f"`{option}`" not in text], f"docs/{guide}"
    differ = {option for option, value in their_fields.items() if ours_options[option] != value}
    assert differ <= set(DIFFER), sorted(differ - set(DIFFER))


def test_async_grpo_config_is_trls_with_every_grpo_option():
    """AsyncGRPOConfig is GRPOConfig with the switch on: TRL's AsyncGRPOConfig fields at its defaults, and GRPO's
    other options (docs/grpo.md, "Asynchronous generation")."""
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsync

    ours, theirs = options(AsyncGRPOConfig), {f.name: default(f) for f in dataclasses.fields(TRLAsync)}
    assert set(theirs) <= set(ours)
    assert set(options(GRPOConfig)) | {"dtype"} == set(ours)
    differ = {option for option, value in theirs.items() if ours[option] != value}
    assert differ <= set(DIFFER) | set(ASYNC_DIFFER), sorted(differ)


@pytest.mark.parametrize("config,option,value", [
    (RLOOConfig, "loss_type", "grpo"), (RLOOConfig, "scale_rewards", "none"),
    (RLOOConfig, "vllm_importance_sampling_correction", True), (DistillationConfig, "epsilon", 0.3),
    (DistillationConfig, "reward_weights", [1.0]), (DistillationConfig, "sync_ref_model", True),
    (DistillationConfig, "padding_free", True)])
def test_an_option_a_trainer_does_not_have_is_unknown(config, option, value):
    with pytest.raises(ConfigError, match=rf"^{config.__name__} has no option `{option}`"):
        config(output_dir="unused", **{option: value})


def test_no_config_keeps_a_refused_list():
    for config in (GRPOConfig, RLOOConfig, DistillationConfig, AsyncGRPOConfig):
        assert not [name for name in vars(config) if "not_taken" in name or name.isupper()], config.__name__
