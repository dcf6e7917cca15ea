"""GRPOConfig: the sampling base's and the policy gradient's options (trainers/sampling/config.py), and GRPO's own:
its policy losses, how rewards become advantages, the entropy bonus and the correction for another sampler."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from trainers.config.options import check_field, opt, reject_unknown_options
from trainers.sampling.config import PolicyGradientConfig
from trainers.sampling.scoring import ImportanceCorrection

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@reject_unknown_options
@dataclass
class GRPOConfig(PolicyGradientConfig):
    """Group Relative Policy Optimization: generation, rewards, advantages and the clipped policy loss."""

    num_generations: int = opt(8, "Completions sampled per prompt (the group size G).", ge=2,
                               note="GRPO compares completions within a group")
    use_bias_correction_kl: bool = opt(
        True, "Multiply the per-token KL by the importance ratio (differentiable), which makes its gradient the "
        "unbiased reverse-KL gradient (DeepSeek-V3.2), as TRL does by default; False uses the plain k3 term."
    )
    delta: float | None = opt(
        None, "Also clip the ratio from above at delta for negative advantages (two-sided GRPO).", gt=1)
    importance_sampling_level: str = opt(
        "token", "Importance ratio per 'token' (GRPO) or per 'sequence' (GSPO).", choices=IMPORTANCE_SAMPLING_LEVELS
    )
    loss_type: str = opt(
        "dapo", "The policy loss and how token losses are averaged (docs/grpo.md).", choices=GRPO_LOSS_TYPES
    )
    sapo_temperature_pos: float = opt(
        1.0, "loss_type='sapo': gate temperature for tokens with a positive advantage.", gt=0)
    sapo_temperature_neg: float = opt(
        1.05, "loss_type='sapo': gate temperature for tokens with a zero or negative advantage.", gt=0
    )
    vespo_k_pos: float = opt(
        2.0, "loss_type='vespo': power k of the Gamma weight where the advantage is >= 0.", ge=0, finite=True)
    vespo_lambda_pos: float = opt(
        3.0, "loss_type='vespo': decay lambda of the Gamma weight where the advantage is >= 0.", ge=0, finite=True)
    vespo_k_neg: float = opt(
        3.0, "loss_type='vespo': power k of the Gamma weight where the advantage is < 0.", ge=0, finite=True)
    vespo_lambda_neg: float = opt(
        2.0, "loss_type='vespo': decay lambda of the Gamma weight where the advantage is < 0.", ge=0, finite=True)
    top_entropy_quantile: float = opt(
        1.0, "Keep in the policy loss only the top-rho fraction of completion tokens by entropy (arXiv:2506.01939; "
        "the paper uses 0.2): the cut is the (1 - rho) quantile over every process's tokens of the micro-batch. "
        "1.0 keeps all; 0.0 only the highest-entropy token.", ge=0, le=1
    )
    off_policy_mask_threshold: float | None = opt(
        None, "DeepSeek-V3.2's off-policy sequence mask: drop from the policy loss a completion with a negative "
        "advantage whose mean log pi_old - log pi exceeds this (e.g. 0.5). None disables.", ge=0, finite=True
    )
    # Entropy bonus
    entropy_coef: float = opt(
        0.0, "Entropy bonus: the loss subtracts entropy_coef x the mean entropy of each micro-batch's loss tokens "
        "(whatever loss_type), so that the policy keeps exploring. 0 disables; with use_adaptive_entropy, the "
        "starting value.", finite=True
    )
    use_adaptive_entropy: bool = opt(
        False, "Adapt entropy_coef after every step (Skywork-OR1): up by entropy_coef_delta when the step's entropy "
        "was at or below entropy_target, down otherwise; the bonus applies only while entropy is at or below it."
    )
    entropy_coef_min: float = opt(
        0.0, "use_adaptive_entropy: the lowest entropy_coef (at most entropy_coef_max).", finite=True)
    entropy_coef_max: float = opt(1.0, "use_adaptive_entropy: the highest entropy_coef.", finite=True)
    entropy_coef_delta: float = opt(
        0.005, "use_adaptive_entropy: how far entropy_coef moves per step.", ge=0, finite=True)
    entropy_target: float = opt(
        0.2, "use_adaptive_entropy: the entropy (nats per token) to hold.", ge=0, finite=True)
    # Rewards to advantages
    scale_rewards: str = opt(
        "group", "Divide advantages by the reward std of the 'group', the whole 'batch', or 'none'.",
        choices=SCALE_REWARDS, note="TRL's True means 'group', False 'none'"
    )
    multi_objective_aggregation: str = opt(
        "sum_then_normalize", "How several reward functions become one advantage: 'sum_then_normalize' (the "
        "weighted sum, then scale_rewards) or 'normalize_then_sum' (GDPO: each function normalized within its "
        "group, then the weighted sum normalized over the batch; scale_rewards is not used).",
        choices=MULTI_OBJECTIVE_AGGREGATIONS
    )
    # Correcting for another sampler (vLLM, a rollout_func, a registered backend), TRL's vllm_importance_sampling_*
    vllm_importance_sampling_correction: bool = opt(
        True, "When a sampler other than the policy itself (vLLM, a rollout_func, a registered generation backend) "
        "returns its log-probs, weight the loss by the importance ratio pi_old / pi_sampler (the trainer's "
        "log-probs against the sampler's, computed once per round), which corrects for another engine's numerics "
        "or a stale sampler; vllm_importance_sampling_mode says how (TRL applies it with use_vllm). False: no "
        "correction."
    )
    vllm_importance_sampling_mode: str = opt(
        "sequence_mask", "The ratio per 'token_*' or per completion ('sequence_*', the product over its model "
        "tokens); '*_truncate' clips it to [clip_min, clip_max], '*_mask' sets it to 0 outside (the token or "
        "completion leaves the loss).", choices=IS_CORRECTION_MODES
    )
    vllm_importance_sampling_clip_max: float | None = opt(
        3.0, "Upper bound C_max of that ratio (None: no upper bound).", ge=0, finite=True
    )
    vllm_importance_sampling_clip_min: float | None = opt(
        None, "Lower bound C_min of that ratio (None: no lower bound; less than clip_max).", ge=0, finite=True
    )
    vllm_importance_sampling_cap: float | None = opt(
        None, "Deprecated in TRL: sets vllm_importance_sampling_clip_max (with a FutureWarning).", ge=0, finite=True
    )


    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL accepts booleans: True -> "group", False -> "none".
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()  # also each field's own choices and bounds
        name = type(self).__name__
        check_field(self.entropy_coef_min <= self.entropy_coef_max, name, "entropy_coef_min", self.entropy_coef_min,
                    f"it must be <= entropy_coef_max ({self.entropy_coef_max})")
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
            warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL); use "
                          "vllm_importance_sampling_clip_max instead.", FutureWarning, stacklevel=3)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        check_field(low is None or high is None or low < high, name, "vllm_importance_sampling_clip_min", low,
                    f"it must be less than vllm_importance_sampling_clip_max ({high})")

    @property
    def importance_correction(self) -> ImportanceCorrection | None:
        """vllm_importance_sampling_*: how the round weighs completions of another sampler (None: it does not)."""
        if not self.vllm_importance_sampling_correction:
            return None
        return ImportanceCorrection(self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                                    self.vllm_importance_sampling_clip_max)
