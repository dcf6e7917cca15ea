"""What GRPO reports about a generation round: TRL's reward and completion metrics, and the completions table
(``log_completions``). Pure functions of the gathered round; the trainer decides when to call them."""

from __future__ import annotations

import json
import math
import os

import torch

from trainers.logs import logger
from trainers.sampling.advantages import nanstd
from trainers.sampling.reward_functions import completion_text


def round_metrics(rewards: torch.Tensor, rewards_per_func: torch.Tensor, reward_names: list[str],
                  std_in_use: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's metrics of one round, over every process's completions.

    rewards: [N] weighted sums; rewards_per_func: [N, F] (NaN where a function returned None); std_in_use: the
    std the advantages were scaled by (per group, or the batch's); lengths, truncated: [N] completion lengths
    and whether each hit max_completion_length. No reward functions: the completion metrics only."""
    metrics = {}
    if reward_names:  # without reward functions (distillation), no reward metrics
        zero = torch.isclose(std_in_use, torch.zeros_like(std_in_use))  # a NaN std (one scored completion): not 0
        metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
                   "frac_reward_zero_std": float(zero.float().mean())}
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()),
                    "completions/clipped_ratio": float(truncated.mean())})
    terminated = lengths[truncated == 0]  # the completions that ended with EOS; TRL logs 0 when none did
    terminated = terminated if len(terminated) else torch.zeros(1)
    metrics.update({"completions/mean_terminated_length": float(terminated.mean()),
                    "completions/min_terminated_length": float(terminated.min()),
                    "completions/max_terminated_length": float(terminated.max())})
    for name in dict.fromkeys(reward_names):  # functions of one name: their mean, as in TRL
        columns = [rewards_per_func[:, i] for i, n in enumerate(reward_names) if n == name]
        metrics[f"rewards/{name}/mean"] = sum(float(torch.nanmean(c)) for c in columns) / len(columns)
        metrics[f"rewards/{name}/std"] = sum(float(nanstd(c)) for c in columns) / len(columns)
    return metrics


def sample_records(prompts: list, completions: list, reward_names: list[str], rewards_per_func: torch.Tensor,
                   rewards: torch.Tensor, advantages: torch.Tensor, extra: dict) -> list[dict]:
    """One record per completion for ``log_completions``: the total and each function's reward (None where it
    returned None), the advantage, and the columns reward functions added with log_extra."""
    records = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        per_func = {name: None if math.isnan(v) else v for name, v in zip(reward_names, rewards_per_func[i].tolist())}
        records.append({"prompt": prompt, "completion": completion_text(completion), "reward": float(rewards[i]),
                        "rewards": per_func, "advantage": float(advantages[i]),
                        **{column: values[i] for column, values in extra.items()}})
    return records


def write_completions(output_dir: str, step: int, records: list[dict], num_to_print: int | None) -> None:
    """Append ``records`` to ``output_dir/completions.jsonl`` and print a table of the first ``num_to_print``
    (all when None)."""
    with open(os.path.join(output_dir, "completions.jsonl"), "a") as f:
        for record in records:
            f.write(json.dumps({"step": step, **record}, default=str) + "\n")
    lines = [f"{'reward':>7} {'adv':>6}  prompt -> completion"]
    for r in records[: num_to_print or len(records)]:
        prompt = completion_text(r["prompt"]) if not isinstance(r["prompt"], str) else r["prompt"]
        lines.append(f"{r['reward']:7.3f} {r['advantage']:6.2f}  {prompt[-40:]!r} -> {r['completion'][:60]!r}")
    logger.info("completions at step %d:\n%s", step, "\n".join(lines))
