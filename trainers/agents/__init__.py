"""Agents: rollout strategies over a generation backend, between generation and the algorithms. A strategy turns a
round's prompts into ``Samples`` through a backend; it knows a backend, a tokenizer and the processes'
collectives, never a trainer.

tool_loop.py     the tool-calling strategy (TRL's ``tools=`` and ``environment_factory=``): turns, tool turns
                 appended token in / token out, budget, masks, the tools/* metrics
parsing.py       a turn's tool calls, parsed from what the model wrote
runner.py        every call of a round run at once (threads, one event loop, timeouts); the event loop thread
                 GRPO's async reward functions run on too
rendering.py     tool schemas, toolboxes, the chat template's check, a tool turn's tokens
environments.py  environment instances pooled per rollout, their tools and their get_reward

The single-turn strategy is the backend itself: one ``sample`` call per round.
"""
