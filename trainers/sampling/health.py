"""GRPO's health rules (trainers/loop/health.py has the monitor and the rule every trainer shares): pure functions of
a run's metrics history that return one plain-language warning, or None.

Metrics read (names as GRPOTrainer logs them): ``frac_reward_zero_std``, ``reward``, ``entropy``,
``completions/clipped_ratio``, ``completions/mean_length``, ``completions/max_length``, ``kl``, and ``step`` to say
when. Runs without a KL term (beta=0) log no ``kl``, and its rule quietly gives None.
"""

from __future__ import annotations

from itertools import pairwise

from trainers.loop.health import Rule, at_step, mean_of, series

# How many of the latest records a "sustained" condition must hold over: one logged record is an average
# over logging_steps steps but can still be a fluke, three in a row is a trend worth interrupting someone for.
RECENT_RECORDS = 3

# (a) A group whose completions all got the same reward has advantage 0 and teaches nothing. Some such
# groups are normal (a solved or hopeless prompt); when most are, most of the compute is wasted.
ZERO_STD_FRACTION = 0.5

# (b) Entropy is the policy's mean per-token entropy (nats). Below ~0.05 nats sampling is nearly greedy, so the
# completions of a group are near copies; a fall to a tenth of the starting entropy is a collapse even when the
# starting value was small (a model that was already sharp).
ENTROPY_FLOOR = 0.05
ENTROPY_RELATIVE_FLOOR = 0.1

# (c) Truncated completions (no EOS before max_completion_length) are judged cut off; when they are the majority
# the reward mostly measures unfinished answers.
CLIPPED_RATIO = 0.5

# (d) Length explosion: the mean completion length grew past 3x its early value AND sits near the longest
# completion seen (most completions run to the limit), the signature of a policy learning "longer is better".
LENGTH_GROWTH = 3.0
NEAR_MAX_FRACTION = 0.8
EARLY_RECORDS = 3  # "early value": mean over the first few records, so one odd first batch does not decide it

# (e) KL to the reference (k3 estimator, nats per token). Healthy GRPO runs with beta > 0 sit around 0.001-0.1;
# KL that rose in (almost) every one of the last few logs and passed 0.5 is drifting away without bound.
KL_RECORDS = 5
KL_ALLOWED_DIPS = 1  # "monotone-ish": one logged dip (noise) among the increases is still growth
KL_LARGE = 0.5


def zero_reward_variance(history: list[dict]) -> str | None:
    """(a) Most groups got the same reward for every completion over the last few logs."""
    points = series(history, "frac_reward_zero_std")[-RECENT_RECORDS:]
    if len(points) < RECENT_RECORDS:
        return None
    fraction = mean_of([v for _, v in points])
    if fraction <= ZERO_STD_FRACTION:
        return None
    rewards = series(history, "reward")[-RECENT_RECORDS:]
    reward = f" (mean reward {mean_of([v for _, v in rewards]):.3g})" if rewards else ""
    return (f"{fraction:.0%} of prompt groups had zero reward variance over the last {len(points)} logs (up to "
            f"{at_step(points[-1][0])}){reward}: every completion of such a prompt got the same reward, so its "
            f"advantage is 0 and it teaches nothing. Try: raise temperature or num_generations for more varied "
            f"completions; use prompts of mixed difficulty (harder ones if most rewards are at the maximum, easier "
            f"ones if most are at the minimum); or a reward that gives partial credit.")


def entropy_collapse(history: list[dict]) -> str | None:
    """(b) The policy's token entropy fell below a small absolute level or a tenth of its first value."""
    points = series(history, "entropy")
    if len(points) < 2:
        return None
    first, (step, latest) = points[0][1], points[-1]
    if latest >= ENTROPY_FLOOR and latest >= ENTROPY_RELATIVE_FLOOR * first:
        return None
    return (f"entropy collapsed: {latest:.3g} nats/token at {at_step(step)}, from {first:.3g} at the start. The policy "
            f"is close to deterministic, so the completions of a group are near copies and exploration stops. "
            f"Try: raise temperature, lower learning_rate, raise beta (KL penalty to the reference), or set "
            f"epsilon_high above epsilon (clip-higher) to let unlikely tokens grow.")


def truncated_completions(history: list[dict]) -> str | None:
    """(c) Most completions hit max_completion_length without an EOS."""
    points = series(history, "completions/clipped_ratio")[-RECENT_RECORDS:]
    if len(points) < RECENT_RECORDS:
        return None
    ratio = mean_of([v for _, v in points])
    if ratio <= CLIPPED_RATIO:
        return None
    return (f"{ratio:.0%} of completions were truncated (no EOS before max_completion_length) over the last "
            f"{len(points)} logs (up to {at_step(points[-1][0])}), so rewards mostly judge unfinished answers. Try: "
            f"raise max_completion_length, set mask_truncated_completions=True to leave them out of the loss, or "
            f"add the 'overlong' reward to penalise running long.")


def length_explosion(history: list[dict]) -> str | None:
    """(d) The mean completion length grew past LENGTH_GROWTH x its early value and is near the longest seen."""
    points = series(history, "completions/mean_length")
    if len(points) <= EARLY_RECORDS:
        return None
    early = mean_of([v for _, v in points[:EARLY_RECORDS]])
    step, latest = points[-1]
    if early <= 0 or latest <= LENGTH_GROWTH * early:
        return None
    longest = [v for _, v in series(history, "completions/max_length")]
    if longest and latest < NEAR_MAX_FRACTION * max(longest):
        return None  # long on average, but far from the limit: growth the task may need
    return (f"completion length exploded: mean {latest:.4g} tokens at {at_step(step)}, {latest / early:.1f}x its early "
            f"{early:.4g}, and most completions run to the limit. The policy may be learning that longer is better "
            f"(or looping). Try: add the 'overlong' reward (a length penalty), loss_type='dr_grpo' (no length bias), "
            f"lower learning_rate; raise max_completion_length only if answers really need the room.")


def kl_growth(history: list[dict]) -> str | None:
    """(e) KL to the reference rose in (almost) every one of the last KL_RECORDS logs and is large."""
    points = series(history, "kl")[-KL_RECORDS:]
    if len(points) < KL_RECORDS:
        return None
    values = [v for _, v in points]
    rises = sum(b > a for a, b in pairwise(values))
    if rises < len(values) - 1 - KL_ALLOWED_DIPS or values[-1] <= KL_LARGE or values[-1] <= values[0]:
        return None
    return (f"KL to the reference keeps growing: {values[0]:.3g} -> {values[-1]:.3g} nats/token over the last "
            f"{len(values)} logs (up to {at_step(points[-1][0])}); the policy drifts further from the reference every "
            f"step, which often means reward hacking. Try: raise beta, lower learning_rate, and read "
            f"completions.jsonl (log_completions=True) for degenerate high-reward answers.")


RULES: tuple[Rule, ...] = (zero_reward_variance, entropy_collapse, truncated_completions, length_explosion, kl_growth)
