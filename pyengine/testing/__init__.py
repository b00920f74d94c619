"""Helpers for tests and benchmarks: tiny checkpoints and hand-built step plans.

``checkpoints`` writes tiny random Hugging Face checkpoints (weights saved by transformers,
a byte-level BPE tokenizer trained on the spot); ``hand_plan`` builds valid
:class:`~pyengine.executor.plan.StepPlan` objects without the Rust scheduler.
"""
