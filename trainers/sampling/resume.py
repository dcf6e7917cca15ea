"""What a sampling trainer's checkpoint keeps beyond the base trainer's (model, optimizer, scheduler, RNG,
TrainerState), so a resumed run continues exactly: a stream's data position and the last round built (it may serve
the next step too); the trainers with more keep it beside (the reference once sync_ref_model has moved it:
FrozenReference, model/reference.py; GRPO's adaptive entropy coefficient: grpo/entropy_control.py). One file per process where the value is per process."""

from __future__ import annotations

import os

import torch

from trainers.sampling.batch import Rollout
from trainers.data.streaming import load_data_position, save_data_position


def save_round_state(folder: str, accelerator, prompt_batches, rounds: dict[int, Rollout]) -> None:
    """The data position and the last round built. Every process calls it."""
    rank = accelerator.process_index
    save_data_position(prompt_batches, folder, rank)
    if rounds:  # the last round may serve the next step too
        index = max(rounds)
        # its tensors only (loaded with weights_only=True); the host widths are read again from them on load, and
        # the rows' roles (skip_zero_gradient_rows) from each micro-batch
        rollout = {k: v for k, v in rounds[index].to("cpu").init_fields().items() if k != "widths"}
        torch.save({"round": index, "rollout": rollout},
                   os.path.join(folder, f"rollout-{rank}.pt"))


def load_round_state(folder: str, accelerator, prompt_batches) -> dict[int, Rollout]:
    """Restores the data position into ``prompt_batches``; returns the saved round ({} when there was none)."""
    rank = accelerator.process_index
    load_data_position(prompt_batches, folder, rank)
    path = os.path.join(folder, f"rollout-{rank}.pt")
    if not os.path.exists(path):
        return {}
    saved = torch.load(path, weights_only=True)
    return {saved["round"]: Rollout(**saved["rollout"]).to(accelerator.device)}
