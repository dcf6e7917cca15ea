"""TrainerAttributes: the public attributes and methods of transformers' Trainer (and TRL's) that scripts and
callbacks use on a trainer beside train(), evaluate() and save_model(): the callback list, which process this is,
the backend, the batch size, the model, the learning rates, and push_to_hub, refused with an explanation.

A mixin of BaseTrainer, kept apart so that trainers/loop/base.py holds the set-up, the loop and its hooks. Each member
reads the trainer's state (``callback_handler``, ``accelerator``, ``args``, ``model``, ``optimizer``,
``router_aux_loss_coef``) or hands a call on to it; the trainer's own modules use a few of them too
(``unwrapped_model``, ``effective_batch_size``).
"""

from __future__ import annotations

from accelerate.utils import DistributedType

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError


class TrainerAttributes:
    """transformers' Trainer attributes and methods on BaseTrainer (see the module docstring)."""

    # ------------------------------------------------------------------ callbacks (transformers' contract)

    def add_callback(self, callback) -> None:
        """Add a transformers.TrainerCallback (an instance or its class) after the existing ones."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        """Remove and return the first callback that is ``callback`` (or an instance of that class); None if none."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the run (transformers' Trainer method)."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (transformers' Trainer method)."""
        return self.accelerator.is_local_main_process

    def end(self) -> None:
        """Finish the trackers and destroy the distributed process group (transformers' Trainer.end). Call it
        once, at the very end of a script: train, evaluate and save_model need the other processes."""
        self.accelerator.end_training()

    # ------------------------------------------------------------------ batches and the model

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step over all processes: per-device x processes x accumulation."""
        return (self.per_process_train_batch_size * self.accelerator.num_processes
                * self.args.gradient_accumulation_steps)

    @property
    def unwrapped_model(self):
        """The model without its training wrapper: ``model`` (transformers' name), kept for older scripts."""
        return self.model

    # ------------------------------------------------------------------ transformers' Trainer attributes

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the Mixture-of-Experts router loss is added (TRL's name, on its SFT and GRPO trainers)."""
        return bool(self.router_aux_loss_coef)

    @property
    def control(self):
        """The TrainerControl the callbacks share (transformers' ``trainer.control``)."""
        return self.callback_handler.control

    @property
    def is_deepspeed_enabled(self) -> bool:
        return dist.is_deepspeed(self.accelerator)

    @property
    def is_fsdp_enabled(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP

    def get_num_trainable_parameters(self) -> int:
        """Parameters with requires_grad (on this process: a ZeRO-3 shard counts its share)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """The current learning rate of each optimizer parameter group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def push_to_hub(self, *args, **kwargs):
        """transformers' push_to_hub: not available (no Hub access here); raises, so no upload is silently skipped."""
        raise ConfigError(f"{type(self).__name__}.push_to_hub: this project does not upload to the Hub. Save with "
                          f"trainer.save_model(dir) and upload that folder with huggingface_hub's upload_folder.")
