"""What the server's detokenizer costs a round sampled by the token route (in-flight weight updates sample there).

    python benchmarks/token_route.py                 # the GRPO demo's round shape, ~1 minute on 2 CPU cores

A `trainers vllm-serve` server on one core (the demo's width-128 model, random weights), this process on the other;
a round is the demo's: 8 prompts x 8 completions of at most 5 tokens with the sampled token's log-prob, one request
per prompt, sent together (as generation/vllm_remote.py sends them). Rounds alternate between the client's default
(``detokenize: False``: the server neither detokenizes the tokens nor the log-probs' tokens; we read ids alone) and
``detokenize: True`` (vLLM's default), so the host's drift falls on both. Reported: the median round, each way.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))

from grpo_arithmetic import MODEL_SHAPE  # noqa: E402

from trainers.cli.tiny import save_tiny_model  # noqa: E402
from trainers.generation.local_server import start_local_server  # noqa: E402
from trainers.generation.vllm_client import VLLMClient  # noqa: E402

SERVER_CORE, CLIENT_CORE = 1, 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="rounds each way, after 5 of warm-up")
    cli = parser.parse_args()
    os.sched_setaffinity(0, {CLIENT_CORE})
    work = tempfile.mkdtemp(prefix="token-route-")
    model = save_tiny_model(os.path.join(work, "model"), **MODEL_SHAPE)
    server = start_local_server(model, os.path.join(work, "server.log"), max_model_len=512, cores=[SERVER_CORE])
    try:
        clients = [VLLMClient(server.url) for _ in range(8)]  # one connection per request in flight
        prompts = [[1 + i, 2 + i, 3, 4, 5, 6] for i in range(8)]

        def round_seconds(detokenize: bool) -> float:
            params = {"max_tokens": 5, "temperature": 1.0, "logprobs": 0, "detokenize": detokenize}
            started = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as threads:
                list(threads.map(lambda i: clients[i].generate_tokens(prompts[i], n=8, seed=i, sampling_params=params),
                                 range(len(prompts))))
            return time.perf_counter() - started

        seconds = {False: [], True: []}
        for index in range(cli.rounds + 5):
            for detokenize in (False, True):
                elapsed = round_seconds(detokenize)
                if index >= 5:
                    seconds[detokenize].append(elapsed)
    finally:
        server.stop()
    ours, vllms = (1000 * statistics.median(seconds[k]) for k in (False, True))
    print("| token route | round (median) |\n|---|---|")
    print(f"| detokenize: True (vLLM's default) | {vllms:.1f} ms |")
    print(f"| detokenize: False (the client's) | {ours:.1f} ms ({100 * (1 - ours / vllms):.0f}% less) |")


if __name__ == "__main__":
    main()
