"""trainers/data/packing.py: best-fit decreasing bins (SFT's packed rows, GRPO's token-budget micro-batches) and
cutting bins to a count (as many micro-batches on every process)."""

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from tests.tiers import examples
from trainers.data.packing import pack_bfd, split_to_count


def test_pack_bfd_hand_example():
    # sorted: 5(#0) 4(#1) 3(#2) 3(#3) 1(#4). 5 -> A (3 left); 4 -> B (4 left); 3 -> A, the fuller fit (0 left);
    # 3 -> B (1 left); 1 -> B (0 left).
    assert pack_bfd([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]


def test_pack_bfd_best_fit_not_first_fit():
    # sorted: 5(#1) 3(#0) 3(#2) 1(#3). 5 -> A (2 left); 3 -> B (4 left); 3 -> B (1 left).
    # The 1 fits both A (2 left) and B (1 left): best fit picks the fuller B; first fit would pick A.
    assert pack_bfd([3, 5, 3, 1], 7) == [[1], [0, 2, 3]]


def test_pack_bfd_ties_keep_index_order():
    assert pack_bfd([2, 2, 2, 2], 4) == [[0, 1], [2, 3]]
    assert pack_bfd([4, 4, 4], 4) == [[0], [1], [2]]
    assert pack_bfd([1, 3, 1], 3) == [[1], [0, 2]]


def test_pack_bfd_empty():
    assert pack_bfd([], 8) == []


@settings(max_examples=examples(150), deadline=None, database=None)
@given(data=st.data(), capacity=st.integers(1, 40))
def test_pack_bfd_properties(data, capacity):
    lengths = data.draw(st.lists(st.integers(1, capacity), max_size=40))
    bins = pack_bfd(lengths, capacity)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every item in exactly one bin
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(0 < load <= capacity for load in loads)
    # items are placed longest first, so each bin lists non-increasing lengths
    assert all(lengths[a] >= lengths[b] for bin_ in bins for a, b in zip(bin_, bin_[1:]))
    # a new bin is opened only when the item fits in no earlier bin (space only shrinks, so the final loads
    # of earlier bins must still be too full for it); hence also at most one bin is at most half full
    for j, bin_ in enumerate(bins):
        assert all(lengths[bin_[0]] > capacity - loads[i] for i in range(j))
    assert sum(2 * load <= capacity for load in loads) <= 1
    assert len(bins) >= -(-sum(lengths) // capacity)  # lower bound on the number of bins


def test_pack_bfd_puts_an_item_longer_than_the_capacity_alone():
    # GRPO's token_budget: such a completion trains alone (the trainer warns); nothing else joins its bin
    assert pack_bfd([9, 2, 3], 8) == [[0], [2, 1]]


# split_to_count


def test_split_to_count_hand_example():
    # bins of 7 ([0, 1, 2]) and 4 ([3, 4]) tokens: the 7 is cut first, after the first items holding half of it
    # (3 + 2 >= 3.5): [0, 1] | [2]; then of 5, 2 and 4 tokens, the 5 is cut: [0] | [1]
    lengths = [3, 2, 2, 1, 3]
    assert split_to_count([[0, 1, 2], [3, 4]], lengths, 3) == [[0, 1], [2], [3, 4]]
    assert split_to_count([[0, 1, 2], [3, 4]], lengths, 4) == [[0], [1], [2], [3, 4]]
    assert split_to_count([[0, 1, 2], [3, 4]], lengths, 2) == [[0, 1, 2], [3, 4]]  # already there


def test_split_to_count_cuts_only_bins_of_two_items_or_more():
    # the 9-token bin holds one item: the smaller bin of two is cut
    assert split_to_count([[0], [1, 2]], [9, 1, 1], 3) == [[0], [1], [2]]


def test_split_to_count_refuses_more_bins_than_items():
    with pytest.raises(ValueError, match="cannot make 4 bins of 3 items"):
        split_to_count([[0], [1, 2]], [1, 1, 1], 4)


@settings(max_examples=examples(150), deadline=None, database=None)
@given(data=st.data(), capacity=st.integers(1, 40))
def test_split_to_count_properties(data, capacity):
    lengths = data.draw(st.lists(st.integers(1, 2 * capacity), min_size=1, max_size=30))
    bins = pack_bfd(lengths, capacity)
    count = data.draw(st.integers(len(bins), len(lengths)))
    cut = split_to_count(bins, lengths, count)
    assert len(cut) == count and all(cut)
    assert sorted(i for b in cut for i in b) == list(range(len(lengths)))  # every item once
    # each new bin is a run of one old bin, in its order: a cut never mixes bins (GRPO's rounds stay apart)
    runs = {tuple(b[i:j]) for b in bins for i in range(len(b)) for j in range(i + 1, len(b) + 1)}
    assert all(tuple(b) in runs for b in cut)
    # no bin grew
    assert max(sum(lengths[i] for i in b) for b in cut) <= max(sum(lengths[i] for i in b) for b in bins)
