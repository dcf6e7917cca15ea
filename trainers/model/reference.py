"""The frozen reference model of DPO, KTO, GRPO and RLOO, resolved as TRL 1.16 resolves it: a mixin of their
trainer, as the base's own mixins are.

``ref_model`` given: that model, frozen. None with PEFT: the policy with its adapters off (no second copy).
None without PEFT: a frozen copy of the model as loaded (from its path, or a deep copy of the instance), or, with
``precompute_ref_log_probs``, no model at all during training (the policy before training scores every row
once). Under ZeRO-3 the copy is partitioned like the policy (``distributed.prepare_frozen``). With
``sync_ref_model`` (TR-DPO, arXiv:2404.09656) the copy moves toward the policy every ``ref_model_sync_steps``.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError
from trainers.model.modeling import load_causal_lm

REFERENCE_FILE = "reference.pt"  # the moved reference in a checkpoint folder


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class FrozenReference:
    """Mixin: ``load_reference`` (from after_load), ``prepare_reference`` (from after_prepare), ``reference()``
    (the model to score with, no gradients), ``sync_reference`` (from after_optimizer_step), and
    ``save_moved_reference`` / ``load_moved_reference`` (a checkpoint's moved reference). Reads the
    config's model_init_kwargs, trust_remote_code, disable_dropout, sync_ref_model, ref_model_mixup_alpha and
    ref_model_sync_steps."""

    ref_model: torch.nn.Module | None = None

    def load_reference(self, model, ref_source, model_source, precompute: bool = False) -> None:
        """Resolve the reference for the loaded (and PEFT-wrapped) ``model``; ``ref_source``: the trainer's
        ``ref_model`` argument (None: none given), ``model_source``: its ``model`` argument; ``precompute``:
        precompute_ref_log_probs (no model kept during training)."""
        args = self.args
        if args.sync_ref_model and self.is_peft:
            raise ConfigError(f"{type(args).__name__}: `sync_ref_model=True` does not work with a PEFT model (as in "
                              f"TRL): its reference is the base model with the adapters off, not a copy to move.")
        self.ref_model = None
        if ref_source is not None:
            kwargs = args.model_init_kwargs if isinstance(ref_source, str) else None
            self.ref_model = load_causal_lm(ref_source, kwargs, args.trust_remote_code)
        elif not self.is_peft and not precompute:
            self.ref_model = (load_causal_lm(model_source, args.model_init_kwargs, args.trust_remote_code)
                              if isinstance(model_source, str) else copy.deepcopy(model))
        if self.ref_model is not None and args.disable_dropout:
            disable_dropout(self.ref_model)

    def prepare_reference(self) -> None:
        if self.ref_model is not None:
            self.ref_model = dist.prepare_frozen(self.accelerator, self.ref_model)

    @contextlib.contextmanager
    def reference(self):
        """The reference model to run (no gradients): the frozen copy, or the policy with its adapters off
        (PEFT), or, with precompute_ref_log_probs, the policy before training."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.is_peft:
            with self.unwrapped_model.disable_adapter():
                yield self.model_wrapped
        elif self.state.global_step > 0:  # every row given before training was scored then: a new dataset
            raise ConfigError(
                f"Cannot compute reference log-probs for a dataset passed to evaluate() after training (TRL's "
                f"words): with {type(self.args).__name__}(precompute_ref_log_probs=True) and no ref_model, the "
                f"reference is the policy before training, which has moved. Give the dataset as eval_dataset to the "
                f"trainer (scored before training), or a ref_model.")
        else:
            yield self.model_wrapped

    def save_moved_reference(self, folder: str) -> None:
        """sync_ref_model: the moved reference, which is not the model it was loaded from, into checkpoint
        ``folder`` (gathered under ZeRO-3; every process calls it)."""
        if not self.args.sync_ref_model:
            return
        reference = dist.unwrap(self.accelerator, self.ref_model)
        with dist.gathered_parameters(self.accelerator, reference):
            if self.accelerator.is_main_process:
                torch.save({k: v.detach().cpu() for k, v in reference.state_dict().items()},
                           os.path.join(folder, REFERENCE_FILE))

    def load_moved_reference(self, folder: str) -> None:
        """sync_ref_model: the moved reference ``save_moved_reference`` kept, when checkpoint ``folder`` has one."""
        path = os.path.join(folder, REFERENCE_FILE)
        if self.args.sync_ref_model and os.path.exists(path):
            dist.load_full_state_dict(self.accelerator, self.ref_model, torch.load(path, weights_only=True))

    def sync_reference(self) -> None:
        """sync_ref_model: after every ref_model_sync_steps-th step, ref = alpha x policy + (1 - alpha) x ref."""
        args = self.args
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:
            dist.mix_parameters(self.accelerator, self.unwrapped_model, self.ref_model, args.ref_model_mixup_alpha)
