"""Slicing a GRPO round into micro-batches (trainers/sampling/batch.py) reads the rows' widths from host integers taken
once per round, not from the masks on the device each micro-batch (issue 59, finding 10: on a GPU each such read
stalls the host until the device catches up). Proved on the ``meta`` device, where any read of a tensor's values
raises: the round is built on CPU, moved to ``meta``, and sliced."""

import pytest
import torch

from trainers.sampling.batch import Rollout


def ragged_round(prompt_lengths, completion_lengths, groups, P=6, C=5) -> Rollout:
    N = len(prompt_lengths)
    prompt_mask = torch.zeros(N, P, dtype=torch.long)
    completion_attention = torch.zeros(N, C, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_mask[row, P - p:] = 1  # left-padded
        completion_attention[row, :c] = 1  # right-padded
    return Rollout(prompt_ids=torch.arange(N * P).view(N, P), prompt_mask=prompt_mask,
                   completion_ids=torch.arange(N * C).view(N, C), completion_attention=completion_attention,
                   prompt_group=torch.tensor(groups), loss_mask=completion_attention.float(),
                   advantages=torch.randn(N), old_logps=torch.randn(N, C))


def reference_columns(rollout: Rollout, rows: list[int]) -> tuple[int, int]:
    """The trimmed columns as read from the masks themselves."""
    prompt_mask, completion = rollout.prompt_mask[rows], rollout.completion_attention[rows]
    used = (prompt_mask.sum(0) > 0).nonzero()
    first = int(used[0]) if len(used) else prompt_mask.shape[1] - 1
    return first, max(int(completion.sum(1).max()), 1)


def test_micro_batches_are_cut_without_reading_the_devices_tensors():
    rollout = ragged_round([2, 4, 1, 3], [1, 5, 2, 3], groups=[0, 0, 1, 1])
    on_cpu = [rollout.micro_batch(0, 2), rollout.micro_batch(2, 4), rollout.micro_batch_of([1, 3])]
    meta = rollout.to("meta")  # every value unreadable: .tolist(), .item(), .nonzero(), .any() would raise
    on_meta = [meta.micro_batch(0, 2), meta.micro_batch(2, 4), meta.micro_batch_of([1, 3])]
    for cpu, lazy, rows in zip(on_cpu, on_meta, ([0, 1], [2, 3], [1, 3])):
        first, width = reference_columns(rollout, rows)
        assert cpu.prompt_ids.shape == lazy.prompt_ids.shape == (2, 6 - first)
        assert cpu.completion_ids.shape == lazy.completion_ids.shape == (2, width)
        assert cpu.old_logps.shape == lazy.old_logps.shape == (2, width)
        assert lazy.prompt_group.device.type == "meta"
        assert torch.equal(cpu.prompt_ids, rollout.prompt_ids[rows, first:])
    assert on_cpu[2].prompt_group.tolist() == [0, 1]  # renumbered in order of first appearance
    # a slice of a slice (the zero-gradient rows' skip) reads the same host widths
    again = on_meta[0].rows(torch.tensor([1], device="meta"), [1])
    assert again.prompt_ids.shape == (1, 4) and again.completion_ids.shape == (1, 5)


@pytest.mark.parametrize("seed", range(20))
def test_the_host_widths_trim_as_the_masks_say(seed):
    generator = torch.Generator().manual_seed(seed)
    N = int(torch.randint(1, 7, (1,), generator=generator))
    prompts = torch.randint(0, 7, (N,), generator=generator).tolist()  # 0: a row without prompt tokens
    completions = torch.randint(0, 6, (N,), generator=generator).tolist()
    rollout = ragged_round(prompts, completions, groups=list(range(N)))
    rows = sorted(set(torch.randint(0, N, (3,), generator=generator).tolist()))
    batch = rollout.micro_batch_of(rows)
    first, width = reference_columns(rollout, rows)
    assert batch.prompt_ids.shape[1] == 6 - first and batch.completion_ids.shape[1] == width
