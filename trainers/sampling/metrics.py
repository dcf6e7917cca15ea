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
    shown = records[: num_to_print or len(records)]
    versions = any("version_spans" in r for r in shown)  # in-flight weight updates: which weights wrote which tokens
    lines = [f"{'reward':>7} {'adv':>6}" + (f" {'weights':>9}" if versions else "") + "  prompt -> completion"]
    for r in shown:
        prompt = completion_text(r["prompt"]) if not isinstance(r["prompt"], str) else r["prompt"]
        weights = f" {spans_text(r.get('version_spans') or []):>9}" if versions else ""
        lines.append(f"{r['reward']:7.3f} {r['advantage']:6.2f}{weights}  {prompt[-40:]!r} -> {r['completion'][:60]!r}")
    logger.info("completions at step %d:\n%s", step, "\n".join(lines))


def spans_text(spans: list[list]) -> str:
    """A completion's version spans in a few characters: "3" (all its tokens by step 3's weights), "3>4@5" (step
    4's from token 5 on)."""
    written: list[tuple[int, int]] = []
    for version, start, _ in spans:
        if version is not None and (not written or written[-1][0] != version):  # tool tokens between: no change
            written.append((version, start))
    if not written:
        return "-"
    return str(written[0][0]) + "".join(f">{version}@{start}" for version, start in written[1:])
