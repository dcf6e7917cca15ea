"""The optimizer: transformers' AdamW with its decay / no-decay parameter groups, or what the user gives
(transformers' ``optimizers=(optimizer, lr_scheduler)`` and ``optimizer_cls_and_kwargs``), checked."""

from __future__ import annotations

import math

import torch
from accelerate.utils import DistributedType

from trainers.errors import ConfigError


def build_optimizer(model, args, optimizer_cls_and_kwargs=None) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases and norm weights), as in transformers. With
    ``optimizer_cls_and_kwargs=(cls, kwargs)``: ``cls(groups, **kwargs)`` on the same groups, as transformers."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ConfigError("The model has no trainable parameters.")
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if optimizer_cls_and_kwargs is not None:
        optimizer_cls, kwargs = optimizer_cls_and_kwargs
        return optimizer_cls(groups, **kwargs)
    # optim="adamw_torch_fused" (TRL's default) selects torch's fused kernel; same speed as foreach on CPU.
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=args.optim == "adamw_torch_fused")


def check_optimizers(optimizers, optimizer_cls_and_kwargs) -> tuple:
    """transformers' ``optimizers=(optimizer, lr_scheduler)`` and ``optimizer_cls_and_kwargs``, checked before
    anything slow. Returns (optimizer or None, scheduler or None)."""
    if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
        raise ConfigError(f"optimizers must be a pair (optimizer, lr_scheduler), either may be None; got {optimizers!r}.")
    optimizer, scheduler = optimizers
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizers: {type(optimizer).__name__} is not a torch.optim.Optimizer.")
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        raise ConfigError("optimizers: the lr_scheduler must be built on the optimizer given beside it (a scheduler "
                          "alone would move the learning rate of an optimizer that does not train).")
    if optimizer is not None and optimizer_cls_and_kwargs is not None:
        raise ConfigError("optimizers and optimizer_cls_and_kwargs both give an optimizer (as in transformers, "
                          "pass one of them).")
    if optimizer_cls_and_kwargs is not None:
        ok = isinstance(optimizer_cls_and_kwargs, (tuple, list)) and len(optimizer_cls_and_kwargs) == 2 \
            and isinstance(optimizer_cls_and_kwargs[0], type) and isinstance(optimizer_cls_and_kwargs[1], dict)
        if not ok:
            raise ConfigError(f"optimizer_cls_and_kwargs must be (an optimizer class, a dict of its keyword "
                              f"arguments); got {optimizer_cls_and_kwargs!r}.")
    return optimizer, scheduler


def check_optimizer_parameters(optimizer: torch.optim.Optimizer, model, accelerator) -> None:
    """A given optimizer must train this model: each of its parameters is one of the model's, and some are
    trainable. (It is built on the model before the trainer sees it, so the model must be an instance.)"""
    if accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("optimizers: a ready-made optimizer cannot be used with FSDP (as in transformers), which "
                          "replaces the parameters; use optimizer_cls_and_kwargs instead.")
    own = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in own for p in params):
        raise ConfigError("optimizers: the optimizer holds parameters that are not the model's. Build it on the "
                          "model instance you pass as `model` (with peft_config, on the PEFT model), not on a path.")
    if not any(p.requires_grad for p in params):
        raise ConfigError("optimizers: none of the optimizer's parameters is trainable (requires_grad).")


def step_unless_nonfinite(optimizer, grad_norm: float | None) -> bool:
    """Apply the optimizer step unless the gradient norm is not finite; -> whether the weights were updated.

    Under fp16 mixed precision without DeepSpeed, Accelerate's optimizer holds a GradScaler: clipping already
    unscaled the gradients, and its ``step()`` both skips the update on an overflow and ``update()``s the scaler
    (halving the scale). It must be called on every step: skipping it on an overflow, which is normal in fp16's
    first steps, leaves the scaler unscaled-but-not-updated, and the next step's unscale raises."""
    scaler = getattr(optimizer, "scaler", None)  # accelerate.optimizer.AcceleratedOptimizer's
    finite = grad_norm is None or math.isfinite(grad_norm)
    if finite or scaler is not None:
        optimizer.step()
    return finite and not getattr(optimizer, "step_was_skipped", False)
