"""vllm_lora_sync's choice between the adapter alone and the merged weights (generation/vllm_lora.py), from what
the policy is and what the servers say (their /server_info lora_config, given here as the dicts they return), and
the adapter a sync saves. Against real engines: tests/integration/test_vllm_lora.py and test_vllm_colocate.py."""

import argparse
import os

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from tests.conftest import warnings_of
from trainers.errors import ConfigError
from trainers.generation.vllm_lora import AdapterFolders, lora_sync_choice, served_rank
from trainers.generation.vllm_server import build_env
from trainers.cli.tiny import build_model

SERVER = {"max_lora_rank": 8, "max_loras": 2}


def peft_model(**lora):
    from peft import LoraConfig, get_peft_model

    base = build_model(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    return get_peft_model(base, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                              **lora}))


def test_auto_takes_the_adapter_where_the_engine_serves_it():
    model = peft_model()
    assert lora_sync_choice("auto", model, None)  # a colocated engine: started to serve it
    assert lora_sync_choice("auto", model, {"http://a": SERVER, "http://b": SERVER})
    assert not lora_sync_choice("merged", model, {"http://a": SERVER})
    plain = build_model(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert not lora_sync_choice("auto", plain, None)
    with pytest.raises(ConfigError, match="vllm_lora_sync='adapter' needs a PEFT LoRA policy"):
        lora_sync_choice("adapter", plain, None)


@pytest.mark.parametrize("lora, servers, reason", [
    ({}, {"http://a": SERVER, "http://b": None}, "http://b was started without --enable-lora"),
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"bias": "lora_only"}, None, "trains biases"),
])
def test_what_vllm_cannot_serve_is_sent_merged_with_a_warning_or_refused(caplog, lora, servers, reason):
    """'auto': the merged weights, with a warning naming why; 'adapter': that reason is an error."""
    model = peft_model(**lora)
    with warnings_of("trainers", caplog) as warnings:
        assert not lora_sync_choice("auto", model, servers)
    assert len(warnings()) == 1 and reason in warnings()[0].getMessage()
    with pytest.raises(ConfigError, match=f"vllm_lora_sync='adapter'.*{reason}"):
        lora_sync_choice("adapter", model, servers)


def test_a_server_with_too_small_a_rank_is_an_error_that_names_the_flag():
    with pytest.raises(ConfigError, match="rank 16 .* --max-lora-rank 8. Restart it with --max-lora-rank 16"):
        lora_sync_choice("auto", peft_model(r=16), {"http://a": SERVER})
    assert served_rank(4) == 8 and served_rank(9) == 16 and served_rank(1) == 1
    with pytest.raises(ConfigError, match="above the largest"):
        served_rank(1024)


def test_a_sync_saves_the_adapter_alone_under_a_new_name_and_keeps_the_newest(tmp_path):
    model = peft_model()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    folders = AdapterFolders(str(tmp_path / "adapters"), keep=2)
    saved = [folders.save(Accelerator(cpu=True), model, version=step) for step in range(3)]
    assert len({a.name for a in saved}) == 3 and [a.version for a in saved] == [0, 1, 2]
    assert sorted(os.listdir(tmp_path / "adapters")) == sorted(os.path.basename(a.path) for a in saved[1:])
    files = load_file(os.path.join(saved[-1].path, "adapter_model.safetensors"))
    assert all("lora_" in name for name in files) and len(files) == 2 * 2  # q and v: A and B each
    ours = {n: p for n, p in model.named_parameters() if "lora_B" in n and "q_proj" in n}
    theirs = [t for n, t in files.items() if "lora_B" in n and "q_proj" in n]
    assert torch.equal(next(iter(ours.values())), theirs[0])
    assert os.path.isfile(os.path.join(saved[-1].path, "adapter_config.json"))
    folders.remove()
    assert os.listdir(tmp_path / "adapters") == []


def test_vllm_serve_allows_runtime_adapters_only_with_enable_lora():
    args = argparse.Namespace(cpu_kvcache_space=1)
    assert build_env(args, {}, extra_args=["--enable-lora", "--max-lora-rank", "8"])[
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in build_env(args, {}, extra_args=["--seed", "0"])
