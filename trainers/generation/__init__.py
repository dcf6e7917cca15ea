"""Generation: the backends that sample completions from a model, for any trainer that samples (GRPO today; RLOO
and on-policy distillation next). Below the agents and the algorithms, above the core: it imports the core only,
and no module here receives a trainer object; a backend is built from ``BackendInputs`` (explicit arguments).

backend.py         the interface with its lifetime (sample, sync_weights, close), BackendInputs, the registry
                   (register_backend, build_backend), and PolicyBackend: the policy itself
sampling.py        SamplingParams, Samples, padding, cutting at EOS, HF ``generate``, PolicySampler
engine.py          the lean decode engine (Llama/Mistral/Qwen2/Qwen3 on CPU)
rows.py            small helpers on rows of token ids (prompt groups, padding widths)
prompts.py         prompt datasets tokenized and checked row by row (tokenize_prompts, PromptRow)
user_rollout.py    a user's rollout_func as a backend (TRL's contract, checked)
vllm_common.py     what both vLLM backends share: the policy's weights as the engine takes them, vLLM's sampling
                   parameters, the weight sync's bookkeeping
vllm_colocate.py   vLLM in the training process (vllm_mode="colocate")
vllm_remote.py     vLLM as a server (vllm_mode="server"), over vllm_client.py; vllm_server.py is what
                   `trainers vllm-serve` runs, vllm_worker/ the one module the server process loads
"""
