"""Throughput of the code_execution reward: completions judged per second by a LocalExecutor, by pool size.

    python benchmarks/code_execution.py                # 96 completions, pools of 1 and 2, isolation auto
    python benchmarks/code_execution.py --isolation processes --completions 64 --workers 1 2 4

A round of short solutions, as a GRPO round of a coding task has them: a third right (asserts), a third wrong
(asserts), a third reading stdin (two cases each). Each completion is one sandbox: the jail, its namespaces and
root, one Python per case. Prints completions/s and ms per completion for each pool size.
"""

import argparse
import time

from trainers.execution import ExecutionLimits, LocalExecutor, Program, parse_tests


def round_of(n: int) -> list[Program]:
    asserts = parse_tests("assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15", "tests", 0)
    stdio = parse_tests([{"input": "1 2 3", "output": "6"}, {"input": "4 5", "output": "9"}], "tests", 0)
    kinds = [Program("def add(a, b):\n    return a + b\n", asserts), Program("def add(a, b):\n    return a * b\n",
                                                                              asserts),
             Program("print(sum(map(int, input().split())))\n", stdio)]
    return [kinds[i % 3] for i in range(n)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=96)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isolation", default="auto", choices=("auto", "namespaces", "processes"))
    cli = parser.parse_args(argv)
    programs = round_of(cli.completions)
    for workers in cli.workers:
        executor = LocalExecutor(ExecutionLimits(), max_workers=workers, isolation=cli.isolation)
        executor.run(programs[:2])  # the isolation probe and a warm page cache
        started = time.perf_counter()
        outcomes = executor.run(programs)
        seconds = time.perf_counter() - started
        executor.close()
        statuses = {s: sum(o.status == s for o in outcomes) for s in sorted({o.status for o in outcomes})}
        print(f"isolation {executor.isolation}, {workers} worker(s): {len(programs) / seconds:.1f} completions/s "
              f"({1000 * seconds / len(programs):.0f} ms each; {statuses})", flush=True)


if __name__ == "__main__":
    main()
