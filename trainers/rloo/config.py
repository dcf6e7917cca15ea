"""RLOOConfig: TRL 1.16's RLOO options. The sampling base's and the policy gradient's options (generation, vLLM,
tools, rewards, the reference model, the clipped ratio: trainers/sampling/config.py, the same names and meaning as
TRL's), and RLOO's own: its defaults and the baseline's two options."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.config.options import check_field, opt, reject_unknown_options
from trainers.sampling.config import PolicyGradientConfig


@reject_unknown_options
@dataclass
class RLOOConfig(PolicyGradientConfig):
    """REINFORCE Leave-One-Out (arXiv:2402.14740): each completion's advantage is its reward minus the mean reward
    of the other completions of its prompt; the KL to the reference is a penalty on the reward; the loss is PPO's
    clipped objective on whole completions."""

    num_generations: int = opt(2, "Completions sampled per prompt (the group size k); the baseline of each is the "
                               "mean reward of the other k - 1.", ge=2, note="the leave-one-out baseline needs two")
    beta: float = opt(
        0.05, "Weight of the KL penalty on the reward: reward - beta x the completion's sum over its tokens of "
        "log pi_old - log pi_ref (TRL's RLOO). 0 loads no reference model.", ge=0)
    normalize_advantages: bool = opt(
        False, "Normalize the round's advantages to mean 0 and standard deviation 1 (over every process's scored "
        "completions).")
    reward_clip_range: tuple[float, float] | None = opt(
        None, "Clip each completion's weighted reward to (min, max) before the KL penalty. None: no clipping.")

    def __post_init__(self):
        super().__post_init__()
        clip = self.reward_clip_range
        if clip is not None:
            check_field(isinstance(clip, (tuple, list)) and len(clip) == 2 and float(clip[0]) <= float(clip[1]),
                        type(self).__name__, "reward_clip_range", clip, "give (min, max) with min <= max")
            self.reward_clip_range = (float(clip[0]), float(clip[1]))
