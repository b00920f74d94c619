"""Attention backends over the paged KV cache.

``metadata`` (per-step layout shared by the backends), ``sdpa`` (PyTorch
scaled_dot_product_attention, CPU and CUDA), ``flash`` (flash-attn varlen kernels, CUDA),
``mla_sdpa`` (multi-head latent attention over the latent cache, DeepSeek) and
``selector`` (which backend to use, and why).
"""
