"""SFT's packing strategies, DFT loss and padding options, and GRPO's pad_to_multiple_of, on pure functions
(no model): checked against TRL 1.16's own functions where it has them, and against hand computations."""

import math
from itertools import pairwise

import pytest
import torch

from trainers import GRPOConfig, SFTConfig
from trainers.sampling.batch import RowWidths
from trainers.generation.sampling import left_pad, right_pad
from trainers.model.losses import SFT_TOKEN_LOSSES, dft_token_loss
from trainers.sft.packing import pack_samples
from trainers.sft.tokenize import IGNORE, Collator, shift_targets

# documents of 5, 9, 3, 12 and 4 tokens (token ids 1..33), every token trained
DOCS = [list(range(1, 6)), list(range(6, 15)), list(range(15, 18)), list(range(18, 30)), list(range(30, 34))]


def shifted(docs):
    return [shift_targets({"input_ids": d, "labels": list(d)}) for d in docs]


# TRL 1.16's pack_dataset(DOCS as input_ids and labels, 8, strategy).to_list(), recorded (the test environment
# need not have TRL; test_recorded_rows_are_trls checks the record against TRL where it is installed)
TRL_ROWS = {
    "wrapped": [list(range(1, 9)), list(range(9, 17)), list(range(17, 25)), list(range(25, 33)), [33]],
    "bfd_split": [(list(range(6, 14)), [8]), (list(range(18, 26)), [8]), ([1, 2, 3, 4, 5, 15, 16, 17], [5, 3]),
                  (list(range(26, 34)), [4, 4]), ([14], [1])],
}


def trl_pack(docs, max_length, strategy):
    """TRL's pack_dataset on DOCS (labels = ids) with max_length 8, as lists of rows (recorded above)."""
    assert docs == DOCS and max_length == 8
    if strategy == "wrapped":
        return [{"input_ids": ids, "labels": list(ids)} for ids in TRL_ROWS["wrapped"]]
    return [{"input_ids": ids, "labels": list(ids), "seq_lengths": lengths} for ids, lengths in TRL_ROWS[strategy]]


@pytest.mark.parametrize("strategy", ["wrapped", "bfd_split"])
def test_recorded_rows_are_trls(strategy):
    trl = pytest.importorskip("trl.data_utils")  # the bench extra installs TRL
    from datasets import Dataset

    dataset = Dataset.from_dict({"input_ids": DOCS, "labels": [list(d) for d in DOCS]})
    assert trl.pack_dataset(dataset, 8, strategy).to_list() == trl_pack(DOCS, 8, strategy)


def test_wrapped_rows_are_trls_chunks():
    rows = pack_samples(shifted(DOCS), 8, "wrapped")
    trl_rows = trl_pack(DOCS, 8, "wrapped")
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in trl_rows]  # 33 tokens: 8, 8, 8, 8, 1
    assert [len(r["input_ids"]) for r in rows] == [8, 8, 8, 8, 1]
    ends = {sum(len(d) for d in DOCS[: i + 1]) - 1 for i in range(len(DOCS))}  # each document's last token
    for k, (row, trl_row) in enumerate(zip(rows, trl_rows)):
        # one sequence per row, as TRL's (no seq_lengths: positions 0..len-1, attention across documents)
        assert row["position_ids"] == list(range(len(row["input_ids"])))
        # TRL's targets: its labels shifted within the row; the row's last token predicts nothing
        trl_targets = trl_row["labels"][1:] + [IGNORE]
        for i, (ours, theirs) in enumerate(zip(row["target_ids"], trl_targets)):
            if 8 * k + i in ends:  # a document's last token: TRL trains it on the next document's first token
                assert ours == IGNORE
            else:
                assert ours == theirs, (k, i)
    # at a cut inside a document (tokens 8 | 9, in document 2), the row's last token predicts nothing and the
    # next row's first token predicts its document's next token
    assert rows[0]["input_ids"][-1] == 8 and rows[0]["target_ids"][-1] == IGNORE
    assert rows[1]["input_ids"][0] == 9 and rows[1]["target_ids"][0] == 10


def test_bfd_split_pieces_are_trls():
    """Overlong documents become max_length pieces, each a document of its own; no token is dropped."""
    rows = pack_samples(shifted(DOCS), 8, "bfd_split")
    trl_rows = trl_pack(DOCS, 8, "bfd_split")

    def pieces(ids, lengths):
        out, start = [], 0
        for n in lengths:
            out.append(tuple(ids[start:start + n]))
            start += n
        return out

    def our_lengths(row):
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        return [b - a for a, b in pairwise(starts)]

    ours = sorted(p for r in rows for p in pieces(r["input_ids"], our_lengths(r)))
    theirs = sorted(p for r in trl_rows for p in pieces(r["input_ids"], r["seq_lengths"]))
    assert ours == theirs
    assert len(rows) == len(trl_rows)
    assert sum(len(p) for p in ours) == sum(len(d) for d in DOCS)  # nothing dropped (bfd would drop 1 + 4)
    assert sum(len(r["input_ids"]) for r in pack_samples(shifted([d[:8] for d in DOCS]), 8, "bfd")) == 28
    # a piece's last token predicts nothing (TRL's padding-free labels start each piece with -100)
    for row in rows:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in pairwise(starts):
            assert row["target_ids"][b - 1] == IGNORE
            assert row["target_ids"][a:b - 1] == row["input_ids"][a + 1:b]


def test_unknown_packing_strategy_is_an_error():
    with pytest.raises(ValueError, match="packing strategy"):
        pack_samples(shifted(DOCS), 8, "first_fit")


def test_dft_loss_by_hand():
    p = torch.tensor([[0.5, 0.25], [0.1, 1.0]])
    logps = p.log().requires_grad_()
    loss = dft_token_loss(logps)
    expected = torch.tensor([[0.5 * math.log(2), 0.25 * math.log(4)], [0.1 * math.log(10), 0.0]])  # -p log p
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, -p)  # d(-sg(p) log p)/d log p = -p: p is held constant
    torch.testing.assert_close(SFT_TOKEN_LOSSES["nll"](p.log()), -p.log())


def test_pad_to_multiple_of_values():
    """TRL's 'auto' (128 on AWS Neuron only: None here) is the default, and a command line's text is parsed."""
    for cls in (SFTConfig, GRPOConfig):
        assert cls().pad_to_multiple_of is None
        assert cls(pad_to_multiple_of="auto").pad_to_multiple_of is None
        assert cls(pad_to_multiple_of="16").pad_to_multiple_of == 16
        assert cls(pad_to_multiple_of="none").pad_to_multiple_of is None
        assert cls(pad_to_multiple_of=8).pad_to_multiple_of == 8


def test_collated_rows_pad_to_the_multiple():
    samples = shifted(DOCS[:3])
    for strategy in (None, "bfd", "wrapped"):
        rows = samples if strategy is None else pack_samples(samples, 8, strategy)
        plain, padded = Collator(0)(rows), Collator(0, pad_to_multiple_of=6)(rows)
        assert padded["input_ids"].shape[1] % 6 == 0 and padded["input_ids"].shape[1] > plain["input_ids"].shape[1]
        extra = padded["input_ids"].shape[1] - plain["input_ids"].shape[1]
        assert (padded["target_ids"][:, -extra:] == IGNORE).all()  # the extra columns train nothing
        assert torch.equal(padded["target_ids"][:, :-extra], plain["target_ids"])


def test_padding_free_with_max_length_is_a_valid_config_as_in_trl():
    # TRL's SFTConfig accepts it (its default max_length is 1024); the trainer refuses it, as TRL's does
    # (tests/integration/test_sft_options.py test_padding_free_with_max_length_is_refused_by_the_trainer)
    assert SFTConfig(padding_free=True).max_length == 1024
    assert SFTConfig(padding_free=True, max_length=None).padding_free
    assert SFTConfig(padding_free=True, packing=True, max_length=64).padding_free


def test_grpo_padding_keeps_multiples():
    ids, mask = left_pad([[1, 2, 3], [4]], 0, multiple=4)
    assert ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 4]] and mask.sum().item() == 4
    ids, mask = left_pad([[1, 2, 3, 4, 5]], 0, multiple=4)
    assert ids.shape == (1, 8) and mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    ids, mask = right_pad([[1, 2, 3, 4, 5], [6]], 0, multiple=4)
    assert ids.shape == (2, 8) and mask.sum().item() == 6
    # a micro-batch's slice keeps widths that are multiples as well: the fewest padding columns that do
    prompt_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])  # P = 8, 3 real columns
    completion = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]])  # C = 8, 5 real columns
    widths = RowWidths.of(prompt_mask, completion, prompt_group=torch.tensor([0, 1]))
    assert widths.columns(8, 8) == (5, 5)
    assert widths.columns(8, 8, 4) == (4, 8)  # 4 prompt columns kept, 8 completion
    assert widths.columns(8, 8, 2) == (4, 6)
