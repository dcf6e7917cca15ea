"""Two CPU hot paths that issue 59 touched, timed alone (one thread): slicing a 256-row GRPO round into 8-row
micro-batches (trainers/sampling/batch.py, from host widths) and the chunked output head's forward and backward at
V 32,768, H 256, 512 positions (trainers/model/output_head.py). Run it from two checkouts to compare:

    PYTHONPATH=. python benchmarks/slicing_and_head.py
"""

import time

import torch

from trainers.sampling.batch import Rollout
from trainers.model.output_head import chunked_head_scores


def ragged_round(rows: int = 256, prompt: int = 64, completion: int = 256) -> Rollout:
    prompt_mask = torch.zeros(rows, prompt, dtype=torch.long)  # [N, P] left-padded
    attention = torch.zeros(rows, completion, dtype=torch.long)  # [N, C] right-padded
    for row in range(rows):
        prompt_mask[row, prompt - 1 - row % 60:] = 1
        attention[row, : 1 + (row * 7) % completion] = 1
    return Rollout(torch.zeros(rows, prompt, dtype=torch.long), prompt_mask,
                   torch.zeros(rows, completion, dtype=torch.long), attention, torch.arange(rows) // 8,
                   attention.float(), torch.randn(rows), old_logps=torch.randn(rows, completion))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rollout = ragged_round()
    rows, size, repeats = rollout.advantages.shape[0], 8, 20
    started = time.perf_counter()
    for _ in range(repeats):
        for start in range(0, rows, size):
            rollout.micro_batch(start, start + size)
    slicing = (time.perf_counter() - started) / (repeats * rows // size)

    vocab, width, positions = 32768, 256, 512
    weight = (torch.randn(vocab, width) * 0.02).requires_grad_()  # [V, H]
    hidden = torch.randn(positions, width, requires_grad=True)  # [N, H]
    targets = torch.randint(vocab, (positions,))

    def head():
        weight.grad = hidden.grad = None
        chunked_head_scores(hidden, weight, targets, with_entropy=False)["logps"].sum().backward()

    head()  # warm-up
    started = time.perf_counter()
    for _ in range(5):
        head()
    print(f"micro_batch {slicing * 1e6:.0f} us, head fwd+bwd {(time.perf_counter() - started) / 5 * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
