"""vLLM colocated (``vllm_mode="colocate"``): an engine in each training process, as TRL runs it.

The engine runs in the training process itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under several processes
TRL's ``external_launcher`` executor, each process with its own engine): no engine process can outlive the run.
It differs from TRL's where TRL's does not work on CPU or would hide a stale engine:

- the engine starts from the policy's config and tokenizer with placeholder weights and receives the policy's
  full weights before its first round (any model instance works, a PEFT one included);
- weights are synced through the worker's in-place layer-wise reload (``reload_weights``): vLLM's CPU backend
  repacks linear weights for oneDNN, where TRL's ``load_weights`` fails;
- on CPU the KV cache is sized for the round's sequences: ``vllm_gpu_memory_utilization`` would be a fraction
  of host RAM there;
- ``close()`` (the end of ``train()``, also on an exception or a signal, and ``trainer.end()``) shuts it down;
  used again afterwards (evaluate, a rollout function), it starts anew.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError
from trainers.generation.backend import BackendInputs
from trainers.generation.vllm_common import (
    KV_BLOCK_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    REASON_CHARS,
    VLLMBackend,
    keep_default_process_group,
    policy_weights,
    sampled_logprobs,
)
from trainers.generation.vllm_lora import AdapterFolders, adapter_rank, lora_sync_choice, served_rank
from trainers.parallel.host import allow_amx_tiles
from trainers.logs import logger
from trainers.model.modeling import context_length


def engine_settings(device_type: str, policy_dtype: torch.dtype, mixed_precision: str, max_model_len: int | None,
                    enforce_eager: bool | None) -> dict:
    """The engine's settings that depend on the device: ``dtype``, ``max_num_batched_tokens``, ``enforce_eager``.

    On CPU: the policy's dtype (float32 unless loaded otherwise; the tests compare the engine's tokens and
    log-probs with the policy's), batched tokens enough for a whole max_model_len prompt, eager (compiling
    takes 20-70 s of every start). On a GPU: the training precision (bf16 or fp16 mixed precision: half the
    memory of float32 weights, and vLLM's FlashAttention kernels), TRL's 4096 batched tokens (vLLM prefills in
    chunks there; its memory profiling grows with this number, to a whole 32k context otherwise), and CUDA
    graphs unless ``enforce_eager`` (vllm_enforce_eager) says otherwise."""
    if device_type == "cpu":
        return dict(dtype=policy_dtype, max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_model_len or 0),
                    enforce_eager=True if enforce_eager is None else enforce_eager)
    training = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, policy_dtype)
    return dict(dtype=training, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enforce_eager=bool(enforce_eager))


def free_memory_error(free: int, total: int, utilization: float) -> ConfigError | None:
    """vLLM's own start-up check (free device memory >= ``utilization`` x total), made before the engine starts
    so that a process whose card is fuller than the others' raises with them rather than alone inside vLLM's start
    (which it reaches after joining the process group). vLLM checks again, a little later, after its own buffers."""
    wanted = math.ceil(total * utilization)
    if free >= wanted:
        return None
    return ConfigError(f"vllm_gpu_memory_utilization={utilization}: this process's colocated engine asks for "
                       f"{wanted / 2**30:.1f} GiB of its device's {total / 2**30:.1f} GiB and "
                       f"{free / 2**30:.1f} GiB are free (the policy, its optimizer and any other process on the "
                       f"device hold the rest). Lower vllm_gpu_memory_utilization, or free the device.")


class VLLMColocate(VLLMBackend):
    """This process's vLLM engine (``.llm``, TRL's ``trainer.vllm_generation.llm``), holding the policy's
    weights. Built on every process, together."""

    def __init__(self, inputs: BackendInputs):
        super().__init__(inputs)
        self.llm = None  # the vllm.LLM; None once closed
        self.vllm_client = None  # TRL's attribute: a server's client, None here
        self._model_dir: str | None = None  # the config and tokenizer the engine starts from
        self._policy_dtype = next(inputs.policy.parameters()).dtype
        self._dtype: torch.dtype | None = None  # the engine's (engine_settings), set by start(); the sync casts to it
        self._restore_set_num_threads = None
        self._owns_process_group = False
        self.sleep_mode: SleepMode | None = None  # vllm_enable_sleep_mode (GPU): what of the engine is asleep
        acc = self.context.accelerator
        self.on_cpu = acc.device.type == "cpu"
        if self.config.vllm_enable_sleep_mode and self.on_cpu:
            raise ConfigError("GRPOConfig: `vllm_enable_sleep_mode=True` needs a GPU: vLLM has no sleep mode on "
                              "CPU. Leave it False.")
        # a LoRA policy: the engine serves its adapter, and syncs send the adapter alone (generation/vllm_lora.py)
        self._adapter_sync = lora_sync_choice(self.config.vllm_lora_sync, inputs.policy, None)
        self._lora = None  # the vllm LoRARequest of the adapter the engine serves
        self.start()
        self._synced_step = 0  # it holds the policy's weights before the first optimizer step
        acc.wait_for_everyone()

    # ------------------------------------------------------------------ set-up

    def _engine_options(self) -> dict:
        """vllm.LLM's arguments (the model folder aside); the device-dependent ones from ``engine_settings``."""
        args, acc, model = self.config, self.context.accelerator, self.inputs.policy
        max_model_len = args.vllm_max_model_length or context_length(model)
        max_num_seqs = self.inputs.completions_per_round  # TRL's: every completion this process samples in a round
        settings = engine_settings(acc.device.type, self._policy_dtype, acc.mixed_precision, max_model_len,
                                   args.vllm_enforce_eager)
        options = dict(
            **settings, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            model_impl=args.vllm_model_impl, seed=args.seed + acc.process_index,
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer's log-probs are
            load_format="dummy",  # the policy's weights arrive with the first sync
            enable_sleep_mode=args.vllm_enable_sleep_mode,
        )
        if acc.num_processes > 1:  # TRL's executor for an engine in each training process
            options["distributed_executor_backend"] = "external_launcher"
        if self.on_cpu:
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # the user's own size wins
                options["kv_cache_memory_bytes"] = self._kv_cache_bytes(max_model_len, max_num_seqs,
                                                                        settings["dtype"])
            if args.vllm_gpu_memory_utilization != 0.3 and acc.is_main_process:
                logger.warning(f"vllm_gpu_memory_utilization={args.vllm_gpu_memory_utilization} is not used on "
                               f"CPU (vLLM would reserve that fraction of host RAM): the KV cache is sized for the "
                               f"round's sequences (docs/grpo.md, 'Generation with vLLM').")
        else:
            options["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
        if self._adapter_sync:  # one adapter at a time: a sync replaces it
            options.update(enable_lora=True, max_lora_rank=served_rank(adapter_rank(model)), max_loras=1)
        if acc.is_main_process:
            logger.info(f"colocated vLLM engine on {acc.device.type}: dtype {settings['dtype']}, "
                        f"max_num_batched_tokens {settings['max_num_batched_tokens']}, "
                        f"enforce_eager {settings['enforce_eager']}, max_model_len {max_model_len}")
        return options

    def _kv_cache_bytes(self, max_model_len: int | None, max_num_seqs: int, dtype: torch.dtype) -> int:
        """On CPU: a KV cache for every sequence of a round at once (the longest prompt + max_completion_length
        each, rounded up to KV_BLOCK_TOKENS) plus one sequence of max_model_len, in bytes."""
        config = self.inputs.policy.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize  # K and V
        longest = self.inputs.longest_prompt
        longest = longest + self.config.max_completion_length if longest else max_model_len
        per_sequence = min(longest, max_model_len) if max_model_len else longest
        per_sequence = -(-per_sequence // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        # one sequence of max_model_len fits on top (vLLM checks that one does), and a quarter more for vLLM's
        # own accounting (measured: the exact product falls ~7% short of a max_model_len sequence)
        tokens = max_num_seqs * per_sequence + -(-(max_model_len or 0) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        return int(tokens * per_token * 1.25)

    def _save_model_folder(self) -> str:
        """The policy's config, generation config and tokenizer in a temporary folder: what the engine starts
        from (its weights come from the policy)."""
        model = self.inputs.policy
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        folder = tempfile.mkdtemp(prefix="trainers-vllm-")
        base.config.save_pretrained(folder)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(folder)
        self.inputs.tokenizer.save_pretrained(folder)
        return folder

    def start(self) -> None:
        """Start this process's engine and give it the policy's weights. Every process calls it."""
        if self.llm is not None:
            return
        # in-process engine: nothing outlives the run; set before vLLM reads its settings
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        acc = self.context.accelerator
        options = self._engine_options()
        self._dtype = options["dtype"]
        if acc.num_processes > 1:  # external_launcher reads the launch from these, as in TRL
            os.environ.update(RANK=str(acc.process_index), LOCAL_RANK=str(acc.local_process_index),
                              WORLD_SIZE=str(acc.num_processes))
        from vllm import LLM

        if acc.device.type == "cpu":
            allow_amx_tiles()  # vLLM's bf16 CPU attention uses AMX without asking the kernel (trainers/parallel/host.py)
        # each sync's reload warns that the rotary embedding's cache was not loaded: it is computed, not a weight
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self._owns_process_group = not torch.distributed.is_initialized()  # single process: vLLM makes its own
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process: restored on close
        self._restore_set_num_threads = torch.set_num_threads
        # vLLM's start joins the world's process group (external_launcher): a process that raised alone before it
        # would leave the others inside it until its timeout. What can fail on one process alone is done first,
        # and every process raises together if any failed.
        failure = None
        try:
            self._model_dir = self._save_model_folder()
        except OSError as error:
            failure = ConfigError(f"use_vllm=True: cannot write the colocated engine's model folder"
                                  f" (the policy's config and tokenizer) in {tempfile.gettempdir()}: "
                                  f"{error}. Point TMPDIR at a writable folder on every machine.")
        if failure is None and not self.on_cpu:
            free, total = torch.cuda.mem_get_info(acc.device)
            failure = free_memory_error(free, total, options["gpu_memory_utilization"])
        self._raise_together(failure)
        try:
            self.llm = LLM(model=self._model_dir, **options)
            # some models start but cannot run (on CPU: an attention head_dim vLLM's kernels lack): one token
            # now, so that this fails when the trainer is built rather than in the first round
            from vllm import SamplingParams as VLLMSamplingParams

            self.llm.generate([{"prompt_token_ids": [0]}], VLLMSamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as error:
            self._shut_down_failed_start()
            failure = ConfigError(self._unloadable_message(error))
            failure.__cause__ = error
        # An engine can fail on one process alone after vLLM's collectives too (its device's memory, its host):
        # every process raises, the others with its message, instead of waiting for it in the first weight sync
        # until the NCCL timeout; the engines that did start are shut down first.
        self._raise_together(failure)
        if self._adapter_sync:  # each process's engine reads the adapter from its own folder
            self.adapters = AdapterFolders(os.path.join(self._model_dir, "adapters"), keep=2)
        self._load_policy()
        if self.config.vllm_enable_sleep_mode:
            self.sleep_mode = SleepMode(self.llm)
            self.sleep_mode.sleep()

    def _raise_together(self, failure: ConfigError | None) -> None:
        """Every process raises if any failed to start (the others with its message), after shutting down what
        it started."""
        try:
            dist.raise_together(self.context.accelerator, failure, shared=(ConfigError,))
        except Exception:
            self.close()  # idempotent: after a failed start it only removes what is left
            raise

    def _unloadable_message(self, error: Exception) -> str:
        """The error for a model vLLM cannot load or run: the model, its architecture and vLLM's reason (cut:
        vLLM's list of supported architectures alone is thousands of characters)."""
        config = self.inputs.policy.config
        reason = " ".join(f"{type(error).__name__}: {error}".split())  # one line (pydantic's are several)
        if len(reason) > REASON_CHARS:
            reason = reason[:REASON_CHARS] + " [...]"
        return (f"use_vllm=True: vLLM cannot load or run the model {self._model_name() or '(given as an instance)'} "
                f"(architectures {getattr(config, 'architectures', None)}, model_type {config.model_type!r}): "
                f"{reason}. Use a model vLLM supports, leave use_vllm False (the trainer samples with the policy "
                f"itself), or serve it from an environment where vLLM can (vllm_mode='server').")

    def _shut_down_failed_start(self) -> None:
        """After a start that failed: the engine, if it was made, is shut down and the model folder removed."""
        if self.llm is not None:
            self.close()  # restores torch.set_num_threads and removes the folder too
            return
        if self._restore_set_num_threads is not None:  # vLLM's CPU worker may have replaced it already
            torch.set_num_threads = self._restore_set_num_threads
        self._remove_model_folder()

    # ------------------------------------------------------------------ weights and generation

    def sync_weights(self, step: int | None = None) -> None:
        if self.llm is None:
            self.start()  # closed at the end of a train() call, used again: started with the policy's weights
            self._synced_step = step
        super().sync_weights(step)

    def _load_policy(self) -> None:
        """The engine's weights := the policy's: every weight (each LoRA layer merged), or with adapter sync the
        base weights and then the adapter."""
        acc = self.context.accelerator
        self._push_weights(policy_weights(acc, self.inputs.policy, merge_lora=self.adapters is None))
        if self.adapters is not None:
            self._push_adapter(None)

    def _push_adapter(self, step: int | None) -> None:
        """The policy's adapter saved by this process and loaded into its engine in place of the one before."""
        from vllm.lora.request import LoRARequest

        adapter = self.adapters.save(self.context.accelerator, self.inputs.policy, step)
        previous, self._lora = self._lora, LoRARequest(adapter.name, adapter.number, adapter.path)
        self.llm.llm_engine.add_lora(self._lora)  # read now: a bad adapter fails at the sync, not in a round
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def _push_weights(self, batches: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        if self.sleep_mode is not None:
            self.sleep_mode.wake_weights()
        weights = ((name, tensor.to(self._dtype)) for batch in batches for name, tensor in batch)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def _generate(self, prompt_ids: list[list[int]], kwargs: dict, seeds: list[int]) -> tuple[list, list]:
        from vllm import SamplingParams as VLLMSamplingParams

        if self.llm is None:
            self.start()
        regex = self.config.vllm_structured_outputs_regex
        if regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(regex=regex)
        if self.sleep_mode is not None:
            self.sleep_mode.wake_for_round(self._load_policy)
        params = [VLLMSamplingParams(**kwargs, seed=seed) for seed in seeds]  # one per row: its own seed
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params,
                                    lora_request=self._lora, use_tqdm=False)
        if self.sleep_mode is not None:
            self.sleep_mode.sleep()
        completions = [list(out.outputs[0].token_ids) for out in outputs]
        return completions, [sampled_logprobs(out.outputs[0]) for out in outputs]

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Shut the engine down: its memory and threads are released; the training run's process group stays.
        Idempotent."""
        if self.llm is None:
            self._remove_model_folder()
            return
        llm, self.llm = self.llm, None
        keep = contextlib.nullcontext() if self._owns_process_group else keep_default_process_group()
        try:
            with keep:
                llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            if self._restore_set_num_threads is not None:
                torch.set_num_threads = self._restore_set_num_threads
            self._remove_model_folder()
            self.sleep_mode = None
            self.adapters, self._lora = None, None  # their folder was in the model folder

    def _remove_model_folder(self) -> None:
        if self._model_dir is not None:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            self._model_dir = None


class SleepMode:
    """vLLM's sleep mode at level 2 (TRL's): between rounds the engine discards its weights and its KV cache, and
    gives their GPU memory to training. The two come back apart: a weight sync wakes the weights (and fills them
    from the policy), a round needs the KV cache too. Tracked apart because a sync between two rounds (every step)
    wakes the weights only: a round after it must still wake the cache."""

    def __init__(self, llm):
        self.llm = llm
        self.weights_asleep = False
        self.cache_asleep = False

    def sleep(self) -> None:
        self.llm.sleep(level=2)
        self.weights_asleep = self.cache_asleep = True

    def wake_weights(self) -> None:
        """Before a weight sync writes into the weights' memory."""
        if self.weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False

    def wake_for_round(self, sync_weights) -> None:
        """Before a round: weights that are still asleep (no sync since the last round) are pushed again from the
        policy (``sync_weights``: level 2 discarded them), then the KV cache is woken."""
        if self.weights_asleep:
            sync_weights()
        if self.cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.cache_asleep = False
