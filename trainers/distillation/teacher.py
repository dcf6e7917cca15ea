"""The teacher of on-policy distillation, and the student's forward against it.

    micro-batch -> the teacher's view of its loss positions     LocalTeacher.view / ServedTeacher.view
                   (a local model's last hidden states and head; a served one's top-k log-probs)
                -> the student's forward, its head swapped for     student_divergence
                   one that returns each position's divergence
                   from the teacher and its own entropy
                   (trainers/distillation/divergence.py, chunked)

The student's forward runs through its wrapper (DDP, DeepSpeed), so gradients sync and ZeRO-3 gathers its head
for the call, as in GRPO's chunked head (trainers/model/output_head.py). A local teacher is a frozen prepared model
(``dist.prepare_frozen``: partitioned like the student under ZeRO-3); its head's weight is gathered once per
micro-batch (a [V, H] copy while the micro-batch trains). Where either head is not a plain linear one (logits
scaled or soft-capped after it, a LoRA head), both models' full logits are used instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.parallel import distributed as dist
from trainers.model.cpu_attention import float32_attention_on_cpu
from trainers.distillation.divergence import (
    chunked_divergence,
    chunked_support_divergence,
    support_divergence,
    token_divergence,
)
from trainers.errors import ConfigError
from trainers.model.output_head import HeadPlan, plan_head, swapped_forward
from trainers.sampling.batch import MicroBatch


@dataclass(frozen=True)
class TeacherHidden:
    """A local teacher at a micro-batch's N loss positions: its last hidden states and its head."""

    hidden: torch.Tensor  # [N, H_t]
    weight: torch.Tensor  # [V, H_t]
    bias: torch.Tensor | None  # [V]


@dataclass(frozen=True)
class TeacherLogits:
    """A local teacher's logits at the N loss positions (a head the chunked path does not take)."""

    logits: torch.Tensor  # [N, V]


@dataclass(frozen=True)
class TeacherSupport:
    """A served teacher at the N loss positions: S tokens each with its log-probabilities (over its full
    vocabulary); ``valid`` marks the columns that count (a token listed twice counts once)."""

    ids: torch.Tensor  # [N, S] long
    logps: torch.Tensor  # [N, S] float32
    valid: torch.Tensor  # [N, S] bool


TeacherView = TeacherHidden | TeacherLogits | TeacherSupport


def forward_inputs(batch: MicroBatch) -> dict:
    """The model inputs of a micro-batch, keeping the completion's positions and one before them: the hidden
    state before each completion token predicts it."""
    input_ids, attention_mask, position_ids = batch.model_inputs()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "use_cache": False, "logits_to_keep": batch.completion_ids.shape[1] + 1}


def chunkable(plan: HeadPlan | None) -> bool:
    """Whether a model's head is one the chunked divergence computes: a plain linear one (no LoRA on it)."""
    return plan is not None and plan.lora is None


class LocalTeacher:
    """A teacher model on this process: ``model`` is the prepared one (a DeepSpeed engine under ZeRO-3)."""

    def __init__(self, accelerator, model: torch.nn.Module):
        self.accelerator, self.model = accelerator, model
        self.plan = plan_head(dist.unwrap(accelerator, model))

    @torch.no_grad()
    def view(self, batch: MicroBatch, keep: torch.Tensor, chunked: bool) -> TeacherView:
        """The teacher at the positions ``keep`` [B, C] (bool) of the micro-batch's completions."""
        inputs = forward_inputs(batch)
        with float32_attention_on_cpu(self.model, batch.completion_ids.device):
            if not chunked:
                logits = self.model(**inputs).logits[:, :-1]  # [B, C, V]
                return TeacherLogits(logits[keep].float())
            with swapped_forward(self.plan.module, lambda hidden, *args, **kwargs: hidden):
                hidden = self.model(**inputs).logits[:, :-1]  # [B, C, H_t]: the head returned its input
        linear = self.plan.linear
        # under ZeRO-3 the head's weight is a shard outside its module's call: a full copy for this micro-batch
        # (backward recomputes each chunk's logits with it, after any gather would have ended)
        with dist.gathered_parameters(self.accelerator, linear, recurse=False):
            weight = linear.weight.detach()
            bias = None if linear.bias is None else linear.bias.detach()
            if dist.zero_stage(self.accelerator) == 3:
                weight, bias = weight.clone(), None if bias is None else bias.clone()
        if self.plan.float32:
            weight = weight.float()
        return TeacherHidden(hidden[keep], weight, bias)


class ServedTeacher:
    """A teacher behind ``trainers vllm-serve``: its ``top_k`` log-probs at each completion position (vLLM's
    prompt log-probs of the whole sequence), and that of the token sampled there."""

    def __init__(self, client, top_k: int):
        self.client, self.top_k = client, top_k

    def view(self, batch: MicroBatch, keep: torch.Tensor, chunked: bool = True) -> TeacherSupport:
        prompt_lengths = batch.prompt_mask.sum(1).tolist()
        sequences = [prompt[mask.bool()].tolist() + completion[attention.bool()].tolist()
                     for prompt, mask, completion, attention in zip(batch.prompt_ids, batch.prompt_mask,
                                                                     batch.completion_ids, batch.completion_attention)]
        answer = self.client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=self.top_k)
        rows, width, k = len(sequences), batch.completion_ids.shape[1], self.top_k
        ids = torch.zeros(rows, width, k + 1, dtype=torch.long)
        logps = torch.zeros(rows, width, k + 1)
        valid = torch.zeros(rows, width, k + 1, dtype=torch.bool)
        for row in range(rows):
            top_ids, top_logps = answer["logprob_token_ids"][row], answer["logprobs"][row]
            sampled_ids, sampled_logps = answer["actual_token_ids"][row], answer["actual_logprobs"][row]
            for position in range(len(top_ids)):
                listed = [i for i, value in zip(top_ids[position], top_logps[position]) if value != float("-inf")]
                n = len(listed)
                ids[row, position, :n] = torch.tensor(listed)
                logps[row, position, :n] = torch.tensor(top_logps[position][:n])
                valid[row, position, :n] = True
                token = sampled_ids[position][0]
                ids[row, position, k] = token
                logps[row, position, k] = sampled_logps[position][0]
                valid[row, position, k] = token not in listed  # the sampled token, unless listed already
        device = batch.completion_ids.device
        return TeacherSupport(ids[keep.cpu()].to(device), logps[keep.cpu()].to(device), valid[keep.cpu()].to(device))


def student_divergence(model: torch.nn.Module, plan: HeadPlan | None, batch: MicroBatch, keep: torch.Tensor,
                       teacher: TeacherView, beta: float, temperature: float, add_tail: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's forward through ``model`` (its wrapper), and at the positions ``keep`` [B, C] its divergence
    from ``teacher`` and its entropy, each [N] float32 (the divergence with a gradient). ``plan``: the student's
    head (None or not chunkable: its full logits, which ``teacher`` must then be TeacherLogits or TeacherSupport)."""
    inputs = forward_inputs(batch)

    def divergence(student_hidden, student_weight, student_bias):
        if isinstance(teacher, TeacherSupport):
            return chunked_support_divergence(student_hidden, student_weight, teacher.ids, teacher.logps,
                                              teacher.valid, beta, temperature, student_bias, add_tail)
        return chunked_divergence(student_hidden, student_weight, teacher.hidden, teacher.weight, beta, temperature,
                                  student_bias, teacher.bias)

    with float32_attention_on_cpu(model, batch.completion_ids.device):
        if chunkable(plan) and not isinstance(teacher, TeacherLogits):
            def head(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
                linear = plan.linear
                weight = linear.weight.float() if plan.float32 else linear.weight
                scores = torch.stack(divergence(hidden[:, :-1][keep], weight, linear.bias), -1)  # [N, 2]
                # returned as the model's logits, with the gradient: ZeRO-3 gathers the head again for backward
                # through hooks on its module's output
                return scores.new_zeros((*keep.shape, 2)).masked_scatter(keep.unsqueeze(-1), scores)

            with swapped_forward(plan.module, head):
                scores = model(**inputs).logits[keep]  # [N, 2]
            return scores[:, 0], scores[:, 1]
        logits = model(**inputs).logits[:, :-1][keep].float() / temperature  # [N, V]
    if isinstance(teacher, TeacherLogits):
        return token_divergence(logits, teacher.logits / temperature, beta)
    return support_divergence_of_logits(logits, teacher, beta, add_tail)


def support_divergence_of_logits(logits: torch.Tensor, teacher: TeacherSupport, beta: float, add_tail: bool,
                                 rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A served teacher's divergence from the student's full logits [N, V] (over the temperature already), and
    the student's entropy, ``rows`` positions at a time."""
    divergences, entropies = [], []
    for start in range(0, logits.shape[0], rows):
        part = slice(start, start + rows)
        log_ps = logits[part].log_softmax(-1)
        divergences.append(support_divergence(log_ps, teacher.ids[part], teacher.logps[part], teacher.valid[part],
                                              beta, add_tail))
        entropies.append(-(log_ps.exp() * log_ps).sum(-1).detach())
    return torch.cat(divergences), torch.cat(entropies)


def check_vocabularies(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    """The divergence compares the two next-token distributions token by token: one vocabulary (TRL's rule)."""
    sizes = [model.config.get_text_config().vocab_size for model in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise ConfigError(f"The student model has vocab_size {sizes[0]} but the teacher model has vocab_size "
                          f"{sizes[1]}. Distillation compares the teacher's full next-token distribution, which "
                          f"requires a shared vocabulary: use a teacher with the same vocab_size (and tokenizer).")

