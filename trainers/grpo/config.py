"""GRPOConfig: generation, rewards, advantages and the policy loss."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from trainers.configs import TrainingConfig, check_field, opt, reject_unknown_options

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")



SCALE_REWARDS = ("group", "batch", "none")



MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")



IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")



IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")



GENERATION_ENGINES = ("auto", "lean", "hf")



@reject_unknown_options
@dataclass
class GRPOConfig(TrainingConfig):
    """Group Relative Policy Optimization: generation, rewards, advantages and the clipped policy loss."""

    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW.")
    remove_unused_columns: bool = opt(False, "Accepted for TRL compatibility; every dataset column reaches the reward functions.")
    num_generations: int = opt(8, "Completions sampled per prompt (the group size G); at least 2.")
    num_generations_eval: int | None = opt(None, "Completions sampled per eval prompt (default: num_generations).")
    max_completion_length: int = opt(512, "Maximum tokens generated per completion.")
    generation_batch_size: int | None = opt(
        None, "Completions generated per round over all processes. Default: per_device_train_batch_size x "
        "processes x steps_per_generation."
    )
    steps_per_generation: int | None = opt(
        None, "Micro-steps served by one generation round. Default: gradient_accumulation_steps."
    )
    num_iterations: int = opt(1, "Passes over each generation round (mu); > 1 reuses rollouts with old log-probs.")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest token set with this probability mass.")
    top_k: int | None = opt(0, "Keep only the k most likely tokens when sampling; 0 disables.")
    min_p: float | None = opt(None, "Drop tokens whose probability is below min_p x the top token's.")
    repetition_penalty: float = opt(1.0, "Penalty on tokens already in the prompt or completion (1.0: none).")
    generation_kwargs: dict | None = opt(None, "Extra keyword arguments for the generation call.")
    chat_template_kwargs: dict | None = opt(None, "Extra keyword arguments for apply_chat_template on prompts.")
    beta: float = opt(0.0, "Weight of the k3 KL penalty to the frozen reference model; 0 loads no reference model.")
    use_bias_correction_kl: bool = opt(
        True, "Multiply the per-token KL by the importance ratio (differentiable), which makes its gradient the "
        "unbiased reverse-KL gradient (DeepSeek-V3.2), as TRL does by default; False uses the plain k3 term."
    )
    sync_ref_model: bool = opt(
        False, "Move the reference model toward the policy every ref_model_sync_steps steps (TR-DPO, "
        "arXiv:2404.09656): ref = (1 - ref_model_mixup_alpha) x ref + ref_model_mixup_alpha x policy. Needs beta > 0 "
        "and a full (not PEFT) model."
    )
    ref_model_mixup_alpha: float = opt(0.6, "sync_ref_model: the policy's share in each update of the reference.")
    ref_model_sync_steps: int = opt(512, "sync_ref_model: update the reference after every this many steps.")
    epsilon: float = opt(0.2, "Lower clipping range of the importance ratio: 1 - epsilon.")
    epsilon_high: float | None = opt(
        None, "Upper clipping range: 1 + epsilon_high (DAPO clip-higher). Default: epsilon. With loss_type='cispo' "
        "it is the largest importance weight, ε_max (5.0 recommended)."
    )
    delta: float | None = opt(None, "Also clip the ratio from above at delta for negative advantages (two-sided GRPO).")
    importance_sampling_level: str = opt(
        "token", f"Importance ratio per 'token' (GRPO) or per 'sequence' (GSPO); one of {IMPORTANCE_SAMPLING_LEVELS}."
    )
    loss_type: str = opt(
        "dapo", f"The policy loss and how token losses are averaged: one of {GRPO_LOSS_TYPES} (docs/grpo.md)."
    )
    sapo_temperature_pos: float = opt(1.0, "loss_type='sapo': gate temperature for tokens with a positive advantage.")
    sapo_temperature_neg: float = opt(
        1.05, "loss_type='sapo': gate temperature for tokens with a zero or negative advantage."
    )
    vespo_k_pos: float = opt(2.0, "loss_type='vespo': power k of the Gamma weight where the advantage is >= 0.")
    vespo_lambda_pos: float = opt(3.0, "loss_type='vespo': decay lambda of the Gamma weight where the advantage is >= 0.")
    vespo_k_neg: float = opt(3.0, "loss_type='vespo': power k of the Gamma weight where the advantage is < 0.")
    vespo_lambda_neg: float = opt(2.0, "loss_type='vespo': decay lambda of the Gamma weight where the advantage is < 0.")
    top_entropy_quantile: float = opt(
        1.0, "Keep in the policy loss only the top-rho fraction of completion tokens by entropy (arXiv:2506.01939; "
        "the paper uses 0.2): the cut is the (1 - rho) quantile over every process's tokens of the micro-batch. "
        "1.0 keeps all; 0.0 only the highest-entropy token."
    )
    off_policy_mask_threshold: float | None = opt(
        None, "DeepSeek-V3.2's off-policy sequence mask: drop from the policy loss a completion with a negative "
        "advantage whose mean log pi_old - log pi exceeds this (e.g. 0.5). None disables."
    )
    entropy_coef: float = opt(
        0.0, "Entropy bonus: the loss subtracts entropy_coef x the mean entropy of each micro-batch's loss tokens "
        "(whatever loss_type), so that the policy keeps exploring. 0 disables; with use_adaptive_entropy, the "
        "starting value."
    )
    use_adaptive_entropy: bool = opt(
        False, "Adapt entropy_coef after every step (Skywork-OR1): up by entropy_coef_delta when the step's entropy "
        "was at or below entropy_target, down otherwise; the bonus applies only while entropy is at or below it."
    )
    entropy_coef_min: float = opt(0.0, "use_adaptive_entropy: the lowest entropy_coef.")
    entropy_coef_max: float = opt(1.0, "use_adaptive_entropy: the highest entropy_coef.")
    entropy_coef_delta: float = opt(0.005, "use_adaptive_entropy: how far entropy_coef moves per step.")
    entropy_target: float = opt(0.2, "use_adaptive_entropy: the entropy (nats per token) to hold.")
    scale_rewards: str = opt(
        "group", f"Divide advantages by the reward std of the 'group', the whole 'batch', or 'none'; one of {SCALE_REWARDS}."
    )
    multi_objective_aggregation: str = opt(
        "sum_then_normalize", "How several reward functions become one advantage: 'sum_then_normalize' (the "
        "weighted sum, then scale_rewards) or 'normalize_then_sum' (GDPO: each function normalized within its "
        "group, then the weighted sum normalized over the batch; scale_rewards is not used)."
    )
    reward_weights: list[float] | None = opt(None, "Weight of each reward function in the sum (default: all 1).")
    mask_truncated_completions: bool = opt(False, "Exclude completions that hit max_completion_length from the loss.")
    dynamic_sampling: bool = opt(
        False, "Drop groups whose rewards are all equal (zero advantage) from the loss, and log how many."
    )
    disable_dropout: bool = opt(False, "Set every dropout probability in the policy to 0.")
    skip_zero_gradient_rows: bool = opt(
        True, "Leave out of the backward the completions whose loss gradient is zero by construction: those "
        "without loss tokens (dynamic_sampling's dropped groups, mask_truncated_completions) are not forwarded "
        "at all, and, with beta=0 and no entropy bonus, those with advantage 0 (a group whose rewards are all "
        "equal) are forwarded without gradients, for the logged entropy. Same loss, gradients and metrics. Off "
        "under ZeRO-3 and FSDP (their forwards are collective) and with an MoE router loss. False trains every "
        "completion, as TRL does."
    )
    generation_engine: str = opt(
        "auto", f"How completions are sampled: one of {GENERATION_ENGINES}. 'lean' is this project's engine for "
        "Llama/Mistral/Qwen2/Qwen3 models (static KV cache, shared prompt prefill); 'hf' is transformers' generate; "
        "'auto' uses 'lean' where it applies."
    )
    ds3_gather_for_generation: bool = opt(
        True, "Under ZeRO-3, gather the full weights once for generation (fast); False generates layer by layer "
        "(slow, but never holds the whole model)."
    )
    log_completions: bool = opt(False, "Print a table of sampled completions at each logging step and append them to completions.jsonl.")
    num_completions_to_print: int | None = opt(None, "Rows of that table (default: all of one round).")
    use_vllm: bool = opt(False, "Not supported: generation uses the policy itself.")
    vllm_importance_sampling_correction: bool = opt(
        True, "When a rollout_func returns its sampler's logprobs, weight the loss by the importance ratio "
        "pi_old / pi_sampler (the trainer's log-probs against the sampler's, computed once per round), which "
        "corrects for another engine's numerics or a stale sampler; vllm_importance_sampling_mode says how. TRL "
        "applies it with use_vllm; here a rollout_func is the only other sampler. False: no correction."
    )
    vllm_importance_sampling_mode: str = opt(
        "sequence_mask", f"One of {IS_CORRECTION_MODES}: the ratio per 'token_*' or per completion ('sequence_*', "
        "the product over its model tokens); '*_truncate' clips it to [clip_min, clip_max], '*_mask' sets it "
        "to 0 outside (the token or completion leaves the loss)."
    )
    vllm_importance_sampling_clip_max: float | None = opt(
        3.0, "Upper bound C_max of that ratio (None: no upper bound)."
    )
    vllm_importance_sampling_clip_min: float | None = opt(
        None, "Lower bound C_min of that ratio (None: no lower bound)."
    )
    vllm_importance_sampling_cap: float | None = opt(
        None, "Deprecated in TRL: sets vllm_importance_sampling_clip_max (with a FutureWarning)."
    )

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL accepts booleans: True -> "group", False -> "none".
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()
        name = type(self).__name__
        check_field(self.metric_for_best_model not in ("loss", "eval_loss"), name, "metric_for_best_model",
               self.metric_for_best_model, "GRPO evaluation measures rewards, not a loss: give 'reward' or "
               "'rewards/<function>/mean' (load_best_model_at_end defaults it to 'loss')")
        check_field(isinstance(self.num_generations, int) and self.num_generations >= 2, name, "num_generations",
               self.num_generations, "GRPO compares completions within a group, so it needs at least 2")
        check_field(self.num_generations_eval is None or (isinstance(self.num_generations_eval, int)
                                                      and self.num_generations_eval >= 1),
               name, "num_generations_eval", self.num_generations_eval, "it must be a positive integer or None")
        check_field(isinstance(self.max_completion_length, int) and self.max_completion_length > 0, name,
               "max_completion_length", self.max_completion_length, "it must be a positive integer")
        check_field(isinstance(self.num_iterations, int) and self.num_iterations > 0, name, "num_iterations",
               self.num_iterations, "it must be a positive integer")
        check_field(self.temperature > 0, name, "temperature", self.temperature, "it must be > 0")
        check_field(0 < self.top_p <= 1, name, "top_p", self.top_p, "it must be in (0, 1]")
        check_field(self.top_k is None or self.top_k >= 0, name, "top_k", self.top_k, "it must be >= 0 (0 disables)")
        check_field(self.beta >= 0, name, "beta", self.beta, "it must be >= 0")
        check_field(not self.sync_ref_model or self.beta > 0, name, "sync_ref_model", self.sync_ref_model,
               "with beta=0 there is no reference model to synchronize: set beta > 0, or leave it False")
        check_field(0 <= self.ref_model_mixup_alpha <= 1, name, "ref_model_mixup_alpha", self.ref_model_mixup_alpha,
               "it must be in [0, 1]")
        check_field(isinstance(self.ref_model_sync_steps, int) and self.ref_model_sync_steps > 0, name,
               "ref_model_sync_steps", self.ref_model_sync_steps, "it must be a positive integer")
        check_field(self.epsilon > 0, name, "epsilon", self.epsilon, "it must be > 0")
        check_field(self.epsilon_high is None or self.epsilon_high > 0, name, "epsilon_high", self.epsilon_high,
               "it must be > 0")
        check_field(self.delta is None or self.delta > 1, name, "delta", self.delta, "it must be > 1")
        check_field(self.loss_type in GRPO_LOSS_TYPES, name, "loss_type", self.loss_type, f"valid: {GRPO_LOSS_TYPES}")
        for f in ("sapo_temperature_pos", "sapo_temperature_neg"):
            check_field(getattr(self, f) > 0, name, f, getattr(self, f), "it must be > 0")
        for f in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_field(0 <= getattr(self, f) < math.inf, name, f, getattr(self, f), "it must be a finite number >= 0")
        check_field(0 <= self.top_entropy_quantile <= 1, name, "top_entropy_quantile", self.top_entropy_quantile,
               "it must be in [0, 1] (1 keeps every token)")
        check_field(self.off_policy_mask_threshold is None or (self.off_policy_mask_threshold >= 0
                                                          and math.isfinite(self.off_policy_mask_threshold)),
               name, "off_policy_mask_threshold", self.off_policy_mask_threshold, "it must be a number >= 0, or None")
        for f in ("entropy_coef", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
            check_field(math.isfinite(getattr(self, f)), name, f, getattr(self, f), "it must be a finite number")
        check_field(self.entropy_coef_min <= self.entropy_coef_max, name, "entropy_coef_min", self.entropy_coef_min,
               f"it must be <= entropy_coef_max ({self.entropy_coef_max})")
        check_field(self.entropy_coef_delta >= 0 and self.entropy_target >= 0, name, "entropy_coef_delta",
               self.entropy_coef_delta, f"it and entropy_target ({self.entropy_target}) must be >= 0")
        check_field(self.scale_rewards in SCALE_REWARDS, name, "scale_rewards", self.scale_rewards,
               f"valid: {SCALE_REWARDS}")
        check_field(self.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS, name, "multi_objective_aggregation",
               self.multi_objective_aggregation, f"valid: {MULTI_OBJECTIVE_AGGREGATIONS}")
        check_field(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, name, "importance_sampling_level",
               self.importance_sampling_level, f"valid: {IMPORTANCE_SAMPLING_LEVELS}")
        check_field(self.generation_engine in GENERATION_ENGINES, name, "generation_engine", self.generation_engine,
               f"valid: {GENERATION_ENGINES}")
        check_field(not self.use_vllm, name, "use_vllm", self.use_vllm,
               "vLLM generation is not supported yet; completions come from the policy itself")
        for f in ("generation_batch_size", "steps_per_generation", "num_completions_to_print"):
            value = getattr(self, f)
            check_field(value is None or (isinstance(value, int) and value > 0), name, f, value,
                   "it must be a positive integer or None")
        check_field(self.generation_batch_size is None or self.steps_per_generation is None, name,
               "steps_per_generation", self.steps_per_generation,
               "set generation_batch_size or steps_per_generation, not both")
        check_field(self.vllm_importance_sampling_mode in IS_CORRECTION_MODES, name, "vllm_importance_sampling_mode",
               self.vllm_importance_sampling_mode, f"valid: {IS_CORRECTION_MODES}")
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
            warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL); use "
                          "vllm_importance_sampling_clip_max instead.", FutureWarning, stacklevel=3)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        for f in ("vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"):
            value = getattr(self, f)
            check_field(value is None or (value >= 0 and math.isfinite(value)), name, f, value,
                   "it must be a finite number >= 0, or None")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        check_field(low is None or high is None or low < high, name, "vllm_importance_sampling_clip_min", low,
               f"it must be less than vllm_importance_sampling_clip_max ({high})")
        # Divisibility of the batch sizes by num_generations needs the process count: checked by the trainer.

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
