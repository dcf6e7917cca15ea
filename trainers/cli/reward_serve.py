"""``trainers reward-serve``: a reward model (one ``RewardTrainer`` saved, or any sequence classifier with one label)
served over HTTP, for ``RemoteRewardModel`` (trainers/sampling/remote_reward.py), the reward function that asks it.

    trainers reward-serve --model outputs/reward-model --port 8200
    GRPOTrainer(model, reward_funcs="http://127.0.0.1:8200", ...)    # a URL in reward_funcs is a reward server

``POST /score`` ``{"prompts": [...], "completions": [...], "chat_template_kwargs": {...}}`` (strings, or lists of
messages; the trainer's template arguments) -> ``{"rewards": [float, ...]}``; ``GET /health``; ``POST /info`` ->
``{"model": name}``. The server scores exactly as the in-process reward model does (trainers/sampling/rewards.py,
``RewardModel``: the same tokenizer, chat template and EOS), in batches of ``--batch-size``, one request's batch at
a time.
"""

from __future__ import annotations

import argparse
import threading

from trainers.sampling.remote_reward import REWARD_KEY_VARIABLE
from trainers.services.http import JsonServer, add_server_arguments, serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="The reward model: a folder RewardTrainer saved (or any "
                        "AutoModelForSequenceClassification with one label), or a Hub id in the local cache.")
    add_server_arguments(parser, 8200, REWARD_KEY_VARIABLE)
    parser.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=32,
                        help="Completions scored in one forward (default 32).")
    parser.add_argument("--device", default=None, help="Where the model runs (default: cuda if there is one).")
    parser.add_argument("--dtype", default="auto", help="The model's dtype: auto, float32, bfloat16, float16.")


def build_server(cli: argparse.Namespace, key: str | None) -> JsonServer:
    import torch

    from trainers.sampling.rewards import load_reward_model

    if cli.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {cli.batch_size}.")
    kwargs = {} if cli.dtype == "auto" else {"dtype": getattr(torch, cli.dtype)}
    reward = load_reward_model(cli.model, model_init_kwargs=kwargs)
    device = cli.device or ("cuda" if torch.cuda.is_available() else "cpu")
    reward.model.to(device)
    lock = threading.Lock()  # one forward at a time: concurrent requests queue here

    def score(payload: dict) -> dict:
        prompts, completions = payload.get("prompts"), payload.get("completions")
        if not isinstance(prompts, list) or not isinstance(completions, list) or len(prompts) != len(completions):
            raise ValueError("POST /score takes {\"prompts\": [...], \"completions\": [...]}, one prompt per "
                             "completion")
        template_kwargs = payload.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be an object")
        rewards = []
        with lock:
            reward.chat_template_kwargs = template_kwargs  # the asking trainer's (its GRPOConfig's)
            for start in range(0, len(completions), cli.batch_size):
                rewards += reward(prompts[start:start + cli.batch_size], completions[start:start + cli.batch_size])
        return {"rewards": rewards}

    def info(payload: dict) -> dict:
        return {"model": reward.__name__, "device": device}

    return JsonServer({"/score": score, "/info": info}, cli.host, cli.port, key, "reward server")


def run(cli: argparse.Namespace) -> int:
    return serve("reward-serve", cli, build_server, REWARD_KEY_VARIABLE)
