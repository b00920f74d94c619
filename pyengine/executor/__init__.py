"""The executor: runs one step plan through the model and samples.

Modules: ``config`` (ExecutorConfig), ``plan`` (the StepPlan fields of docs/contract.md),
``kv_cache`` (paged K/V tensors and their sizing), ``latent_kv_cache`` (MLA's one
latent row per token), ``attention`` (SDPA, flash-attn and latent-attention backends,
automatic selection), ``persistent_batch`` (per-row block tables, sampling
parameters, token history, last sampled token), ``sampler`` / ``penalties`` /
``seeded_noise`` (batched sampling, log-probabilities), ``pooling`` (embedding requests),
``runner_output`` (``ModelRunnerOutput``, what the runner returns for a step) and
``model_runner`` (ties it together).
"""
