"""TRL's ``environment_factory``: environment instances pooled per rollout, their tools (public methods) and their
``get_reward`` as reward functions (``Environments``)."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from trainers.agents.rendering import toolbox
from trainers.errors import ConfigError, DatasetFormatError


def _methods(instance: Any) -> list[Callable]:
    """An environment's tools: its public methods other than ``reset`` and ``get_reward``, bound. Listed on the
    class, as TRL does (listing the instance would evaluate its properties)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class Environments:
    """TRL's ``environment_factory``: one callable (every row) or ``{name: callable}`` (rows routed by their
    ``environment`` column). An instance per rollout, pooled and reset (construct once, reset often: an instance
    may hold a costly resource); its public methods other than ``reset``/``get_reward`` are its tools."""

    def __init__(self, factory: Callable | Mapping[str, Callable], standalone_tools: list[Callable]):
        self.multi = isinstance(factory, Mapping)
        factories = dict(factory) if self.multi else {None: factory}
        if not factories:
            raise ConfigError("environment_factory: an empty dict; give {name: factory} for each environment")
        self._factories = factories
        self._standalone = list(standalone_tools)
        self._pool: dict[Any, list] = {}  # every instance made, by environment
        self._free: dict[Any, list] = {}  # the instances no round holds, in the order they are taken again
        self._lock = threading.Lock()  # rounds are taken and given back from two threads (asynchronous GRPO)
        self._tools: dict[Any, list[Callable]] = {}
        for name, make in factories.items():
            where = f"environment_factory[{name!r}]" if self.multi else "environment_factory"
            if not callable(make):
                raise ConfigError(f"{where} must be callable (a class or a function returning an environment), "
                                  f"got {type(make).__name__}")
            instance = make()  # the probe seeds the pool
            if not callable(getattr(instance, "reset", None)):
                raise ConfigError(f"{where}: {type(instance).__name__} has no callable reset(**row); every "
                                  f"environment needs one (it may return a string appended to the prompt)")
            self._tools[name] = self._standalone + _methods(instance)
            toolbox(self._tools[name])  # names must be unique
            self._pool[name] = [instance]
            self._free[name] = [instance]

    def _check(self, name: Any, index: int | None = None) -> None:
        if name not in self._factories:
            where = f"rollout {index} has " if index is not None else ""
            raise DatasetFormatError(f"{where}environment={name!r}, which is not among the environments of "
                                     f"environment_factory; expected one of {list(self._factories)}")

    def tools_for(self, name: Any) -> list[Callable]:
        """The tools a row of environment ``name`` offers (``None`` for a single factory): for its prompt's
        schema and its parser."""
        self._check(name)
        return list(self._tools[name])

    def take(self, names: list) -> list:
        """One instance per rollout (``names[i]``: rollout i's environment), reusing the instances no round holds;
        the pool grows only when the rounds held at once need more of an environment than were ever made. The
        caller resets them, and gives them back (``give_back``) once the round's rewards are computed: a round
        sampled ahead of training (asynchronous GRPO) never resets the instances of one not yet scored."""
        for index, name in enumerate(names):
            self._check(name, index)
        taken = []
        with self._lock:
            for name in names:
                if not self._free[name]:
                    made = self._factories[name]()
                    self._pool[name].append(made)
                    self._free[name].append(made)
                taken.append(self._free[name].pop(0))
        return taken

    def give_back(self, instances: list) -> None:
        """A scored round's instances are free again, in its order (the next round takes them in that order)."""
        with self._lock:
            for instance in instances:
                for name, pool in self._pool.items():
                    if any(instance is made for made in pool):
                        self._free[name].append(instance)
                        break

    def toolbox_of(self, instance: Any) -> dict[str, Callable]:
        """The standalone tools and the instance's bound methods, by name."""
        return toolbox(self._standalone + _methods(instance))

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """One reward function per environment class that has ``get_reward`` (a class under two names counts
        once), named after the class: ``fn(environments, **kwargs)`` -> one value per rollout, ``None`` for the
        rollouts of another class (left out of the weighted sum). An async ``get_reward`` gives an async function
        awaiting all rollouts together."""
        classes = []
        for pool in self._pool.values():
            cls = type(pool[0])
            if callable(getattr(cls, "get_reward", None)) and cls not in classes:
                classes.append(cls)
        return [(cls.__name__, _reward_function(cls)) for cls in classes]


def _reward_function(cls: type) -> Callable:
    """The exact class, not isinstance: an environment subclassing another is not scored twice."""
    if inspect.iscoroutinefunction(cls.get_reward):
        async def get_reward(environments, **kwargs):
            async def one(environment):
                return await environment.get_reward() if type(environment) is cls else None
            return list(await asyncio.gather(*(one(environment) for environment in environments)))
    else:
        def get_reward(environments, **kwargs):
            return [environment.get_reward() if type(environment) is cls else None for environment in environments]
    get_reward.__name__ = get_reward.__qualname__ = cls.__name__
    return get_reward
