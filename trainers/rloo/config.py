"""RLOOConfig: TRL 1.16's RLOO options. Its generation, reward, reference and vLLM options are GRPO's (the same
names and meaning in TRL), so it is GRPOConfig with RLOO's two own options and defaults, without GRPO's loss and
advantage options (TRL's RLOOConfig has none of them: a value for one is refused)."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.grpo.config import GRPO_LOSS_OPTIONS, GRPOConfig
from trainers.options import check_field, opt, refuse_not_taken, reject_unknown_options

# GRPOConfig's options that TRL 1.16's RLOOConfig does not have: RLOO's loss, advantage and KL are its own
GRPO_ONLY = GRPO_LOSS_OPTIONS


@reject_unknown_options
@dataclass
class RLOOConfig(GRPOConfig):
    """REINFORCE Leave-One-Out (arXiv:2402.14740): each completion's advantage is its reward minus the mean reward
    of the other completions of its prompt; the KL to the reference is a penalty on the reward; the loss is PPO's
    clipped objective on whole completions."""

    documented_base = GRPOConfig  # the reference page lists what it adds to and changes of GRPOConfig
    not_taken = GRPO_ONLY

    num_generations: int = opt(2, "Completions sampled per prompt (the group size k); the baseline of each is the "
                               "mean reward of the other k - 1.", ge=2, note="the leave-one-out baseline needs two")
    beta: float = opt(
        0.05, "Weight of the KL penalty on the reward: reward - beta x the completion's sum over its tokens of "
        "log pi_old - log pi_ref (TRL's RLOO). 0 loads no reference model.", ge=0)
    vllm_importance_sampling_correction: bool = opt(
        False, "Not an RLOO option in TRL 1.16 (GRPO's): only False is accepted.")
    normalize_advantages: bool = opt(
        False, "Normalize the round's advantages to mean 0 and standard deviation 1 (over every process's scored "
        "completions).")
    reward_clip_range: tuple[float, float] | None = opt(
        None, "Clip each completion's weighted reward to (min, max) before the KL penalty. None: no clipping.")

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        refuse_not_taken(self, "(GRPO's; TRL's RLOOConfig has none): RLOO's advantage is the leave-one-out baseline "
                               "and its loss the clipped sequence ratio (docs/rloo.md). Use GRPOConfig for it.")
        clip = self.reward_clip_range
        if clip is not None:
            check_field(isinstance(clip, (tuple, list)) and len(clip) == 2 and float(clip[0]) <= float(clip[1]),
                        name, "reward_clip_range", clip, "give (min, max) with min <= max")
            self.reward_clip_range = (float(clip[0]), float(clip[1]))
