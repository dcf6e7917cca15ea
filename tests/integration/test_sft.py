"""SFT end to end on a tiny model, one CPU process."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import config_factory, step_records
from tests.floats import assert_trained_alike
from trainers import SFTConfig, SFTTrainer
from trainers.errors import ConfigError
from trainers.sft.packing import pack_samples
from trainers.sft.tokenize import Collator, shift_targets
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows


config = config_factory(SFTConfig, per_device_train_batch_size=8, learning_rate=1e-3, max_steps=4)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}


def test_sft_drives_the_loss_well_down(tiny_model_dir, tmp_path):
    rows = as_sft_rows(reverse_digits_rows(512, seed=1))
    trainer = SFTTrainer(model=tiny_model_dir, args=config(
        tmp_path, per_device_train_batch_size=32, learning_rate=3e-3, max_steps=80, logging_steps=10,
        logging_first_step=True, lr_scheduler_type="cosine", warmup_steps=5), train_dataset=rows)
    result = trainer.train()
    history = step_records(trainer)
    assert history[0]["loss"] > 5.0  # ln(259) = 5.56: a random model
    assert history[-1]["loss"] < 1.6, history  # copying digits in reverse is learnable
    assert history[-1]["mean_token_accuracy"] > 0.4
    assert result.global_step == 80
    for key in ("step", "loss", "learning_rate", "grad_norm", "epoch", "num_tokens", "mean_token_accuracy"):
        assert key in history[-1]
    # num_tokens counts every non-padding input token: 32 rows x (6 prompt + 5 completion + 1 EOS) per step
    assert history[-1]["num_tokens"] == 80 * 32 * 12
    with open(os.path.join(tmp_path / "out", "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f] == trainer.state.log_history  # train()'s summary last


def test_save_then_reload_gives_the_same_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path), train_dataset=as_sft_rows(reverse_digits_rows(32)))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    ids = torch.tensor([tokenizer("12345=54321")["input_ids"]])
    trained = trainer.unwrapped_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained(ids).logits, rtol=0, atol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        assert not torch.allclose(original(ids).logits, reloaded(ids).logits)  # training did change it


def test_peft_trains_and_saves_only_the_adapter(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, learning_rate=1e-2),
                         train_dataset=as_sft_rows(reverse_digits_rows(32)),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    before = weights(trainer)
    trainer.train()
    after = weights(trainer)
    lora_keys = [k for k in before if "lora_" in k]
    assert lora_keys
    for key in before:
        changed = not torch.equal(before[key], after[key])
        # lora_A starts random, lora_B at zero: both move; nothing else may
        assert changed == ("lora_" in key), key
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    assert not os.path.exists(tmp_path / "adapter" / "model.safetensors")


def test_packed_documents_see_only_themselves(tiny_model_dir, tokenizer):
    """Each packed document's logits equal those of the document alone (no attention across documents)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    texts = ["12345=54321", "hello world, a longer document", "7=7", "another one"]
    samples = [shift_targets({"input_ids": tokenizer(t)["input_ids"], "labels": tokenizer(t)["input_ids"]})
               for t in texts]
    rows = pack_samples(samples, max_length=64)
    assert len(rows) == 1  # all four fit one row of 64
    batch = Collator(tokenizer.pad_token_id, padding_free=True)(rows)
    with torch.no_grad():
        # use_cache=False, as in the trainer's forward: transformers derives the per-document mask from
        # position_ids only when no cache is passed (a generation cache would make it attend across documents).
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        # walk the row by its position ids: a 0 starts a new document
        starts = [i for i, p in enumerate(batch["position_ids"][0].tolist()) if p == 0] + [batch["input_ids"].shape[1]]
        assert len(starts) - 1 == len(texts)
        for begin, end in zip(starts, starts[1:]):
            alone = model(input_ids=batch["input_ids"][:, begin:end]).logits[0]
            torch.testing.assert_close(packed[begin:end], alone, rtol=1e-5, atol=1e-5)
    # and a packed row is not the same as attending across documents
    with torch.no_grad():
        crossing = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    assert not torch.allclose(crossing[starts[1]:], packed[starts[1]:], atol=1e-3)


def test_packed_rows_give_the_padded_loss_and_gradients(tiny_model_dir, tokenizer):
    """The packed-rows fast path ([rows, T], positions restarting per document, trailing padding as a block of
    its own) computes the padded batch's loss and gradients within float tolerance."""
    from transformers import AutoModelForCausalLM

    from trainers.sft.tokenize import IGNORE

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    texts = ["12345=54321", "hello world, a longer document here", "7=7", "another one", "x", "the sat cat mat"]
    samples = [shift_targets({"input_ids": tokenizer(t)["input_ids"], "labels": tokenizer(t)["input_ids"]})
               for t in texts]
    collate = Collator(tokenizer.pad_token_id)
    padded, packed = collate(samples), collate(pack_samples(samples, max_length=40))
    assert packed["input_ids"].shape[0] >= 2 and packed["attention_mask"] is None
    assert (packed["target_ids"] != IGNORE).sum() == (padded["target_ids"] != IGNORE).sum()

    def loss_and_grads(batch):
        model.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["target_ids"].flatten(),
                                                 ignore_index=IGNORE)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_padded, grads_padded = loss_and_grads(padded)
    loss_packed, grads_packed = loss_and_grads(packed)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_trains_to_the_same_place_as_padding(tiny_model_dir, tmp_path):
    """Packing changes batching, not the objective: one step on the same rows gives the same loss."""
    rows = as_sft_rows(reverse_digits_rows(8))
    losses = {}
    for packing in (False, True):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(
            tmp_path / str(packing), packing=packing, max_length=96, max_steps=1, per_device_train_batch_size=8 if not packing else 1,
            shuffle_dataset=False), train_dataset=rows)
        trainer.train()
        losses[packing] = trainer.state.log_history[0]["loss"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_accumulation_split_does_not_change_the_result(tiny_model_dir, tmp_path):
    """(per-device 8, accumulation 1) and (4, 2) see the same global batches: same losses, same weights."""
    rows = as_sft_rows(reverse_digits_rows(40, seed=3))
    rows[0]["completion"] = "a much longer completion than the others"  # uneven token counts per micro-batch
    results = []
    for per_device, accumulation in ((8, 1), (4, 2), (2, 4)):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(
            tmp_path / f"{per_device}", per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation, max_steps=5, lr_scheduler_type="linear"), train_dataset=rows)
        trainer.train()
        assert trainer.effective_batch_size == 8
        results.append(([r["loss"] for r in step_records(trainer)], weights(trainer)))
    reference_losses, reference_weights = results[0]
    for losses, final in results[1:]:
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert_trained_alike(final, reference_weights, learning_rate=1e-3)


def test_evaluation_logs_eval_loss(tiny_model_dir, tmp_path):
    rows = as_sft_rows(reverse_digits_rows(64))
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, eval_strategy="steps", eval_steps=2,
                                                           per_device_eval_batch_size=5),
                         train_dataset=rows, eval_dataset=rows[:13])
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert 0 < evals[-1]["eval_loss"] < evals[0]["eval_loss"] < 6
    assert 0 <= evals[-1]["eval_mean_token_accuracy"] <= 1


def test_eval_on_start_evaluates_the_untrained_model_first(tiny_model_dir, tmp_path):
    rows = as_sft_rows(reverse_digits_rows(64))
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=2, eval_on_start=True),
                         train_dataset=rows, eval_dataset=rows[:13])
    untrained = trainer.evaluate()["eval_loss"]
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    # evaluate() logs too (transformers); then eval_strategy "no": only the one before training
    assert [r["step"] for r in evals] == [0, 0]
    assert evals[1]["eval_loss"] == pytest.approx(untrained, rel=1e-6)
    assert trainer.state.log_history[2]["step"] == 1 and "loss" in trainer.state.log_history[2]  # then training


@pytest.mark.parametrize("option", [{"eval_strategy": "steps"}, {"eval_strategy": "epoch"}, {"eval_on_start": True}])
def test_evaluation_without_an_eval_dataset_is_an_error_up_front(tiny_model_dir, tmp_path, option):
    name = next(iter(option))
    with pytest.raises(ConfigError, match=f"`{name}=.*` needs an eval_dataset"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path, **option),
                   train_dataset=as_sft_rows(reverse_digits_rows(8)))


def test_checkpoints_rotate_and_resume(tiny_model_dir, tmp_path):
    rows = as_sft_rows(reverse_digits_rows(64))
    args = config(tmp_path, max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=2)
    SFTTrainer(model=tiny_model_dir, args=args, train_dataset=rows).train()
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-4", "checkpoint-6", "metrics.jsonl", "training_args.json"]
    resumed = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=8, save_strategy="no"),
                         train_dataset=rows)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 8
    assert [r["step"] for r in step_records(resumed)] == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("options,checkpointed", [
    ({"gradient_checkpointing": True}, [True, True]),
    # transformers 5's names, with its every_n_layers: the tiny model's first of 2 layers only
    ({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}}, [True, False]),
])
def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir, tmp_path, options, checkpointed):
    rows = as_sft_rows(reverse_digits_rows(16))
    finals = []
    for name, extra in (("plain", {}), ("checkpointed", options)):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / name, max_steps=2, **extra),
                             train_dataset=rows)
        layers = trainer.unwrapped_model.model.layers
        assert [layer.gradient_checkpointing for layer in layers] == ([False, False] if not extra else checkpointed)
        trainer.train()
        finals.append(weights(trainer))
    assert trainer.args.gradient_checkpointing and trainer.args.activation_checkpointing  # the names agree
    for key in finals[0]:
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_checkpoint_offload_without_a_gpu_fails_at_construction(tiny_model_dir, tmp_path):
    """transformers' offload pins host memory, which torch cannot do without a GPU: it would fail in the first
    backward. Refused before training, naming the option."""
    with pytest.raises(ConfigError, match=r"gradient_checkpointing_kwargs\['offload'\]"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path, gradient_checkpointing=True,
                                                     gradient_checkpointing_kwargs={"offload": True}),
                   train_dataset=as_sft_rows(reverse_digits_rows(8)))


def test_formatting_func_trains_what_a_text_column_would(tiny_model_dir, tmp_path):
    """TRL's formatting_func: each row becomes one text; the same as passing that text column, eval included."""
    raw = [{"question": f"{i}+{i}", "answer": str(2 * i)} for i in range(16)]
    texts = [{"text": f"Q: {r['question']} A: {r['answer']}"} for r in raw]
    formatted = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / "f", max_steps=2, eval_strategy="steps",
                                                              eval_steps=2),
                           train_dataset=raw, eval_dataset=raw[:4],
                           formatting_func=lambda row: f"Q: {row['question']} A: {row['answer']}")
    plain = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / "p", max_steps=2, eval_strategy="steps",
                                                          eval_steps=2),
                       train_dataset=texts, eval_dataset=texts[:4])
    assert [r["input_ids"] for r in formatted.train_rows] == [r["input_ids"] for r in plain.train_rows]
    formatted.train()
    plain.train()
    losses = [[r.get("loss", r.get("eval_loss")) for r in t.state.log_history] for t in (formatted, plain)]
    assert losses[0] == losses[1]
    # a dataset given to evaluate() is formatted too
    assert formatted.evaluate(eval_dataset=raw[4:8])["eval_loss"] == pytest.approx(
        plain.evaluate(eval_dataset=texts[4:8])["eval_loss"])


def test_formatting_func_errors_name_it(tiny_model_dir, tmp_path):
    from trainers.data.formats import DatasetFormatError

    raw = [{"question": "1+1", "answer": "2"}] * 8
    with pytest.raises(DatasetFormatError, match="formatting_func returned NoneType for row 0 of train_dataset"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path), train_dataset=raw, formatting_func=lambda row: None)
    with pytest.raises(ConfigError, match="completion_only_loss"):  # TRL refuses the pair too
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path), formatting_func=lambda row: row["prompt"],
                   train_dataset=[{"prompt": "1+1=", "completion": "2"}] * 8)
    with pytest.raises(ConfigError, match="formatting_func must be a function"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path), train_dataset=raw, formatting_func="text")
