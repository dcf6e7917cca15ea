"""The completions table (``log_completions``): the records each round gives (``sample_records``,
trainers/sampling/rollout.py), written when the trainer logs."""

from __future__ import annotations

import json
import os

from trainers.logs import logger
from trainers.sampling.reward_functions import completion_text


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
