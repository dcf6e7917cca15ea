"""2 processes (DDP over gloo): compute_metrics and predict() over 5 eval rows in batches of 2 per process, so
the processes hold 3 and 2 rows and the last batch has a stand-in row. Writes report-<rank>.json with what
compute_metrics received and what predict() returned, which the test compares with a 1-process run, and the
losses of 2 training steps with and without a compute_loss_func that computes the same NLL (its
num_items_in_batch must count both processes' tokens for the two to agree).

argv: model_dir output_dir
"""

import json
import os
import sys

import torch

from trainers import SFTConfig, SFTTrainer

EVAL = [{"text": "the quick brown fox " * (i + 1)} for i in range(5)]
ROWS = [{"text": f"row {i} " + "abc " * (i + 1)} for i in range(8)]


def run(model_dir: str, output_dir: str) -> dict:
    """What compute_metrics and predict() give on this process (the whole evaluation, in dataset order)."""
    seen = {}

    def compute_metrics(eval_pred):
        seen["label_ids"] = eval_pred.label_ids.tolist()
        seen["argmax"] = eval_pred.predictions.argmax(-1).tolist()
        seen["losses"] = eval_pred.losses.tolist()
        return {"rows": len(eval_pred.label_ids)}

    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                     include_for_metrics=["loss"], disable_tqdm=True, report_to="none", save_strategy="no")
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=ROWS, eval_dataset=EVAL,
                         compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    output = trainer.predict(EVAL)
    return {"rank": trainer.accelerator.process_index, "eval_loss": metrics["eval_loss"], "eval_rows": metrics["eval_rows"],
            **seen, "predict_argmax": output.predictions.argmax(-1).tolist(), "predict_labels": output.label_ids.tolist(),
            "test_loss": output.metrics["test_loss"]}


def nll(outputs, labels, num_items_in_batch=None):
    loss = torch.nn.functional.cross_entropy(outputs.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


def train_losses(model_dir: str, output_dir: str, compute_loss_func) -> list[float]:
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=2, learning_rate=1e-3, logging_steps=1, disable_tqdm=True, report_to="none",
                     save_strategy="no", seed=0)
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=ROWS, compute_loss_func=compute_loss_func)
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


if __name__ == "__main__":
    torch.set_num_threads(1)
    report = run(sys.argv[1], sys.argv[2])
    report["losses_builtin"] = train_losses(sys.argv[1], os.path.join(sys.argv[2], "builtin"), None)
    report["losses_user"] = train_losses(sys.argv[1], os.path.join(sys.argv[2], "user"), nll)
    with open(os.path.join(sys.argv[2], f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)
