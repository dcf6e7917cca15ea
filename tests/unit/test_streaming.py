"""StreamedBatches (trainers/data/streaming.py): a stream read in order, prepared in chunks, cut into global batches
across chunk and epoch boundaries, resumable from its saved position, the same with prefetch threads."""

import pytest
from datasets import Dataset, IterableDataset

from trainers.errors import DatasetFormatError
from trainers.data.streaming import StreamedBatches


def stream(n: int, shards: int = 1):
    return Dataset.from_list([{"x": i} for i in range(n)]).to_iterable_dataset(num_shards=shards)


def doubled_evens(raw, first):
    """A preparation that drops rows (odd x) and changes the rest, and checks it is told where the chunk starts."""
    assert [r["x"] for r in raw][0] == first
    return [r["x"] * 2 for r in raw if r["x"] % 2 == 0]


def batches(source: StreamedBatches, steps: int) -> list[list]:
    return [source.batch(step) for step in range(steps)]


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_run_on_across_chunks_and_epochs_in_stream_order(workers):
    source = StreamedBatches(stream(10), doubled_evens, 4, "train_dataset", chunk_rows=3, workers=workers)
    # prepared rows per pass: 0 4 8 12 16; batches of 4 run on into the next pass
    assert batches(source, 5) == [[0, 4, 8, 12], [16, 0, 4, 8], [12, 16, 0, 4], [8, 12, 16, 0], [4, 8, 12, 16]]
    assert source.batch(4) == [4, 8, 12, 16]  # the last batch again (each micro-step asks)
    with pytest.raises(RuntimeError, match="read in order"):
        source.batch(2)


def test_drop_last_drops_each_passes_incomplete_batch():
    source = StreamedBatches(stream(10), doubled_evens, 2, "train_dataset", chunk_rows=4, drop_last=True)
    assert batches(source, 4) == [[0, 4], [8, 12], [0, 4], [8, 12]]  # 16 is each pass's incomplete batch
    too_big = StreamedBatches(stream(10), doubled_evens, 8, "train_dataset", drop_last=True)
    with pytest.raises(DatasetFormatError, match="fewer than one global batch"):
        too_big.batch(0)


def test_a_shuffled_stream_is_reshuffled_each_pass_with_set_epoch():
    shuffled = stream(12, shards=3).shuffle(seed=7, buffer_size=5)
    source = StreamedBatches(shuffled, lambda raw, first: [r["x"] for r in raw], 12, "train_dataset", chunk_rows=5)
    first, second = source.batch(0), source.batch(1)
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second
    shuffled.set_epoch(1)
    assert second == [r["x"] for r in shuffled]  # transformers' set_epoch(epoch) before pass `epoch`


@pytest.mark.parametrize("workers", [0, 1])
def test_restoring_a_saved_position_continues_with_the_next_rows_without_preparing_the_skipped_ones(workers):
    full = StreamedBatches(stream(10), doubled_evens, 3, "train_dataset", chunk_rows=4)
    expected = batches(full, 7)
    first = StreamedBatches(stream(10), doubled_evens, 3, "train_dataset", chunk_rows=4, workers=workers)
    batches(first, 4)
    state = first.state()
    prepared = []

    def counting(raw, start):
        prepared.append(start)
        return doubled_evens(raw, start)

    resumed = StreamedBatches(stream(10), counting, 3, "train_dataset", chunk_rows=4, workers=workers)
    prepared.clear()
    resumed.restore(state)
    assert prepared == [state["chunk_start"]]  # only the chunk it is in is prepared again
    assert [resumed.batch(step) for step in range(4, 7)] == expected[4:]


def test_empty_and_untrainable_streams_are_errors_that_name_the_dataset():
    with pytest.raises(DatasetFormatError, match="train_dataset is empty"):
        StreamedBatches(IterableDataset.from_generator(lambda: iter([])), doubled_evens, 2, "train_dataset")
    nothing = StreamedBatches(stream(5), lambda raw, first: [], 2, "train_dataset")
    with pytest.raises(DatasetFormatError, match="no row to train on"):
        nothing.batch(0)


def test_errors_in_a_prefetched_chunk_surface_in_order():
    def failing(raw, first):
        if first >= 4:
            raise DatasetFormatError(f"train_dataset row {first}: bad")
        return [r["x"] for r in raw]

    source = StreamedBatches(stream(10), failing, 4, "train_dataset", chunk_rows=4, workers=2)
    assert source.batch(0) == [0, 1, 2, 3]
    with pytest.raises(DatasetFormatError, match="row 4: bad"):
        source.batch(1)


def test_validation_runs_on_the_chunk_already_read_and_each_later_one():
    seen = []
    source = StreamedBatches(stream(6), lambda raw, first: [r["x"] for r in raw], 2, "train_dataset", chunk_rows=2)
    source.validate = lambda rows, first: seen.append((first, rows))
    assert seen == [(0, [0, 1])]
    batches(source, 3)
    assert seen == [(0, [0, 1]), (2, [2, 3]), (4, [4, 5])]


def test_processes_that_disagree_are_stopped():
    def agree(fingerprint):
        raise DatasetFormatError("different rows")

    source = StreamedBatches(stream(4), lambda raw, first: [r["x"] for r in raw], 2, "train_dataset", agree=agree)
    with pytest.raises(DatasetFormatError, match="different rows"):
        source.batch(0)
