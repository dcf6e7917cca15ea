"""DistillationConfig: TRL 1.16's DistillationConfig options. The sampling base's options (generation, vLLM, tools:
trainers/sampling/config.py, the same names and meaning as TRL's) and distillation's own: the teacher, ``beta`` as
the divergence, ``lmbda``, and the served teacher's ``teacher_model_server_url``/``loss_top_k``/``loss_add_tail``
(named as TRL's experimental ServerDistillationConfig). No reward, advantage, loss or reference options: there are
none to take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.config.options import check_field, opt, reject_unknown_options
from trainers.sampling.config import SamplingConfig


@reject_unknown_options
@dataclass
class DistillationConfig(SamplingConfig):
    """On-policy distillation (Agarwal et al. 2024, arXiv:2306.13649): the student samples one completion per
    prompt, the teacher scores every position of it, and the loss is the per-token divergence between the two
    next-token distributions (``beta``: forward KL, reverse KL or the generalized JSD between), averaged over
    the step's completion tokens."""

    num_generations: int = opt(1, "Completions sampled per prompt, each scored by the teacher (TRL's distillation "
                               "samples one).", ge=1)
    beta: float = opt(
        1.0, "Which divergence: 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher), between "
        "them the generalized Jensen-Shannon divergence with the mixture (1 - beta) p_student + beta p_teacher "
        "(0.5: the JSD). Not a KL penalty: there is no reference model.", ge=0, le=1)
    temperature: float = opt(1.0, "Sampling temperature, and the temperature both models' logits are divided by in "
                             "the divergence.", gt=0)
    teacher_model_name_or_path: str | None = opt(
        None, "The teacher's folder or Hub id, when the trainer's teacher_model argument is not given.")
    teacher_model_revision: str | None = opt(None, "The teacher's revision (branch, tag or commit).")
    teacher_model_init_kwargs: dict[str, Any] | None = opt(
        None, "Keyword arguments for from_pretrained when the teacher is loaded from a name.")
    lmbda: float = opt(
        1.0, "The share of generation rounds that are on-policy (sampled by the student, GKD's lambda); the others "
        "train on the dataset's `completion` column (off-policy). 1.0: always on-policy, as TRL 1.16's trainer. "
        "Which rounds are off-policy is drawn from the seed and the round's index, the same on every process and "
        "after a resume.", ge=0, le=1)
    teacher_model_server_url: str | None = opt(
        None, "A teacher served by `trainers vllm-serve` at this URL (e.g. 'http://localhost:8001') instead of a "
        "local one: it returns its top loss_top_k log-probs at each completion position (docs/distillation.md).")
    loss_top_k: int = opt(
        1, "With teacher_model_server_url: how many of the teacher's most likely tokens the divergence is computed "
        "over (plus the sampled token and, with loss_add_tail, the rest of the vocabulary as one outcome). The "
        "vocabulary size gives the exact divergence.", ge=1)
    loss_add_tail: bool = opt(
        True, "With teacher_model_server_url: add the probability outside those tokens as one more outcome of both "
        "distributions (False: renormalize both over those tokens).")

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        url = self.teacher_model_server_url
        check_field(url is None or (url.startswith(("http://", "https://")) and url.split("://", 1)[1].strip("/")),
                    name, "teacher_model_server_url", url, "give the server's URL with its scheme and host, e.g. "
                    "'http://localhost:8001'")
        check_field(url is None or self.teacher_model_name_or_path is None, name, "teacher_model_server_url", url,
                    "give a served teacher or teacher_model_name_or_path, not both")
        # vLLM computes prompt log-probs from the raw logits (its sampling processors, temperature among them, do not
        # apply to them), so a served teacher's distribution is at temperature 1
        check_field(url is None or self.temperature == 1.0, name, "temperature", self.temperature,
                    "a served teacher's log-probs are at temperature 1 (vLLM applies no temperature to prompt "
                    "log-probs), so the divergence must be too: use temperature=1.0, or a local teacher")
