"""Generation: the backends that sample completions from a model, for any trainer that samples (GRPO today; RLOO
and on-policy distillation next). Below the algorithms, above the core: it imports the core only, and no module
here receives a trainer object.

sampling.py  the interface (SamplingParams, Samples, the Sampler protocol), padding, HF ``generate``, and
             PolicySampler: the policy itself, through the lean engine or HF ``generate``
engine.py    the lean decode engine (Llama/Mistral/Qwen2/Qwen3 on CPU)
rows.py      small helpers on rows of token ids (prompt groups, padding widths)
"""
