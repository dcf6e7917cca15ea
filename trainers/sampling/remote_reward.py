"""A reward model on another machine: ``RemoteRewardModel``, the reward function (TRL's contract) whose scores come
from ``trainers reward-serve`` (trainers/cli/reward_serve.py). A ``reward_funcs`` entry that is a URL resolves to
one (trainers/sampling/rewards.py)."""

from __future__ import annotations

import os

from trainers.errors import RemoteServiceError
from trainers.services.http import post_json

REWARD_KEY_VARIABLE = "TRAINERS_REWARD_API_KEY"  # the reward server's key, for the server and the trainer


class RemoteRewardModel:
    """A reward function (TRL's contract) whose scores come from ``trainers reward-serve`` at ``url``. ``api_key``:
    the server's key (None: TRAINERS_REWARD_API_KEY). ``timeout``: seconds a batch may take. Named after the
    server's model (``rewards/<name>/mean``), asked once, when it is made. A server that fails, times out or refuses
    the key stops the run with a checkpoint (``RemoteServiceError``). ``chat_template_kwargs``: the trainer's, for
    conversations, applied by the server as the in-process model applies them."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0,
                 chat_template_kwargs: dict | None = None):
        if not url.startswith(("http://", "https://")):
            raise RemoteServiceError(f"a reward server's URL starts with http:// or https://, got {url!r}.")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # the trainer's, sent with every batch
        self.api_key = api_key if api_key is not None else os.environ.get(REWARD_KEY_VARIABLE) or None
        self.__name__ = self.model_name()

    def model_name(self) -> str:
        answer = post_json(self.url, "/info", {}, self.api_key, self.timeout, "reward server")
        return str(answer.get("model") or "reward_server")

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        answer = post_json(self.url, "/score", {"prompts": prompts, "completions": completions,
                                                "chat_template_kwargs": self.chat_template_kwargs},
                           self.api_key, self.timeout, "reward server")
        rewards = answer.get("rewards")
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise RemoteServiceError(f"The reward server at {self.url} answered /score without one reward per "
                                     f"completion ({len(completions)}): {str(answer)[:300]}")
        return [float(r) for r in rewards]
