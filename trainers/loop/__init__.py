"""The loop and its services: BaseTrainer, logging, evaluation, saving and checkpoints, callbacks, health, trackers,
statistics."""
