"""DPO's losses: every ``loss_type`` TRL 1.16 accepts, as a pure function of the pairs' log-probs behind one
registry (``DPO_LOSSES``) and one signature, and the f-divergence scores they are built on.

A loss maps ``PairScores`` (a micro-batch of B pairs) and ``LossOptions`` to a per-pair loss [B]; the trainer
averages it over the step's pairs and weights the loss types with ``loss_weights``
(``combined_loss``). Formulas follow TRL 1.16's ``DPOTrainer._compute_loss`` (docs/dpo.md lists each with its
paper); ``tests/unit/test_dpo_losses.py`` pins them to hand-computed values and to TRL's on fixed tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairScores:
    """A micro-batch of B preference pairs. The log-probs are sums over each completion's tokens (with ld_alpha,
    the tokens past the shorter completion weighted by it)."""

    chosen: torch.Tensor  # [B] log pi(chosen | prompt), with gradient
    rejected: torch.Tensor  # [B] log pi(rejected | prompt)
    ref_chosen: torch.Tensor  # [B] the reference's, no gradient
    ref_rejected: torch.Tensor  # [B]
    chosen_tokens: torch.Tensor  # [B] float: completion tokens (ipo, sigmoid_norm normalize by them)
    rejected_tokens: torch.Tensor  # [B]
    chosen_token_logps: torch.Tensor  # [B, T] per-token log pi of the chosen completions (sft)
    chosen_mask: torch.Tensor  # [B, T] float: 1 on chosen completion tokens
    # sft's token mean is over a set of pairs: their count per chosen token. None: this micro-batch's, as TRL;
    # the trainer gives the whole step's (every micro-batch and process), so the split does not change it
    sft_scale: torch.Tensor | float | None = None

    @property
    def chosen_logratios(self) -> torch.Tensor:  # [B]
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> torch.Tensor:  # [B]
        return self.rejected - self.ref_rejected


@dataclass(frozen=True)
class LossOptions:
    """The DPOConfig fields the losses read."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05

    @classmethod
    def from_config(cls, args) -> LossOptions:
        return cls(args.beta, args.label_smoothing, args.f_divergence_type, args.f_alpha_divergence_coef,
                   args.discopop_tau)


# ----------------------------------------------------------------------------------------------------------------
# f-divergences (arXiv:2309.16240): the score f'(pi/pi_ref) each log-ratio is turned into before the difference
# ----------------------------------------------------------------------------------------------------------------


def divergence_scores(logratios: torch.Tensor, options: LossOptions) -> torch.Tensor:
    """The f-divergence score of each log-ratio log(pi / pi_ref): [B] -> [B]."""
    kind = options.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    # alpha_divergence; as TRL: computed in float32, the exponent clamped so exp cannot overflow
    alpha = options.f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    limit = 11.0 if logratios.dtype == torch.float16 else 80.0
    exponent = ((alpha - 1) * logratios.float()).clamp(max=limit)
    return (torch.exp(exponent) - 1).to(logratios.dtype) / (alpha - 1)


def score_margin(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """f(chosen log-ratio) - f(rejected log-ratio): [B]. With reverse_kl, DPO's implicit reward margin / beta."""
    return divergence_scores(pairs.chosen_logratios, options) - divergence_scores(pairs.rejected_logratios, options)


# ----------------------------------------------------------------------------------------------------------------
# The losses: PairScores, LossOptions -> [B]
# ----------------------------------------------------------------------------------------------------------------


def sigmoid_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """DPO (arXiv:2305.18290): -log sigmoid(beta x margin)."""
    return -F.logsigmoid(options.beta * score_margin(pairs, options))


def hinge_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """SLiC (arXiv:2305.10425): relu(1 - beta x margin)."""
    return torch.relu(1 - options.beta * score_margin(pairs, options))


def _length_normalized_margin(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """f(chosen log-ratio) / chosen tokens - f(rejected log-ratio) / rejected tokens: [B]."""
    chosen = divergence_scores(pairs.chosen_logratios, options) / pairs.chosen_tokens.clamp(min=1)
    rejected = divergence_scores(pairs.rejected_logratios, options) / pairs.rejected_tokens.clamp(min=1)
    return chosen - rejected


def ipo_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """IPO (arXiv:2310.12036), on length-normalized log-ratios as TRL: (margin - 1 / (2 beta))^2."""
    return (_length_normalized_margin(pairs, options) - 1 / (2 * options.beta)) ** 2


def sigmoid_norm_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """DPO on length-normalized log-ratios: -log sigmoid(beta x normalized margin)."""
    return -F.logsigmoid(options.beta * _length_normalized_margin(pairs, options))


def exo_pair_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """EXO (arXiv:2402.00856), label_smoothing > 0: the reverse KL between the model's and the smoothed labels'
    pair distributions."""
    z, eps = options.beta * score_margin(pairs, options), options.label_smoothing
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log(1 - eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))


def robust_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """Robust DPO (arXiv:2403.00409): unbiased under label flips with probability label_smoothing."""
    z, eps = options.beta * score_margin(pairs, options), options.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def nca_pair_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """NCA (arXiv:2402.05369), on the raw log-ratios."""
    chosen, rejected = options.beta * pairs.chosen_logratios, options.beta * pairs.rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def bco_pair_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """BCO on pairs (arXiv:2404.04656), as TRL 1.16: without the running mean of the rewards."""
    chosen, rejected = options.beta * pairs.chosen_logratios, options.beta * pairs.rejected_logratios
    return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)


def sppo_hard_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """SPPO with hard labels (arXiv:2405.00675): each log-ratio pulled to +-1 / (2 beta)."""
    half = 0.5 / options.beta
    return (pairs.chosen_logratios - half) ** 2 + (pairs.rejected_logratios + half) ** 2


def _aot(difference: torch.Tensor, options: LossOptions) -> torch.Tensor:
    z, eps = options.beta * difference, options.label_smoothing
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps


def aot_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """AOT on pairs (arXiv:2406.05882): the micro-batch's sorted policy margins against its sorted reference
    margins (so a pair's loss depends on the others in its micro-batch)."""
    policy, _ = torch.sort(pairs.chosen - pairs.rejected, dim=0)
    reference, _ = torch.sort(pairs.ref_chosen - pairs.ref_rejected, dim=0)
    return _aot(policy - reference, options)


def aot_unpaired_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """AOT unpaired: the sorted chosen log-ratios against the sorted rejected ones."""
    chosen, _ = torch.sort(pairs.chosen_logratios, dim=0)
    rejected, _ = torch.sort(pairs.rejected_logratios, dim=0)
    return _aot(chosen - rejected, options)


def apo_zero_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """APO-zero (arXiv:2408.06266): chosen pushed up, rejected down; for chosen outputs better than the model's."""
    chosen, rejected = options.beta * pairs.chosen_logratios, options.beta * pairs.rejected_logratios
    return (1 - torch.sigmoid(chosen)) + torch.sigmoid(rejected)


def apo_down_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """APO-down: both pushed down, rejected more; for chosen outputs worse than the model's."""
    chosen, rejected = options.beta * pairs.chosen_logratios, options.beta * pairs.rejected_logratios
    return torch.sigmoid(chosen) + (1 - torch.sigmoid(chosen - rejected))


def discopop_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """DiscoPOP (arXiv:2406.08414): a log-ratio-modulated mix of the logistic and exponential losses."""
    z = options.beta * score_margin(pairs, options)
    mix = torch.sigmoid(z / options.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def sft_loss(pairs: PairScores, options: LossOptions) -> torch.Tensor:
    """The NLL of the chosen completions (RPO's term, arXiv:2404.19733), a token mean: each pair's NLL sum times
    ``sft_scale`` (pairs per chosen token), so the mean over pairs is the mean over tokens. With the default
    scale, TRL's: the micro-batch's chosen-token mean."""
    mask = pairs.chosen_mask  # [B, T]
    scale = pairs.sft_scale if pairs.sft_scale is not None else mask.shape[0] / mask.sum().clamp(min=1)
    return -(pairs.chosen_token_logps * mask).sum(-1) * scale


DPO_LOSSES: dict[str, Callable[[PairScores, LossOptions], torch.Tensor]] = {
    "sigmoid": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "robust": robust_loss,
    "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_unpaired": aot_unpaired_loss,
    "apo_zero": apo_zero_loss,
    "apo_down": apo_down_loss,
    "discopop": discopop_loss,
    "sft": sft_loss,
    "sigmoid_norm": sigmoid_norm_loss,
}
# the losses an f-divergence other than reverse_kl may change (the others use the raw log-ratios), as TRL's check
F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})


def combined_loss(pairs: PairScores, options: LossOptions, loss_types: list[str], loss_weights: list[float],
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i weight_i x loss_type_i, per pair: [B]. ``weights``: WPO's per-pair weights (use_weighting), applied to
    every term, as TRL."""
    total = torch.zeros_like(pairs.chosen)
    for loss_type, weight in zip(loss_types, loss_weights, strict=True):
        per_pair = DPO_LOSSES[loss_type](pairs, options)
        if weights is not None:
            per_pair = per_pair * weights
        total = total + weight * per_pair
    return total
