"""TRL's reward functions at TRL's import path (``trl.rewards``), so a TRL script's ``from trl.rewards import ...``
ports by changing ``trl`` to ``trainers``. They live in trainers/sampling/reward_functions.py with GRPO's other
built-in rewards; this module only re-exports them (the library itself never imports it), ``code_execution_reward``
(completions' code run against tests in a sandbox) among them."""

from trainers.sampling.reward_functions import (
    accuracy_reward,
    code_execution_reward,
    get_soft_overlong_punishment,
    think_format_reward,
)

__all__ = ["accuracy_reward", "code_execution_reward", "get_soft_overlong_punishment", "think_format_reward"]
