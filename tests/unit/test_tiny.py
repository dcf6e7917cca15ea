"""trainers/cli/tiny.py: the embedded default's tiny model (every process of a launch builds it into the same
folder at once), and the task tokenizer of the tool demo."""

import multiprocessing
import os

from trainers.agents.rendering import check_tool_template, tool_schemas
from trainers.cli.tiny import build_task_tokenizer, build_tokenizer, embedded_default, save_tiny_model


def build_and_read(output_dir: str, failures) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    try:
        for _ in range(10):
            path, _ = embedded_default("grpo", {"output_dir": output_dir})
            load_file(os.path.join(path, "model.safetensors"))
            AutoConfig.from_pretrained(path)
            AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - any failure to read is the finding
        failures.put(repr(error))


def test_processes_building_the_same_tiny_model_never_read_a_half_written_file(tmp_path):
    # Writing straight into the folder failed here within ten rounds of four processes (a reader parsed an
    # empty config or tokenizer file while a sibling rewrote it).
    context = multiprocessing.get_context("fork")
    failures = context.Queue()
    workers = [context.Process(target=build_and_read, args=(str(tmp_path), failures)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0] * 4
    assert failures.empty(), failures.get()
    # nothing is left behind but the model folder
    assert sorted(os.listdir(tmp_path)) == ["tiny-model"]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def test_a_task_tokenizer_spells_digits_and_reloads_to_the_same_ids(tmp_path):
    """build_task_tokenizer (the tool demo's): the words of its texts become tokens, digits stay one token each,
    a sampled assistant turn tokenizes as it does inside the whole conversation, and a tiny Qwen2's folder reloads
    it to the same ids (transformers' AutoTokenizer puts Qwen2's own pre-tokenizer back on load, whatever
    tokenizer.json says: a tokenizer that split text another way would change under the trainer)."""
    from transformers import AutoTokenizer

    def conversation(a, b):
        return [{"role": "user", "content": f"What is {a} * {b}?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]},
                {"role": "tool", "name": "multiply", "content": str(a * b)},
                {"role": "assistant", "content": f"The answer is {a * b}."}]

    renderer, schemas = build_tokenizer(tools=True), tool_schemas([multiply])
    texts = [renderer.apply_chat_template(conversation(a, a + 7), tools=schemas, tokenize=False)
             for a in range(100, 400, 3)]
    tok = build_task_tokenizer(texts, tools=True)
    check_tool_template(tok, None)
    words = tok.convert_ids_to_tokens(tok("multiply answer integer", add_special_tokens=False)["input_ids"])
    assert words == ["multiply", "Ġanswer", "Ġinteger"]
    assert tok.tokenize("56088") == list("56088")
    whole = conversation(123, 456)
    head = tok.apply_chat_template(whole[:1], tools=schemas, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    turn = tok.apply_chat_template(whole[:2], tools=schemas, tokenize=True, return_dict=False)
    assert turn[:len(head)] == head  # the header's tokens end where the model's begin
    assert len(turn) < len(renderer.apply_chat_template(whole[:2], tools=schemas, tokenize=True,
                                                        return_dict=False)) / 3
    again = AutoTokenizer.from_pretrained(save_tiny_model(str(tmp_path / "model"), tokenizer=tok))
    for text in texts[:5] + ["The answer is 56088. 0123456789"]:
        assert again(text)["input_ids"] == tok(text)["input_ids"]
