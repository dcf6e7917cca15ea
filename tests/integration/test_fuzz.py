"""Property-based tests: any malformed config or dataset row either trains or raises one of our clear errors
(a TrainersError naming the culprit), never an unrelated stack trace from deep inside a dependency."""

import dataclasses
import tempfile

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.errors import ConfigError, TrainersError

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.sampled_from(["dapo", "grpo", "linear", "cosine", "steps", "no", "group", "token"]),
    st.lists(st.one_of(st.integers(-2, 5), st.floats(-1, 2), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
NAMES = sorted({f.name for c in (SFTConfig, GRPOConfig) for f in dataclasses.fields(c)} - {"output_dir"}
               | set(list(TRL_ONLY_OPTIONS)[:40]) | {"learning_rat", "num_generation", "batch_size"})
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@given(st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=5))
@settings(max_examples=examples(400), deadline=None)
def test_any_config_is_built_or_refused_with_a_config_error(kwargs):
    for config_class in (SFTConfig, GRPOConfig):
        try:
            config_class(output_dir="out", **kwargs)
        except ConfigError:
            pass


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 3, None]),
                                 "content": st.one_of(st.text(max_size=12), st.integers(), st.none())})
CELL = st.one_of(st.none(), st.text(max_size=24), st.integers(-200, 400), st.lists(st.integers(-200, 400), max_size=8),
                 st.lists(st.integers(0, 1), max_size=8), st.lists(MESSAGE, max_size=3))
JUNK_ROW = st.dictionaries(st.sampled_from(["text", "messages", "prompt", "completion", "input_ids", "labels",
                                            "completion_mask", "note"]), CELL, min_size=1, max_size=3)
TEXT = st.text(max_size=40)
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT})
TOKENS = st.lists(st.integers(0, 258), min_size=1, max_size=40)
VALID_ROWS = st.one_of(  # rows of one well-formed format, to reach training most of the time
    st.lists(st.fixed_dictionaries({"text": TEXT}), min_size=1, max_size=4),
    st.lists(st.fixed_dictionaries({"messages": st.lists(TURN, min_size=1, max_size=4)}), min_size=1, max_size=4),
    st.lists(st.fixed_dictionaries({"prompt": TEXT, "completion": TEXT}), min_size=1, max_size=4),
    st.lists(st.fixed_dictionaries({"input_ids": TOKENS}), min_size=1, max_size=4),
    st.lists(TOKENS.flatmap(lambda ids: st.fixed_dictionaries({
        "input_ids": st.just(ids), "labels": st.lists(st.sampled_from([-100, 5, 300]), min_size=len(ids),
                                                      max_size=len(ids))})), min_size=1, max_size=4),
)
SFT_ROWS = st.one_of(VALID_ROWS, VALID_ROWS.flatmap(lambda rows: st.tuples(st.just(rows), JUNK_ROW).map(
    lambda pair: pair[0] + [pair[1]])), st.lists(JUNK_ROW, max_size=4))


@given(SFT_ROWS)
@settings(SLOW, max_examples=examples(60))
def test_any_sft_rows_train_or_raise_our_error(tiny_model_dir, rows):
    with tempfile.TemporaryDirectory() as out:
        try:
            trainer = SFTTrainer(model=tiny_model_dir, train_dataset=rows, args=SFTConfig(
                output_dir=out, max_steps=1, per_device_train_batch_size=2, max_length=32, disable_tqdm=True,
                save_strategy="no"))
            trainer.train()
            event("trained")
        except TrainersError as error:
            event(f"refused: {type(error).__name__}: {str(error)[:70]}")


GRPO_ROW = st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=20), st.lists(TURN, min_size=1,
                                                                                                   max_size=2), CELL)},
                                 optional={"answer": CELL, "meta": CELL})


@given(st.lists(GRPO_ROW, min_size=0, max_size=3))
@settings(SLOW, max_examples=examples(40))
def test_any_grpo_rows_train_or_raise_our_error(tiny_model_dir, rows):
    def length(completions, **kwargs):
        return [float(len(str(c))) for c in completions]

    with tempfile.TemporaryDirectory() as out:
        try:
            trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[length, "accuracy"], train_dataset=rows,
                                  args=GRPOConfig(output_dir=out, max_steps=1, per_device_train_batch_size=2,
                                                  num_generations=2, max_completion_length=2, disable_tqdm=True,
                                                  save_strategy="no"))
            trainer.train()
            event("trained")
        except TrainersError as error:
            event(f"refused: {type(error).__name__}: {str(error)[:70]}")
