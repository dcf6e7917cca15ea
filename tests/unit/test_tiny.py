"""The embedded default's tiny model: every process of a launch builds it into the same folder at once."""

import multiprocessing
import os

from trainers.tools.tiny import embedded_default


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
