"""transformers' ``TrainerCallback`` contract: the events a trainer fires, and the ``TrainerControl`` flags a
callback sets to ask for a log, an evaluation, a checkpoint or the end of training.

A callback is a ``transformers.TrainerCallback`` (or its class). Each event is called as transformers calls it,
``callback.on_<event>(args, state, control, model=..., processing_class=..., optimizer=..., lr_scheduler=...,
train_dataloader=None, eval_dataloader=None, **event_kwargs)``; a callback that returns a ``TrainerControl``
replaces the shared one. There are no DataLoaders here (batches are built from tokenized rows), so the two
dataloader arguments are None.

Events of this package's own, beyond transformers' (a callback without the method is skipped for them):
``on_rollout_end(..., round_index=, rollout=, samples=, metrics=)``, GRPO's: a generation round was built (its
index, its ``Rollout``, the backend's ``Samples`` before padding, the round's metrics). ``on_episode_end(..., episode=)``: the tool loop ran a
round's episodes on this process (trainers/agents/tool_loop.py's ``Episode``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl
from transformers.trainer_callback import ExportableState

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError
from trainers.logs import logger

# Events transformers' TrainerCallback does not define: called on the callbacks that have them
OWN_EVENTS = ("rollout_end", "episode_end")

# The TrainerControl requests that involve every process
FLAGS = ("should_training_stop", "should_log", "should_evaluate", "should_save")


class CallbackHandler:
    """The trainer's callbacks, in order, and the ``TrainerControl`` they share."""

    def __init__(self, callbacks, trainer):
        self.trainer = trainer
        self.callbacks: list[TrainerCallback] = []
        self.control = TrainerControl()
        self._warned_epoch_stop = False
        for callback in callbacks or []:
            self.add(callback)

    def add(self, callback) -> None:
        instance = callback() if isinstance(callback, type) else callback
        if not isinstance(instance, TrainerCallback):
            raise ConfigError(f"callbacks: {type(instance).__name__} is not a transformers.TrainerCallback; subclass "
                              f"it and override the events you need (on_log, on_step_end, on_evaluate, ...).")
        self.callbacks.append(instance)

    def _find(self, callback) -> TrainerCallback | None:
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                return cb
        return None

    def pop(self, callback) -> TrainerCallback | None:
        found = self._find(callback)
        if found is not None:
            self.callbacks.remove(found)
        return found

    def states(self) -> dict:
        """The state() of every callback that has one (transformers' ExportableState), by class name; a list
        when there are several of one class. What a checkpoint keeps (TrainerState.stateful_callbacks)."""
        states: dict = {}
        for callback in self.callbacks:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if name in states:
                    states[name] = (states[name] if isinstance(states[name], list) else [states[name]])
                    states[name].append(callback.state())
                else:
                    states[name] = callback.state()
        return states

    def restore(self, saved: dict) -> None:
        """Rebuild the callbacks saved in a checkpoint from their states (transformers' _load_callback_state):
        each one of the same class, in order, is replaced where it stands."""
        missing = []
        for name, data in saved.items():
            data = data if isinstance(data, list) else [data]
            same = [i for i, cb in enumerate(self.callbacks) if type(cb).__name__ == name]
            if not same:
                missing.append(name)
            for index, state in zip(same, data):
                rebuilt = type(self.callbacks[index])(**state.get("args", {}))
                for attribute, value in state.get("attributes", {}).items():
                    setattr(rebuilt, attribute, value)
                self.callbacks[index] = rebuilt
        if missing and self.trainer.accelerator.is_main_process:
            logger.warning(f"the checkpoint holds the state of callbacks this trainer does not have: "
                           f"{', '.join(missing)}; not restored.")

    def fire(self, event: str, **kwargs: Any) -> TrainerControl:
        """Call ``on_<event>`` of every callback, in order; returns the (possibly replaced) control."""
        if not self.callbacks:
            return self.control
        trainer = self.trainer
        common = {"model": trainer.unwrapped_model, "processing_class": trainer.processing_class,
                  "optimizer": getattr(trainer, "optimizer", None), "lr_scheduler": getattr(trainer, "lr_scheduler", None),
                  "train_dataloader": None, "eval_dataloader": None}
        for callback in self.callbacks:
            if event in OWN_EVENTS and not hasattr(callback, f"on_{event}"):
                continue
            result = getattr(callback, f"on_{event}")(trainer.args, trainer.state, self.control, **common, **kwargs)
            if result is not None:
                self.control = result
        if self.control.should_epoch_stop and not self._warned_epoch_stop:
            self._warned_epoch_stop = True
            logger.warning("a callback set control.should_epoch_stop: not supported here (the data order is a "
                           "function of the step); the epoch goes on. Use should_training_stop to stop training.")
        return self.control

    def agree(self) -> None:
        """Every process acts on a request any process's callbacks made. A log, an evaluation, a checkpoint and
        the end of training involve all processes together; one process going alone would wait forever (a
        callback that sets a flag only where ``state.is_world_process_zero``, for example)."""
        accelerator = self.trainer.accelerator
        if not self.callbacks or accelerator.num_processes == 1:
            return
        flags = torch.tensor([float(getattr(self.control, f)) for f in FLAGS], device=accelerator.device)
        for name, value in zip(FLAGS, dist.all_reduce_max(accelerator, flags).tolist()):
            setattr(self.control, name, bool(value))

    def requested(self, flag: str) -> bool:
        """Whether the callbacks of any process set ``control.<flag>``."""
        self.agree()
        return getattr(self.control, flag)

    def new_training(self) -> None:
        """At the start of train(): the stop flags of an earlier call are forgotten (transformers' _new_training)."""
        self.control.should_training_stop = False
        self.control.should_epoch_stop = False
        self.new_step()

    def new_step(self) -> None:
        """At the start of each optimizer step: the log/evaluate/save requests of the last one were served."""
        self.control.should_log = False
        self.control.should_evaluate = False
        self.control.should_save = False
