"""What a GRPO checkpoint keeps beyond the base trainer's (model, optimizer, scheduler, RNG, TrainerState), so a
resumed run continues exactly: a stream's data position, the reference model once sync_ref_model has moved it,
the adaptive entropy coefficient, and the last round built (it may serve the next step too). One file per process
where the value is per process."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from trainers import distributed as dist
from trainers.grpo.batch import Rollout
from trainers.grpo.entropy_control import EntropyControl
from trainers.streaming import load_data_position, save_data_position


def save_grpo_state(folder: str, accelerator, prompt_batches, reference, entropy_control: EntropyControl | None,
                    rounds: dict[int, Rollout]) -> None:
    """``reference``: the moved reference model (sync_ref_model), else None. Every process calls it."""
    rank = accelerator.process_index
    save_data_position(prompt_batches, folder, rank)
    if reference is not None:  # the moved reference is not the model it was loaded from: keep it
        reference = dist.unwrap(accelerator, reference)
        with dist.gathered_parameters(accelerator, reference):
            if accelerator.is_main_process:
                torch.save({k: v.detach().cpu() for k, v in reference.state_dict().items()},
                           os.path.join(folder, "reference.pt"))
    if entropy_control is not None:  # the adaptive coefficient and the entropy it last saw
        with open(os.path.join(folder, f"entropy-{rank}.json"), "w") as f:
            json.dump(dataclasses.asdict(entropy_control), f)
    if rounds:  # the last round may serve the next step too
        index = max(rounds)
        # its tensors only (loaded with weights_only=True); the host widths are read again from them on load, and
        # the rows' roles (skip_zero_gradient_rows) from each micro-batch
        rollout = {k: v for k, v in rounds[index].to("cpu").init_fields().items() if k != "widths"}
        torch.save({"round": index, "rollout": rollout},
                   os.path.join(folder, f"rollout-{rank}.pt"))


def load_grpo_state(folder: str, accelerator, prompt_batches, reference, entropy_control: EntropyControl | None
                    ) -> dict[int, Rollout]:
    """Restores what ``save_grpo_state`` kept into ``prompt_batches``, ``reference`` (None: not kept) and
    ``entropy_control``; returns the saved round ({} when there was none)."""
    rank = accelerator.process_index
    load_data_position(prompt_batches, folder, rank)
    if reference is not None and os.path.exists(os.path.join(folder, "reference.pt")):
        state = torch.load(os.path.join(folder, "reference.pt"), weights_only=True)
        dist.load_full_state_dict(accelerator, reference, state)
    entropy_path = os.path.join(folder, f"entropy-{rank}.json")
    if entropy_control is not None and os.path.exists(entropy_path):
        with open(entropy_path) as f:
            saved = json.load(f)
        entropy_control.coef, entropy_control.last_entropy = saved["coef"], saved["last_entropy"]
    path = os.path.join(folder, f"rollout-{rank}.pt")
    if not os.path.exists(path):
        return {}
    saved = torch.load(path, weights_only=True)
    return {saved["round"]: Rollout(**saved["rollout"]).to(accelerator.device)}
