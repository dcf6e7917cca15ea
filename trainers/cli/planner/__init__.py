"""Memory per GPU for every shipped Accelerate template, and the cheapest one that fits: ``trainers plan``.

    trainers plan --model-size 7B --method grpo --num-gpus 8 --gpu-memory 80
    trainers plan --model path/to/model --method sft --lora --num-gpus 1 --gpu-memory 24
    trainers plan --model-size 7B --num-gpus 8 --json
    trainers plan --model PATH --method sft --num-gpus 2 --device cpu     # peak RSS per process, CPU run

For each shipped template (trainers/templates/, which is accelerate_configs/ in a checkout; or the files in
--templates-dir) the planner adds up what one process holds at its peak: weights, gradients, fp32 master
weights and Adam states (split as the ZeRO stage, FSDP or offload splits them), the GRPO reference model,
activations (a per-token-per-layer formula, with or without gradient checkpointing), the logits, the KV cache
of generation, the weights ZeRO-3 gathers, and a named runtime overhead. It then
recommends the cheapest template that fits (offload last: it is the slowest), prints the launch commands,
and when nothing fits, recomputes with LoRA, gradient checkpointing, a smaller batch and offload and says
which of those would fit. The formulas and their limits are in docs/distributed.md ("The planner").

GB here are GiB (2^30 bytes), as torch.cuda and benchmarks/memory.py report them.
"""

# The package, by role (its docstring above is `trainers plan --help`): shapes (model shapes and the set-up planned
# for), memory (templates' strategies and the bytes per process under each), plan (the recommendation, suggestions
# and launch commands), output (the table, JSON and flags). Every public name is re-exported here.

from trainers.cli.planner.memory import (  # noqa: F401
    ACTIVATION_COEFFICIENTS,
    ALLOCATOR_FRAGMENTATION,
    CPU_PROCESS_BASELINE_BYTES,
    CUDA_CONTEXT_BYTES,
    DEEPSPEED_CPU_RUNTIME_BYTES,
    FINAL_NORM_BYTES_PER_HIDDEN,
    RESIDUAL_BYTES,
    Precision,
    Strategy,
    Template,
    TemplateEstimate,
    activation_bytes,
    activation_bytes_per_token_per_layer,
    applicability,
    estimate,
    generation_transients,
    kv_cache_bytes,
    load_templates,
    logits_bytes,
    model_state_bytes,
    precision_of,
    reference_model_bytes,
    strategy_of,
    training_transients,
    zero3_live_elements,
    zero_bucket_elements,
)
from trainers.cli.planner.output import (  # noqa: F401
    add_arguments,
    describe,
    format_table,
    inputs_from_args,
    main,
    plan_to_json,
    run,
)
from trainers.cli.planner.plan import (  # noqa: F401
    Plan,
    Suggestion,
    best_of,
    cheapest_fit,
    estimate_all,
    launch_commands,
    make_plan,
    plan_notes,
    suggestions,
    trainer_flags,
)
from trainers.cli.planner.shapes import (  # noqa: F401
    GB,
    MODEL_SIZES,
    ModelShape,
    PlanInputs,
    resolve_shape,
    shape_from_folder,
    shape_from_size,
    validate,
)
