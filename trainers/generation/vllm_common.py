"""What both vLLM backends share (TRL's ``use_vllm``): the policy's weights as the engine takes them, the sampling
parameters as vLLM reads them, and ``VLLMBackend``, the part of the backend interface they have in common (the
weight sync's bookkeeping, cutting completions at EOS). ``VLLMColocate`` (generation/vllm_colocate.py) runs the
engine in the training process; ``VLLMRemote`` (generation/vllm_remote.py) is the client of a `trainers vllm-serve`
server. Either is ``trainer.vllm_generation``, as in TRL 1.16 (``.llm`` colocated, ``.vllm_client`` as a server).

Weights are sent whole (the full state dict: a tied output head is not among ``named_parameters()``); LoRA as
W + BA computed per module (the policy's weights are not touched), or the adapter alone where the engine serves
it (vllm_lora_sync: generation/vllm_lora.py); under ZeRO-3 one module gathered at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError
from trainers.generation.backend import BackendInputs
from trainers.generation.sampling import Samples, SamplingParams, cut_at_eos, ended
from trainers.generation.vllm_lora import AdapterFolders, is_peft

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


def check_vllm_here() -> None:
    """vllm_mode='colocate' runs vLLM in this process (a server needs only its own environment to have it):
    checked before the model loads."""
    missing = vllm_missing()
    if missing:
        raise ConfigError(f"GRPOConfig: `use_vllm=True` with vllm_mode='colocate' needs vLLM here: {missing}. "
                          f"Install it (on CPU: `bash scripts/setup.sh vllm`; docs/grpo.md, 'Generation with vLLM'), "
                          f"use vllm_mode='server' with a server in its own environment, or leave use_vllm False.")


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


def policy_weights(accelerator, model: torch.nn.Module, merge_lora: bool = True
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's full weights under the checkpoint's names (``model.layers.0.mlp.up_proj.weight``), one
    module at a time: its own parameters and persistent buffers, as ``state_dict()`` holds them, so a tied
    output head is there too (it is not among ``named_parameters()``). A PEFT model gives its base model's names
    with each LoRA layer merged (W + BA; ``merge_lora=False``: its base layer's weights alone, for an engine that
    serves the adapter itself) and a ``modules_to_save`` copy in place of the original. Under ZeRO-3 each
    module is gathered in turn (the tensors are copies, made while it is gathered); every process must iterate
    together. ``model``: the unwrapped policy."""
    peft = is_peft(model)
    root = model.get_base_model() if peft else model
    tuner_layer = modules_to_save = ()
    if peft:
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
                if merge_lora:
                    yield _lora_merged(name, module)
                else:
                    yield [(f"{name}.{key}", value.detach().clone())
                           for key, value in module.get_base_layer().named_parameters()]
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
def keep_default_process_group():
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


class VLLMBackend:
    """The backend interface over a vLLM engine; a subclass says where the engine is (``_generate``: completions
    and their log-probs; ``_push_weights``: the policy's weights into it; ``close``)."""

    def __init__(self, inputs: BackendInputs):
        self.inputs = inputs
        self.context, self.config = inputs.context, inputs.config
        self._synced_step: int | None = None  # the optimizer step whose weights the engine holds
        # a subclass that syncs a LoRA policy's adapter alone sets this (generation/vllm_lora.py): then a sync saves
        # the adapter and ``_push_adapter`` gives it to the engine, instead of ``_push_weights``
        self.adapters: AdapterFolders | None = None
        # where sampling is in the run, for its seeds (row_seeds): the optimizer step the last sync was for, and the
        # generate calls since
        self._step, self._calls = 0, 0
        self._check_generation_kwargs()

    def _check_generation_kwargs(self) -> None:
        """generation_kwargs are vLLM SamplingParams arguments here (as in TRL): a wrong one fails now, by name
        (where vLLM is importable: a server in its own environment checks them when it samples)."""
        if vllm_missing() or self.inputs.sampling is None:
            return
        from vllm import SamplingParams as VLLMSamplingParams

        try:
            VLLMSamplingParams(**vllm_sampling_kwargs(self.inputs.sampling, set(self.context.eos_ids)))
        except Exception as error:
            raise ConfigError(f"GRPOConfig: with use_vllm=True, generation_kwargs={self.config.generation_kwargs!r} "
                              f"are passed to vllm.SamplingParams, which refused them: {error}") from error

    def _model_name(self) -> str | None:
        """The policy's name or folder (the server checks it serves the same model; errors name it)."""
        model = self.inputs.policy
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return getattr(base, "name_or_path", None) or None

    def sync_weights(self, step: int | None = None) -> None:
        """The engine's weights := the policy's after optimizer step ``step``, unless it holds them already
        (TRL's _last_loaded_step); ``step=None`` (TRL's ``sync_weights()``): now, whatever it holds. Every process
        calls it (gathers under ZeRO-3)."""
        if step is not None:
            self.seed_position(step)
        if step is None or step != self._synced_step:
            if self.adapters is None:
                self._push_weights(policy_weights(self.context.accelerator, self.inputs.policy))
            else:
                self._push_adapter(step)
            self._synced_step = step

    def seed_position(self, step: int) -> None:
        """Sampling from here on is for optimizer step ``step`` (its rows' seeds derive from it and the calls since):
        the weight sync says so; GRPO's asynchronous producer says so for each round, whatever weights it has."""
        if step != self._step:
            self._step, self._calls = step, 0

    def row_seeds(self, rows: int) -> list[int]:
        """One sampling seed per row of this process's next generate call, so that a run samples the same tokens
        again whatever else the engine is doing (batching, other requests, a fresh server): consecutive seeds from a
        base drawn from the run's seed, the optimizer step of the last weight sync, the calls since and the process.
        A row's completions differ from its neighbours' (another seed), and a request for n copies of one prompt
        with seed s samples with s, s + 1, ... (vLLM's parallel sampling), the same seeds as n requests."""
        self._calls += 1
        where = f"{self.config.seed}/{self._step}/{self._calls}/{self.context.accelerator.process_index}"
        base = int.from_bytes(hashlib.sha256(where.encode()).digest()[:4], "big") >> 2  # room for + rows below 2^31
        return [base + i for i in range(rows)]

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt (its token ids, ending with an EOS unless max_new_tokens cut it) and the
        engine's log-prob of each of its tokens (NaN where it gave none). Every process calls it together."""
        return self._generate(prompt_ids, *self.request_options(prompt_ids, params))

    def request_options(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[dict, list[int]]:
        """(vllm.SamplingParams arguments, one seed per row) for sampling ``prompt_ids`` with ``params``."""
        kwargs = vllm_sampling_kwargs(params, set(self.context.eos_ids))
        given = kwargs.pop("seed", None)  # generation_kwargs' seed: every call's rows from it (as TRL's n from it)
        seeds = self.row_seeds(len(prompt_ids)) if given is None else [given + i for i in range(len(prompt_ids))]
        return kwargs, seeds

    def sample(self, prompts: list, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        """Completions and the engine's log-probs of them, each cut after its first EOS (as the policy's)."""
        return self.samples(prompt_ids, *self.generate(prompt_ids, params))

    def samples(self, prompt_ids: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
                versions: list[list[int | None]] | None = None) -> Samples:
        """The engine's completions (with their log-probs and, where known, each token's weight version) as
        ``Samples``, each cut after its first EOS (as the policy's)."""
        eos_ids = set(self.context.eos_ids)
        cut = [cut_at_eos(list(ids), eos_ids, self.context.pad_id) for ids in completions]
        return Samples(prompt_ids, cut, [values[:len(ids)] for values, ids in zip(logprobs, cut)],
                       finished=[ended(ids, eos_ids) for ids in cut],
                       versions=None if versions is None else [v[:len(ids)] for v, ids in zip(versions, cut)])

    def _generate(self, prompt_ids: list[list[int]], kwargs: dict, seeds: list[int] | None
                  ) -> tuple[list[list[int]], list[list[float]]]:
        """Completions of ``prompt_ids`` sampled with ``kwargs`` (vllm.SamplingParams'), row i with seed
        ``seeds[i]``."""
        raise NotImplementedError

    def _push_weights(self, batches: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        raise NotImplementedError

    def _push_adapter(self, step: int | None) -> None:
        """Save the policy's adapter as it is after ``step`` (``self.adapters``) and give it to the engine."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
