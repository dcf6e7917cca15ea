"""A streamed train_dataset with 2 processes: each process trains on its own distinct rows of every global batch,
whose union is the stream's next rows; a run resumed mid-stream (ZeRO-2) trains on exactly the rows, and reaches
exactly the weights, of an uninterrupted one (the straight and the stopped runs in one launch, streaming_job.py's
`--then`; the resume in a second one)."""

import os

import pytest
from datasets import Dataset

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "streaming_job.py")


def stream_order(tokenizer) -> list[list[int]]:
    """The job's rows as the stream gives them, pass after pass (its shuffle is reseeded each pass)."""
    from tests.distributed.streaming_job import ROWS

    stream = Dataset.from_list(ROWS).to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=6)
    order = []
    for epoch in range(3):
        stream.set_epoch(epoch)
        order += [tokenizer(r["prompt"] + r["completion"] + tokenizer.eos_token)["input_ids"] for r in stream]
    return order


def rows_by_step(reports: list[dict]) -> dict[int, list[list[int]]]:
    """Every row trained on at each step, over both processes and both micro-batches, in global-batch order
    ([accumulation step][process][row])."""
    steps: dict[int, list] = {}
    for step in sorted({entry["step"] for report in reports for entry in report["seen"]}):
        for accumulation in range(2):
            for report in reports:
                for entry in report["seen"]:
                    if entry["step"] == step and entry["accumulation"] == accumulation:
                        steps.setdefault(step, []).extend(entry["rows"])
    return steps


@pytest.mark.distributed
def test_ddp_processes_share_each_global_batch_of_a_stream(tiny_model_dir, tmp_path, tokenizer):
    launch("multi_gpu", JOB, tiny_model_dir, str(tmp_path), "4", "--workers", "1")
    reports = rank_reports(tmp_path, "run")
    order = stream_order(tokenizer)
    by_step = rows_by_step(reports)
    for step, rows in by_step.items():
        assert rows == order[8 * step: 8 * step + 8], step  # the stream's next 8 rows, in batch order
    mine = [[tuple(r) for entry in report["seen"] for r in entry["rows"]] for report in reports]
    assert len(mine[0]) == len(mine[1]) == 16
    first_pass = order[:20]
    assert not set(mine[0][:8]) & set(mine[1][:8])  # steps 0-1 lie in the first pass: no row on both processes
    assert sorted(mine[0][:8] + mine[1][:8]) == sorted(map(tuple, first_pass[:16]))
    assert reports[0]["checksum"] == reports[1]["checksum"]  # one synced model


@pytest.mark.distributed
def test_zero2_resume_mid_stream_continues_with_the_next_rows(tiny_model_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch("zero2", JOB, tiny_model_dir, str(straight), "6", "--then", tiny_model_dir, str(split), "6", "3")
    launch("zero2", JOB, tiny_model_dir, str(split), "6", "--resume")
    whole, first, rest = (rank_reports(folder, prefix) for folder, prefix in
                          ((straight, "run"), (split, "run"), (split, "resumed")))
    for rank in range(2):
        assert first[rank]["seen"] + rest[rank]["seen"] == whole[rank]["seen"]
        assert len(whole[rank]["seen"]) == 12  # 6 steps x 2 micro-batches: 48 rows, into the third pass
    assert rest[0]["checksum"] == whole[0]["checksum"]
