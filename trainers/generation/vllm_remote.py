"""vLLM as a server (``vllm_mode="server"``): the backend over the client of a `trainers vllm-serve` server
(generation/vllm_client.py; the server: generation/vllm_server.py). The main process sends every process's prompts
in one request and the policy's weights after each optimizer step that precedes a round; the other processes take
part in the weight gathers (ZeRO-3) and get their rows back. A server that fails mid-run raises
``VLLMServerError`` on every process, together: the trainer answers it with a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from trainers import distributed as dist
from trainers.errors import VLLMServerError
from trainers.generation.backend import BackendInputs
from trainers.generation.vllm_common import WEIGHT_BATCH_BYTES, VLLMBackend


class VLLMRemote(VLLMBackend):
    """A `trainers vllm-serve` server; ``.vllm_client`` (TRL's ``trainer.vllm_generation.vllm_client``) on the
    main process. Built on every process, together: the client is checked against the served model and the
    policy's weights are sent before training."""

    def __init__(self, inputs: BackendInputs):
        super().__init__(inputs)
        self.llm = None  # TRL's attribute: a colocated engine, None here
        self.vllm_client = None
        self._closed = False  # on every process: close() ran, the next sync connects again
        self._connect()
        self.sync_weights(0)  # the policy's weights before the first optimizer step
        self.context.accelerator.wait_for_everyone()

    def _connect(self) -> None:
        """The client, on the main process, checked against the served model. Every process calls it."""
        args, acc = self.config, self.context.accelerator
        error = None
        if acc.is_main_process:
            try:
                from trainers.generation.vllm_client import VLLMClient

                self.vllm_client = VLLMClient(
                    base_url=args.vllm_server_base_url, host=args.vllm_server_host, server_port=args.vllm_server_port,
                    group_port=args.vllm_group_port, connection_timeout=args.vllm_server_timeout)
                self.vllm_client.check_server(self._model_name())
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error)

    def sync_weights(self, step: int | None = None) -> None:
        if self._closed:  # closed at the end of a train() call, used again (evaluate, a rollout function)
            self._connect()
            self._closed, self._synced_step = False, None
        super().sync_weights(step)

    def _push_weights(self, batches: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """The main process sends the weights in requests of about WEIGHT_BATCH_BYTES; the others take part in
        the gathers."""
        client, error = self.vllm_client, None
        if client is None:
            for _ in batches:
                pass
        else:
            try:
                with client.weight_update():
                    pending, size = [], 0
                    for batch in batches:
                        pending += batch
                        size += sum(t.numel() * t.element_size() for _, t in batch)
                        if size >= WEIGHT_BATCH_BYTES:
                            client.update_named_params(pending)
                            pending, size = [], 0
                    client.update_named_params(pending)
            except Exception as caught:
                error = caught
                for _ in batches:  # the other processes are still gathering
                    pass
        # every process gets the VLLMServerError: the trainer answers it with a checkpoint, written together
        dist.raise_together(self.context.accelerator, error, shared=(VLLMServerError,))

    def _generate(self, prompt_ids: list[list[int]], kwargs: dict) -> tuple[list, list]:
        """Every process's prompts in one request from the main process; each process gets its own rows back."""
        acc = self.context.accelerator
        everyone = dist.gather_objects(acc, [prompt_ids])  # [process][row]
        answer, error = None, None
        if acc.is_main_process:
            try:
                options = {k: v for k, v in kwargs.items() if k in ("n", "repetition_penalty", "temperature", "top_p",
                                                                    "top_k", "min_p", "max_tokens", "logprobs")}
                extra = {k: v for k, v in kwargs.items() if k not in options}
                out = self.vllm_client.generate(
                    prompts=[ids for part in everyone for ids in part], **options,
                    structured_outputs_regex=self.config.vllm_structured_outputs_regex,
                    generation_kwargs=extra)
                logprobs = out["logprobs"] or [[[math.nan]] * len(ids) for ids in out["completion_ids"]]
                answer = (out["completion_ids"],
                          [[math.nan if top[0] is None else top[0] for top in row] for row in logprobs])
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error, shared=(VLLMServerError,))  # as in _push_weights
        completions, logprobs = dist.broadcast_object(acc, answer)
        start = sum(len(part) for part in everyone[:acc.process_index])
        mine = slice(start, start + len(prompt_ids))
        return completions[mine], logprobs[mine]

    def close(self) -> None:
        """Close the client (the server keeps running); the next weight sync connects again. Idempotent."""
        self._closed = True
        if self.vllm_client is not None:
            client, self.vllm_client = self.vllm_client, None
            client.close()
