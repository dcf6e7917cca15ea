"""use_vllm=True (colocate) with a model vLLM cannot load or run: a ConfigError when the trainer is built, naming
the model and vLLM's reason (not a traceback from deep inside vLLM, nor a failure in the first round), and nothing
left behind. Runs tests/integration/vllm_unloadable_job.py in its own process (vLLM binds the threads of the
process its engine runs in)."""

import os

import pytest

from tests.conftest import REPO, run_job

pytestmark = pytest.mark.usefixtures("vllm_python")  # skipped where vLLM is not installed
JOB = os.path.join(REPO, "tests", "integration", "vllm_unloadable_job.py")


def test_a_model_vllm_cannot_load_is_a_clear_error(tmp_path):
    report = run_job(JOB, tmp_path, report=tmp_path / "report.json")

    unknown = report["unknown_architecture"]  # refused when the engine is made
    assert unknown["error_type"] == "ConfigError", unknown
    message = unknown["message"]
    assert message.startswith(f"use_vllm=True: vLLM cannot load or run the model {report['unknown_dir']} "
                               f"(architectures ['NoSuchModelForCausalLM'], model_type 'qwen2')"), message
    assert "are not supported for now" in message and "vllm_mode='server'" in message
    assert len(message) < 1200 and "\n" not in message  # vLLM's list of supported architectures is cut

    small = report["head_dim_16"]  # the engine starts; its first generation fails: now when the trainer is built
    assert small["error_type"] == "ConfigError", small
    assert small["message"].startswith(f"use_vllm=True: vLLM cannot load or run the model {report['small_heads_dir']} "
                                       f"(architectures ['Qwen2ForCausalLM']"), small["message"]
    assert "head_dim=16" in small["message"], small["message"]  # vLLM's reason

    for case in (unknown, small):  # the engine that did start was shut down, with its thread binding
        assert case["children"] == [] and case["threads_settable"], case
