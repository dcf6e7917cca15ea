"""The distributed core: one Accelerator built from the launch environment, and the few verbs trainers need.

Trainers never branch on the backend. They call:
  - ``build_accelerator``: one process, ``torchrun``, ``accelerate launch --config_file <template>``, or
    Accelerate's ``notebook_launcher``;
    on a machine without a GPU it still gives real multi-process training (DDP over gloo, DeepSpeed ZeRO on CPU).
  - ``configure_deepspeed``: fills the DeepSpeed config values that Accelerate leaves as "auto".
  - ``gathered_parameters``: the full weights of a ZeRO-3 model for the duration of a block;
    ``gathered_for_generation`` also takes DeepSpeed's hooks off, so ranks may decode different lengths.
  - ``gather_objects`` / ``broadcast_object`` / ``all_reduce_sum`` / ``all_reduce_max``: Python objects, counts
    and extremes across processes.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    gather_object,
)

from trainers.errors import DistributedError
from trainers.parallel.notebook_fork import check_threads_after_fork, notebook_launched
from trainers.parallel.host import (
    keep_host_memory,
    let_gloo_workers_finish,
    tune_host_allocator,
    warn_on_stale_build_locks,
)

DEEPSPEED_ENV = "ACCELERATE_USE_DEEPSPEED"


def _launched_with_deepspeed() -> bool:
    return os.environ.get(DEEPSPEED_ENV, "false").lower() == "true"


def _world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_accelerator(
    gradient_accumulation_steps: int, mixed_precision: str | None = None, use_cpu: bool = False,
    log_with: list[str] | None = None, project_dir: str | None = None, ddp_kwargs: dict | None = None,
    backend: str | None = None, timeout_seconds: int = 1800,
) -> Accelerator:
    """Build the Accelerator for however this process was launched.

    ``ddp_kwargs`` go to DistributedDataParallel when the model is wrapped in it; ``backend`` (None: Accelerate's
    pick) and ``timeout_seconds`` to the process group, as transformers passes ``ddp_backend`` and ``ddp_timeout``.
    The process group is made by the first Accelerator of a process; later ones share it.

    Without a GPU, Accelerate needs two nudges that are easy to get wrong (see docs/distributed.md):
      - DeepSpeed on CPU needs an explicit gloo process group, or Accelerate sees one process.
      - Plain multi-process on CPU needs ``cpu=True`` (distributed type MULTI_CPU): a gloo process group alone
        leaves the type at NO, and the processes silently train different models.
    Under Accelerate's notebook_launcher (forked processes, no config file) the same holds, plus its
    mixed_precision= and a check against the fork's OpenMP hang (see the notebook_launcher section above).
    """
    # Our loop feeds micro-batches itself; without sync_with_dataloader=False a finished transformers Trainer in
    # the same process leaves Accelerate's shared "end of dataloader" flag set, and every micro-batch would sync.
    plugin = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps, sync_with_dataloader=False)
    kwargs: dict[str, Any] = {"gradient_accumulation_plugin": plugin}
    if log_with:
        kwargs.update(log_with=log_with, project_dir=project_dir)
    if mixed_precision is None and notebook_launched() and os.environ["MIXED_PRECISION"] != "no":
        # notebook_launcher(mixed_precision=...): the launch's choice, as `accelerate launch --mixed_precision`'s
        # is (a config's bf16=True/False still wins); "no" is also its default, so it leaves ACCELERATE_* in charge
        mixed_precision = os.environ["MIXED_PRECISION"]
    if mixed_precision is not None:
        kwargs["mixed_precision"] = mixed_precision
    has_gpu = torch.cuda.is_available() and not use_cpu
    if backend == "nccl" and not has_gpu:
        raise DistributedError("ddp_backend='nccl' needs CUDA GPUs; this run has none (or use_cpu=True). Use "
                               "ddp_backend='gloo', or leave it at None.")
    if not has_gpu and launched_with_fsdp():
        raise RuntimeError(
            "This launch asks for FSDP (fsdp2.yaml), which Accelerate only engages on GPUs; on this machine it would "
            "silently run plain DDP instead. Without a GPU use multi_gpu.yaml (DDP) or zero1/zero2/zero3.yaml."
        )
    if not has_gpu:
        if _launched_with_deepspeed():
            tune_host_allocator()  # host RAM is the training memory, and ZeRO frees and re-gathers weights
            warn_on_stale_build_locks()  # DeepSpeed compiles its CPU ops on first use
            backend = backend or "gloo"
        else:
            keep_host_memory()  # every step allocates and frees the same large activations
            kwargs["cpu"] = True
    group = {"timeout": timedelta(seconds=timeout_seconds)} | ({"backend": backend} if backend else {})
    kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(**group), DistributedDataParallelKwargs(**(ddp_kwargs or {}))]
    # As transformers does for every Trainer: each trainer's Accelerator starts from a fresh AcceleratorState, so
    # one built earlier in the process (another mixed precision, another DeepSpeed plugin) does not refuse this one.
    # The process group (PartialState) is kept: later trainers share it.
    AcceleratorState._reset_state()
    accelerator = Accelerator(**kwargs)
    if _world_size_from_env() > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"WORLD_SIZE={_world_size_from_env()} but Accelerate built a single-process setup "
            f"(distributed type {accelerator.distributed_type}); the processes would train separate models."
        )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu" and not is_deepspeed(accelerator):
        raise DistributedError(
            "fp16 mixed precision needs a GPU: on CPU Accelerate would train in float32 without saying so. Use bf16 "
            "(bf16=True, or mixed_precision='bf16' in the launch), or no mixed precision.")
    if notebook_launched() and not has_gpu:
        check_threads_after_fork()  # after Accelerator(): it may have set the thread count (OMP_NUM_THREADS unset)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        atexit.unregister(let_gloo_workers_finish)  # once per process, however many trainers it builds
        atexit.register(let_gloo_workers_finish)
    return accelerator


def launched_with_fsdp() -> bool:
    """Whether this launch asks for FSDP (fsdp2.yaml: ``accelerate launch`` sets ACCELERATE_USE_FSDP from it)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def is_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator: Accelerator) -> int:
    """The DeepSpeed ZeRO stage in use, or 0 when DeepSpeed is not."""
    if not is_deepspeed(accelerator):
        return 0
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def forwards_are_collective(accelerator: Accelerator, model: torch.nn.Module) -> bool:
    """Whether a forward of the prepared ``model`` talks to the other processes: it gathers sharded weights
    (ZeRO-3, FSDP), or DDP broadcasts the module's buffers before it (broadcast_buffers). Then every process
    must run the same number of forwards; one that only some processes run would hang them."""
    if zero_stage(accelerator) == 3 or accelerator.distributed_type == DistributedType.FSDP:
        return True
    return (isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.broadcast_buffers
            and any(True for _ in model.module.buffers()))


def zero_settings(stage: int, hidden_size: int, num_parameters: int, layer_parameters: int,
                  largest_parameter: int) -> dict:
    """ZeRO bucket and live-parameter sizes (in elements) derived from the model's shape.

    DeepSpeed's defaults are sized for very large models on GPUs: 5e8-element communication buckets (2 GB
    in fp32), up to 1e9 gathered parameters kept alive with a reuse distance of 1e9 (a 300M model can stay
    fully gathered from forward to backward, defeating ZeRO-3), and 1e9-element optimizer sub-groups (whose
    temporaries are as large as the whole partition). Accelerate only derives a few of them, and only when
    they are written as "auto" in a DeepSpeed config file. Here, for every stage:

      reduce/allgather buckets  hidden^2 (Accelerate's rule), within [1e6, 5e8]
      stage 3 prefetch bucket   0.9 x hidden^2
      persistence threshold     10 x hidden: smaller tensors (norms, biases) are never partitioned
      max live parameters       2 transformer layers' worth (at least the largest single tensor)
      max reuse distance        the same: a layer is released between forward and backward
      optimizer sub-group       1e8 elements at most, so Adam's temporaries stay small
    """
    bucket = int(min(max(hidden_size * hidden_size, 1e6), 5e8))
    settings: dict = {"reduce_bucket_size": bucket}
    if stage in (1, 2):
        settings["allgather_bucket_size"] = bucket
    if stage == 3:
        live = int(max(2 * layer_parameters, largest_parameter, 1e6))
        settings.update({
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": live,
            "stage3_max_reuse_distance": live,
            "sub_group_size": int(min(1e8, max(num_parameters, 1e6))),
        })
    return settings


def _shape_of(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(hidden size, parameters, parameters per transformer layer, largest single parameter) of a model,
    counting full sizes even when ZeRO-3 has already partitioned it."""
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    params = list(model.parameters())
    total = sum(numel(p) for p in params)
    largest = max((numel(p) for p in params), default=0)
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None) or 1024
    layers = getattr(config, "num_hidden_layers", None) or 1
    embeddings = sum(numel(p) for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
    return int(hidden), total, max((total - embeddings) // layers, 1), largest


def configure_deepspeed(
    accelerator: Accelerator, micro_batch_size: int, gradient_accumulation_steps: int, max_grad_norm: float | None,
    model: torch.nn.Module | None = None,
) -> dict:
    """Fill the DeepSpeed config values that Accelerate leaves as "auto" or absent, before ``prepare``.

    Accelerate derives the batch sizes from a prepared DataLoader; the trainers make their own batches, so the
    values are set here. Gradient clipping happens inside DeepSpeed's step, so it must learn max_grad_norm too.
    With a ``model``, bucket and live-parameter sizes come from ``zero_settings`` unless the DeepSpeed config
    sets them. Returns the ZeRO settings applied.
    """
    if not is_deepspeed(accelerator):
        return {}
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    config["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * accelerator.num_processes
    # Clipping happens inside DeepSpeed's step. "No clipping" is an unreachable bound rather than 0, so that
    # DeepSpeed still computes the gradient norm (the trainers log it and skip non-finite steps by it).
    config["gradient_clipping"] = float(max_grad_norm or 1e30)
    # Steps are driven by the trainer's loop; DeepSpeed's own periodic prints would only add noise.
    config["steps_per_print"] = float("inf")
    applied = {}
    if model is not None:
        zero = config.setdefault("zero_optimization", {})
        for key, value in zero_settings(zero_stage(accelerator), *_shape_of(model)).items():
            if zero.get(key, "auto") == "auto":
                zero[key] = applied[key] = value
    return applied


@contextlib.contextmanager
def gathered_parameters(accelerator: Accelerator, model: torch.nn.Module, enabled: bool = True,
                        recurse: bool = True):
    """Inside this block the model holds its full parameters, even under ZeRO-3 (then gathered on every rank);
    ``recurse=False``: only the module's own parameters, not its submodules' (a gather one module at a time).

    Outside ZeRO-3 it does nothing. Every process must enter it together (it is a collective).
    """
    if zero_stage(accelerator) != 3 or not enabled:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters(recurse=recurse)), modifier_rank=None):
        yield


@contextlib.contextmanager
def gathered_for_generation(accelerator: Accelerator, engine: torch.nn.Module, enabled: bool = True):
    """``gathered_parameters`` for generation: the full weights on every rank and, under ZeRO-3, DeepSpeed's
    parameter hooks taken off inside (as TRL's unwrap_model_for_generation does). With the hooks on, every
    forward gathers again, a collective: processes that decode a different number of tokens (a completion that
    stops early on one rank, a tool loop's turns) would wait in each other's gathers forever. ``engine``: the
    prepared model (the DeepSpeed engine)."""
    with gathered_parameters(accelerator, engine, enabled=enabled):
        offload = None
        if enabled and zero_stage(accelerator) == 3:
            offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
        if offload is None:
            yield
            return
        for parameter in offload.module.parameters(recurse=True):
            parameter.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()  # the forwards without hooks left its recorded trace stale
            offload._register_deepspeed_module(offload.module)


def prepare_frozen(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A model that only runs forward (a reference or reward model): eval mode, no gradients, on the device.

    Under ZeRO-3 it becomes a DeepSpeed inference engine, partitioned like the policy, so no process holds a
    full copy; otherwise it is cast to bf16 when training in bf16 (it never needs fp32 master weights).
    """
    model.eval().requires_grad_(False)
    if zero_stage(accelerator) == 3:
        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine
    if accelerator.mixed_precision == "bf16":
        model = model.to(dtype=torch.bfloat16)
    return model.to(accelerator.device)


@contextlib.contextmanager
def writable_parameters(accelerator: Accelerator, *models: torch.nn.Module):
    """Inside this block ``models`` hold their full parameters, and what the main process writes into them
    stays: under ZeRO-3 they are gathered on every rank and, on exit, the main process's values are scattered
    back. Yields whether this process should write (every process outside ZeRO-3). Every process must enter
    it together (it is a collective under ZeRO-3)."""
    if zero_stage(accelerator) != 3:
        yield True
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for m in models for p in m.parameters()], modifier_rank=0):
        yield accelerator.is_main_process


def mix_parameters(accelerator: Accelerator, source: torch.nn.Module, target: torch.nn.Module, alpha: float) -> None:
    """``target <- (1 - alpha) * target + alpha * source``, parameter by parameter (same architecture), on full
    weights under ZeRO-3. Every process must call it."""
    source, target = unwrap(accelerator, source), unwrap(accelerator, target)  # engines -> modules
    with writable_parameters(accelerator, source, target) as writes, torch.no_grad():
        if writes:
            for to, of in zip(target.parameters(), source.parameters(), strict=True):
                to.mul_(1.0 - alpha).add_(of.to(to.dtype), alpha=alpha)


def load_full_state_dict(accelerator: Accelerator, model: torch.nn.Module, state_dict: dict) -> None:
    """Copy a full state dict into ``model`` (into its gathered weights under ZeRO-3). Every process must
    call it."""
    model = unwrap(accelerator, model)
    with writable_parameters(accelerator, model) as writes:
        if writes:
            model.load_state_dict(state_dict)


class ThisProcess:
    """An accelerator's view of this process alone: the verbs below see one process and do no collectives, so
    code written for every process together (a tool loop, a backend's sampling) runs in a background thread of
    one process (GRPO's asynchronous producer, trainers/sampling/async_rounds.py). ``process_index`` stays the real
    one (sampling seeds derive from it)."""

    num_processes = 1
    is_main_process = True
    is_local_main_process = True

    def __init__(self, accelerator: Accelerator):
        self.process_index = accelerator.process_index
        self.device = accelerator.device


def gather_objects(accelerator: Accelerator, objects: list) -> list:
    """Concatenate a list of picklable objects from every process, in rank order."""
    if accelerator.num_processes == 1:
        return list(objects)
    return gather_object(list(objects))


def raise_together(accelerator: Accelerator, error: BaseException | None,
                   shared: tuple[type[Exception], ...] = ()) -> None:
    """Every process calls this at the same point, passing the exception it caught there (or None). If any
    process failed, every process raises: the failing one its own exception, the others a DistributedError
    naming it. Without this, the healthy processes would wait in the next collective until its timeout.

    ``shared``: exception types (built from a message) that the others raise too, with the failing process's
    message, instead of a DistributedError: for an error that every process must answer together (the vLLM
    server's: a checkpoint, which every process writes)."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    failed = all_reduce_sum(accelerator, torch.tensor([0.0 if error is None else 1.0], device=accelerator.device))
    if failed.item() == 0:
        return
    kind = None if error is None else next((i for i, k in enumerate(shared) if isinstance(error, k)), None)
    reports = gather_object([None if error is None else (type(error).__name__, str(error), kind)])
    if error is not None:
        raise error
    rank, (name, message, kind) = next((r, m) for r, m in enumerate(reports) if m is not None)
    if kind is not None:
        raise shared[kind](f"(process {rank}) {message}")
    raise DistributedError(f"process {rank} failed, so this process stops too: {name}: {message}")


def broadcast_object(accelerator: Accelerator, obj: Any, from_process: int = 0) -> Any:
    """Give every process the main process's copy of ``obj``."""
    if accelerator.num_processes == 1:
        return obj
    holder = [obj]
    torch.distributed.broadcast_object_list(holder, src=from_process)
    return holder[0]


def gather_varlen(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Every process's 1-D ``values`` (of any length, on every process), concatenated in process order."""
    if accelerator.num_processes == 1:
        return values
    lengths = accelerator.gather(torch.tensor([values.numel()], device=values.device)).tolist()
    padded = accelerator.pad_across_processes(values, dim=0)  # to the longest: gather wants equal shapes
    gathered = accelerator.gather(padded).view(len(lengths), -1)
    return torch.cat([row[:n] for row, n in zip(gathered, lengths)])


def all_reduce_sum(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over processes (returns a new tensor on every process)."""
    if accelerator.num_processes == 1:
        return values.clone()
    return accelerator.reduce(values.clone(), reduction="sum")


@contextlib.contextmanager
def explained_ddp_errors():
    """DDP's failure on a parameter that got no gradient, raised again as an error that names the option to set
    (DDP's own message names its keyword argument, not ours)."""
    try:
        yield
    except RuntimeError as error:
        if "find_unused_parameters=True" not in str(error):
            raise
        raise DistributedError(
            "DistributedDataParallel found parameters that got no gradient in the previous step (a branch the "
            "model did not take, or a parameter outside the loss). Set ddp_find_unused_parameters=True, or freeze "
            "those parameters (requires_grad=False).") from error


@contextlib.contextmanager
def accumulating(accelerator: Accelerator, model: torch.nn.Module, sync: bool):
    """One micro-batch's forward and backward within an optimizer step; gradients are synced across processes
    only with ``sync`` (the step's last micro-batch): DDP's and FSDP's no_sync before it, and DeepSpeed's
    accumulation boundary, which ``accelerator.backward`` sets from ``sync_gradients``. Unlike Accelerate's
    ``accumulate``, which counts micro-batches against gradient_accumulation_steps, the caller says which is the
    last, so a step may have any number of them (GRPO's token_budget)."""
    accelerator.sync_gradients = sync
    with contextlib.nullcontext() if sync else accelerator.no_sync(model):
        yield


def all_reduce_max(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """The elementwise max of a tensor over processes (returns a new tensor on every process)."""
    values = values.clone()
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return values


def unwrap(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The user's model (HF or PEFT) without DDP / DeepSpeed wrappers."""
    return accelerator.unwrap_model(model)


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict on the main process; under ZeRO-3 it is gathered from every rank.

    Every process must call it; processes other than the main one may receive an empty dict.
    """
    return accelerator.get_state_dict(model, unwrap=True)
