"""A GRPO micro-batch's forward, loss and backward read nothing from the device in this package's code (issue 59,
finding 10): on a GPU each read (``.item()``, ``.tolist()``, ``.nonzero()``, a boolean selection, ``.any()``) stalls
the host until the device has caught up, once per micro-batch. What they needed (the rows' widths, prompt groups,
how many positions the head scores, which rows skip_zero_gradient_rows leaves out) is read once per round instead.

Proved on CPU with a dispatch mode that records every operator that reads values on the host, with the line of
code that called it, between two micro-batches' ``on_substep_end`` callbacks of a real ``train()``: the whole of
the second micro-batch. Reads from transformers' own code (its attention mask checks) are outside this package and
listed in docs/cuda.md. ``.tolist()`` on a CPU tensor dispatches no operator, so it is covered by slicing a round
on the ``meta`` device (tests/unit/test_round_widths.py) instead."""

import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

import trainers
from trainers import GRPOConfig, GRPOTrainer

PACKAGE = os.path.dirname(os.path.abspath(trainers.__file__)) + os.sep
TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
         aten.is_nonzero.default, aten.equal.default}  # .item(), int(), bool(), .nonzero(), torch.equal ...
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostReads(TorchDispatchMode):
    """Records ``(operator, file:line)`` for each operator that reads a tensor's values on the host: the line is
    the innermost one outside torch (the backward of a boolean selection: the line that ran backward)."""

    def __init__(self):
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in READS or boolean_index:
            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith(TORCH))
            self.sites.append((str(func), f"{frame.filename}:{frame.lineno}"))
        return func(*args, **(kwargs or {}))


class SecondMicroBatch(TrainerCallback):
    """Host reads from the end of the first micro-batch of the first step to the end of the second."""

    def __init__(self):
        self.mode, self.substeps = HostReads(), 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.substeps += 1
        if self.substeps == 1:
            self.mode.__enter__()
        elif self.substeps == 2:
            self.mode.__exit__(None, None, None)


def constant_for_abc(prompts, completions, **kwargs):
    """Every completion of "abc" scores 0.5 (advantage 0: skip_zero_gradient_rows forwards that group without a
    gradient, but one row); the others by length."""
    return [0.5 if p == "abc" else float(len(c)) for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_micro_batch_reads_nothing_from_the_device(tiny_model_dir, tmp_path, padding_free):
    # three micro-batches of one prompt's 8 completions each; the second is "abc"'s
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      gradient_accumulation_steps=3, max_completion_length=8, max_steps=1, logging_steps=1,
                      save_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False, report_to="none",
                      padding_free=padding_free)
    watch = SecondMicroBatch()
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=constant_for_abc, args=args, callbacks=[watch],
                          train_dataset=[{"prompt": p} for p in ("hello", "abc", "xyz")])
    trainer.train()
    assert watch.substeps == 2
    ours = [site for site in watch.mode.sites if site[1].startswith(PACKAGE)]
    assert ours == [], ours
    # the dispatch mode saw the micro-batch: transformers' own mask check reads once per forward here
    assert any("transformers" in site for _, site in watch.mode.sites), watch.mode.sites
