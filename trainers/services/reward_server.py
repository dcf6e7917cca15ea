"""``trainers reward-serve``: a reward model (one ``RewardTrainer`` saved, or any sequence classifier with one label)
served over HTTP, and ``RemoteRewardModel``, the reward function that asks it.

    trainers reward-serve --model outputs/reward-model --port 8200
    GRPOTrainer(model, reward_funcs="http://127.0.0.1:8200", ...)    # a URL in reward_funcs is a reward server

``POST /score`` ``{"prompts": [...], "completions": [...]}`` (strings, or lists of messages) ->
``{"rewards": [float, ...]}``; ``GET /health``; ``POST /info`` -> ``{"model": name}``. The server scores exactly as
the in-process reward model does (trainers/sampling/rewards.py, ``RewardModel``: the same tokenizer, chat template
and EOS), in batches of ``--batch-size``, one request's batch at a time.
"""

from __future__ import annotations

import argparse
import os
import threading

from trainers.errors import RemoteServiceError
from trainers.services.http import JsonServer, add_server_arguments, post_json, serve

REWARD_KEY_VARIABLE = "TRAINERS_REWARD_API_KEY"  # the reward server's key, for the server and the trainer


class RemoteRewardModel:
    """A reward function (TRL's contract) whose scores come from ``trainers reward-serve`` at ``url``. ``api_key``:
    the server's key (None: TRAINERS_REWARD_API_KEY). ``timeout``: seconds a batch may take. Named after the
    server's model (``rewards/<name>/mean``), asked once on first use. A server that fails, times out or refuses
    the key stops the run with a checkpoint (``RemoteServiceError``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        if not url.startswith(("http://", "https://")):
            raise RemoteServiceError(f"a reward server's URL starts with http:// or https://, got {url!r}.")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.api_key = api_key if api_key is not None else os.environ.get(REWARD_KEY_VARIABLE) or None
        self.__name__ = self.model_name()

    def model_name(self) -> str:
        answer = post_json(self.url, "/info", {}, self.api_key, self.timeout, "reward server")
        return str(answer.get("model") or "reward_server")

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        answer = post_json(self.url, "/score", {"prompts": prompts, "completions": completions}, self.api_key,
                           self.timeout, "reward server")
        rewards = answer.get("rewards")
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise RemoteServiceError(f"The reward server at {self.url} answered /score without one reward per "
                                     f"completion ({len(completions)}): {str(answer)[:300]}")
        return [float(r) for r in rewards]


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
        rewards = []
        with lock:
            for start in range(0, len(completions), cli.batch_size):
                rewards += reward(prompts[start:start + cli.batch_size], completions[start:start + cli.batch_size])
        return {"rewards": rewards}

    def info(payload: dict) -> dict:
        return {"model": reward.__name__, "device": device}

    return JsonServer({"/score": score, "/info": info}, cli.host, cli.port, key, "reward server")


def run(cli: argparse.Namespace) -> int:
    return serve("reward-serve", cli, build_server, REWARD_KEY_VARIABLE)
