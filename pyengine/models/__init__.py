"""Decoder models of the Llama family, written against the paged KV cache.

Modules: ``config`` (parse a Hugging Face config.json), ``rope`` (rotary embeddings with
Llama-3 / linear scaling), ``layers`` (norm, tensor-parallel-ready linears, MLP, attention),
``decoder`` (the decoder model and its per-architecture classes), ``deepseek`` /
``mla`` / ``deepseek_config`` / ``deepseek_routing`` / ``deepseek_moe`` / ``rope_yarn``
(DeepSeek-V2 / V3: multi-head latent attention and its experts), ``architectures``
(architecture name -> class), ``checkpoint`` (safetensors and PyTorch .bin reading),
``hub`` (a Hugging Face hub id -> its local snapshot folder), ``loader`` (model, tokenizer
and generation config from a folder) and ``errors``.
"""
