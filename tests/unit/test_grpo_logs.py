"""TRL's round metrics and the completions records by hand (trainers/sampling/rollout.py, metrics.py)."""

import json

import pytest
import torch

from trainers.sampling.metrics import write_completions
from trainers.sampling.rollout import round_metrics, sample_records

NAN = float("nan")


def test_round_metrics_by_hand():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])  # two groups of 2
    per_func = torch.tensor([[1.0, 0.0], [0.0, NAN], [1.0, 1.0], [1.0, 1.0]])  # "acc" and "fmt", one None
    std_in_use = torch.tensor([0.7071, 0.0])  # the second group has no spread
    lengths, truncated = torch.tensor([3.0, 8.0, 5.0, 8.0]), torch.tensor([0.0, 1.0, 0.0, 1.0])
    m = round_metrics(rewards, per_func, ["acc", "fmt"], std_in_use, lengths, truncated)
    assert m["reward"] == 1.25 and m["reward_std"] == pytest.approx(float(torch.tensor([1.0, 0, 2, 2]).std()))
    assert m["frac_reward_zero_std"] == 0.5
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (6.0, 3.0, 8.0)
    assert m["completions/clipped_ratio"] == 0.5
    # only the completions that ended: lengths 3 and 5
    assert (m["completions/mean_terminated_length"], m["completions/min_terminated_length"],
            m["completions/max_terminated_length"]) == (4.0, 3.0, 5.0)
    assert m["rewards/acc/mean"] == 0.75 and m["rewards/fmt/mean"] == pytest.approx(2 / 3)  # the None left out
    # no completion ended: TRL's convention is 0; functions sharing a name log their mean
    m = round_metrics(rewards, per_func, ["same", "same"], std_in_use, lengths, torch.ones(4))
    assert (m["completions/mean_terminated_length"], m["completions/min_terminated_length"],
            m["completions/max_terminated_length"]) == (0.0, 0.0, 0.0)
    assert m["rewards/same/mean"] == pytest.approx((0.75 + 2 / 3) / 2)


def test_sample_records_and_the_completions_file(tmp_path):
    records = sample_records(["p1", [{"role": "user", "content": "p2"}]],
                             ["c1", [{"role": "assistant", "content": "c2"}]], ["acc"],
                             torch.tensor([[1.0], [NAN]]), torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5]),
                             {"note": ["a", "b"]})
    assert records[1] == {"prompt": [{"role": "user", "content": "p2"}], "completion": "c2", "reward": 0.0,
                          "rewards": {"acc": None}, "advantage": -0.5, "note": "b"}
    write_completions(str(tmp_path), 7, records, num_to_print=1)
    write_completions(str(tmp_path), 8, records[:1], num_to_print=None)
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"]) for r in lines] == [(7, "c1"), (7, "c2"), (8, "c1")]
