"""Generation with vLLM for GRPO (TRL's ``use_vllm``): the engine, its weights, and a sampler over it.

``VLLMGeneration`` is ``trainer.vllm_generation``, as in TRL 1.16: ``.llm`` is the ``vllm.LLM`` of this process
(``vllm_mode="colocate"``), ``.vllm_client`` the client of a server (``vllm_mode="server"``,
trainers/grpo/vllm_client.py). ``VLLMSampler`` samples the rollout stage's completions through it, with the
engine's log-probs (which feed ``vllm_importance_sampling_correction``).

Colocate runs the engine in the training process itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under several
processes TRL's ``external_launcher`` executor, each process with its own engine): no engine process can outlive
the run. It differs from TRL's where TRL's does not work on CPU or would hide a stale engine:

- the engine starts from the policy's config and tokenizer with placeholder weights and receives the policy's
  full weights before its first round (any model instance works, a PEFT one included);
- weights are synced through the worker's in-place layer-wise reload (``reload_weights``): vLLM's CPU backend
  repacks linear weights for oneDNN, where TRL's ``load_weights`` fails. The full state dict is sent (a tied
  output head is not among ``named_parameters()``); LoRA as W + BA computed per module (the policy's weights
  are not touched); under ZeRO-3 one module gathered at a time;
- on CPU the KV cache is sized for the round's sequences: ``vllm_gpu_memory_utilization`` would be a fraction
  of host RAM there;
- the engine is shut down at the end of ``train()`` (also on an exception or a signal) and by
  ``trainer.end()``; used again afterwards (evaluate, a rollout function), it starts anew.
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
from typing import Any

import torch

from trainers import distributed as dist
from trainers.errors import ConfigError, VLLMServerError
from trainers.generation.sampling import Samples, SamplingParams, cut_at_eos
from trainers.host import allow_amx_tiles
from trainers.logs import logger
from trainers.modeling import context_length

MAX_NUM_BATCHED_TOKENS = 4096  # TRL's: vLLM's memory profiler is misled by its default of 32768
KV_BLOCK_TOKENS = 128  # each sequence's KV cache rounded up to this many tokens (vLLM allocates in blocks)
REASON_CHARS = 600  # vLLM's reason for refusing a model, at most, in our error
WEIGHT_BATCH_BYTES = 64 * 2**20  # server mode: tensors sent per request, at most (one module may be more)


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (None: it can)."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # ImportError, or a broken install (mismatched torchvision, ...)
        return f"vLLM is not importable ({type(error).__name__}: {error})"
    return None


# ---------------------------------------------------------------------------------------------- the weights

def _lora_merged(name: str, module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A PEFT LoRA layer's weights as the engine wants them: the base weight + each active adapter's B A x
    scaling (a new tensor; the policy's are not touched), and the base layer's other parameters."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        raise ConfigError(f"use_vllm with a PEFT adapter: only LoRA adapters can be merged into the engine's "
                          f"weights ({name} is a {type(module).__name__}).")
    base = module.get_base_layer()
    weight = base.weight.detach().clone()
    if not module.disable_adapters and not module.merged:  # merged: the base weight holds the adapter already
        for adapter in module.active_adapters:
            if adapter not in module.scaling:
                continue  # this adapter does not touch this layer
            if module.use_dora.get(adapter):
                raise ConfigError("use_vllm with a DoRA adapter (use_dora=True) is not supported: its weight "
                                  "is not W + BA. Use plain LoRA.")
            weight += module.get_delta_weight(adapter).to(weight.dtype)
    out = [(f"{name}.weight", weight)]
    out += [(f"{name}.{key}", value.detach().clone()) for key, value in base.named_parameters() if key != "weight"]
    return out


def _active_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A PEFT ModulesToSaveWrapper's module in use: the adapter's trained copy, or the original."""
    adapters = [] if module.disable_adapters else [a for a in module.active_adapters if a in module.modules_to_save]
    return module.modules_to_save[adapters[0]] if adapters else module.original_module


def policy_weights(accelerator, model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's full weights under the checkpoint's names (``model.layers.0.mlp.up_proj.weight``), one
    module at a time: its own parameters and persistent buffers, as ``state_dict()`` holds them, so a tied
    output head is there too (it is not among ``named_parameters()``). A PEFT model gives its base model's names
    with each LoRA layer merged (W + BA) and a ``modules_to_save`` copy in place of the original. Under ZeRO-3 each
    module is gathered in turn (the tensors are copies, made while it is gathered); every process must iterate
    together. ``model``: the unwrapped policy."""
    is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")  # a PeftModel
    root = model.get_base_model() if is_peft else model
    tuner_layer = modules_to_save = ()
    if is_peft:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper

        tuner_layer, modules_to_save = (BaseTunerLayer,), (ModulesToSaveWrapper,)
    sharded = dist.zero_stage(accelerator) == 3
    done = None  # a module sent whole (with its submodules): they are skipped
    for name, module in root.named_modules():
        if done is not None and name.startswith(done + "."):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, tuner_layer):
            done = name
            with dist.gathered_parameters(accelerator, module), torch.no_grad():
                yield _lora_merged(name, module)
            continue
        if isinstance(module, modules_to_save):
            done = name
            active = _active_copy(module)
            with dist.gathered_parameters(accelerator, active):
                yield [(prefix + key, value.detach().clone()) for key, value in active.state_dict().items()]
            continue
        own = [(key, value) for key, value in module._parameters.items() if value is not None]
        own += [(key, value) for key, value in module._buffers.items()
                if value is not None and key not in module._non_persistent_buffers_set]
        if not own:
            continue
        with dist.gathered_parameters(accelerator, module, recurse=False):
            # under ZeRO-3 the gathered tensor is freed on leaving the block: copy it while it is there
            yield [(prefix + key, value.detach().clone() if sharded else value.detach()) for key, value in own]


# ---------------------------------------------------------------------------------------------- sampling

def vllm_sampling_kwargs(params: SamplingParams, eos_ids: set[int]) -> dict:
    """vllm.SamplingParams arguments for one completion per prompt, mapped as TRL 1.16 maps its options
    (min_p None -> 0.0, generation_kwargs last, overriding), with the log-prob of each sampled token (after
    temperature: the engine runs with logprobs_mode="processed_logprobs"), and generation ending on the
    trainer's EOS ids. ``do_sample=False`` is greedy (temperature 0)."""
    kwargs = {
        "n": 1, "repetition_penalty": params.repetition_penalty, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "min_p": 0.0 if params.min_p is None else params.min_p,
        "max_tokens": params.max_new_tokens, "logprobs": 0, "stop_token_ids": sorted(eos_ids),
    }
    if not params.do_sample:
        kwargs.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    kwargs.update(params.extra)  # generation_kwargs: vLLM SamplingParams arguments with use_vllm, as in TRL
    return kwargs


def sampled_logprobs(output) -> list[float]:
    """The engine's log-prob of each token of one completion (``vllm.CompletionOutput``); NaN where it gave none."""
    if output.logprobs is None:
        return [math.nan] * len(output.token_ids)
    values = []
    for token, candidates in zip(output.token_ids, output.logprobs):
        chosen = candidates.get(token)
        values.append(math.nan if chosen is None or chosen.logprob is None else float(chosen.logprob))
    return values


@contextlib.contextmanager
def _keep_default_process_group():
    """vLLM's in-process shutdown ends with ``torch.distributed.destroy_process_group()``, which would destroy
    the training run's own process group (its engine joined it): within this block that call (the default group
    only) does nothing; vLLM's own groups are still destroyed."""
    original = torch.distributed.destroy_process_group

    def destroy(group=None):
        if group is not None:
            original(group)

    torch.distributed.destroy_process_group = destroy
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = original


class VLLMGeneration:
    """``trainer.vllm_generation``: a vLLM engine that samples for ``trainer`` (a GRPOTrainer, set up: its
    model prepared), with the policy's weights. Built on every process (each colocated engine, or the client
    on the main process; every process takes part in weight gathers)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        args, acc = trainer.args, trainer.accelerator
        self.mode = args.vllm_mode
        self.llm = None  # colocate: the vllm.LLM; None once closed
        self.vllm_client = None  # server: the VLLMClient (main process)
        self._model_dir: str | None = None  # colocate: the config and tokenizer the engine starts from
        self._dtype = next(trainer.unwrapped_model.parameters()).dtype
        self._synced_step: int | None = None  # the optimizer step whose weights the engine holds
        self._sync_after_steps = True  # tests switch it off to show that the sync is what keeps the engine right
        self._restore_set_num_threads = None
        self._owns_process_group = False
        self._sleeping = False  # sleep mode: the engine's weights are discarded until the next sync
        self.on_cpu = acc.device.type == "cpu"
        if args.vllm_enable_sleep_mode and self.on_cpu:
            raise ConfigError("GRPOConfig: `vllm_enable_sleep_mode=True` needs a GPU: vLLM has no sleep mode on "
                              "CPU. Leave it False.")
        self._check_generation_kwargs()
        if self.mode == "colocate":
            self.start()
        else:
            self._connect()
        acc.wait_for_everyone()

    # ------------------------------------------------------------------ set-up

    def _check_generation_kwargs(self) -> None:
        """generation_kwargs are vLLM SamplingParams arguments here (as in TRL): a wrong one fails now, by name
        (where vLLM is importable: a server in its own environment checks them when it samples)."""
        if vllm_missing():
            return
        from vllm import SamplingParams as VLLMSamplingParams

        trainer = self.trainer
        try:
            VLLMSamplingParams(**vllm_sampling_kwargs(trainer.sampling, trainer.eos_ids))
        except Exception as error:
            raise ConfigError(f"GRPOConfig: with use_vllm=True, generation_kwargs={trainer.args.generation_kwargs!r} "
                              f"are passed to vllm.SamplingParams, which refused them: {error}") from error

    def _engine_options(self) -> dict:
        """vllm.LLM's arguments (the model folder aside)."""
        trainer = self.trainer
        args, acc, model = trainer.args, trainer.accelerator, trainer.unwrapped_model
        max_model_len = args.vllm_max_model_length or context_length(model)
        # TRL's: every completion this process samples in a round, at once
        max_num_seqs = trainer.per_process_train_batch_size * trainer.steps_per_generation
        options = dict(
            dtype=self._dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_model_len or 0),
            model_impl=args.vllm_model_impl, seed=args.seed + acc.process_index,
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer's log-probs are
            load_format="dummy",  # the policy's weights arrive with the first sync
            enable_sleep_mode=args.vllm_enable_sleep_mode,
        )
        if acc.num_processes > 1:  # TRL's executor for an engine in each training process
            options["distributed_executor_backend"] = "external_launcher"
        if self.on_cpu:
            options["enforce_eager"] = True  # compiling takes 20-70 s of start-up for a few % of speed
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # the user's own size wins
                options["kv_cache_memory_bytes"] = self._kv_cache_bytes(max_model_len, max_num_seqs)
            if args.vllm_gpu_memory_utilization != 0.3 and acc.is_main_process:
                logger.warning(f"vllm_gpu_memory_utilization={args.vllm_gpu_memory_utilization} is not used on "
                               f"CPU (vLLM would reserve that fraction of host RAM): the KV cache is sized for the "
                               f"round's sequences (docs/grpo.md, 'Generation with vLLM').")
        else:
            options["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
        return options

    def _kv_cache_bytes(self, max_model_len: int | None, max_num_seqs: int) -> int:
        """On CPU: a KV cache for every sequence of a round at once (the longest prompt + max_completion_length
        each, rounded up to KV_BLOCK_TOKENS) plus one sequence of max_model_len, in bytes."""
        trainer = self.trainer
        config = trainer.unwrapped_model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * self._dtype.itemsize  # K and V
        known = [ids for ids in (trainer.train_prompt_ids or []) + (trainer.eval_prompt_ids or [])]
        longest = max(map(len, known)) + trainer.args.max_completion_length if known else max_model_len
        per_sequence = min(longest, max_model_len) if max_model_len else longest
        per_sequence = -(-per_sequence // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        # one sequence of max_model_len fits on top (vLLM checks that one does), and a quarter more for vLLM's
        # own accounting (measured: the exact product falls ~7% short of a max_model_len sequence)
        tokens = max_num_seqs * per_sequence + -(-(max_model_len or 0) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        return int(tokens * per_token * 1.25)

    def _save_model_folder(self) -> str:
        """The policy's config, generation config and tokenizer in a temporary folder: what the engine starts
        from (its weights come from the policy)."""
        trainer = self.trainer
        model = trainer.unwrapped_model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        folder = tempfile.mkdtemp(prefix="trainers-vllm-")
        base.config.save_pretrained(folder)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(folder)
        trainer.processing_class.save_pretrained(folder)
        return folder

    def start(self) -> None:
        """Start this process's engine (colocate) and give it the policy's weights. Every process calls it."""
        if self.llm is not None:
            return
        # in-process engine: nothing outlives the run; set before vLLM reads its settings
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        acc = self.trainer.accelerator
        options = self._engine_options()
        if acc.num_processes > 1:  # external_launcher reads the launch from these, as in TRL
            os.environ.update(RANK=str(acc.process_index), LOCAL_RANK=str(acc.local_process_index),
                              WORLD_SIZE=str(acc.num_processes))
        from vllm import LLM

        if acc.device.type == "cpu":
            allow_amx_tiles()  # vLLM's bf16 CPU attention uses AMX without asking the kernel (trainers/host.py)
        # each sync's reload warns that the rotary embedding's cache was not loaded: it is computed, not a weight
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self._owns_process_group = not torch.distributed.is_initialized()  # single process: vLLM makes its own
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process: restored on close
        self._restore_set_num_threads = torch.set_num_threads
        self._model_dir = self._save_model_folder()
        try:
            self.llm = LLM(model=self._model_dir, **options)
            # some models start but cannot run (on CPU: an attention head_dim vLLM's kernels lack): one token
            # now, so that this fails when the trainer is built rather than in the first round
            from vllm import SamplingParams as VLLMSamplingParams

            self.llm.generate([{"prompt_token_ids": [0]}], VLLMSamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as error:
            self._shut_down_failed_start()
            raise ConfigError(self._unloadable_message(error)) from error
        self._synced_step = None
        self.sync_weights()
        if self.trainer.args.vllm_enable_sleep_mode:
            self._sleep()

    def _unloadable_message(self, error: Exception) -> str:
        """The error for a model vLLM cannot load or run: the model, its architecture and vLLM's reason (cut:
        vLLM's list of supported architectures alone is thousands of characters)."""
        config = self.trainer.unwrapped_model.config
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

    def _connect(self) -> None:
        """Server mode: the client, on the main process, checked against the served model before training."""
        args, acc = self.trainer.args, self.trainer.accelerator
        error = None
        if acc.is_main_process:
            try:
                from trainers.grpo.vllm_client import VLLMClient

                self.vllm_client = VLLMClient(
                    base_url=args.vllm_server_base_url, host=args.vllm_server_host, server_port=args.vllm_server_port,
                    group_port=args.vllm_group_port, connection_timeout=args.vllm_server_timeout)
                self.vllm_client.check_server(self._model_name())
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error)
        self.sync_weights()

    def _model_name(self) -> str | None:
        """The policy's name or folder, for the server's check that it serves the same model."""
        model = self.trainer.unwrapped_model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return getattr(base, "name_or_path", None) or None

    # ------------------------------------------------------------------ weights

    def sync_for_step(self, step: int) -> None:
        """Before a generation round: the engine gets the policy's weights unless it has them from this
        optimizer step already (TRL's _last_loaded_step). Every process calls it."""
        if self.mode == "colocate" and self.llm is None:
            self.start()  # closed at the end of a train() call, used again
        if self._synced_step is None or (self._sync_after_steps and step != self._synced_step):
            self.sync_weights()
            self._synced_step = step

    def sync_weights(self, model: torch.nn.Module | None = None) -> None:
        """The engine's weights := the policy's (``model``: the unwrapped policy, by default the trainer's).
        Every process calls it (gathers under ZeRO-3)."""
        trainer = self.trainer
        model = model if model is not None else trainer.unwrapped_model
        batches = policy_weights(trainer.accelerator, model)
        if self.mode == "colocate":
            if self._sleeping:
                self.llm.wake_up(tags=["weights"])
            weights = ((name, tensor.to(self._dtype)) for batch in batches for name, tensor in batch)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
            self._sleeping = False
        else:
            self._send_to_server(batches)
        if self._synced_step is None:
            self._synced_step = trainer.state.global_step if hasattr(trainer, "state") else 0

    def _send_to_server(self, batches: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """Server mode: the main process sends the weights in requests of about WEIGHT_BATCH_BYTES; the others
        take part in the gathers."""
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
        dist.raise_together(self.trainer.accelerator, error, shared=(VLLMServerError,))

    def _sleep(self) -> None:
        """Sleep mode (GPU): discard the weights and the KV cache until the next round (TRL's level 2)."""
        self.llm.sleep(level=2)
        self._sleeping = True

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt (its token ids, ending with an EOS unless max_new_tokens cut it) and the
        engine's log-prob of each of its tokens (NaN where it gave none). Every process calls it together."""
        kwargs = vllm_sampling_kwargs(params, self.trainer.eos_ids)
        if self.mode == "colocate":
            return self._generate_here(prompt_ids, kwargs)
        return self._generate_on_server(prompt_ids, kwargs)

    def _generate_here(self, prompt_ids: list[list[int]], kwargs: dict) -> tuple[list, list]:
        from vllm import SamplingParams as VLLMSamplingParams

        if self.llm is None:
            self.start()
        regex = self.trainer.args.vllm_structured_outputs_regex
        if regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(regex=regex)
        if self._sleeping:  # level 2 discarded the weights: they come back from the policy
            self.sync_weights()
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                                    sampling_params=VLLMSamplingParams(**kwargs), use_tqdm=False)
        if self.trainer.args.vllm_enable_sleep_mode:
            self._sleep()
        completions = [list(out.outputs[0].token_ids) for out in outputs]
        return completions, [sampled_logprobs(out.outputs[0]) for out in outputs]

    def _generate_on_server(self, prompt_ids: list[list[int]], kwargs: dict) -> tuple[list, list]:
        """Every process's prompts in one request from the main process; each process gets its own rows back."""
        acc = self.trainer.accelerator
        everyone = dist.gather_objects(acc, [prompt_ids])  # [process][row]
        answer, error = None, None
        if acc.is_main_process:
            try:
                options = {k: v for k, v in kwargs.items() if k in ("n", "repetition_penalty", "temperature", "top_p",
                                                                    "top_k", "min_p", "max_tokens", "logprobs")}
                extra = {k: v for k, v in kwargs.items() if k not in options}
                out = self.vllm_client.generate(
                    prompts=[ids for part in everyone for ids in part], **options,
                    structured_outputs_regex=self.trainer.args.vllm_structured_outputs_regex,
                    generation_kwargs=extra)
                logprobs = out["logprobs"] or [[[math.nan]] * len(ids) for ids in out["completion_ids"]]
                answer = (out["completion_ids"],
                          [[math.nan if top[0] is None else top[0] for top in row] for row in logprobs])
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error, shared=(VLLMServerError,))  # as in _send_to_server
        completions, logprobs = dist.broadcast_object(acc, answer)
        start = sum(len(part) for part in everyone[:acc.process_index])
        mine = slice(start, start + len(prompt_ids))
        return completions[mine], logprobs[mine]

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Shut the engine down (colocate: its memory and threads are released; the training run's process
        group stays) or the client (server: the server keeps running). Idempotent."""
        if self.vllm_client is not None:
            client, self.vllm_client = self.vllm_client, None
            client.close()
        if self.llm is None:
            self._remove_model_folder()
            return
        llm, self.llm = self.llm, None
        keep = contextlib.nullcontext() if self._owns_process_group else _keep_default_process_group()
        try:
            with keep:
                llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            if self._restore_set_num_threads is not None:
                torch.set_num_threads = self._restore_set_num_threads
            self._remove_model_folder()
            self._sleeping = False

    def _remove_model_folder(self) -> None:
        if self._model_dir is not None:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            self._model_dir = None


class VLLMSampler:
    """The rollout stage's sampler with use_vllm: completions and their log-probs from ``trainer.vllm_generation``
    (the engine holds the policy's weights of the last optimizer step: ``sync_for_step`` before each round),
    each cut after its first EOS, as the policy sampler cuts them."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def sample(self, prompts: list, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        trainer = self.trainer
        completions, logprobs = trainer.vllm_generation.generate(prompt_ids, params)
        pad_id = trainer.processing_class.pad_token_id
        cut = [cut_at_eos(list(ids), trainer.eos_ids, pad_id) for ids in completions]
        return Samples(prompt_ids, cut, [values[:len(ids)] for values, ids in zip(logprobs, cut)])
