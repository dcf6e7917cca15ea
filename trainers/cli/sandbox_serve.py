"""``trainers sandbox-serve``: runs programs for ``code_execution`` rewards on this machine, for trainers elsewhere.

    trainers sandbox-serve --port 8100 --api-key KEY          # 127.0.0.1 by default
    code_execution_reward(executor="http://host:8100")        # the trainer (TRAINERS_SANDBOX_API_KEY=KEY)

``POST /run`` (trainers/execution/executors.py has the protocol) runs the programs with this server's limits and
pool; ``GET /health`` says it is up and how it isolates programs. Requests run concurrently, sharing the pool.
"""

from __future__ import annotations

import argparse
import dataclasses

from trainers.execution.executors import SANDBOX_KEY_VARIABLE, LocalExecutor, Program
from trainers.execution.sandbox import ISOLATIONS, ExecutionLimits
from trainers.services.http import JsonServer, add_server_arguments, serve

LIMIT_NAMES = [field.name for field in dataclasses.fields(ExecutionLimits)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, 8100, SANDBOX_KEY_VARIABLE)
    parser.add_argument("--max-workers", "--max_workers", dest="max_workers", type=int, default=None,
                        help="Programs run at once (default: the cores, at most 8).")
    parser.add_argument("--isolation", choices=ISOLATIONS, default="auto",
                        help="auto: namespaces where the kernel gives them, else processes (with a warning).")
    defaults = ExecutionLimits()
    for name in LIMIT_NAMES:
        parser.add_argument(f"--{name}", type=type(getattr(defaults, name)), default=getattr(defaults, name),
                            help=f"ExecutionLimits.{name} for every program (default {getattr(defaults, name)}).")


def build_server(cli: argparse.Namespace, key: str | None) -> JsonServer:
    limits = ExecutionLimits(**{name: getattr(cli, name) for name in LIMIT_NAMES})
    executor = LocalExecutor(limits, cli.max_workers, cli.isolation)
    isolation = executor.isolation  # probed now: a refusal is said at start, not at the first request

    def run(payload: dict) -> dict:
        programs = payload.get("programs")
        if not isinstance(programs, list):
            raise ValueError("POST /run takes {\"programs\": [{\"code\", \"tests\", \"function\"}, ...]}")
        try:
            parsed = [Program.from_json(p) for p in programs]
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"a program is not {{\"code\", \"tests\": {{\"mode\", ...}}, \"function\"}}: "
                             f"{error!r}") from error
        return {"outcomes": [o.to_json() for o in executor.run(parsed)]}

    def info(payload: dict) -> dict:
        return {"isolation": isolation, "max_workers": executor.max_workers, "limits": dataclasses.asdict(limits)}

    return JsonServer({"/run": run, "/info": info}, cli.host, cli.port, key, "sandbox server")


def run(cli: argparse.Namespace) -> int:
    return serve("sandbox-serve", cli, build_server, SANDBOX_KEY_VARIABLE)
