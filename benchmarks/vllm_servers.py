"""One vLLM server against two: generation rounds per second, and whether two servers sample the tokens one does.

    python benchmarks/vllm_servers.py                      # tiny model (~3 min on 2 CPU cores)
    python benchmarks/vllm_servers.py --model small --rounds 3

Two `trainers vllm-serve` servers on loopback, each pinned to a core of its own (the one-server rows use server A
alone, on one core: the comparison is one core of generation against two, as one node against two). A round is
``--prompts`` prompts x ``--generations`` completions of ``--tokens`` tokens (forced: min_tokens), sent as the
trainer sends them (one request per prompt for its n completions, seeded per row: generation/vllm_remote.py), to a
pool of [A] or of [A, B] (generation/vllm_servers.py). No training: generation alone, where a second server can
help. Reported: rounds per second (median over rounds after one warm-up), the speed-up, each server's share of
the completions, and the token agreement: the fraction of completion tokens equal between the one-server and the
two-server round with the same seeds (and between two one-server rounds, the baseline).
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainers.cli.tiny import save_tiny_model  # noqa: E402
from trainers.generation.local_server import start_local_server  # noqa: E402
from trainers.generation.vllm_client import VLLMClient  # noqa: E402
from trainers.generation.vllm_remote import request_completions  # noqa: E402
from trainers.generation.vllm_servers import ServerPool  # noqa: E402

MODELS = {"tiny": dict(hidden_size=256, num_layers=4), "small": dict(hidden_size=768, num_layers=12)}


def agreement(first: list[list[int]], second: list[list[int]]) -> float:
    """The fraction of positions (over the longer of each pair) where two rounds' completions hold the same token."""
    same = total = 0
    for a, b in zip(first, second):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
    return same / max(total, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench-servers"))
    cli = parser.parse_args()
    os.makedirs(cli.workdir, exist_ok=True)
    model = save_tiny_model(os.path.join(cli.workdir, cli.model), **MODELS[cli.model])
    servers = {}

    def start(name: str, core: int):
        servers[name] = start_local_server(model, os.path.join(cli.workdir, f"server-{name}.log"), cores=[core],
                                           extra=("--seed", "0"))

    threads = [threading.Thread(target=start, args=(name, core)) for name, core in (("A", 0), ("B", 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        print(f"start-up: A {servers['A'].startup_seconds:.0f} s, B {servers['B'].startup_seconds:.0f} s")

        def connect(url: str, wait: bool):
            return VLLMClient(url, connection_timeout=60 if wait else 0)

        one, two = ServerPool([servers["A"].url], connect), ServerPool([servers["A"].url, servers["B"].url], connect)
        prompts = [[100 + i, 7, 8, 9] for i in range(cli.prompts) for _ in range(cli.generations)]
        kwargs = {"temperature": 1.0, "max_tokens": cli.tokens, "min_tokens": cli.tokens, "logprobs": 0}
        times, tokens = {"one": [], "two": []}, {"one": [], "two": []}
        for round_index in range(cli.rounds + 1):
            seeds = [1000 * round_index + i for i in range(len(prompts))]
            for name, pool in (("one", one), ("two", two)) if round_index % 2 == 0 else (("two", two), ("one", one)):
                started = time.perf_counter()
                completions, _ = request_completions(pool, prompts, seeds, kwargs, None)
                if round_index:  # the first round warms both up
                    times[name].append(time.perf_counter() - started)
                tokens[name].append(completions)
        again, _ = request_completions(one, prompts, [1000 * cli.rounds + i for i in range(len(prompts))], kwargs,
                                       None)
        rps = {name: 1 / statistics.median(values) for name, values in times.items()}
        agree = statistics.mean(agreement(a, b) for a, b in zip(tokens["one"], tokens["two"]))
        baseline = agreement(tokens["one"][-1], again)
        shares = two.metrics()
        print(f"\nmodel {cli.model}; a round: {cli.prompts} prompts x {cli.generations} completions x {cli.tokens} "
              f"tokens\n")
        print("| servers | rounds/s | speed-up | shares (A / B) | token agreement with one server |")
        print("|---|---:|---:|---|---:|")
        print(f"| one (A, 1 core) | {rps['one']:.3f} | 1.00 | 1.00 / - | {baseline:.4f} (again, same seeds) |")
        print(f"| two (A, B, 1 core each) | {rps['two']:.3f} | {rps['two'] / rps['one']:.2f} | "
              f"{shares['servers/share/0']:.2f} / {shares['servers/share/1']:.2f} | {agree:.4f} |")
        one.close()
        two.close()
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
