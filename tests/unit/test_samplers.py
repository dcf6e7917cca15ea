"""Unit tests for trainers/data/samplers.py: global batches, their split over processes and accumulation steps,
and GRPO's layout of one generation round."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from trainers.data.samplers import GlobalBatchSampler, length_grouped_order, local_slice

# ------------------------------------------------------------------------------------------------------------
# GlobalBatchSampler and local_slice
# ------------------------------------------------------------------------------------------------------------


def test_sampler_rejects_empty_dataset():
    with pytest.raises(ValueError, match="empty dataset"):
        GlobalBatchSampler(0, 4, seed=0)


@pytest.mark.parametrize(
    "num_rows,global_batch,steps,padding",
    [(10, 4, 3, 2), (12, 4, 3, 0), (3, 8, 1, 5), (1, 1, 1, 0), (7, 7, 1, 0), (9, 2, 5, 1), (2, 7, 1, 5)],
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_epoch_coverage_and_padding(num_rows, global_batch, steps, padding, shuffle):
    sampler = GlobalBatchSampler(num_rows, global_batch, seed=3, shuffle=shuffle)
    assert sampler.steps_per_epoch == steps
    assert sampler.padding_per_epoch == padding
    for epoch in range(3):
        batches = [sampler.batch(epoch * steps + s) for s in range(steps)]
        rows = [r for b in batches for r in b]
        assert all(len(b) == global_batch for b in batches)
        assert set(rows) == set(range(num_rows))  # every row at least once
        assert len(rows) - num_rows == padding  # the top-up is exactly padding_per_epoch rows
        counts = [rows.count(r) for r in range(num_rows)]
        # topping up is spread: no row appears more than once more than any other
        assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("num_rows,global_batch,steps,dropped", [(10, 4, 2, 2), (12, 4, 3, 0), (9, 2, 4, 1)])
def test_sampler_drop_last_leaves_out_the_incomplete_batch(num_rows, global_batch, steps, dropped):
    sampler = GlobalBatchSampler(num_rows, global_batch, seed=3, drop_last=True)
    assert (sampler.steps_per_epoch, sampler.dropped_per_epoch, sampler.padding_per_epoch) == (steps, dropped, 0)
    seen = set()
    for epoch in range(4):
        order = sampler.epoch_order(epoch)
        rows = [r for s in range(steps) for r in sampler.batch(epoch * steps + s)]
        assert rows == order[:steps * global_batch]  # full batches of the epoch's order, no row twice
        assert len(set(rows)) == len(rows) == num_rows - dropped
        seen |= set(rows)
    assert seen == set(range(num_rows))  # reshuffling drops different rows in different epochs
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(3, 4, seed=0, drop_last=True)


def test_length_grouped_order_sorts_mega_batches_longest_first():
    lengths = [(i * 37) % 101 + 1 for i in range(100)]
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
    grouped = length_grouped_order(order, lengths, batch=4)  # mega-batches of min(100 // 16, 50) x 4 = 24 rows
    assert sorted(grouped) == list(range(100))
    assert lengths[grouped[0]] == max(lengths)  # the longest row comes first
    for start in range(0, 100, 24):  # each mega-batch sorted, longest first (its head may be the swapped one)
        chunk = grouped[start:start + 24]
        assert [lengths[r] for r in chunk[1:]] == sorted((lengths[r] for r in chunk[1:]), reverse=True)
        assert set(chunk[1:]) <= set(order[start:start + 24])  # rows stay in their mega-batch

    def padding(rows):  # padded positions when each batch of 4 is padded to its longest row
        return sum(4 * max(lengths[r] for r in rows[i:i + 4]) - sum(lengths[r] for r in rows[i:i + 4])
                   for i in range(0, len(rows), 4))
    assert padding(grouped) < padding(order) / 4


def test_sampler_with_lengths_groups_each_epoch_differently():
    lengths = [i % 17 for i in range(40)]
    sampler = GlobalBatchSampler(40, 8, seed=1, lengths=lengths)
    first, second = sampler.epoch_order(0), sampler.epoch_order(1)
    assert sorted(first) == sorted(second) == list(range(40)) and first != second
    assert GlobalBatchSampler(40, 8, seed=1, lengths=lengths).epoch_order(0) == first  # a function of the seed


def test_sampler_top_up_uses_first_rows_of_the_epoch_order():
    sampler = GlobalBatchSampler(10, 4, seed=0, shuffle=True)
    order = sampler.epoch_order(0)
    assert sorted(order[:10]) == list(range(10))
    assert order[10:] == order[:2]
    assert sampler.batch(2) == order[8:10] + order[:2]


def test_sampler_no_shuffle_is_identity_order():
    sampler = GlobalBatchSampler(10, 4, seed=0, shuffle=False)
    assert [sampler.batch(s) for s in range(6)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1],
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1],
    ]
    assert GlobalBatchSampler(3, 8, seed=0, shuffle=False).batch(0) == [0, 1, 2, 0, 1, 2, 0, 1]


def test_sampler_deterministic_for_seed_and_differs_across_epochs():
    a = GlobalBatchSampler(50, 8, seed=7)
    b = GlobalBatchSampler(50, 8, seed=7)
    steps = a.steps_per_epoch
    assert [a.batch(s) for s in range(3 * steps)] == [b.batch(s) for s in range(3 * steps)]
    epoch0 = [r for s in range(steps) for r in a.batch(s)]
    epoch1 = [r for s in range(steps, 2 * steps) for r in a.batch(s)]
    assert epoch0 != epoch1
    assert epoch0 != list(range(50)) + list(range(6))  # actually shuffled
    other_seed = GlobalBatchSampler(50, 8, seed=8)
    assert [r for s in range(steps) for r in other_seed.batch(s)] != epoch0
    # the order is torch.randperm seeded with seed + epoch
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    assert epoch1[:50] == expected


def test_sampler_batch_is_pure():
    sampler = GlobalBatchSampler(23, 5, seed=11)
    forward = {s: sampler.batch(s) for s in range(20)}
    fresh = GlobalBatchSampler(23, 5, seed=11)
    order = [13, 0, 19, 4, 4, 7, 1, 18, 12, 0, 5, 6, 2, 3, 8, 9, 10, 11, 14, 15, 16, 17]
    for s in order:
        assert fresh.batch(s) == forward[s]
    for s in reversed(range(20)):
        assert sampler.batch(s) == forward[s]
    # a returned batch is a copy: mutating it does not change later answers
    got = sampler.batch(3)
    got[0] = -1
    assert sampler.batch(3) == forward[3]


def test_local_slice_layout_hand_example():
    batch = list(range(100, 112))  # B=2, P=3, A=2
    assert local_slice(batch, 0, 0, 2, 3) == [100, 101]
    assert local_slice(batch, 0, 2, 2, 3) == [104, 105]
    assert local_slice(batch, 1, 0, 2, 3) == [106, 107]
    assert local_slice(batch, 1, 2, 2, 3) == [110, 111]


@settings(max_examples=examples(60), deadline=None, database=None)
@given(per_device=st.integers(1, 4), processes=st.integers(1, 4), accumulation=st.integers(1, 4),
       num_rows=st.integers(1, 60), seed=st.integers(0, 1000), step=st.integers(0, 30))
def test_local_slice_partitions_the_global_batch(per_device, processes, accumulation, num_rows, seed, step):
    global_batch = per_device * processes * accumulation
    batch = GlobalBatchSampler(num_rows, global_batch, seed=seed).batch(step)
    assert len(batch) == global_batch
    positions = list(range(global_batch))  # slice positions, so duplicated rows (top-up) are still distinct
    slices = {(a, p): local_slice(positions, a, p, per_device, processes)
              for a in range(accumulation) for p in range(processes)}
    assert all(len(s) == per_device for s in slices.values())
    union = sorted(i for s in slices.values() for i in s)
    assert union == positions  # disjoint and covering
    # [accumulation][process][row] layout
    rebuilt = [i for a in range(accumulation) for p in range(processes) for i in slices[(a, p)]]
    assert rebuilt == positions
    assert [batch[i] for i in rebuilt] == batch
    assert all(local_slice(batch, a, p, per_device, processes) == [batch[i] for i in slices[(a, p)]]
               for a, p in slices)


@pytest.mark.parametrize("num_rows", [24, 30, 5])
def test_global_batch_rows_do_not_depend_on_the_split(num_rows):
    splits = [(12, 1, 1), (1, 12, 1), (1, 1, 12), (2, 3, 2), (3, 2, 2), (4, 3, 1), (6, 1, 2)]
    per_split = []
    for per_device, processes, accumulation in splits:  # each 12 rows per step
        sampler = GlobalBatchSampler(num_rows, per_device * processes * accumulation, seed=5)
        steps = []
        for step in range(2 * sampler.steps_per_epoch):
            batch = sampler.batch(step)
            gathered = [r for a, p in itertools.product(range(accumulation), range(processes))
                        for r in local_slice(batch, a, p, per_device, processes)]
            steps.append(sorted(gathered))
        per_split.append(steps)
    assert all(s == per_split[0] for s in per_split)


# ------------------------------------------------------------------------------------------------------------
# group_slots (GRPO's layout of one generation round)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts,num_generations,num_processes,expected",
    [
        ([3, 7], 4, 2, [[3, 3, 3, 3], [7, 7, 7, 7]]),
        ([3, 7], 4, 1, [[3, 3, 3, 3, 7, 7, 7, 7]]),
        ([5, 6, 7], 2, 3, [[5, 5], [6, 6], [7, 7]]),
        ([1, 2], 3, 3, [[1, 1], [1, 2], [2, 2]]),  # a group may straddle two processes
        ([9, 8, 7, 6], 2, 4, [[9, 9], [8, 8], [7, 7], [6, 6]]),
        ([0, 1], 2, 4, [[0], [0], [1], [1]]),
    ],
)
def test_group_slots(prompts, num_generations, num_processes, expected):
    from trainers.data.samplers import group_slots

    shares = [group_slots(prompts, num_generations, num_processes, p) for p in range(num_processes)]
    assert shares == expected
    assert [r for share in shares for r in share] == [p for p in prompts for _ in range(num_generations)]


def test_group_slots_uneven_split_raises():
    from trainers.data.samplers import group_slots

    with pytest.raises(ValueError, match="3 completions cannot be split evenly over 2 processes"):
        group_slots([4], 3, 2, 0)
