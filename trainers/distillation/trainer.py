"""DistillationTrainer: TRL 1.16's on-policy distillation, a sibling of GRPO on the sampling base. Everything that
samples (the lean engine, HF generate, vLLM colocated or as a server, a rollout_func, tools and environments) is the
sampling base's (trainers/sampling/trainer.py), with no reward functions (an environment's reward is logged) and no
advantages; what distillation adds is the loss (``compute_loss``: the per-token divergence from the teacher,
trainers/distillation/teacher.py) and, with ``lmbda`` < 1, rounds of the dataset's completions
(``off_policy_samples``: the stage builds them as it builds sampled ones). The trainer's arguments are TRL's DistillationTrainer's, in its order, then rollout_func and environment_factory."""

from __future__ import annotations

import random

import torch

from trainers.parallel import distributed as dist
from trainers.data.formats import chat_ids, is_conversational
from trainers.distillation.config import DistillationConfig
from trainers.distillation.teacher import (
    LocalTeacher,
    ServedTeacher,
    check_vocabularies,
    chunkable,
    student_divergence,
)
from trainers.errors import ConfigError, DatasetFormatError
from trainers.generation.sampling import Samples
from trainers.generation.vllm_client import VLLMClient
from trainers.model.losses import BatchCounts
from trainers.model.modeling import load_causal_lm
from trainers.model.output_head import plan_head
from trainers.sampling.batch import MicroBatch
from trainers.sampling.rollout import Sampled, decode
from trainers.sampling.trainer import SamplingTrainer
from trainers.loop.stats import Stats


class DistillationTrainer(SamplingTrainer):
    """Distills ``teacher_model`` (a folder, Hub id or model with the student's vocabulary; or
    ``args.teacher_model_name_or_path``, or a served teacher: ``args.teacher_model_server_url``) into ``model``
    on the student's own completions of ``train_dataset``'s prompts."""

    config_class = DistillationConfig
    _tag_names = ("trainers", "distillation")
    # no advantage estimator and no log-prob scorer (the sampling base's defaults): the teacher's distribution is
    # the signal, and the loss reads no log-probs of the round; an environment's reward is logged

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        self._teacher_source = teacher_model
        self.teacher_model: torch.nn.Module | None = None  # TRL's attribute: the prepared local teacher
        self.teacher: LocalTeacher | ServedTeacher | None = None
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers,
                         quantization_config, peft_config, tools=tools, rollout_func=rollout_func,
                         environment_factory=environment_factory, rewards_required=False)

    # ------------------------------------------------------------------ data and the teacher

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args = self.args
        source, url = self._teacher_source or args.teacher_model_name_or_path, args.teacher_model_server_url
        if source is None and url is None:
            raise ConfigError("DistillationTrainer needs a teacher: the teacher_model argument, "
                              "DistillationConfig.teacher_model_name_or_path, or a served teacher "
                              "(DistillationConfig.teacher_model_server_url).")
        if source is not None and url is not None:
            raise ConfigError("DistillationTrainer: give a local teacher (teacher_model / teacher_model_name_or_path) "
                              "or a served one (teacher_model_server_url), not both.")
        if args.teacher_model_init_kwargs and not isinstance(source, str):
            raise ConfigError("DistillationConfig.teacher_model_init_kwargs applies when the teacher is loaded from "
                              "a name; the teacher_model given is already built.")
        super().prepare_data(train_dataset, eval_dataset)
        if args.lmbda < 1.0:  # off-policy rounds train on the dataset's completions: every row needs one
            self._check_completions(self.train_rows, "train_dataset")

    def _check_completions(self, rows: list[dict] | None, name: str) -> None:
        for index, row in enumerate(rows or []):  # a stream's rows: checked as each round reads them
            if not isinstance(row.get("completion"), (str, list)):
                raise DatasetFormatError(
                    f"{name} row {index} has no 'completion' (a string, or a list of assistant messages): with "
                    f"lmbda={self.args.lmbda} < 1 some rounds train on the dataset's completions (off-policy). Add "
                    f"the column, or set lmbda=1.0 (on-policy only).")

    def after_load(self, model) -> None:
        super().after_load(model)
        args, source = self.args, self._teacher_source or self.args.teacher_model_name_or_path
        if source is None:  # a served teacher
            return
        kwargs = dict(args.teacher_model_init_kwargs or {})
        if isinstance(source, str) and args.teacher_model_revision is not None:
            kwargs.setdefault("revision", args.teacher_model_revision)
        self.teacher_model = load_causal_lm(source, kwargs if isinstance(source, str) else None,
                                            args.trust_remote_code)
        check_vocabularies(model, self.teacher_model)

    def after_prepare(self) -> None:
        super().after_prepare()
        args = self.args
        if self.teacher_model is not None:
            self.teacher_model = dist.prepare_frozen(self.accelerator, self.teacher_model)
            self.teacher = LocalTeacher(self.accelerator, self.teacher_model)
        else:
            client = VLLMClient(base_url=args.teacher_model_server_url, connection_timeout=args.vllm_server_timeout,
                                api_key=args.vllm_server_api_key)
            self.teacher = ServedTeacher(client, args.loss_top_k)
        # the chunked divergence where both heads are plain linear ones (a served teacher has none), else full logits
        self.student_head = plan_head(self.unwrapped_model)
        self.chunked = chunkable(self.student_head) and (isinstance(self.teacher, ServedTeacher)
                                                         or chunkable(self.teacher.plan))

    def off_policy_samples(self, rows: list[dict], prompt_ids: list[list[int]]) -> Sampled:
        """With ``lmbda`` < 1, the rounds drawn off-policy: the dataset's own completions of the round's prompts,
        which the rollout stage then treats as any other round's (padded, masked, logged)."""
        if self.prompt_sampler is None:  # a stream: its rows are checked as they are read
            self._check_completions(rows, "train_dataset")
        completions = [self._completion_ids(row, ids) for row, ids in zip(rows, prompt_ids)]
        prompts, texts = decode(self.processing_class, rows, completions)
        return Sampled(Samples(prompt_ids, completions), prompts, texts)

    def on_policy(self, round_index: int) -> bool:
        """Whether round ``round_index`` samples from the student: drawn with probability lmbda from the seed and
        the index alone (the same on every process, and after a resume)."""
        lmbda = self.args.lmbda
        return lmbda >= 1.0 or random.Random(f"{self.args.seed}/{round_index}").random() < lmbda

    def _completion_ids(self, row: dict, prompt_ids: list[int]) -> list[int]:
        """A dataset completion as the student would have written it after ``prompt_ids``: text and its EOS, or the
        assistant messages as the chat template renders them after the prompt; at most max_completion_length."""
        tokenizer, limit = self.processing_class, self.args.max_completion_length
        completion = row["completion"]
        if is_conversational(row["prompt"]):
            full = chat_ids(tokenizer, list(row["prompt"]) + list(completion), **(self.args.chat_template_kwargs or {}))
            if full[:len(prompt_ids)] != prompt_ids:
                raise DatasetFormatError("The chat template renders prompt + completion with a different start than "
                                         "the prompt alone, so the completion's tokens cannot be told apart.")
            ids = full[len(prompt_ids):]
        else:
            ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return ids[:limit]

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model, batch: MicroBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        """The divergence from the teacher at every loss token, summed and divided by the step's loss tokens (every
        micro-batch and process): TRL's normalization. The student's entropy as a statistic."""
        args = self.args
        keep = batch.loss_mask > 0  # [B, C]
        view = self.teacher.view(batch, keep, self.chunked)
        with self.accelerator.autocast():
            divergence, entropy = student_divergence(model, self.student_head if self.chunked else None, batch, keep,
                                                     view, args.beta, args.temperature, args.loss_add_tail)  # [N]
        loss = divergence.sum() / max(counts.tokens, 1.0)
        stats: Stats = {"entropy": (entropy.sum(), float(entropy.numel()))}
        return loss, stats
