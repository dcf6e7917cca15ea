"""TRL options that change how SFT batches and weighs tokens, end to end on a tiny model, one CPU process:
packing_strategy ('wrapped', 'bfd_split'), loss_type='dft', pad_to_multiple_of (SFT and GRPO), and PEFT prompt
learning. Each loss is checked against one computed here by hand from the model's logits."""

from itertools import pairwise

import pytest
from transformers import TrainerCallback
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError
from trainers.sft.tokenize import IGNORE, Collator, transformers_labels
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows
from tests.conftest import config_factory

TEXTS = [{"text": "a sentence of text number " + str(i) + " that goes on" * (i % 3)} for i in range(10)]


config = config_factory(SFTConfig, per_device_train_batch_size=8, learning_rate=1e-3, max_steps=1,
                        shuffle_dataset=False)


def first_loss(trainer) -> float:
    """The training loss of the first step (evaluations log records without one)."""
    return next(record["loss"] for record in trainer.state.log_history if "loss" in record)


def hand_loss(model_dir, rows, per_token=lambda logps: -logps) -> float:
    """The mean over every trained token of ``per_token(log p(target))``, each row run alone through the
    untrained model (its positions 0..len-1, no padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids, targets = torch.tensor([row["input_ids"]]), torch.tensor(row["target_ids"])
            logps = model(input_ids=ids).logits[0].float().log_softmax(-1)  # [T, V]
            trained = targets != IGNORE
            picked = logps[trained].gather(-1, targets[trained].unsqueeze(-1)).squeeze(-1)
            total += per_token(picked).sum().item()
            count += int(trained.sum())
    return total / count


def documents(row: dict) -> list[dict]:
    """A packed row's samples, found where its position ids restart."""
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
    return [{"input_ids": row["input_ids"][a:b], "target_ids": row["target_ids"][a:b]}
            for a, b in pairwise(starts)]


@pytest.mark.parametrize("strategy", ["wrapped", "bfd_split", "bfd"])
def test_packing_strategies_keep_or_cut_tokens_as_trl(tiny_model_dir, tmp_path, strategy):
    plain = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / "plain", max_length=None), train_dataset=TEXTS)
    samples = [s["input_ids"] for s in plain.train_rows]  # untruncated, in dataset order
    assert max(len(s) for s in samples) > 16  # some are cut or split below
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, packing=True, packing_strategy=strategy,
                                                           max_length=16, per_device_train_batch_size=64),
                         train_dataset=TEXTS)
    rows = trainer.train_rows
    assert all(len(r["input_ids"]) <= 16 for r in rows)
    kept = sum(len(r["input_ids"]) for r in rows)
    if strategy == "wrapped":  # the samples end to end, cut every 16 tokens
        stream = [t for s in samples for t in s]
        assert [r["input_ids"] for r in rows] == [stream[i:i + 16] for i in range(0, len(stream), 16)]
    else:  # bfd drops what is over max_length; bfd_split keeps it as pieces
        assert kept == sum(len(s) if strategy == "bfd_split" else min(len(s), 16) for s in samples)
    # one step over every row (some twice, to fill the batch of 64): the loss of each row as one sequence
    # (wrapped) or of each packed sample alone
    batch = [rows[i] for i in trainer.sampler.batch(0)]
    trainer.train()
    pieces = batch if strategy == "wrapped" else [piece for r in batch for piece in documents(r)]
    assert first_loss(trainer) == pytest.approx(hand_loss(tiny_model_dir, pieces), rel=1e-4)


def test_dft_loss_trains_and_evaluates_the_formula(tiny_model_dir, tmp_path):
    rows = as_sft_rows(reverse_digits_rows(8))
    losses = {}
    for loss_type in ("nll", "dft"):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / loss_type, loss_type=loss_type),
                             train_dataset=rows, eval_dataset=rows)
        eval_loss = trainer.evaluate()["eval_loss"]
        trainer.train()
        losses[loss_type] = first_loss(trainer)
        assert eval_loss == pytest.approx(losses[loss_type], rel=1e-5)  # the same rows, the same formula
        assert any("mean_token_accuracy" in record for record in trainer.state.log_history)
    # -sg(p) log p, averaged over the trained tokens (TRL's DFT); the NLL for comparison
    assert losses["dft"] == pytest.approx(hand_loss(tiny_model_dir, trainer.train_rows,
                                                    lambda logps: -logps * logps.exp()), rel=1e-4)
    assert losses["nll"] == pytest.approx(hand_loss(tiny_model_dir, trainer.train_rows), rel=1e-4)
    assert losses["dft"] < losses["nll"] / 50  # a random model: p ~ 1/259 on every token


def test_dft_with_compute_loss_func_is_trls_error(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="`compute_loss_func` together with `loss_type='dft'`"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path, loss_type="dft"),
                   train_dataset=as_sft_rows(reverse_digits_rows(8)),
                   compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum())


@pytest.mark.parametrize("packing", [False, True])
def test_sft_pad_to_multiple_of_pads_and_keeps_the_loss(tiny_model_dir, tmp_path, packing):
    rows = as_sft_rows(reverse_digits_rows(8))
    records, widths = {}, {}
    for multiple in (None, 48):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(
            tmp_path / str(multiple), pad_to_multiple_of=multiple, packing=packing, max_length=40,
            per_device_train_batch_size=8 if not packing else 2), train_dataset=rows)
        widths[multiple] = trainer.micro_batch(0, 0).input_ids.shape[1]
        trainer.train()
        records[multiple] = trainer.state.log_history[0]
    assert widths[None] % 48 and widths[48] == 48
    assert records[48]["loss"] == pytest.approx(records[None]["loss"], rel=1e-5)
    assert records[48]["grad_norm"] == pytest.approx(records[None]["grad_norm"], rel=1e-4)


def test_grpo_pad_to_multiple_of_pads_and_keeps_the_loss(tiny_model_dir, tmp_path):
    prompts = [{"prompt": p} for p in ["abc", "hello world", "xyz", "12"]]

    def digits(completions, **kwargs):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    records, rounds = {}, {}
    for multiple in (None, 16):
        args = GRPOConfig(output_dir=str(tmp_path / str(multiple)), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=6, learning_rate=1e-2, max_steps=1, logging_steps=1,
                          save_strategy="no", disable_tqdm=True, seed=0, beta=0.04, pad_to_multiple_of=multiple,
                          gradient_accumulation_steps=2, num_iterations=2, shuffle_dataset=False)
        built = []  # each round's Rollout (the on_rollout_end event)
        keep = type("Keep", (TrainerCallback,), {"on_rollout_end": lambda self, *a, rollout=None, **k: built.append(rollout)})
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=args, train_dataset=prompts,
                              callbacks=[keep()])
        trainer.train()
        records[multiple] = trainer.state.log_history[0]
        rounds[multiple] = built[-1]
    padded = rounds[16]
    assert padded.prompt_ids.shape[1] == 16 and padded.completion_ids.shape[1] == 16
    micro = padded.micro_batch(0, 4)
    assert micro.prompt_ids.shape[1] % 16 == 0 and micro.completion_ids.shape[1] % 16 == 0
    assert rounds[None].completion_ids.shape[1] <= 6
    for key in ("loss", "reward", "kl", "grad_norm", "entropy"):
        assert records[16][key] == pytest.approx(records[None][key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_prompt_learning_trains_only_the_prompt(tiny_model_dir, tmp_path, method):
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig

    peft_config = {"prompt_tuning": PromptTuningConfig, "p_tuning": PromptEncoderConfig,
                   "prefix_tuning": PrefixTuningConfig}[method](task_type="CAUSAL_LM", num_virtual_tokens=4)
    rows = as_sft_rows(reverse_digits_rows(8))
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=10, learning_rate=0.1,
                                                           lr_scheduler_type="constant"),
                         train_dataset=rows, eval_dataset=rows, peft_config=peft_config)
    model = trainer.unwrapped_model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start = trainer.evaluate()["eval_loss"]
    # the loss leaves out the virtual tokens' positions, as PEFT's own loss does (it gives them label -100;
    # prefix tuning puts them in the attention cache, not in the outputs)
    batch = Collator(trainer.processing_class.pad_token_id)(trainer.eval_rows)
    with torch.no_grad():
        peft_loss = model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 labels=transformers_labels(batch["target_ids"])).loss
    assert start == pytest.approx(peft_loss.item(), rel=1e-5)
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < start - 0.05
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert "prompt_encoder.default.embedding.weight" in changed  # P-tuning: its prompt encoder's MLP too
    assert all(k.startswith("prompt_encoder.default.") for k in changed), changed


def test_prompt_learning_with_packing_or_in_grpo_is_refused(tiny_model_dir, tmp_path):
    from peft import PromptEncoderConfig, PromptTuningConfig, get_peft_model

    rows = as_sft_rows(reverse_digits_rows(8))
    with pytest.raises(ConfigError, match="`packing=True` does not work with a PEFT prompt-learning adapter"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path, packing=True, max_length=64), train_dataset=rows,
                   peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="GRPOTrainer: a PEFT prompt-learning adapter \\(P_TUNING.*peft_config"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    args=GRPOConfig(output_dir=str(tmp_path / "grpo"), num_generations=2,
                                    per_device_train_batch_size=2, max_completion_length=4),
                    train_dataset=[{"prompt": "abc"}],
                    peft_config=PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                    encoder_hidden_size=16))
    # a PeftModel built with one, given as the model
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="PROMPT_TUNING"):
        GRPOTrainer(model=peft_model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    args=GRPOConfig(output_dir=str(tmp_path / "grpo2"), num_generations=2,
                                    per_device_train_batch_size=2, max_completion_length=4),
                    train_dataset=[{"prompt": "abc"}], processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
