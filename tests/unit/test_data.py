"""Unit tests for trainers/data/formats.py: formats, tokenization with loss masks, truncation, shifting, packing,
collation. The samplers' tests are in test_samplers.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from trainers.data.formats import DatasetFormatError, check_messages, is_conversational
from trainers.data.packing import pack_bfd
from trainers.sft.packing import pack_samples
from trainers.sft.tokenize import (
    IGNORE,
    Collator,
    detect_format,
    shift_targets,
    tokenize_row,
    truncate,
)

EOS = "<|im_end|>"
EOS_ID = 256
PAD_ID = 257
IM_START_ID = 258


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trained_segments(tokenizer, sample: dict) -> list[str]:
    """Decode each maximal run of consecutive trained (label != -100) positions."""
    segments, current = [], []
    for token, label in zip(sample["input_ids"], sample["labels"]):
        if label != IGNORE:
            assert label == token  # a trained label is always the input token itself
            current.append(token)
        elif current:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    return [tokenizer.decode(s) for s in segments]


@pytest.fixture(scope="module")
def no_template_tokenizer():
    from trainers.cli.tiny import build_tokenizer

    return build_tokenizer(chat_template=False)


def test_tokenizer_fixture_ids(tokenizer):
    # The hard-coded ids below rely on this layout of the byte-level test tokenizer.
    assert tokenizer.eos_token == EOS and tokenizer.eos_token_id == EOS_ID
    assert tokenizer.pad_token_id == PAD_ID
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_ID
    assert enc(tokenizer, "ab") == [64, 65]
    assert enc(tokenizer, "ab" + EOS) == [64, 65, EOS_ID]


# ------------------------------------------------------------------------------------------------------------
# detect_format
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "columns,text_field,expected",
    [
        (["text"], "text", "language_modeling"),
        (["text", "id"], "text", "language_modeling"),
        (["content", "id"], "content", "language_modeling"),
        (["messages"], "text", "conversational"),
        (["messages", "text"], "text", "conversational"),
        (["conversations"], "text", "conversational"),
        (["prompt", "completion"], "text", "prompt_completion"),
        (["prompt", "completion", "text"], "text", "prompt_completion"),
        (["input_ids"], "text", "tokenized"),
        (["input_ids", "labels"], "text", "tokenized"),
        (["input_ids", "completion_mask", "messages", "prompt", "completion", "text"], "text", "tokenized"),
    ],
)
def test_detect_format(columns, text_field, expected):
    assert detect_format(columns, text_field=text_field) == expected


@pytest.mark.parametrize("columns,text_field", [(["prompt", "answer"], "text"), (["text"], "content"), ([], "text"),
                                                (["completion"], "text")])
def test_detect_format_unknown_lists_columns(columns, text_field):
    with pytest.raises(DatasetFormatError) as info:
        detect_format(columns, text_field=text_field)
    message = str(info.value)
    assert f"columns {sorted(columns)}" in message
    for fmt in ("language_modeling", "conversational", "prompt_completion", "tokenized"):
        assert fmt in message


def test_dataset_format_error_is_value_error():
    assert issubclass(DatasetFormatError, ValueError)


@pytest.mark.parametrize(
    "value,expected",
    [([{"role": "user", "content": "x"}], True), ([], False), ("text", False), ([{"content": "x"}], False),
     (["a"], False), (None, False)],
)
def test_is_conversational(value, expected):
    assert is_conversational(value) is expected


# ------------------------------------------------------------------------------------------------------------
# tokenize_row: language modelling
# ------------------------------------------------------------------------------------------------------------


def test_language_modeling_appends_eos(tokenizer):
    sample = tokenize_row({"text": "hello"}, tokenizer, "language_modeling", eos_token=EOS)
    assert sample["input_ids"] == enc(tokenizer, "hello") + [EOS_ID]
    assert len(sample["input_ids"]) == 6
    assert sample["labels"] == sample["input_ids"]
    assert sample["labels"] is not sample["input_ids"]


def test_language_modeling_does_not_double_eos(tokenizer):
    sample = tokenize_row({"text": "hello" + EOS}, tokenizer, "language_modeling", eos_token=EOS)
    assert sample["input_ids"] == enc(tokenizer, "hello") + [EOS_ID]
    assert sample["input_ids"].count(EOS_ID) == 1
    assert sample["labels"] == sample["input_ids"]


def test_language_modeling_custom_field_and_eos(tokenizer):
    sample = tokenize_row({"body": "hi", "text": "ignored"}, tokenizer, "language_modeling", text_field="body",
                          eos_token="<|endoftext|>")
    assert sample["input_ids"] == enc(tokenizer, "hi") + [PAD_ID]


def test_language_modeling_non_string_raises(tokenizer):
    with pytest.raises(DatasetFormatError, match="Column 'text' must hold strings; got list"):
        tokenize_row({"text": ["a"]}, tokenizer, "language_modeling", eos_token=EOS)


def test_unknown_format_raises(tokenizer):
    with pytest.raises(ValueError, match="unknown format 'nope'"):
        tokenize_row({"text": "a"}, tokenizer, "nope", eos_token=EOS)


# ------------------------------------------------------------------------------------------------------------
# tokenize_row: prompt/completion
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("completion_only_loss", [None, True])
def test_prompt_completion_strings_mask_prompt(tokenizer, completion_only_loss):
    row = {"prompt": "12+3=", "completion": "15"}
    sample = tokenize_row(row, tokenizer, "prompt_completion", eos_token=EOS,
                          completion_only_loss=completion_only_loss)
    prompt_ids, completion_ids = enc(tokenizer, "12+3="), enc(tokenizer, "15")
    assert sample["input_ids"] == prompt_ids + completion_ids + [EOS_ID]
    assert sample["labels"] == [IGNORE] * 5 + completion_ids + [EOS_ID]
    assert trained_segments(tokenizer, sample) == ["15" + EOS]


def test_prompt_completion_strings_all_trained(tokenizer):
    row = {"prompt": "12+3=", "completion": "15"}
    sample = tokenize_row(row, tokenizer, "prompt_completion", eos_token=EOS, completion_only_loss=False)
    assert sample["input_ids"] == enc(tokenizer, "12+3=15") + [EOS_ID]
    assert sample["labels"] == sample["input_ids"]


def test_prompt_completion_completion_already_ending_with_eos(tokenizer):
    row = {"prompt": "ab", "completion": "c" + EOS}
    sample = tokenize_row(row, tokenizer, "prompt_completion", eos_token=EOS)
    assert sample["input_ids"] == enc(tokenizer, "abc") + [EOS_ID]
    assert sample["labels"] == [IGNORE, IGNORE] + enc(tokenizer, "c") + [EOS_ID]


def test_prompt_completion_multibyte_boundary(tokenizer):
    # "é" is two byte tokens: both belong to the prompt, the completion "ü" (two tokens) and EOS are trained.
    sample = tokenize_row({"prompt": "é", "completion": "ü"}, tokenizer, "prompt_completion", eos_token=EOS)
    assert len(sample["input_ids"]) == 5
    assert sample["labels"][:2] == [IGNORE, IGNORE]
    assert sample["labels"][2:] == sample["input_ids"][2:]
    assert trained_segments(tokenizer, sample) == ["ü" + EOS]


def test_sharegpt_conversations_train_like_messages(tokenizer):
    """ShareGPT rows ({'from', 'value'}; roles human/gpt) tokenize exactly like the same chat in messages form."""
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}]}
    messages = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello"}]}
    for assistant_only_loss in (False, True):
        kwargs = dict(eos_token=EOS, assistant_only_loss=assistant_only_loss)
        assert tokenize_row(sharegpt, tokenizer, "conversational", **kwargs) == \
            tokenize_row(messages, tokenizer, "conversational", **kwargs)
    assert trained_segments(tokenizer, tokenize_row(sharegpt, tokenizer, "conversational", eos_token=EOS,
                                                    assistant_only_loss=True)) == ["hello<|im_end|>\n"]


def test_a_generation_prompt_the_conversation_does_not_repeat_trains_from_the_divergence(tokenizer):
    """DeepSeek-R1 distills end the generation prompt with "<think>\\n", which the rendered conversation drops:
    as TRL (which warns), the completion is trained from where the renderings diverge."""
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    row = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]}
    sample = tokenize_row(row, tokenizer, "prompt_completion", eos_token=EOS)
    assert trained_segments(tokenizer, sample) == ["hello<|im_end|>\n"]
    assert tokenizer.decode(sample["input_ids"]).endswith("<|im_start|>assistant\nhello<|im_end|>\n")


def test_prompt_completion_conversational(tokenizer):
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
        "completion": [{"role": "assistant", "content": "Hello."}],
    }
    sample = tokenize_row(row, tokenizer, "prompt_completion", eos_token=EOS)
    prompt_text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(sample["input_ids"]) == prompt_text + "Hello.<|im_end|>\n"
    n_prompt = len(enc(tokenizer, prompt_text))
    assert n_prompt == 5 + len("system\nBe brief.\n") + len("user\nHi?\n") + len("assistant\n")
    assert sample["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert sample["labels"][n_prompt:] == sample["input_ids"][n_prompt:]
    assert trained_segments(tokenizer, sample) == ["Hello.<|im_end|>\n"]
    assert sample["input_ids"].count(EOS_ID) == 3  # no extra EOS appended to chat data


def test_prompt_completion_conversational_all_trained(tokenizer):
    row = {"prompt": [{"role": "user", "content": "Hi?"}], "completion": [{"role": "assistant", "content": "Yo"}]}
    sample = tokenize_row(row, tokenizer, "prompt_completion", eos_token=EOS, completion_only_loss=False)
    assert sample["labels"] == sample["input_ids"]
    assert tokenizer.decode(sample["input_ids"]) == (
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "prompt,completion",
    [("Hi", [{"role": "assistant", "content": "Yo"}]), ([{"role": "user", "content": "Hi"}], "Yo")],
)
def test_prompt_completion_mixed_types_raise(tokenizer, prompt, completion):
    with pytest.raises(DatasetFormatError, match="both be strings or both be lists of messages"):
        tokenize_row({"prompt": prompt, "completion": completion}, tokenizer, "prompt_completion", eos_token=EOS)


def test_prompt_completion_non_string_raises(tokenizer):
    with pytest.raises(DatasetFormatError, match="must hold strings or lists of messages"):
        tokenize_row({"prompt": 3, "completion": 4}, tokenizer, "prompt_completion", eos_token=EOS)


# ------------------------------------------------------------------------------------------------------------
# tokenize_row: conversational (`messages`)
# ------------------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
RENDERED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n"
)


def test_messages_all_trained(tokenizer):
    sample = tokenize_row({"messages": CONVERSATION}, tokenizer, "conversational", eos_token=EOS)
    assert tokenizer.decode(sample["input_ids"]) == RENDERED
    assert sample["input_ids"] == enc(tokenizer, RENDERED)
    assert sample["labels"] == sample["input_ids"]


def test_messages_assistant_only_loss(tokenizer):
    sample = tokenize_row({"messages": CONVERSATION}, tokenizer, "conversational", eos_token=EOS,
                          assistant_only_loss=True)
    assert sample["input_ids"] == enc(tokenizer, RENDERED)
    assert trained_segments(tokenizer, sample) == ["Hello.<|im_end|>\n", "4<|im_end|>\n"]
    # exact positions: the first assistant content starts right after its "<|im_start|>assistant\n" header
    head = enc(tokenizer, RENDERED[: RENDERED.index("Hello.")])
    first = enc(tokenizer, "Hello.<|im_end|>\n")
    assert head[-len("assistant\n") - 1] == IM_START_ID
    assert sample["labels"][: len(head)] == [IGNORE] * len(head)
    assert sample["labels"][len(head): len(head) + len(first)] == first
    assert sample["labels"][len(head) + len(first)] == IGNORE  # the next "<|im_start|>user" is not trained
    n_trained = sum(label != IGNORE for label in sample["labels"])
    assert n_trained == len(first) + len(enc(tokenizer, "4<|im_end|>\n")) == 8 + 3


def test_messages_assistant_only_loss_consecutive_assistant_turns(tokenizer):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    sample = tokenize_row({"messages": messages}, tokenizer, "conversational", eos_token=EOS, assistant_only_loss=True)
    # each assistant turn's header stays untrained, so the two turns are two separate trained runs
    assert trained_segments(tokenizer, sample) == ["b<|im_end|>\n", "c<|im_end|>\n"]


def test_messages_assistant_only_loss_conversation_starting_with_assistant(tokenizer):
    messages = [
        {"role": "assistant", "content": "Welcome!"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Sure."},
    ]
    sample = tokenize_row({"messages": messages}, tokenizer, "conversational", eos_token=EOS, assistant_only_loss=True)
    assert trained_segments(tokenizer, sample) == ["Welcome!<|im_end|>\n", "Sure.<|im_end|>\n"]


def test_messages_without_assistant_and_assistant_only_loss_trains_nothing(tokenizer):
    sample = tokenize_row({"messages": [{"role": "user", "content": "hi"}]}, tokenizer, "conversational",
                          eos_token=EOS, assistant_only_loss=True)
    assert sample["labels"] == [IGNORE] * len(sample["input_ids"])
    assert len(sample["input_ids"]) == 2 + len("user\nhi\n")


def test_messages_not_a_message_list_raises(tokenizer):
    with pytest.raises(DatasetFormatError, match="'messages' must be a non-empty list of"):
        tokenize_row({"messages": "hello"}, tokenizer, "conversational", eos_token=EOS)


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_messages_without_chat_template_raises(no_template_tokenizer, assistant_only_loss):
    assert not no_template_tokenizer.chat_template
    with pytest.raises(DatasetFormatError, match="no chat template"):
        tokenize_row({"messages": CONVERSATION}, no_template_tokenizer, "conversational", eos_token=EOS,
                     assistant_only_loss=assistant_only_loss)


def test_conversational_prompt_completion_without_chat_template_raises(no_template_tokenizer):
    row = {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]}
    with pytest.raises(DatasetFormatError, match="chat template"):
        tokenize_row(row, no_template_tokenizer, "prompt_completion", eos_token=EOS)


def test_assistant_only_loss_rejects_rewriting_template(tokenizer):
    # A template that renders only the last message rewrites earlier turns.
    import copy

    tok = copy.deepcopy(tokenizer)  # leave the session fixture untouched
    tok.chat_template = "{{ messages[-1]['role'] + ':' + messages[-1]['content'] + '\n' }}"
    with pytest.raises(DatasetFormatError, match="assistant_only_loss=True"):
        tokenize_row({"messages": CONVERSATION}, tok, "conversational", eos_token=EOS, assistant_only_loss=True)
    assert tokenizer.chat_template != tok.chat_template


# ------------------------------------------------------------------------------------------------------------
# tokenize_row: tokenized rows
# ------------------------------------------------------------------------------------------------------------


def test_tokenized_with_labels(tokenizer):
    row = {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}
    assert tokenize_row(row, tokenizer, "tokenized", eos_token=EOS) == {
        "input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}


def test_tokenized_with_completion_mask(tokenizer):
    row = {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 1, 0, 1]}
    assert tokenize_row(row, tokenizer, "tokenized", eos_token=EOS) == {
        "input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8]}


def test_tokenized_labels_take_precedence_over_completion_mask(tokenizer):
    row = {"input_ids": [5, 6, 7], "labels": [5, -100, 7], "completion_mask": [0, 0, 0]}
    assert tokenize_row(row, tokenizer, "tokenized", eos_token=EOS)["labels"] == [5, -100, 7]


@pytest.mark.parametrize("extra", [{}, {"labels": None}, {"completion_mask": None}])
def test_tokenized_without_labels_trains_everything(tokenizer, extra):
    row = {"input_ids": (9, 10, 11), **extra}
    sample = tokenize_row(row, tokenizer, "tokenized", eos_token=EOS)
    assert sample == {"input_ids": [9, 10, 11], "labels": [9, 10, 11]}  # no EOS appended to pre-tokenized rows
    assert isinstance(sample["input_ids"], list)


@pytest.mark.parametrize(
    "row,n_labels",
    [({"input_ids": [1, 2, 3], "labels": [1, 2]}, 2), ({"input_ids": [1, 2, 3], "labels": [1, 2, 3, 4]}, 4),
     ({"input_ids": [1, 2, 3], "completion_mask": [1, 1]}, 2)],
)
def test_tokenized_length_mismatch_raises(tokenizer, row, n_labels):
    with pytest.raises(DatasetFormatError, match=f"has {n_labels} entries but 'input_ids' has 3"):
        tokenize_row(row, tokenizer, "tokenized", eos_token=EOS)


def test_tokenized_completion_mask_longer_than_input_ids_raises(tokenizer):
    with pytest.raises(DatasetFormatError):
        tokenize_row({"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1, 1]}, tokenizer, "tokenized", eos_token=EOS)


# ------------------------------------------------------------------------------------------------------------
# truncate, shift_targets
# ------------------------------------------------------------------------------------------------------------

SAMPLE = {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]}


def test_truncate_keep_start():
    assert truncate(SAMPLE, 3, "keep_start") == {"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}
    assert truncate(SAMPLE, 3) == {"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}


def test_truncate_keep_end():
    assert truncate(SAMPLE, 3, "keep_end") == {"input_ids": [3, 4, 5], "labels": [3, 4, 5]}
    assert truncate(SAMPLE, 1, "keep_end") == {"input_ids": [5], "labels": [5]}


@pytest.mark.parametrize("max_length", [None, 5, 6, 100])
@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncate_noop(max_length, mode):
    assert truncate(SAMPLE, max_length, mode) is SAMPLE


def test_truncate_cuts_every_key():
    sample = {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], "position_ids": [0, 1, 2, 3]}
    assert truncate(sample, 2, "keep_end") == {"input_ids": [3, 4], "labels": [3, 4], "position_ids": [2, 3]}


def test_shift_targets():
    assert shift_targets(SAMPLE) == {"input_ids": [1, 2, 3, 4, 5], "target_ids": [-100, 3, 4, 5, -100]}
    assert shift_targets({"input_ids": [7], "labels": [7]}) == {"input_ids": [7], "target_ids": [-100]}
    assert shift_targets({"input_ids": [1, 2], "labels": [1, 2]})["target_ids"] == [2, -100]


def test_shift_after_tokenize_prompt_completion(tokenizer):
    sample = tokenize_row({"prompt": "ab", "completion": "c"}, tokenizer, "prompt_completion", eos_token=EOS)
    shifted = shift_targets(sample)
    # position 1 ("b", the last prompt token) predicts "c"; position 2 ("c") predicts EOS; EOS predicts nothing
    assert shifted["target_ids"] == [IGNORE] + enc(tokenizer, "c") + [EOS_ID, IGNORE]


# ------------------------------------------------------------------------------------------------------------
# pack_samples
# ------------------------------------------------------------------------------------------------------------


def _samples(lengths, start=1):
    """Samples with distinct token values; labels train everything, then targets are shifted."""
    out, token = [], start
    for n in lengths:
        ids = list(range(token, token + n))
        token += n
        out.append(shift_targets({"input_ids": ids, "labels": list(ids)}))
    return out


def test_pack_samples_rows():
    samples = _samples([5, 4, 3, 3, 1])
    rows = pack_samples(samples, 8)
    # bins [[0, 2], [1, 3, 4]], members in original order
    assert rows[0]["input_ids"] == samples[0]["input_ids"] + samples[2]["input_ids"]
    assert rows[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows[0]["target_ids"] == [2, 3, 4, 5, -100, 11, 12, -100]
    assert rows[1]["input_ids"] == samples[1]["input_ids"] + samples[3]["input_ids"] + samples[4]["input_ids"]
    assert rows[1]["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 0]
    assert rows[1]["target_ids"] == [7, 8, 9, -100, 14, 15, -100, -100]
    assert len(rows) == 2


def test_pack_samples_keeps_dataset_order_within_a_row():
    # best-fit decreasing places the longer sample #1 first, but a row lists its samples in dataset order
    samples = _samples([2, 4])
    assert pack_bfd([2, 4], 8) == [[1, 0]]
    (row,) = pack_samples(samples, 8)
    assert row["input_ids"] == [1, 2, 3, 4, 5, 6]
    assert row["position_ids"] == [0, 1, 0, 1, 2, 3]
    assert row["target_ids"] == [2, -100, 4, 5, 6, -100]


@settings(max_examples=examples(60), deadline=None, database=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=1, max_size=25), max_length=st.integers(16, 40))
def test_pack_samples_properties(lengths, max_length):
    samples = _samples(lengths)
    rows = pack_samples(samples, max_length)
    all_ids = []
    for row in rows:
        n = len(row["input_ids"])
        assert n == len(row["target_ids"]) == len(row["position_ids"]) <= max_length
        all_ids += row["input_ids"]
        pos, tgt = row["position_ids"], row["target_ids"]
        assert pos[0] == 0
        for t in range(n):
            last_of_sample = t == n - 1 or pos[t + 1] == 0
            if last_of_sample:
                assert tgt[t] == IGNORE  # never a target across a document boundary
            else:
                assert pos[t + 1] == pos[t] + 1
                assert tgt[t] == row["input_ids"][t + 1]
    assert sorted(all_ids) == list(range(1, sum(lengths) + 1))  # every token exactly once


# ------------------------------------------------------------------------------------------------------------
# Collator
# ------------------------------------------------------------------------------------------------------------

COLLATE_SAMPLES = [
    {"input_ids": [1, 2, 3], "target_ids": [2, 3, -100]},
    {"input_ids": [4, 5], "target_ids": [5, -100]},
]


def test_collator_padded():
    batch = Collator(pad_token_id=PAD_ID)(COLLATE_SAMPLES)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, PAD_ID]]
    assert batch["target_ids"].tolist() == [[2, 3, -100], [5, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["position_ids"] is None
    assert batch["num_input_tokens"].item() == 5
    for key in ("input_ids", "target_ids", "attention_mask"):
        assert batch[key].dtype == torch.long
        assert batch[key].shape == (2, 3)


def test_collator_padded_pad_to_multiple_of():
    batch = Collator(pad_token_id=0, pad_to_multiple_of=4)(COLLATE_SAMPLES)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert batch["target_ids"].tolist() == [[2, 3, -100, -100], [5, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["num_input_tokens"].item() == 5
    # already a multiple: unchanged width
    batch = Collator(pad_token_id=0, pad_to_multiple_of=3)(COLLATE_SAMPLES)
    assert batch["input_ids"].shape == (2, 3)


def test_collator_padding_free():
    batch = Collator(pad_token_id=PAD_ID, padding_free=True)(COLLATE_SAMPLES)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert batch["target_ids"].tolist() == [[2, 3, -100, 5, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["attention_mask"] is None
    assert batch["num_input_tokens"].item() == 5
    assert batch["input_ids"].shape == batch["target_ids"].shape == batch["position_ids"].shape == (1, 5)
    assert batch["input_ids"].dtype == torch.long


def test_collator_padding_free_pad_to_multiple_of():
    batch = Collator(pad_token_id=PAD_ID, padding_free=True, pad_to_multiple_of=8)(COLLATE_SAMPLES)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, PAD_ID, PAD_ID, PAD_ID]]
    assert batch["target_ids"].tolist() == [[2, 3, -100, 5, -100, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["num_input_tokens"].item() == 5  # padding is not counted


def test_collator_keeps_packed_rows_as_rows():
    """Packed rows are not flattened into one (that would make attention (B x T)^2); trailing padding
    restarts its own positions."""
    rows = pack_samples(_samples([3, 2, 4]), 5)  # bins [[2], [0, 1]]
    for padding_free in (False, True):
        batch = Collator(pad_token_id=0, padding_free=padding_free)(rows)
        assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
        assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 0], [1, 2, 3, 4, 5]]
        assert batch["target_ids"].tolist() == [[7, 8, 9, -100, -100], [2, 3, -100, 5, -100]]
        assert batch["attention_mask"] is None
        assert batch["num_input_tokens"].item() == 9


def test_end_to_end_sft_pipeline(tokenizer):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "10+5=", "completion": "15"}]
    samples = [shift_targets(truncate(tokenize_row(r, tokenizer, "prompt_completion", eos_token=EOS), 16))
               for r in rows]
    batch = Collator(pad_token_id=tokenizer.pad_token_id)(samples)
    # row 0: "1+1=2<eos>" (6 tokens) padded to 8; targets: "2" at position 3, EOS at position 4
    assert batch["input_ids"][0].tolist() == enc(tokenizer, "1+1=2") + [EOS_ID, PAD_ID, PAD_ID]
    assert batch["target_ids"][0].tolist() == [-100, -100, -100] + enc(tokenizer, "2") + [EOS_ID] + [-100] * 3
    assert batch["target_ids"][1].tolist() == [-100] * 4 + enc(tokenizer, "15") + [EOS_ID, -100]
    assert batch["num_input_tokens"].item() == 6 + 8


# --- TRL parity of tokenization (found by a side-by-side audit against TRL 1.16) ---------------------------


def bos_tokenizer():
    """The tiny tokenizer plus a BOS its post-processor adds to plain text, as Llama's and Gemma's do."""
    from tokenizers import processors

    from trainers.cli.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                                         special_tokens=[("<s>", bos)])
    return tok, bos


def test_plain_text_gets_the_tokenizers_bos_like_trl():
    tok, bos = bos_tokenizer()
    text = tokenize_row({"text": "hello"}, tok, "language_modeling", eos_token=EOS)
    assert text["input_ids"] == [bos] + enc(tok, "hello" + EOS)  # TRL: [259, 71, 68, 75, 75, 78, 256]
    pair = tokenize_row({"prompt": "ab", "completion": "cd"}, tok, "prompt_completion", eos_token=EOS)
    assert pair["input_ids"] == [bos] + enc(tok, "abcd" + EOS)
    assert pair["labels"] == [IGNORE] * 3 + enc(tok, "cd" + EOS)  # BOS and prompt are not trained
    chat = tokenize_row({"messages": [{"role": "user", "content": "hi"}]}, tok, "conversational", eos_token=EOS)
    assert bos not in chat["input_ids"]  # a rendered chat holds its own special tokens


def test_tokenized_rows_use_assistant_masks_and_completion_mask_like_trl(tokenizer):
    row = {"input_ids": [10, 11, 12, 13, 256], "completion_mask": [0, 0, 1, 1, 1]}
    assert tokenize_row(row, tokenizer, "tokenized", eos_token=EOS)["labels"] == [IGNORE, IGNORE, 12, 13, 256]
    off = tokenize_row(row, tokenizer, "tokenized", eos_token=EOS, completion_only_loss=False)
    assert off["labels"] == [10, 11, 12, 13, 256]  # completion_only_loss=False trains every token
    masked = {"input_ids": [10, 11, 12, 13, 256], "assistant_masks": [0, 0, 1, 1, 1]}
    assert tokenize_row(masked, tokenizer, "tokenized", eos_token=EOS, completion_only_loss=False)["labels"] == \
        [IGNORE, IGNORE, 12, 13, 256]  # assistant_masks always applies
    with pytest.raises(DatasetFormatError, match="'assistant_masks' has 2 entries but 'input_ids' has 5"):
        tokenize_row({"input_ids": [10, 11, 12, 13, 256], "assistant_masks": [0, 1]}, tokenizer, "tokenized",
                     eos_token=EOS)


def test_tools_and_chat_template_kwargs_columns_reach_the_template():
    import json

    from trainers.cli.tiny import CHATML_TEMPLATE, build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = ("{% if tools %}{{ 'TOOLS:' ~ (tools|length) ~ '\\n' }}{% endif %}"
                         "{% if thinking is defined and not thinking %}{{ 'NOTHINK\\n' }}{% endif %}" + CHATML_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for value in (tools, json.dumps(tools)):  # a list, or JSON text as datasets often store it
        row = {"messages": messages, "tools": value, "chat_template_kwargs": {"thinking": False}}
        out = tokenize_row(row, tok, "conversational", eos_token=EOS, assistant_only_loss=True)
        assert tok.decode(out["input_ids"]).startswith("TOOLS:1\nNOTHINK\n<|im_start|>user")
        assert trained_segments(tok, out) == ["yo<|im_end|>\n"]
    calling = messages[:1] + [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    check_messages(calling, "column 'messages'")  # a tool-calling turn may have no content (the template renders it)
    with pytest.raises(DatasetFormatError, match="Column 'tools' holds text that is not JSON"):
        tokenize_row({"messages": messages, "tools": "[{"}, tok, "conversational", eos_token=EOS)


def test_a_list_of_rows_keeps_every_key_any_row_has():
    """datasets' from_list takes its columns from the first row; a key only later rows have must not vanish."""
    from trainers.data.formats import as_dataset

    dataset = as_dataset([{"prompt": "a"}, {"prompt": "b", "answer": "2"}], "train_dataset")
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset["answer"] == [None, "2"]
