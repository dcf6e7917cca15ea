"""Health rules over synthetic metrics histories: each rule fires on a sick run, stays quiet on a healthy one,
ignores records that lack its metrics, and HealthMonitor warns once per rule."""

import json
import math

import pytest

from trainers.loop import health
from trainers.sampling import health as grpo_health
from trainers.sampling.health import (
    entropy_collapse,
    kl_growth,
    length_explosion,
    truncated_completions,
    zero_reward_variance,
)
from trainers.loop.health import HealthMonitor, nonfinite_loss

RULES = grpo_health.RULES + health.RULES  # a GRPO trainer's (GRPOTrainer.HEALTH_RULES)


def grpo_history(steps: int = 8, **columns) -> list[dict]:
    """A healthy GRPO history; ``columns`` (name -> list of values, one per step) replace metrics."""
    records = []
    for i in range(steps):
        record = {"step": i + 1, "epoch": 0.1 * (i + 1), "loss": 0.01 * (-1) ** i, "reward": 0.2 + 0.05 * i,
                  "reward_std": 0.3, "frac_reward_zero_std": 0.125, "completions/mean_length": 40.0 + i,
                  "completions/min_length": 10.0, "completions/max_length": 128.0,
                  "completions/clipped_ratio": 0.05, "entropy": 2.0 - 0.05 * i, "kl": 0.01 + 0.001 * i,
                  "clip_ratio/region_mean": 0.01, "grad_norm": 0.8, "learning_rate": 1e-6}
        for name, values in columns.items():
            record[name] = values[i]
        records.append(record)
    return records


def sft_history(steps: int = 6) -> list[dict]:
    """SFT records and eval records: no GRPO metric at all."""
    records = []
    for i in range(steps):
        records.append({"step": i + 1, "loss": 2.0 - 0.1 * i, "mean_token_accuracy": 0.5, "grad_norm": 1.0,
                        "learning_rate": 2e-5, "num_tokens": 1000 * (i + 1)})
        records.append({"step": i + 1, "epoch": 0.1, "eval_loss": 2.1 - 0.1 * i})
    return records


SICK = {
    "zero_reward_variance": grpo_history(frac_reward_zero_std=[0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9]),
    "entropy_collapse": grpo_history(entropy=[2.0, 1.5, 1.0, 0.6, 0.3, 0.2, 0.15, 0.1]),
    "truncated_completions": grpo_history(**{"completions/clipped_ratio": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9]}),
    "length_explosion": grpo_history(**{"completions/mean_length": [30, 30, 30, 40, 60, 90, 110, 120],
                                        "completions/max_length": [128] * 8}),
    "kl_growth": grpo_history(kl=[0.01, 0.02, 0.05, 0.1, 0.3, 0.5, 0.8, 1.2]),
    "nonfinite_loss": grpo_history(loss=[0.1, 0.1, 0.1, float("nan"), 0.1, 0.1, 0.1, 0.1]),
}
RULE_BY_NAME = {rule.__name__: rule for rule in RULES}


@pytest.mark.parametrize("name", sorted(SICK))
def test_each_rule_fires_on_its_sick_history_with_advice(name):
    warning = RULE_BY_NAME[name](SICK[name])
    assert isinstance(warning, str) and warning
    assert "Try:" in warning  # says what to try, not only what is wrong


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_no_rule_fires_on_a_healthy_run(rule):
    assert rule(grpo_history()) is None


@pytest.mark.parametrize("name", sorted(SICK))
def test_each_sick_history_triggers_only_its_own_rule(name):
    fired = [rule.__name__ for rule in RULES if rule(SICK[name]) is not None]
    assert fired == [name]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
@pytest.mark.parametrize("history", [[], sft_history(), [{"step": 3, "eval_reward": 0.5}] * 10],
                         ids=["empty", "sft_and_eval", "eval_only"])
def test_rules_are_quiet_without_their_metrics(rule, history):
    assert rule(history) is None


def test_eval_records_between_train_records_are_skipped():
    history = []
    for record in SICK["entropy_collapse"]:
        history += [record, {"step": record["step"], "eval_reward": 0.1}]
    assert entropy_collapse(history) is not None
    assert entropy_collapse([r for r in history if "entropy" not in r]) is None


def test_zero_variance_needs_a_sustained_majority():
    one_bad_log = grpo_history(frac_reward_zero_std=[0.1] * 7 + [1.0])
    assert zero_reward_variance(one_bad_log) is None  # mean of the last 3 is 0.4
    warning = zero_reward_variance(grpo_history(frac_reward_zero_std=[1.0] * 8))
    assert "100%" in warning and "temperature" in warning and "num_generations" in warning
    assert zero_reward_variance(grpo_history(steps=2, frac_reward_zero_std=[1.0, 1.0])) is None  # too few logs


def test_entropy_collapse_absolute_and_relative():
    absolute = grpo_history(steps=3, entropy=[0.06, 0.05, 0.01])  # under the floor, though not a tenth of 0.06
    assert entropy_collapse(absolute) is not None
    relative = grpo_history(steps=3, entropy=[8.0, 3.0, 0.7])  # a tenth of 8.0, though far above the floor
    assert entropy_collapse(relative) is not None
    assert entropy_collapse(grpo_history(steps=3, entropy=[8.0, 3.0, 0.9])) is None
    assert entropy_collapse(grpo_history(steps=1, entropy=[0.001])) is None  # nothing to compare with yet


def test_truncation_warning_names_the_fix():
    warning = truncated_completions(SICK["truncated_completions"])
    assert "max_completion_length" in warning and "73%" in warning  # mean of 0.6, 0.7, 0.9


def test_length_explosion_needs_growth_and_the_limit():
    far_from_limit = grpo_history(**{"completions/mean_length": [30, 30, 30, 40, 60, 90, 110, 120],
                                     "completions/max_length": [1024] * 8})
    assert length_explosion(far_from_limit) is None  # 4x longer, but nowhere near the longest completion
    always_at_limit = grpo_history(**{"completions/mean_length": [120] * 8, "completions/max_length": [128] * 8})
    assert length_explosion(always_at_limit) is None  # long from the start: truncated_completions' business
    assert "4.0x" in length_explosion(SICK["length_explosion"])


def test_kl_growth_tolerates_one_dip_but_not_a_plateau():
    one_dip = grpo_history(kl=[0.01, 0.02, 0.05, 0.6, 0.9, 0.8, 1.1, 1.5])
    assert kl_growth(one_dip) is not None
    small = grpo_history(kl=[0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008])
    assert kl_growth(small) is None  # growing, but tiny
    flat = grpo_history(kl=[2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.1, 1.9])
    assert kl_growth(flat) is None  # large, but not growing
    assert "beta" in kl_growth(SICK["kl_growth"])


@pytest.mark.parametrize("name,value", [("loss", float("nan")), ("loss", float("inf")),
                                        ("grad_norm", float("-inf")), ("grad_norm", float("nan"))])
def test_nonfinite_loss_or_grad_norm(name, value):
    history = grpo_history()
    history[5][name] = value
    warning = nonfinite_loss(history)
    assert name in warning and "step 6" in warning and "learning_rate" in warning


def test_nonfinite_survives_a_json_round_trip_and_ignores_none():
    history = [json.loads(json.dumps(r)) for r in SICK["nonfinite_loss"]]  # metrics.jsonl writes NaN as NaN
    assert math.isnan(history[3]["loss"]) and nonfinite_loss(history) is not None
    assert nonfinite_loss([{"step": 1, "loss": 0.5, "grad_norm": None}]) is None  # DeepSpeed may log no norm


def test_monitor_warns_once_per_rule():
    monitor = HealthMonitor(RULES)
    history = SICK["entropy_collapse"]
    assert len(monitor.check(history)) == 1
    assert monitor.check(history) == []  # still collapsed: not repeated
    assert monitor.check(history + SICK["kl_growth"][-5:]) == [kl_growth(SICK["kl_growth"][-5:])]
    assert monitor.check(SICK["nonfinite_loss"]) != []  # another rule still warns the first time it fires
    assert HealthMonitor(RULES).check(history) == monitor_warning_of(history)  # a new monitor (a new run) warns again


def monitor_warning_of(history):
    return [w for w in (rule(history) for rule in RULES) if w is not None]


def test_monitor_as_the_trainer_calls_it_after_each_log():
    monitor, history, warnings = HealthMonitor(RULES), [], []
    for record in SICK["truncated_completions"]:
        history.append(record)
        warnings.append(monitor.check(history))
    fired_at = [i for i, w in enumerate(warnings) if w]
    assert len(fired_at) == 1 and len(warnings[fired_at[0]]) == 1


def test_replay_reports_a_problem_that_went_away():
    recovered = grpo_history(**{"completions/clipped_ratio": [0.9, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1]})
    assert truncated_completions(recovered) is None  # the end state is healthy
    replayed = HealthMonitor(RULES).replay(recovered)
    assert len(replayed) == 1 and "truncated" in replayed[0]
    assert HealthMonitor(RULES).replay(grpo_history()) == []


def test_monitor_with_custom_rules():
    monitor = HealthMonitor(rules=(nonfinite_loss,))
    assert monitor.check(SICK["entropy_collapse"]) == []
    assert len(monitor.check(SICK["nonfinite_loss"])) == 1


def test_thresholds_are_module_constants():
    for name in ("ZERO_STD_FRACTION", "ENTROPY_FLOOR", "ENTROPY_RELATIVE_FLOOR", "CLIPPED_RATIO", "LENGTH_GROWTH",
                 "NEAR_MAX_FRACTION", "KL_LARGE", "RECENT_RECORDS"):
        assert isinstance(getattr(grpo_health, name), (int, float))
