"""Loading models and tokenizers, and the one forward pass every trainer uses: per-token log-probs of targets."""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch

from trainers.model.cpu_attention import float32_attention_on_cpu
from trainers.errors import ConfigError, ModelLoadError
from trainers.model.losses import logps_and_entropy, selective_log_softmax
from trainers.model.output_head import plan_head, scoring_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _looks_like_local_path(name: str) -> bool:
    """A Hub id is "name" or "org/name"; anything else that does not exist is a missing local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def load_causal_lm(model: Any, model_init_kwargs: dict | None = None, trust_remote_code: bool = False):
    """A causal LM from a path / Hub id, or the given instance unchanged.

    dtype defaults to float32 (as TRL's): training updates need full-precision master weights; use mixed
    precision (bf16=True) for speed.
    """
    from transformers import AutoModelForCausalLM, PreTrainedModel

    if not isinstance(model, str):
        if model_init_kwargs:
            raise ModelLoadError("model_init_kwargs only applies when `model` is a path; the model is already built.")
        if not isinstance(model, (PreTrainedModel, torch.nn.Module)):
            raise ModelLoadError(f"`model` must be a path or a PreTrainedModel, got {type(model).__name__}.")
        return model
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "float32"))
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"model_init_kwargs['dtype']={dtype!r} is invalid; valid: {sorted(DTYPES)} or 'auto'.")
        dtype = DTYPES[dtype]
    kwargs.setdefault("trust_remote_code", trust_remote_code)  # TRL's scripts put it in model_init_kwargs too
    check_model_path(model)
    try:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **kwargs)
    except OSError as error:
        raise ModelLoadError(
            f"Could not load a model from '{model}': it is not a local model folder, and fetching it as a Hub id "
            f"failed ({error})."
        ) from error


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")  # read restarting position ids


def padding_free_attention(device_type: str, current: str | None, chosen_by_user: bool,
                           flash_available: bool) -> tuple[str | None, str | None]:
    """The attention for padding-free rows (position ids restarting per sequence) on this device: -> (the
    implementation to switch the model to, or None; a warning, or None).

    SDPA and eager attention see the restarts as a dense block-diagonal mask, quadratic in the packed length: on CPU
    that is what is measured and kept. On CUDA a varlen kernel skips the mask: flash-attn 2 when it is installed
    and the attention was not chosen by the user (model_init_kwargs' attn_implementation, or a model instance);
    else a warning that says what it costs and what to do."""
    if device_type != "cuda" or current is None or current in VARLEN_ATTENTION or "flash" in current:
        return None, None
    if flash_available and not chosen_by_user:
        return "flash_attention_2", None
    return None, (f"padding_free=True on CUDA with attn_implementation={current!r}: the packed rows attend through "
                  f"a dense block-diagonal mask, quadratic in the packed length. A varlen kernel skips it: install "
                  f"flash-attn and pass model_init_kwargs={{'attn_implementation': 'flash_attention_2'}} (or "
                  f"'flex_attention'), or set padding_free=False.")


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def enable_activation_checkpointing(model, kwargs: dict | None) -> None:
    """transformers' activation checkpointing, as its Trainer turns it on: ``every_n_layers`` and ``offload`` are
    taken out of ``kwargs``; the rest go to torch.utils.checkpoint (default ``use_reentrant=False``)."""
    kwargs = dict(kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if offload and not _has_accelerator():  # transformers pins the host copies, which torch cannot do without one
        raise ConfigError("gradient_checkpointing_kwargs['offload']=True moves the checkpoints' saved activations "
                          "from the GPU to pinned host memory, and this machine has no GPU (torch cannot pin memory "
                          "without one); on CPU they are in host memory already: drop 'offload'.")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                              every_n_layers=every_n_layers, offload=offload)
    elif every_n_layers != 1 or offload:
        raise ConfigError("gradient_checkpointing_kwargs: 'every_n_layers' and 'offload' need a transformers with "
                          "activation_checkpointing_enable (5.x, recent); upgrade transformers or drop them.")
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or {"use_reentrant": False})
    model.config.use_cache = False


def non_embedding_parameters(model) -> int:
    """transformers' ``num_parameters(exclude_embeddings=True)`` (a tied LM head is the embedding), counting
    ZeRO-3's partitioned weights at their full size (``ds_numel``)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if id(p) not in embeddings)


def vocabulary_size(model) -> int:
    """Rows of the model's input embedding table: the ids it can take (some models pad the table past the
    tokenizer). num_embeddings is the full size under ZeRO-3 too; where PEFT's trainable-token wrapper hides
    it, the text config's vocab_size."""
    return getattr(model.get_input_embeddings(), "num_embeddings", None) or model.config.get_text_config().vocab_size


def context_length(model) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), or None where the config has none."""
    return getattr(model.config, "max_position_embeddings", None)


def generation_eos_ids(model) -> list[int]:
    """The end ids of the model's generation config as a list (it holds None, one id, or several)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return [i for i in ids if i is not None]


def router_aux_loss_coef(model, requested: float | None) -> float:
    """The weight of a Mixture-of-Experts model's router load-balancing loss, as TRL decides it: the model
    config's when ``requested`` is None, 0.0 for a model without a router (an error if one was requested)."""
    config = model.config.get_text_config()
    has_router = hasattr(config, "output_router_logits")  # MoE configs (Mixtral, Qwen2/3-MoE, ...) declare it
    if requested and not has_router:
        raise ConfigError(f"router_aux_loss_coef={requested}, but {type(model).__name__} is not a Mixture-of-Experts "
                          f"model with a router: there is no load-balancing loss to weight. Leave it at None.")
    if not has_router:
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if requested is None else float(requested)


def check_model_path(path: str) -> None:
    """Refuse a local model path that does not exist or is not a saved model (Hub ids pass through)."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelLoadError(f"Model folder '{path}' has no config.json; is it a saved model?")
        return
    if os.path.exists(path) or _looks_like_local_path(path):
        raise ModelLoadError(f"Model path '{path}' does not exist (or is not a folder).")


def load_tokenizer(processing_class: Any, model_name_or_path: Any, pad_token: str | None = None,
                   chat_template_path: str | None = None):
    """The tokenizer to use: the given one, or the model folder's, with the template file ``chat_template_path``
    (the caller clones a tokenizer folder's, see ``clone_chat_template``). Ensures a pad token (falls back to
    EOS)."""
    from transformers import AutoTokenizer

    tokenizer = processing_class
    if tokenizer is None:
        source = model_name_or_path if isinstance(model_name_or_path, str) else model_name_or_path.config._name_or_path
        if not source:
            raise ModelLoadError("Pass `processing_class` (a tokenizer): the model instance does not say where it came from.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as error:
            raise ModelLoadError(f"Could not load a tokenizer from '{source}' ({error}); pass `processing_class`.") from error
        # Without tokenizer files transformers builds an empty tokenizer (its special tokens only) from the model's
        # config: every text would become unknown ids, so refuse it rather than train on nonsense
        if len(tokenizer.get_vocab()) <= len(tokenizer.added_tokens_decoder):
            raise ModelLoadError(f"'{source}' has no tokenizer files (transformers built an empty tokenizer from its "
                                 f"config); pass `processing_class`.")
    if chat_template_path is not None and os.path.isfile(chat_template_path):
        with open(chat_template_path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if pad_token is not None:
        if pad_token not in tokenizer.get_vocab():
            raise ModelLoadError(f"pad_token {pad_token!r} is not in the tokenizer's vocabulary.")
        tokenizer.pad_token = pad_token
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("The tokenizer has neither a pad token nor an EOS token; set SFTConfig(pad_token=...).")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


CLONE_VOCAB_MULTIPLE = 64  # TRL rounds the resized vocabulary up to a multiple of 64


def clone_chat_template(tokenizer, source: str) -> list[int]:
    """TRL's ``clone_chat_template``, tokenizer side: take the chat template of the tokenizer at ``source`` (a
    folder or Hub id) together with the tokens it needs: its added tokens missing here (e.g. ``<|im_start|>``)
    are added, its EOS becomes this tokenizer's EOS, and dummy tokens ``<extra_id_N>`` round the vocabulary up
    to a multiple of 64. Returns the added ids; ``match_vocabulary`` resizes the model once it is loaded."""
    from transformers import AddedToken, AutoTokenizer

    try:
        donor = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"chat_template_path '{source}' is neither a template file nor a tokenizer folder or "
                             f"Hub id that loads ({error}).") from error
    template = donor.chat_template
    if not template:
        raise ModelLoadError(f"chat_template_path '{source}': that tokenizer has no chat template.")
    tokenizer.chat_template = template
    vocab = tokenizer.get_vocab()
    added = [token for token in donor.added_tokens_decoder.values() if token.content not in vocab]
    tokenizer.add_tokens(added)
    if donor.eos_token is not None:
        tokenizer.eos_token = donor.eos_token
    index = 0
    while len(tokenizer.get_vocab()) % CLONE_VOCAB_MULTIPLE:
        dummy = AddedToken(f"<extra_id_{index}>")
        if tokenizer.add_tokens(dummy):
            added.append(dummy)
        index += 1
    return tokenizer.convert_tokens_to_ids([token.content for token in added])


def match_vocabulary(model, tokenizer) -> None:
    """After ``clone_chat_template``: resize the model's embeddings (and tied head) to the tokenizer's
    vocabulary, and end generation on its EOS, as TRL does."""
    model.resize_token_embeddings(len(tokenizer.get_vocab()))
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id


def train_added_tokens(peft_config, model, token_ids: list[int]) -> None:
    """Under PEFT, let the embedding rows of tokens ``clone_chat_template`` added train beside the adapters
    (``trainable_token_indices``), as TRL does. An untied output head joins ``modules_to_save`` too, or the
    model could not learn to emit them; a tied head shares those rows (adding it would break PEFT's token
    wrapper, which TRL does)."""
    if not hasattr(peft_config, "trainable_token_indices"):  # not a LoRA-style config
        return
    indices = peft_config.trainable_token_indices
    if indices is None:
        peft_config.trainable_token_indices = {"embed_tokens": list(token_ids)}
    elif isinstance(indices, list):
        peft_config.trainable_token_indices = {"embed_tokens": indices + list(token_ids)}
    else:
        indices.setdefault("embed_tokens", []).extend(token_ids)
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if not tied and "lm_head" not in (peft_config.modules_to_save or []):
        peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]


def cast_lm_head_to_fp32(model) -> None:
    """TRL's cast_lm_head_to_fp32 (the ScaleRL recipe): the output head's weight in float32 and its product computed
    in float32 outside autocast, so logits (and log-probs) keep float32 precision in a bf16/fp16 model. A head tied
    to the input embeddings shares that float32 weight; the embeddings' outputs are cast back to the model's dtype
    so the rest of the model runs as before."""
    head = model.get_output_embeddings()
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is optional
        BaseTunerLayer = ()
    if isinstance(head, BaseTunerLayer):
        raise ConfigError("`cast_lm_head_to_fp32=True` does not work when the output head carries a PEFT adapter "
                          "(target_modules includes lm_head): remove lm_head from the adapter's target modules, or "
                          "set cast_lm_head_to_fp32=False.")
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"`cast_lm_head_to_fp32=True` needs a linear output head; this model's is a "
                          f"{type(head).__name__}.")
    embeddings = model.get_input_embeddings()
    original_dtype = head.weight.dtype
    head.float()  # in place: a tied embedding matrix (the same Parameter) becomes float32 too
    head.float32_head = True  # the chunked head (trainers/model/output_head.py) computes it in float32 too

    # a bound method (not a closure over ``head``), so a deep copy of the model (GRPO's reference) uses its own head
    head.forward = types.MethodType(_linear_in_fp32, head)
    if embeddings is not None and embeddings.weight is head.weight and original_dtype != torch.float32:
        embeddings.register_forward_hook(functools.partial(_cast_output, dtype=original_dtype))


def _linear_in_fp32(head: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [..., V] float32, whatever autocast is on."""
    with torch.autocast(hidden_states.device.type, enabled=False):
        return torch.nn.functional.linear(hidden_states.float(), head.weight, head.bias)


def _cast_output(module, args, output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return output.to(dtype)


def prompt_learning_config(model):
    """The active PEFT config of ``model`` (a PeftModel, possibly inside DDP/DeepSpeed) when it is prompt
    learning (prompt tuning, P-tuning, prefix tuning, ...); None for any other model."""
    model = getattr(model, "module", model)  # the DDP / DeepSpeed wrapper's model
    config = getattr(model, "active_peft_config", None)
    return config if getattr(config, "is_prompt_learning", False) else None


def virtual_token_count(model) -> int:
    """How many positions a PEFT prompt-learning adapter puts before the real tokens in the model's outputs (its
    virtual tokens: prompt tuning, P-tuning, ...); 0 for other models. Prefix tuning and cartridges put theirs
    in the attention cache instead, not in the outputs."""
    config = prompt_learning_config(model)
    if config is None or config.peft_type in ("PREFIX_TUNING", "CARTRIDGE"):
        return 0
    return config.num_virtual_tokens


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    logits_to_keep: int | None = None,
    with_entropy: bool = False,
    with_accuracy: bool = False,
    with_router_loss: bool = False,
    entropy_grad: bool = False,
    with_logits: bool = False,
    with_mean_logit: bool = False,
    kept: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run the model once and return, per position, log p(target) (and optionally entropy, argmax hit, the
    logits' mean over the vocabulary as "mean_logit" (no gradient), and the model's logits themselves as
    "logits", [B, K, V]).

    input_ids: [B, T]. target_ids: [B, K] where K = logits_to_keep (the last K positions) or T; entries < 0
    are don't-care (their values are meaningless, 0 where the head is chunked; mask them). Returns tensors of
    shape [B, K], and with ``with_router_loss`` the MoE model's router load-balancing loss as "aux_loss" (a
    scalar, unweighted). The output head runs chunked (trainers/model/output_head.py: no [B, K, V] logits) unless the
    logits are asked for or the head is one it does not take. ``kept``: how many of target_ids are >= 0, where the
    caller knows it (a host integer: the head then finds them without reading target_ids).
    """
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
    if with_router_loss:
        kwargs["output_router_logits"] = True  # the model then returns its load-balancing loss as outputs.aux_loss
    if logits_to_keep is not None:
        # The last position predicts beyond the sequence; keep one more and drop it so K positions remain.
        kwargs["logits_to_keep"] = logits_to_keep + 1
    virtual = 0 if logits_to_keep is not None else virtual_token_count(model)  # prompt learning's, first
    plan = None if with_logits else plan_head(model)
    with float32_attention_on_cpu(model, input_ids.device):  # bf16 attention is the slower one on CPU
        if plan is None:
            outputs = model(**kwargs)
        else:  # the head's targets line up with the positions it gets: [B, K + 1] or [B, n + T]
            pad = (0, 1) if logits_to_keep is not None else (virtual, 0)
            with scoring_head(plan, torch.nn.functional.pad(target_ids, pad, value=-1), temperature, with_entropy,
                              entropy_grad, with_mean_logit=with_mean_logit, kept=kept):
                outputs = model(**kwargs)
    logits = outputs.logits  # [B, K(+1), V] (or scores, [.., 3]); [B, n + T, V] with n virtual tokens first
    logits = logits[:, :-1] if logits_to_keep is not None else logits[:, virtual:]
    if plan is None:
        scores = token_scores(logits, target_ids, temperature, with_entropy, with_accuracy, entropy_grad)
        if with_mean_logit:
            scores["mean_logit"] = logits.detach().float().mean(-1) / temperature
    else:
        scores = split_scores(logits, with_entropy, with_accuracy)
    if with_router_loss:
        scores["aux_loss"] = outputs.aux_loss
    if with_logits:
        scores["logits"] = logits
    return scores


def split_scores(scores: torch.Tensor, with_entropy: bool, with_accuracy: bool = False) -> dict[str, torch.Tensor]:
    """The chunked head's [B, K, 3] (or 4) scores as token_scores returns them: {"logps", "entropy"?,
    "correct"?}, and "mean_logit" where the head computed it."""
    out = {"logps": scores[..., 0]}
    if scores.shape[-1] > 3:
        out["mean_logit"] = scores[..., 3]
    if with_entropy:
        out["entropy"] = scores[..., 1]
    if with_accuracy:
        out["correct"] = scores[..., 2].detach() > 0.5
    return out


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only: [B, T] mask -> [B, T], padding at position 0. A left-padded
    prompt gets the positions it had in generation."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def token_scores(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, with_entropy: bool,
                 with_accuracy: bool = False, entropy_grad: bool = False) -> dict[str, torch.Tensor]:
    """logits [B, K, V], target_ids [B, K] -> {"logps", "entropy"?, "correct"?}, each [B, K]. The entropy has a
    gradient only with ``entropy_grad``."""
    if temperature != 1.0:
        logits = logits / temperature
    if with_entropy:
        logps, entropy = logps_and_entropy(logits, target_ids, entropy_grad=entropy_grad)
        out = {"logps": logps, "entropy": entropy}
    else:
        out = {"logps": selective_log_softmax(logits, target_ids)}
    if with_accuracy:
        with torch.no_grad():
            out["correct"] = logits.detach().argmax(-1) == target_ids
    return out
