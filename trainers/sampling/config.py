"""The sampling base's options, composed by every config of a trainer that learns from its own samples.

``SamplingConfig``: what GRPO, RLOO and distillation share (TRL's generation, vLLM, tool and logging options, the
rounds' shape, and this project's engines and asynchronous generation). ``PolicyGradientConfig`` adds what GRPO and
RLOO share and distillation has not: the reference model's KL, the clipped ratio, reward weights and how the
policy's forwards are laid out. Each algorithm's config declares only what it adds (GRPOConfig: its losses and
advantage options; RLOOConfig: its baseline options; DistillationConfig: the teacher), so an option a trainer does
not have is not one of its fields (the unknown-option error names it). tests/unit/test_trl_config_fields.py holds
each config against TRL 1.16's fields and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.config.training import TrainingConfig, resolve_pad_to_multiple_of
from trainers.config.options import check_field, opt, reject_unknown_options

GENERATION_ENGINES = ("auto", "lean", "hf")
# options that only asynchronous generation reads (weight_sync_timeout and request_timeout serve server mode too)
ASYNC_OPTIONS = ("max_staleness", "max_inflight_tasks", "queue_maxsize", "weight_sync_steps", "heartbeat_stale_after_s",
                 "in_flight_weight_updates")
VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("vllm", "transformers")
LORA_SYNC_CHOICES = ("auto", "adapter", "merged")  # vllm_lora_sync (generation/vllm_lora.py)


@reject_unknown_options
@dataclass
class SamplingConfig(TrainingConfig):
    """A trainer that samples its own completions: generation rounds, sampling, engines, tools, vLLM, asynchronous
    generation and the completions table."""

    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW.", ge=0, finite=True)
    remove_unused_columns: bool = opt(False, "Accepted for TRL compatibility; every dataset column reaches the reward functions.")
    # Generation rounds
    num_generations: int = opt(1, "Completions sampled per prompt.", ge=1)
    num_generations_eval: int | None = opt(
        None, "Completions sampled per eval prompt (default: num_generations).", ge=1)
    max_completion_length: int = opt(512, "Maximum tokens generated per completion.", ge=1)
    generation_batch_size: int | None = opt(
        None, "Completions generated per round over all processes. Default: per_device_train_batch_size x "
        "processes x steps_per_generation.", ge=1
    )
    steps_per_generation: int | None = opt(
        None, "Micro-steps served by one generation round. Default: gradient_accumulation_steps.", ge=1
    )
    num_iterations: int = opt(
        1, "Passes over each generation round (mu); > 1 reuses rollouts with old log-probs.", ge=1)
    pad_to_multiple_of: str | int | None = opt(
        "auto", "Pad the prompt ids (on the left) and the completion ids (on the right) of every forward up to a "
        "multiple of this many columns, each (None: no extra padding); the loss is unchanged. TRL's 'auto' pads "
        "to 128 on AWS Neuron only, which this project does not run on, so it means None here (the field reads "
        "None once the config is built).", ge=1, choices=("auto",)
    )
    # Sampling
    temperature: float = opt(1.0, "Sampling temperature.", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest token set with this probability mass.", gt=0, le=1)
    top_k: int | None = opt(0, "Keep only the k most likely tokens when sampling.", ge=0, note="0 disables")
    min_p: float | None = opt(None, "Drop tokens whose probability is below min_p x the top token's.")
    repetition_penalty: float = opt(1.0, "Penalty on tokens already in the prompt or completion (1.0: none).")
    generation_kwargs: dict | None = opt(None, "Extra keyword arguments for the generation call.")
    chat_template_kwargs: dict | None = opt(None, "Extra keyword arguments for apply_chat_template on prompts.")
    mask_truncated_completions: bool = opt(False, "Exclude completions that hit max_completion_length from the loss.")
    disable_dropout: bool = opt(False, "Set every dropout probability in the policy to 0.")
    cast_lm_head_to_fp32: bool = opt(
        False, "Keep the output head of the policy and the reference model in float32 and compute the logits in "
        "float32 (TRL's option, from the ScaleRL recipe): more precise log-probs for a bf16/fp16 model. A head tied "
        "to the input embeddings makes those float32 too. Not with a PEFT adapter on lm_head."
    )
    # How completions are generated and logged
    generation_engine: str = opt(
        "auto", "How completions are sampled. 'lean' is this project's engine for Llama/Mistral/Qwen2/Qwen3 "
        "models (static KV cache, shared prompt prefill), not yet measured on a GPU; 'hf' is transformers' "
        "generate. 'auto' picks 'lean' on CPU (where it applies) and 'hf' on CUDA; 'lean' stays available by name.",
        choices=GENERATION_ENGINES
    )
    generation_backend: str | None = opt(
        None, "A generation backend registered by name (trainers.generation.backend.register_backend): a class "
        "built from BackendInputs with sample, sync_weights and close. None: chosen from rollout_func, use_vllm and "
        "vllm_mode (a rollout function, vLLM colocated or as a server, else the policy itself)."
    )
    ds3_gather_for_generation: bool = opt(
        True, "Under ZeRO-3, gather the full weights once for generation (fast); False generates layer by layer "
        "(slow, but never holds the whole model)."
    )
    # Tool calling (GRPOTrainer's tools= and environment_factory=; docs/grpo.md, "Tools and environments")
    max_tool_calling_iterations: int | None = opt(
        None, "Tool-calling turns per rollout: after this many rounds of tool calls the rollout ends. None: no "
        "limit; a rollout ends when the model writes a turn without tool calls or max_completion_length (every "
        "turn and tool result together) is used up.", ge=0)
    tool_workers: int | None = opt(
        None, "Threads that run synchronous tool calls (and environments' reset and get_reward); all calls of a "
        "round run at once, async tools on one event loop. None: one per rollout on this process (at most 64).",
        ge=1)
    tool_timeout: float | None = opt(
        None, "Seconds a tool call may take; a call that takes longer gives an error result and the rollout goes "
        "on (a synchronous tool's thread is left to finish on its own). None: no limit.", gt=0, finite=True)
    # Generation with vLLM (TRL's use_vllm and vllm_* options; docs/grpo.md, "Generation with vLLM")
    use_vllm: bool = opt(
        False, "Sample completions with vLLM instead of the policy itself: an engine in each training process "
        "(vllm_mode='colocate') or a separate server (vllm_mode='server'). Its weights follow the policy's after "
        "every optimizer step; its log-probs feed vllm_importance_sampling_correction. Needs the vllm package.")
    vllm_mode: str = opt(
        "colocate", "'colocate': each training process runs its own in-process engine on its own device; "
        "'server': the main process sends prompts and weights to a server started with `trainers vllm-serve`.",
        choices=VLLM_MODES)
    vllm_model_impl: str = opt(
        "vllm", "The engine's model implementation: 'vllm' (its own) or 'transformers'.", choices=VLLM_MODEL_IMPLS)
    vllm_enable_sleep_mode: bool = opt(
        False, "Colocate, on a GPU: offload the engine's weights and KV cache between generation rounds (slower "
        "rounds, more memory for training). vLLM has no sleep mode on CPU: there it is refused.")
    vllm_enforce_eager: bool | None = opt(
        None, "Colocate: run the engine without compiling it (vLLM's enforce_eager). None: eager on CPU, where "
        "compiling takes 20-70 s of every start for a few % of speed; compiled (CUDA graphs) on a GPU. The engine "
        "starts again at each train() call: True saves that start-up on a GPU where rounds are short.")
    vllm_lora_sync: str = opt(
        "auto", "With a PEFT LoRA policy, what a weight sync sends: 'adapter' the adapter alone (the engine keeps the "
        "base weights and serves the adapter: ~1% of the bytes), 'merged' every weight with each LoRA layer merged "
        "(W + BA), 'auto' the adapter wherever the engine can serve it (a colocated engine; a server started with "
        "--enable-lora) and vLLM's adapter format holds it (no modules_to_save, DoRA or trained biases), else merged "
        "with a warning saying why. 'adapter' makes each of those reasons an error.", choices=LORA_SYNC_CHOICES)
    vllm_structured_outputs_regex: str | None = opt(
        None, "Constrain every completion to this regular expression (vLLM's structured outputs). None: free text.")
    vllm_server_base_url: str | list[str] | None = opt(
        None, "Server mode: the server's URL (e.g. 'http://localhost:8000'), or several (a list, or URLs separated "
        "by commas): each round's requests are spread over them, the weights pushed to all, and one that fails is "
        "taken out while the others serve. When given, vllm_server_host and vllm_server_port are not used.")
    vllm_server_host: str = opt("0.0.0.0", "Server mode: the server's host, when vllm_server_base_url is None.")
    vllm_server_port: int = opt(8000, "Server mode: the server's port, when vllm_server_base_url is None.",
                                ge=1, le=65535)
    vllm_server_api_key: str | None = opt(
        None, "Server mode: the key `trainers vllm-serve` was started with (--api-key; it prints one it generated). "
        "None: the environment variable TRAINERS_VLLM_API_KEY, else no key. Sent with every request; masked in "
        "training_args.json and checkpoints.")
    vllm_server_timeout: float = opt(
        240.0, "Server mode: seconds to wait for the server to answer before training starts.", gt=0, finite=True)
    vllm_group_port: int = opt(
        51216, "Server mode: the port on the trainer's main process where the server's workers join the weight "
        "transfer (it must be free there and reachable from the server).", ge=1, le=65535)
    vllm_gpu_memory_utilization: float = opt(
        0.3, "Colocate, on a GPU: the fraction of GPU memory the engine reserves (weights, activations, KV cache). "
        "Not used on CPU, where vLLM would read it as a fraction of host RAM: there the KV cache is sized for "
        "the round's sequences (docs/grpo.md).", gt=0, le=1)
    vllm_max_model_length: int | None = opt(
        None, "Colocate: the engine's context (prompt + completion tokens). None: the model's own context.", ge=1)
    vllm_tensor_parallel_size: int = opt(
        1, "Colocate: GPUs per engine (tensor parallelism); only 1 here (for more, run a server, which takes its own "
        "--tensor-parallel-size).", ge=1)
    log_completions: bool = opt(False, "Print a table of sampled completions at each logging step and append them to completions.jsonl.")
    num_completions_to_print: int | None = opt(None, "Rows of that table (default: all of one round).", ge=1)

    # Asynchronous generation (docs/grpo.md, "Asynchronous generation"; the names of TRL's experimental
    # AsyncGRPOConfig, whose scripts port to AsyncGRPOConfig / AsyncGRPOTrainer, trainers/grpo/asynchronous.py)
    async_generation: bool = opt(
        False, "Generate rounds ahead of training: a producer thread on each process samples the next rounds from the "
        "vLLM server (vllm_mode='server') with the weights the server has, while the trainer trains on earlier ones. "
        "Each round is generated within max_staleness weight syncs of the step that trains on it; the sampler's "
        "log-probs correct for the lag (vllm_importance_sampling_correction). max_staleness=0 is the synchronous run.")
    max_staleness: int = opt(
        4, "async_generation: the most weight syncs a round may lag behind the policy that trains on it (the "
        "producer waits rather than generate a staler one; 0: the synchronous run, exactly).", ge=0)
    max_inflight_tasks: int = opt(
        -1, "async_generation: generation requests in flight to the server at once, per process (-1: a round's "
        "groups, up to 16).", ge=-1)
    queue_maxsize: int = opt(
        1024, "async_generation: completions generated ahead and not yet trained on, per process, at most (at least "
        "one round is always allowed).", ge=1)
    weight_sync_steps: int = opt(
        1, "async_generation: push the policy's weights to the server every this many optimizer steps (a weight "
        "sync is one version; staleness counts them).", ge=1)
    in_flight_weight_updates: bool = opt(
        True, "async_generation: push the weights while the producer's requests are in flight: the server pauses "
        "them between decode steps, loads the new weights and resumes them, so the trainer never waits for a round "
        "to finish (nor for the load: it goes on once its tensors have left); each completion token records the "
        "weights that sampled it (version_spans in completions.jsonl). "
        "False: every round is sampled with one version (the push waits for the round in flight).")
    weight_sync_timeout: int = opt(
        1800, "Server mode: seconds a weight transfer to the vLLM server may wait before it is an error (the run "
        "stops with a checkpoint instead of hanging).", gt=0)
    request_timeout: int = opt(
        600, "Server mode: seconds a request to the vLLM server may wait for its answer before it is an error.", gt=0)
    heartbeat_stale_after_s: float = opt(
        300.0, "async_generation: seconds the trainer waits for a round while the producer shows no progress before "
        "it stops the run (with a checkpoint), naming the round.", gt=0)
    fork_threshold_tokens: int = opt(
        1024, "Accepted from TRL's AsyncGRPOConfig; no effect here: the tool loop appends the tokens it sampled and "
        "the tool results' tokens, never re-tokenizing a conversation, so there is no drift to fork on.", ge=0)

    def __post_init__(self):
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, type(self).__name__)
        super().__post_init__()  # also each field's own choices and bounds
        # Rules that relate fields to each other
        name = type(self).__name__
        check_field(self.generation_batch_size is None or self.steps_per_generation is None, name,
                    "steps_per_generation", self.steps_per_generation,
                    "set generation_batch_size or steps_per_generation, not both")
        given = self.vllm_server_base_url
        urls = [] if given is None else given.split(",") if isinstance(given, str) else given
        for url in urls:
            check_field(isinstance(url, str) and url.strip().startswith(("http://", "https://"))
                        and url.strip().split("://", 1)[1].strip("/"), name, "vllm_server_base_url", given,
                        "give each server's URL with its scheme and host, e.g. 'http://localhost:8000' (several: a "
                        "list, or separated by commas)")
        check_field(given is None or len(urls) > 0, name, "vllm_server_base_url", given, "give at least one URL")
        check_field(self.vllm_mode != "colocate" or self.vllm_tensor_parallel_size == 1, name, "vllm_tensor_parallel_size",
                    self.vllm_tensor_parallel_size, "the colocated engine runs on one device here; for tensor "
                    "parallelism start a server (`trainers vllm-serve --tensor-parallel-size N`) and use "
                    "vllm_mode='server'")
        self._check_async(name)
        # Divisibility of the batch sizes by num_generations needs the process count: checked by the trainer.

    def _check_async(self, name: str) -> None:
        if not self.async_generation:
            for option in ASYNC_OPTIONS:
                default = type(self).__dataclass_fields__[option].default
                check_field(getattr(self, option) == default, name, option, getattr(self, option),
                            "it applies to asynchronous generation: set async_generation=True too, or leave it out")
            return
        check_field(self.use_vllm or self.generation_backend is not None, name, "async_generation", True,
                    "generation runs ahead of training only in an engine apart from the policy: set use_vllm=True "
                    "with vllm_mode='server' (or a generation_backend whose backend has producer())")
        check_field(not self.use_vllm or self.vllm_mode == "server", name, "vllm_mode", self.vllm_mode,
                    "the colocated engine shares this process and its device with training, so generating ahead "
                    "overlaps nothing; start `trainers vllm-serve` and set vllm_mode='server'")


@reject_unknown_options
@dataclass
class PolicyGradientConfig(SamplingConfig):
    """What GRPO and RLOO add to the sampling base: rewards and their weights, the KL to a reference model, the
    clipped importance ratio, and the layout of the policy's forwards."""

    # KL penalty and reference model
    beta: float = opt(
        0.0, "Weight of the k3 KL penalty to the frozen reference model; 0 loads no reference model.", ge=0)
    sync_ref_model: bool = opt(
        False, "Move the reference model toward the policy every ref_model_sync_steps steps (TR-DPO, "
        "arXiv:2404.09656): ref = (1 - ref_model_mixup_alpha) x ref + ref_model_mixup_alpha x policy. Needs beta > 0 "
        "and a full (not PEFT) model."
    )
    ref_model_mixup_alpha: float = opt(
        0.6, "sync_ref_model: the policy's share in each update of the reference.", ge=0, le=1)
    ref_model_sync_steps: int = opt(512, "sync_ref_model: update the reference after every this many steps.", ge=1)
    # The policy loss
    # The clipped importance ratio
    epsilon: float = opt(0.2, "Lower clipping range of the importance ratio: 1 - epsilon.", gt=0)
    epsilon_high: float | None = opt(
        None, "Upper clipping range: 1 + epsilon_high (DAPO clip-higher). Default: epsilon. With GRPO's "
        "loss_type='cispo' it is the largest importance weight, ε_max (5.0 recommended).", gt=0
    )
    # Rewards
    reward_weights: list[float] | None = opt(None, "Weight of each reward function in the sum (default: all 1).")
    dynamic_sampling: bool = opt(
        False, "Drop groups whose rewards are all equal (zero advantage) from the loss, and log how many."
    )
    # The policy's forwards
    padding_free: bool = opt(
        False, "Run each training and scoring forward over the micro-batch's sequences laid end to end in one row "
        "without padding, positions restarting per sequence (as SFTConfig.padding_free): ragged prompts and "
        "completions stop paying for each other's padding. The same log-probs as the padded forward. Needs a "
        "model whose output head the chunked head takes (not one that scales or soft-caps its logits).")
    token_budget: int | None = opt(
        None, "With padding_free: the most tokens (prompt + completion) one training forward on a process packs. "
        "Each optimizer step's completions on a process are regrouped into micro-batches of at most this many "
        "tokens (best-fit decreasing), as many on every process, instead of per_device_train_batch_size rows "
        "each: short completions share a forward, long ones get their own, and a forward's activations are "
        "bounded by tokens. The step trains on the same completions (every loss but bnpo, whose mean is per "
        "micro-batch, is unchanged); the old and reference log-probs are computed in such micro-batches too. "
        "Every prompt plus max_completion_length must fit in it. None: micro-batches of rows.", gt=0)
    skip_zero_gradient_rows: bool = opt(
        True, "Leave out of the backward the completions whose loss gradient is zero by construction: those "
        "without loss tokens (dynamic_sampling's dropped groups, mask_truncated_completions) are not forwarded "
        "at all, and, with beta=0 and no entropy bonus, those with advantage 0 (a group whose rewards are all "
        "equal) are forwarded without gradients, for the logged entropy. Same loss, gradients and metrics. Off "
        "under ZeRO-3 and FSDP (their forwards are collective) and with an MoE router loss. False trains every "
        "completion, as TRL does."
    )
    # How completions are generated and logged

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_field(not self.sync_ref_model or self.beta > 0, name, "sync_ref_model", self.sync_ref_model,
                    "with beta=0 there is no reference model to synchronize: set beta > 0, or leave it False")
        check_field(self.token_budget is None or self.padding_free, name, "token_budget", self.token_budget,
                    "a token budget packs the micro-batch's completions into one row: set padding_free=True too")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
